"""``glyph-domains``: an offline DomainNet-like benchmark, generated from installed packages.

Ten classes (the digits 0-9) in six visual domains whose style differs the way DomainNet's
does, rendered at 32x32 RGB from material that ships inside installed packages:

* ``print``: a glyph from one of matplotlib's bundled typefaces (DejaVu, STIX, Computer
  Modern), dark ink on light paper;
* ``handwriting``: scikit-learn's handwritten digits (each of its 1,797 scans used at most
  once), blue ballpoint on ruled paper;
* ``photo``: a printed glyph over a random crop of scikit-learn's sample photographs
  (``china.jpg``, ``flower.jpg``), in the colour that contrasts with the crop;
* ``sketch``: the glyph's outline only, in pencil grey, with stray construction strokes;
* ``painting``: a coloured glyph with brush texture over a smooth random colour field;
* ``noisy-blur``: a faint light glyph on a dark background, blurred, with strong sensor noise.

Every glyph gets a random affine (rotation, scale, shift). The *public* split, on which the
offline foundation model is pretrained and which no client holds, is drawn from the
``print``, ``photo`` and ``painting`` styles only (a stand-in for ImageNet-like natural images);
``handwriting``, ``sketch`` and ``noisy-blur`` stay unseen until fine-tuning, as DomainNet's
sketch and quickdraw are for an ImageNet backbone. The clients' pool holds every domain.

Generation is deterministic: one numpy generator per (domain, pool) from ``GENERATOR_SEED``
(the experiment seed changes partitions, never pixels). The arrays are cached on disk under
``<cache-dir>/datasets/glyph-domains-<key>.npz`` with a JSON card (sizes, SHA-256 of the
pixels, labels and domains, seconds); the key hashes the generator version, the sizes and the
versions of the packages whose files and rasteriser shape the pixels (Pillow, matplotlib,
scikit-learn). The pixels are stored at their native 32x32 and resized on demand.

Imports inside functions keep ``PIL``, ``matplotlib``, ``scipy``, ``sklearn`` and ``torch`` out
of this module's start-up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedfm_flower.data.digits import digits_arrays
from fedfm_flower.data.source import Source
from fedfm_flower.records.durable import atomic_path, atomic_write_text, exclusive_lock

if TYPE_CHECKING:  # torch loads with the first pixels: partition checks read labels only
    import torch

log = logging.getLogger(__name__)

NAME = "glyph-domains"
GENERATOR_VERSION = 1
GENERATOR_SEED = 2026
NATIVE_SIZE = 32
NUM_CLASSES = 10
DOMAINS: tuple[str, ...] = ("print", "handwriting", "photo", "sketch", "painting", "noisy-blur")
PUBLIC_DOMAINS: tuple[str, ...] = ("print", "photo", "painting")
FONTS: tuple[str, ...] = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "cmr10.ttf",
    "cmss10.ttf",
    "cmtt10.ttf",
    "cmb10.ttf",
)
_SUPERSAMPLE = 4  # glyph masks are drawn at 4x and box-filtered down (antialiasing)


@dataclass(frozen=True)
class GlyphSizes:
    """How many images the generator makes: per domain in the clients' pool, per public domain."""

    per_domain: int = 1600
    public_per_domain: int = 1600


@dataclass(frozen=True)
class GlyphArrays:
    """The generated benchmark: pixels, labels, domain indices and which samples are public."""

    images: np.ndarray  # uint8 [N, 32, 32, 3]
    labels: np.ndarray  # int64 [N]
    domains: np.ndarray  # int64 [N], index into DOMAINS
    public: np.ndarray  # bool [N]

    def digest(self) -> str:
        """SHA-256 of pixels, labels, domains and the public mask."""
        digest = hashlib.sha256()
        for array in (self.images, self.labels, self.domains, self.public):
            digest.update(str((array.dtype.str, array.shape)).encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()


# --- glyph masks ------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _font_dir() -> Path:
    import matplotlib

    return Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf"


@functools.lru_cache(maxsize=64)
def _font(name: str, size: int):  # noqa: ANN202 - PIL's FreeTypeFont
    from PIL import ImageFont

    return ImageFont.truetype(str(_font_dir() / name), size)


def _affine(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A supersampled ``mask`` rotated, scaled and shifted at random, boxed down to 32x32."""
    from PIL import Image

    big = NATIVE_SIZE * _SUPERSAMPLE
    image = Image.fromarray((mask * 255).astype(np.uint8))
    angle = float(rng.uniform(-8, 8))
    scale = float(rng.uniform(0.85, 1.05))
    size = max(8, int(round(image.width * scale)))
    image = image.resize((size, size), Image.Resampling.BILINEAR).rotate(
        angle, resample=Image.Resampling.BILINEAR, expand=True
    )
    canvas = Image.new("L", (big, big), 0)
    slack_x, slack_y = big - image.width, big - image.height
    dx = int(slack_x // 2 + rng.integers(-big // 16, big // 16 + 1))
    dy = int(slack_y // 2 + rng.integers(-big // 16, big // 16 + 1))
    canvas.paste(image, (dx, dy), image)
    small = canvas.resize((NATIVE_SIZE, NATIVE_SIZE), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def _printed_mask(label: int, rng: np.random.Generator) -> np.ndarray:
    """A digit rendered in a random bundled typeface, as a [32, 32] ink mask in [0, 1]."""
    from PIL import Image, ImageDraw

    big = NATIVE_SIZE * _SUPERSAMPLE
    font = _font(FONTS[int(rng.integers(len(FONTS)))], int(big * 0.8))
    image = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), str(label), font=font)
    draw.text(((big - right - left) / 2, (big - bottom - top) / 2), str(label), fill=255, font=font)
    return _affine(np.asarray(image, dtype=np.float32) / 255.0, rng)


def _handwritten_mask(scan: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A scikit-learn 8x8 scan (values in [0, 1]) upscaled smoothly, as a [32, 32] ink mask."""
    from PIL import Image

    big = NATIVE_SIZE * _SUPERSAMPLE
    image = Image.fromarray((scan * 255).astype(np.uint8)).resize(
        (big, big), Image.Resampling.BICUBIC
    )
    mask = np.asarray(image, dtype=np.float32) / 255.0
    return _affine(np.clip((mask - 0.15) / 0.6, 0.0, 1.0), rng)  # sharpen the soft scan


# --- styles -----------------------------------------------------------------------------


def _blend(background: np.ndarray, ink: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Ink over background through ``mask``: [32, 32, 3] floats in [0, 1]."""
    return background * (1.0 - mask[..., None]) + ink * mask[..., None]


def _smooth_field(rng: np.random.Generator, cells: int, channels: int = 3) -> np.ndarray:
    """A random field on a ``cells`` x ``cells`` grid, bicubically upsampled to 32x32."""
    import torch
    import torch.nn.functional as F

    grid = torch.from_numpy(rng.random((1, channels, cells, cells)).astype(np.float32))
    field = F.interpolate(grid, size=(NATIVE_SIZE, NATIVE_SIZE), mode="bicubic")
    return field[0].permute(1, 2, 0).clamp(0, 1).numpy()


def _blur(image: np.ndarray, sigma: float) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    return gaussian_filter(image, sigma=(sigma, sigma, 0), mode="nearest")


def _style_print(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    paper = np.array([0.93, 0.92, 0.88]) + rng.uniform(-0.05, 0.05)
    ink = np.full(3, rng.uniform(0.0, 0.2))
    grain = rng.normal(0.0, 0.02, (NATIVE_SIZE, NATIVE_SIZE, 1))
    return _blend(paper + grain, ink, mask)


def _style_handwriting(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    paper = np.ones((NATIVE_SIZE, NATIVE_SIZE, 3)) * np.array([0.97, 0.96, 0.9])
    offset = int(rng.integers(0, 6))
    paper[offset::6, :, :] = np.array([0.7, 0.8, 0.95])  # ruled lines
    ink = np.array([0.1, 0.15, 0.6]) + rng.uniform(-0.08, 0.08, 3)
    return _blend(paper, ink, mask)


def _style_photo(
    mask: np.ndarray, rng: np.random.Generator, photos: list[np.ndarray]
) -> np.ndarray:
    from PIL import Image

    photo = photos[int(rng.integers(len(photos)))]
    side = int(rng.integers(40, min(photo.shape[:2])))
    y = int(rng.integers(0, photo.shape[0] - side))
    x = int(rng.integers(0, photo.shape[1] - side))
    crop = Image.fromarray(photo[y : y + side, x : x + side]).resize(
        (NATIVE_SIZE, NATIVE_SIZE), Image.Resampling.BILINEAR
    )
    from scipy.ndimage import grey_dilation

    background = np.asarray(crop, dtype=np.float32) / 255.0
    light = background.mean() < 0.5
    halo = np.clip(grey_dilation(mask, size=3), 0.0, 1.0)  # a caption-style outline
    framed = _blend(background, np.full(3, 0.0 if light else 1.0), 0.7 * halo)
    return _blend(framed, np.full(3, 1.0 if light else 0.0), mask)


def _style_sketch(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image, ImageDraw
    from scipy.ndimage import grey_dilation, grey_erosion

    outline = np.clip(grey_dilation(mask, size=3) - grey_erosion(mask, size=3), 0.0, 1.0)
    strokes = Image.new("L", (NATIVE_SIZE, NATIVE_SIZE), 0)
    draw = ImageDraw.Draw(strokes)
    for _ in range(int(rng.integers(1, 4))):
        points = [tuple(int(v) for v in rng.integers(0, NATIVE_SIZE, 2)) for _ in range(2)]
        draw.line(points, fill=int(rng.integers(60, 140)), width=1)
    lines = np.maximum(0.8 * outline, np.asarray(strokes, dtype=np.float32) / 255.0)
    pencil = np.full(3, rng.uniform(0.25, 0.45))
    return _blend(np.ones((NATIVE_SIZE, NATIVE_SIZE, 3)), pencil, lines)


def _style_painting(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    paint = rng.random(3)
    paint = (paint - paint.min()) / max(np.ptp(paint), 1e-6)  # a saturated colour
    background = 0.7 * (1.0 - paint) + 0.3 * _smooth_field(rng, cells=3)  # its complement
    brush = _smooth_field(rng, cells=8, channels=1) - 0.5
    canvas = _blend(background, paint, np.clip(mask * 0.95, 0, 1))
    return canvas + 0.25 * brush


def _style_noisy_blur(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    dark = np.full((NATIVE_SIZE, NATIVE_SIZE, 3), rng.uniform(0.05, 0.2))
    light = np.full(3, rng.uniform(0.45, 0.65))
    image = _blur(_blend(dark, light, mask), sigma=float(rng.uniform(1.0, 1.6)))
    return image + rng.normal(0.0, 0.14, image.shape)


# --- generation -------------------------------------------------------------------------


def _photos() -> list[np.ndarray]:
    from sklearn.datasets import load_sample_images

    return [np.asarray(image) for image in load_sample_images().images]


def _digit_scans() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits: [1797, 8, 8] scans in [0, 1] and their labels."""

    images, labels = digits_arrays()
    return images.numpy(), labels


def _render_pool(domain: str, count: int, pool: int, photos, scans) -> tuple[np.ndarray, ...]:  # noqa: ANN001
    """``count`` images of ``domain`` for pool 0 (clients) or 1 (public): (images, labels)."""
    rng = np.random.default_rng([GENERATOR_SEED, DOMAINS.index(domain), pool])
    if domain == "handwriting":
        pixels, scan_labels = scans
        if count > len(scan_labels):
            raise ValueError(f"handwriting has {len(scan_labels)} scans; {count} asked")
        chosen = rng.permutation(len(scan_labels))[:count]
        labels = scan_labels[chosen]
        masks = [_handwritten_mask(pixels[i], rng) for i in chosen]
    else:
        labels = rng.permutation(np.arange(count) % NUM_CLASSES).astype(np.int64)
        masks = [_printed_mask(int(label), rng) for label in labels]
    images = np.empty((count, NATIVE_SIZE, NATIVE_SIZE, 3), dtype=np.uint8)
    for k, mask in enumerate(masks):
        if domain == "photo":
            image = _style_photo(mask, rng, photos)
        else:
            image = STYLES[domain](mask, rng)
        images[k] = np.round(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)
    return images, labels


STYLES = {
    "print": _style_print,
    "handwriting": _style_handwriting,
    "sketch": _style_sketch,
    "painting": _style_painting,
    "noisy-blur": _style_noisy_blur,
}


def generate(sizes: GlyphSizes = GlyphSizes()) -> GlyphArrays:
    """Render the benchmark: every domain's client pool, then the public domains' pool."""
    photos, scans = _photos(), _digit_scans()
    parts = []
    for pool, domains, count in (
        (0, DOMAINS, sizes.per_domain),
        (1, PUBLIC_DOMAINS, sizes.public_per_domain),
    ):
        for domain in domains:
            images, labels = _render_pool(domain, count, pool, photos, scans)
            parts.append((images, labels, DOMAINS.index(domain), pool == 1))
    return GlyphArrays(
        images=np.concatenate([p[0] for p in parts]),
        labels=np.concatenate([p[1] for p in parts]),
        domains=np.concatenate([np.full(len(p[1]), p[2], dtype=np.int64) for p in parts]),
        public=np.concatenate([np.full(len(p[1]), p[3]) for p in parts]),
    )


def cache_key(sizes: GlyphSizes) -> str:
    """Hash of everything that changes the generated pixels."""
    fields = {
        "version": GENERATOR_VERSION,
        "seed": GENERATOR_SEED,
        "sizes": [sizes.per_domain, sizes.public_per_domain],
        "packages": {p: metadata.version(p) for p in ("pillow", "matplotlib", "scikit-learn")},
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def cached_arrays(cache_dir: Path, sizes: GlyphSizes = GlyphSizes()) -> GlyphArrays:
    """The benchmark from ``<cache-dir>/datasets`` (verified), or generated now and cached."""
    path = cache_dir / "datasets" / f"{NAME}-{cache_key(sizes)}.npz"
    arrays = _read(path)
    if arrays is not None:
        return arrays
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_suffix(".lock")):
        arrays = _read(path)  # another process may have generated it while we waited
        if arrays is None:
            started = time.perf_counter()
            arrays = generate(sizes)
            seconds = time.perf_counter() - started
            card = {
                "name": NAME,
                "sha256": arrays.digest(),
                "images": len(arrays.labels),
                "public": int(arrays.public.sum()),
                "domains": list(DOMAINS),
                "public-domains": list(PUBLIC_DOMAINS),
                "generation-seconds": seconds,
            }
            atomic_write_text(path.with_suffix(".json"), json.dumps(card, indent=2))
            with atomic_path(path) as temporary, temporary.open("wb") as file:
                np.savez(file, **{k: getattr(arrays, k) for k in GlyphArrays.__annotations__})
            log.info("generated %s: %d images in %.1fs (%s)", NAME, card["images"], seconds, path)
    return arrays


def _read(path: Path) -> GlyphArrays | None:
    """The arrays at ``path`` if present and matching their card's digest, else None."""
    card_path = path.with_suffix(".json")
    if not (path.is_file() and card_path.is_file()):
        return None
    try:
        expected = json.loads(card_path.read_text())["sha256"]
        with np.load(path, allow_pickle=False) as stored:
            arrays = GlyphArrays(**{k: stored[k] for k in GlyphArrays.__annotations__})
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        log.warning("%s is unreadable (%s); generating it again", path, err)
        return None
    if arrays.digest() != expected:
        log.warning("%s does not match its card's digest; generating it again", path)
        return None
    return arrays


def glyph_source(cache_dir: Path, image_size: int) -> Source:
    """The benchmark as a ``Source`` with a ``domain`` natural id and a fixed public split."""
    arrays = cached_arrays(cache_dir)

    def pixels(sample_ids: np.ndarray) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        images = torch.from_numpy(arrays.images)
        chosen = images[torch.from_numpy(sample_ids)].permute(0, 3, 1, 2).float().div_(255.0)
        if image_size == NATIVE_SIZE:
            return chosen.contiguous()
        return F.interpolate(chosen, size=(image_size, image_size), mode="bilinear").clamp_(0, 1)

    return Source(
        name=NAME,
        labels=arrays.labels,
        num_classes=NUM_CLASSES,
        natural_id_column="domain",
        natural_ids=np.asarray(DOMAINS)[arrays.domains],
        synthetic_domains=0,
        pixels=pixels,
        public_ids=np.flatnonzero(arrays.public),
    )
