"""Image primitives shared by the OOD suite and the outlier-exposure set: 28×28 uint8 grayscale.

Everything is drawn offline from what the project installs: glyphs from the TrueType fonts that
ship inside matplotlib (``matplotlib/mpl-data/fonts/ttf``: DejaVu, STIX, Computer Modern), photos
from the sample images inside the scikit-image wheel (``skimage.data``; only files bundled in the
wheel, never the pooch-fetched ones), noise and patterns from numpy. Every function takes a
``numpy.random.Generator`` and draws from nothing else, so the same generator state gives the same
bytes.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from PIL import Image, ImageDraw, ImageFilter, ImageFont

SIZE = 28  # output side (MNIST)
BOX = 20  # MNIST: a digit's bounding box is scaled to fit 20×20 and centred by its centre of mass

U8 = NDArray[np.uint8]


def font_dir() -> Path:
    """matplotlib's bundled TrueType fonts (a dependency of the project, so always present)."""
    import matplotlib

    return Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf"


#: The name that stands for Pillow's built-in scalable font (Aileron Regular, inside Pillow's own
#: wheel since 10.1) where a font file name is expected.
PILLOW_FONT = "pillow:Aileron"


@lru_cache(maxsize=64)
def _font(name: str, px: int) -> ImageFont.FreeTypeFont:
    if name == PILLOW_FONT:
        font = ImageFont.load_default(px)
        if not isinstance(font, ImageFont.FreeTypeFont):  # a Pillow built without FreeType
            raise RuntimeError("Pillow's built-in scalable font needs Pillow with FreeType")
        return font
    return ImageFont.truetype(str(font_dir() / name), px)


def mnist_frame(img: NDArray[np.floating] | U8) -> U8:
    """MNIST's normalisation of a white-on-black shape: crop to its bounding box, scale the box to
    fit 20×20 (aspect kept, antialiased), and place it in 28×28 with its centre of mass at the
    centre. Empty input gives an empty (black) frame."""
    a = np.asarray(img, dtype=np.float32)
    ys, xs = np.nonzero(a > 0)
    out = np.zeros((SIZE, SIZE), np.float32)
    if ys.size == 0:
        return out.astype(np.uint8)
    a = a[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    h, w = a.shape
    scale = BOX / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    pil = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).resize((nw, nh), Image.LANCZOS)
    small = np.asarray(pil, dtype=np.float32)
    total = small.sum()
    cy = (small.sum(axis=1) * np.arange(nh)).sum() / total if total > 0 else nh / 2
    cx = (small.sum(axis=0) * np.arange(nw)).sum() / total if total > 0 else nw / 2
    top = int(np.clip(round(SIZE / 2 - cy), 0, SIZE - nh))
    left = int(np.clip(round(SIZE / 2 - cx), 0, SIZE - nw))
    out[top : top + nh, left : left + nw] = small
    return np.clip(out, 0, 255).round().astype(np.uint8)


def glyph(rng: np.random.Generator, chars: str, fonts: tuple[str, ...]) -> U8:
    """One character drawn like a handwritten digit: a random glyph of ``chars`` in a random font
    of ``fonts`` (file names under :func:`font_dir`, or :data:`PILLOW_FONT`), white on black, a
    random stroke thickening (0–3 px at 64 px), rotation (±15°) and shear-free aspect jitter, then
    :func:`mnist_frame`."""
    ch = chars[int(rng.integers(len(chars)))]
    font = _font(fonts[int(rng.integers(len(fonts)))], 64)
    canvas = Image.new("L", (128, 128), 0)
    stroke = int(rng.integers(0, 4))
    ImageDraw.Draw(canvas).text(
        (64, 64), ch, fill=255, font=font, anchor="mm", stroke_width=stroke, stroke_fill=255
    )
    sx = float(rng.uniform(0.8, 1.2))
    if sx != 1.0:
        canvas = canvas.resize((max(1, round(128 * sx)), 128), Image.BILINEAR)
    canvas = canvas.rotate(float(rng.uniform(-15, 15)), resample=Image.BILINEAR, expand=True)
    return mnist_frame(np.asarray(canvas))


@lru_cache(maxsize=64)
def skimage_gray(name: str) -> NDArray[np.float32]:
    """A scikit-image sample image as float32 grayscale in [0, 255] (ITU-R 601 luma for RGB).

    ``name`` is a loader of ``skimage.data`` whose file ships in the wheel (no network)."""
    import skimage.data

    raw = getattr(skimage.data, name)()
    img = np.asarray(raw[0] if isinstance(raw, tuple) else raw)  # stereo_motorcycle: left view
    if name == "lfw_subset":  # 200 face crops (25×25, float in [0, 1]): tile them into one image
        img = np.concatenate(
            [np.concatenate(list(img[r * 20 : r * 20 + 20]), 1) for r in range(10)]
        )
    if img.dtype == np.bool_:
        img = img.astype(np.float32)
    if np.issubdtype(img.dtype, np.integer):
        img = img.astype(np.float32) / float(np.iinfo(img.dtype).max)
    img = img.astype(np.float32)
    img = (img - img.min()) / max(float(img.max() - img.min()), 1e-6) if img.max() > 1 else img
    if img.ndim == 3:
        img = img[..., :3] @ np.array([0.299, 0.587, 0.114], np.float32)
    return np.ascontiguousarray(img * 255.0)


def photo_crop(rng: np.random.Generator, names: tuple[str, ...]) -> U8:
    """A random square crop (side 16 px to the whole short side) of a random image of ``names``,
    resized to 28×28 (antialiased bilinear), randomly mirrored."""
    img = skimage_gray(names[int(rng.integers(len(names)))])
    h, w = img.shape
    side = int(rng.integers(min(16, min(h, w)), min(h, w) + 1))
    top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
    crop = Image.fromarray(img[top : top + side, left : left + side].astype(np.uint8))
    out = np.asarray(crop.resize((SIZE, SIZE), Image.BILINEAR))
    return np.ascontiguousarray(out[:, ::-1] if rng.random() < 0.5 else out)


def _grid() -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
    return y, x


def to_u8(a: NDArray[np.floating]) -> U8:
    return np.clip(np.round(a), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------- evaluation-suite generators


def uniform_noise(rng: np.random.Generator) -> U8:
    """I.i.d. uniform pixels in 0–255."""
    return rng.integers(0, 256, size=(SIZE, SIZE), dtype=np.uint8)


def gaussian_noise(rng: np.random.Generator) -> U8:
    """I.i.d. Gaussian pixels: mean U(32, 224), sd U(16, 96), clipped to 0–255."""
    return to_u8(rng.normal(rng.uniform(32, 224), rng.uniform(16, 96), size=(SIZE, SIZE)))


def blank(rng: np.random.Generator) -> U8:
    """A constant image at a random gray level (0–255)."""
    return np.full((SIZE, SIZE), int(rng.integers(0, 256)), np.uint8)


def stripes(rng: np.random.Generator) -> U8:
    """Straight stripes: random angle, period 3–14 px, phase, square or sine profile, contrast."""
    y, x = _grid()
    th, period = rng.uniform(0, np.pi), rng.uniform(3, 14)
    s = np.sin(2 * np.pi * (x * np.cos(th) + y * np.sin(th)) / period + rng.uniform(0, 2 * np.pi))
    s = np.sign(s) if rng.random() < 0.5 else s
    lo, hi = np.sort(rng.uniform(0, 255, 2))
    return to_u8(lo + (hi - lo) * (s + 1) / 2)


def checkerboard(rng: np.random.Generator) -> U8:
    """A checkerboard: cell 2–9 px, random offset, two random gray levels."""
    y, x = _grid()
    cell = int(rng.integers(2, 10))
    oy, ox = rng.integers(0, cell, 2)
    board = (((y + oy) // cell + (x + ox) // cell) % 2).astype(np.float64)
    a, b = rng.uniform(0, 255, 2)
    return to_u8(a + (b - a) * board)


def gradient(rng: np.random.Generator) -> U8:
    """A linear ramp in a random direction, or a radial one from a random centre, between two
    random gray levels."""
    y, x = _grid()
    if rng.random() < 0.5:
        th = rng.uniform(0, 2 * np.pi)
        t = x * np.cos(th) + y * np.sin(th)
    else:
        cy, cx = rng.uniform(0, SIZE, 2)
        t = np.hypot(y - cy, x - cx)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-9)
    a, b = rng.uniform(0, 255, 2)
    return to_u8(a + (b - a) * t)


# ----------------------------------------------------------------- outlier-exposure generators


def salt_pepper(rng: np.random.Generator) -> U8:
    """Sparse impulse noise: a random fraction (2–40 %) of pixels set to 255 on a black or gray
    background."""
    bg = float(rng.choice([0.0, rng.uniform(0, 128)]))
    img = np.full((SIZE, SIZE), bg)
    img[rng.random((SIZE, SIZE)) < rng.uniform(0.02, 0.4)] = 255.0
    return to_u8(img)


def block_noise(rng: np.random.Generator) -> U8:
    """Low-resolution random pixels (2×2 to 14×14) upscaled (nearest or bilinear) to 28×28."""
    n = int(rng.integers(2, 15))
    small = Image.fromarray(rng.integers(0, 256, size=(n, n), dtype=np.uint8))
    mode = Image.NEAREST if rng.random() < 0.5 else Image.BILINEAR
    return np.asarray(small.resize((SIZE, SIZE), mode))


def blurred_noise(rng: np.random.Generator) -> U8:
    """Uniform noise blurred by a Gaussian of radius 0.7–3 px, contrast-stretched."""
    img = Image.fromarray(rng.integers(0, 256, size=(SIZE, SIZE), dtype=np.uint8))
    a = np.asarray(img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.7, 3.0)))), np.float64)
    a = (a - a.min()) / max(float(a.max() - a.min()), 1e-9)
    lo, hi = np.sort(rng.uniform(0, 255, 2))
    return to_u8(lo + (hi - lo) * a)


def shapes(rng: np.random.Generator) -> U8:
    """1–4 random filled or outlined ellipses, rectangles or polygons of random gray levels on a
    random background (drawn at 4× and downsampled)."""
    canvas = Image.new("L", (SIZE * 4, SIZE * 4), int(rng.integers(0, 256)))
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(1, 5))):
        kind = int(rng.integers(3))
        pts = rng.uniform(-10, SIZE * 4 + 10, size=(2, 2))
        box = [float(pts[:, 0].min()), float(pts[:, 1].min())]
        box += [float(pts[:, 0].max()) + 8, float(pts[:, 1].max()) + 8]
        fill = int(rng.integers(0, 256))
        width = int(rng.integers(4, 16))
        filled = rng.random() < 0.5
        if kind == 0:
            draw.ellipse(box, fill=fill if filled else None, outline=fill, width=width)
        elif kind == 1:
            draw.rectangle(box, fill=fill if filled else None, outline=fill, width=width)
        else:
            poly = [
                tuple(map(float, p))
                for p in rng.uniform(0, SIZE * 4, size=(int(rng.integers(3, 7)), 2))
            ]
            draw.polygon(poly, fill=fill if filled else None, outline=fill, width=width)
    return np.asarray(canvas.resize((SIZE, SIZE), Image.BILINEAR))


def smooth_field(rng: np.random.Generator) -> U8:
    """A smooth random field: a 3×3 to 6×6 grid of random levels upscaled bicubically, at random
    contrast (near-constant to full range) around a random mean."""
    n = int(rng.integers(3, 7))
    small = rng.uniform(0, 1, size=(n, n)).astype(np.float32)
    a = np.asarray(Image.fromarray(small, mode="F").resize((SIZE, SIZE), Image.BICUBIC), np.float64)
    a = (a - a.min()) / max(float(a.max() - a.min()), 1e-9) - 0.5
    mean, contrast = rng.uniform(0, 255), rng.uniform(4, 255)
    return to_u8(mean + contrast * a)


def plaid(rng: np.random.Generator) -> U8:
    """Concentric rings or the product of two sinusoidal gratings (a plaid)."""
    y, x = _grid()
    if rng.random() < 0.5:
        cy, cx = rng.uniform(0, SIZE, 2)
        s = np.sin(2 * np.pi * np.hypot(y - cy, x - cx) / rng.uniform(3, 10))
    else:
        t1, t2 = rng.uniform(0, np.pi, 2)
        p1, p2 = rng.uniform(3, 12, 2)
        s = np.sin(2 * np.pi * (x * np.cos(t1) + y * np.sin(t1)) / p1)
        s = s * np.sin(2 * np.pi * (x * np.cos(t2) + y * np.sin(t2)) / p2)
    lo, hi = np.sort(rng.uniform(0, 255, 2))
    return to_u8(lo + (hi - lo) * (s + 1) / 2)
