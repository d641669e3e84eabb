"""Digits as people send them: held-out MNIST digits rendered as photos and scans of paper.

The served model reads MNIST digits; users upload pictures. This set is how the server's input
pipeline (:mod:`models.prepare`) is measured on what users send: every image holds one legible
digit of known class, from the 2,000 held-out MNIST digits no shipped model trained on
(``mnist-2k-holdout.npz``), rendered offline with NumPy and PIL in families a user produces:

* ``paper`` — dark ink on light paper (a scan or a phone photo): the digit at 25–70 % of a
  48–160 px canvas, off centre, rotated ±12°, paper and ink tinted (RGB), uneven light (a linear
  gradient and a vignette), sensor noise, a little blur, JPEG (quality 35–95) or PNG;
* ``board`` — light ink on a dark, noisy background (chalk on a board, a white digit on a gray
  screen photo), the same geometry;
* ``thick`` — a felt pen: the strokes thickened (grey dilation) before rendering on paper;
* ``small`` — a small digit in a corner of a large (200–400 px) photo of paper, 12–25 % of it;
* ``printed`` — digits typed in the fonts matplotlib ships (DejaVu Sans/Serif/Mono, STIX),
  dark on paper, tinted and rotated: not handwriting, reported apart.

Image ``i`` of family ``f`` of seed ``s`` is drawn from ``numpy.random.default_rng([PHOTO_TAG, s,
f, i])`` alone: the same seed gives the same bytes.
"""

from __future__ import annotations

import io
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

__all__ = ["FAMILIES", "HANDWRITTEN", "PHOTO_TAG", "PhotoSet", "photo_digits"]

PHOTO_TAG = 0x9407  # first word of every generator's seed sequence
HANDWRITTEN: tuple[str, ...] = ("paper", "board", "thick", "small")
FAMILIES: tuple[str, ...] = (*HANDWRITTEN, "printed")
PRINTED_FONTS = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSansMono.ttf",
    "STIXGeneral.ttf",
)


class PhotoSet(NamedTuple):
    """Encoded images (PNG or JPEG bytes), their digit labels and family names."""

    images: list[bytes]
    labels: np.ndarray  # int64 (n,)
    families: list[str]


def _encode(img: Image.Image, rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    if rng.random() < 0.6:
        img.save(buf, format="JPEG", quality=int(rng.integers(35, 96)))
    else:
        img.save(buf, format="PNG")
    return buf.getvalue()


def _ink_mask(digit: np.ndarray, side: int, rng: np.random.Generator, thick: bool) -> Image.Image:
    """The MNIST digit (white on black 28×28) as an ink mask of ``side`` px, rotated ±12°."""
    mask = Image.fromarray(digit).resize((side, side), Image.BICUBIC)
    if thick:
        mask = mask.filter(ImageFilter.MaxFilter(2 * max(1, side // 28) + 1))
    return mask.rotate(float(rng.uniform(-12, 12)), resample=Image.BILINEAR, expand=True)


def _light(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Uneven light ``(h, w)`` in (0, 1]: a linear gradient in a random direction times a vignette."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    yy, xx = yy / max(h - 1, 1) - 0.5, xx / max(w - 1, 1) - 0.5
    a = rng.uniform(0, 2 * np.pi)
    grad = 1.0 - rng.uniform(0.0, 0.45) * (0.5 + np.cos(a) * xx + np.sin(a) * yy)
    vignette = 1.0 - rng.uniform(0.0, 0.35) * (xx**2 + yy**2) * 2
    return np.clip(grad * vignette, 0.2, 1.0)


def _compose(
    mask: Image.Image, canvas: int, rng: np.random.Generator, dark_on_light: bool
) -> Image.Image:
    """Place ``mask`` at a random spot of a ``canvas``-px page and render ink, paper and light."""
    m = np.asarray(mask, np.float32) / 255.0
    mh, mw = m.shape
    page = np.zeros((canvas, canvas), np.float32)
    top = int(rng.integers(0, max(1, canvas - mh + 1)))
    left = int(rng.integers(0, max(1, canvas - mw + 1)))
    page[top : top + mh, left : left + mw] = m[: canvas - top, : canvas - left]
    if dark_on_light:
        paper = rng.uniform(170, 250) + rng.normal(0, 6, 3)  # tinted RGB paper
        ink = rng.uniform(0, 90) + rng.normal(0, 15, 3)  # blue/black/gray pen
    else:
        paper = rng.uniform(20, 110) + rng.normal(0, 6, 3)
        ink = rng.uniform(190, 255) + rng.normal(0, 8, 3)
    rgb = paper[None, None, :] * (1 - page[..., None]) + ink[None, None, :] * page[..., None]
    rgb = rgb * _light(canvas, canvas, rng)[..., None]
    rgb += rng.normal(0, rng.uniform(0, 10 if dark_on_light else 18), rgb.shape)
    img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    if rng.random() < 0.5:
        img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.2))))
    if rng.random() < 0.3:
        img = img.convert("L")
    return img


def _handwritten(family: str, digit: np.ndarray, rng: np.random.Generator) -> Image.Image:
    if family == "small":
        canvas = int(rng.integers(200, 401))
        side = max(16, int(canvas * rng.uniform(0.12, 0.25)))
    else:
        canvas = int(rng.integers(48, 161))
        side = max(14, int(canvas * rng.uniform(0.25, 0.70)))
    mask = _ink_mask(digit, side, rng, thick=family == "thick")
    return _compose(mask, canvas, rng, dark_on_light=family != "board")


def _printed(label: int, rng: np.random.Generator) -> Image.Image:
    from PIL import ImageFont

    from models.data_ood.render import font_dir

    name = PRINTED_FONTS[int(rng.integers(len(PRINTED_FONTS)))]
    font = ImageFont.truetype(str(font_dir() / name), 96)
    mask = Image.new("L", (160, 160), 0)
    ImageDraw.Draw(mask).text((80, 80), str(label), fill=255, font=font, anchor="mm")
    mask = mask.crop(mask.getbbox())
    canvas = int(rng.integers(48, 161))
    side = max(14, int(canvas * rng.uniform(0.25, 0.70)))
    s = side / max(mask.size)
    mask = mask.resize(
        (max(1, round(mask.width * s)), max(1, round(mask.height * s))), Image.BICUBIC
    )
    mask = mask.rotate(float(rng.uniform(-8, 8)), resample=Image.BILINEAR, expand=True)
    return _compose(mask, canvas, rng, dark_on_light=True)


def photo_digits(
    n_per_family: int = 200, seed: int = 0, families: tuple[str, ...] = FAMILIES
) -> PhotoSet:
    """``n_per_family`` encoded images of each family (digits of the held-out split, in order of
    a seeded permutation, so no digit repeats within a family up to 2,000)."""
    from models.data import load_holdout_mnist

    digits, labels = load_holdout_mnist()
    images: list[bytes] = []
    out_labels: list[int] = []
    names: list[str] = []
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
        f = FAMILIES.index(family)
        order = np.random.default_rng([PHOTO_TAG, seed, f]).permutation(len(labels))
        for i in range(n_per_family):
            rng = np.random.default_rng([PHOTO_TAG, seed, f, i])
            j = int(order[i % len(order)])
            label = int(labels[j]) if family != "printed" else i % 10
            img = (
                _printed(label, rng)
                if family == "printed"
                else _handwritten(family, digits[j], rng)
            )
            images.append(_encode(img, rng))
            out_labels.append(label)
            names.append(family)
    return PhotoSet(images, np.asarray(out_labels, np.int64), names)
