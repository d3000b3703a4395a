"""One Flower Strategy per method, on a shared personalized-strategy base (``strategies.base``)
composed of small parts (``strategies.parts``)."""
