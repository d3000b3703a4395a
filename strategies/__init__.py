"""One Flower Strategy per method, on a shared personalized-strategy base."""
