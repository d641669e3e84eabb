"""What the model reads: an uploaded picture of a digit turned into an MNIST digit.

MNIST's digits are white ink on black, the ink's bounding box scaled to fit 20×20 (aspect kept,
antialiased) and placed in 28×28 by its centre of mass (LeCun et al., the MNIST database page).
People send something else: a phone photo or a scan, dark ink on light paper, the digit somewhere
on a larger canvas, under uneven light, JPEG-compressed, in colour. :func:`canonicalise` applies
MNIST's own construction to such a picture, so the model sees what it was trained on:

1. alpha flattened onto white, then grayscale with the ITU-R 601 luma rule
   (:func:`models.data.conform_image`'s, bit-identical to PIL's ``convert("L")``);
2. large canvases reduced (antialiased) to :data:`WORK_SIDE` on their longer side, so the cost per
   image is bounded whatever the upload's size;
3. polarity from the border: a light border means dark ink on light paper, which is inverted;
4. background levelled: a median over windows wider than a pen stroke, on a coarse grid,
   estimates the (possibly unevenly lit) paper, which is subtracted; the sensor's noise floor (a
   robust spread of the background) is cut off;
5. the digit: the heaviest connected component of ink and those near it (specks and far marks
   dropped), stretched to the full range; its bounding box scaled to fit 20×20 keeping its
   aspect, placed in 28×28 by its centre of mass.

Two pictures have no digit to find, and say so (:class:`Finding`) instead of being made into one:
``blank`` (no contrast: an empty page, a constant colour) and ``fills_canvas`` (the "ink" is most
of the picture: a photo, noise, a pattern). The server answers them with ``abstain: true``.

An MNIST digit itself (white on black, 20×20 box, centred) comes out unchanged: its border is
black, its background zero, its box already 20 on the longer side.
"""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

import numpy as np
import torch
from scipy import ndimage

__all__ = [
    "BOX",
    "PREPARE_MODES",
    "SIDE",
    "Canonical",
    "Finding",
    "PrepareMode",
    "canonicalise",
    "default_prepare",
    "prepare_image",
    "resolve_prepare",
]

SIDE = 28  # MNIST's canvas
BOX = 20  # MNIST's digit box, inside the canvas
#: Longer side the canonicalisation works at: a 4000×3000 photo is reduced to this first (a digit
#: filling a tenth of it keeps ~40 px, twice the 20 px it ends at).
WORK_SIDE = 256
#: Ink contrast (levels of 255, after levelling) below which an image is ``blank``.
MIN_CONTRAST = 40.0
#: Fraction of the canvas the ink may cover before the image is ``fills_canvas``: an MNIST digit
#: covers ~19 % of its 28×28 canvas, a digit photographed on a page less.
MAX_INK_FRACTION = 0.45
#: Components holding less than this share of the strokes' mass are specks (dust, JPEG ringing).
SPECK_SHARE = 0.02
#: Strokes are ink over this share of the brightest 3×3 patch; under FAINT_LEVEL is background.
STROKE_LEVEL = 0.35
FAINT_LEVEL = 0.1

PrepareMode = Literal["mnist", "none"]
#: ``mnist``: :func:`canonicalise` (the default for a 1×28×28 model); ``none``: pixels already in
#: the model's format, only converted to its channels and resized (:func:`models.data.conform_image`).
PREPARE_MODES: tuple[PrepareMode, ...] = ("mnist", "none")


class Finding(enum.IntEnum):
    """What :func:`canonicalise` found; anything but ``ok`` is answered with ``abstain: true``."""

    ok = 0
    blank = 1  # no ink: contrast under MIN_CONTRAST
    fills_canvas = 2  # the "ink" covers over MAX_INK_FRACTION of the picture: not a written digit


class Canonical(NamedTuple):
    """A canonicalised image: uint8 ``(1, 28, 28)``, white ink on black, and what was found."""

    image: torch.Tensor
    finding: Finding


def default_prepare(in_channels: int, input_size: tuple[int, int] | list[int]) -> PrepareMode:
    """The prepare a model gets unless a request says otherwise: ``mnist`` for 1×28×28 models
    (digit readers), ``none`` for any other input (an RGB 32×32 classifier reads photos as they
    are)."""
    return "mnist" if in_channels == 1 and tuple(input_size) == (SIDE, SIDE) else "none"


def resolve_prepare(
    asked: str | None, in_channels: int, input_size: tuple[int, int] | list[int]
) -> PrepareMode:
    """A request's ``prepare`` for a model: its :func:`default_prepare` when not ``asked``;
    ``ValueError`` naming the fix for an unknown mode, or ``mnist`` for a model that does not read
    1×28×28 digits."""
    if asked is None:
        return default_prepare(in_channels, input_size)
    if asked not in PREPARE_MODES:
        raise ValueError(
            f"prepare must be one of {', '.join(map(repr, PREPARE_MODES))}; got {asked!r}"
        )
    if asked == "mnist" and default_prepare(in_channels, input_size) != "mnist":
        raise ValueError(
            f"prepare='mnist' makes a 1x28x28 MNIST digit; this model reads "
            f"{in_channels}x{input_size[0]}x{input_size[1]} images: use prepare='none'"
        )
    return asked  # type: ignore[return-value]  # checked against PREPARE_MODES above


def prepare_image(
    image: torch.Tensor, mode: PrepareMode, in_channels: int, input_size: tuple[int, int]
) -> Canonical:
    """One decoded uint8 image → the model's uint8 input under ``mode``: :func:`canonicalise`
    (``mnist``) or :func:`models.data.conform_image` (``none``: channels and size only, always
    ``Finding.ok``). The one function the server, training data and evaluation call."""
    if mode == "mnist":
        return canonicalise(image)
    from models.data import conform_image

    return Canonical(conform_image(image, in_channels, input_size), Finding.ok)


def _gray(image: torch.Tensor) -> np.ndarray:
    """uint8 ``(C, H, W)`` (C 1–4) → float32 ``(H, W)`` in [0, 255]: alpha over white, luma."""
    from models.data import _luma

    c = image.shape[0]
    if c in (2, 4):  # alpha over white: v·a + 255·(1 − a), rounded
        alpha = image[-1:].int()
        colour = image[:-1].int()
        image = ((colour * alpha + 255 * (255 - alpha) + 127) // 255).to(torch.uint8)
        c -= 1
    if c == 3:
        image = _luma(image)
    elif c != 1:
        raise ValueError(f"image must have 1, 2, 3 or 4 channels; got {c}")
    return image[0].numpy().astype(np.float32)


def _shrink(gray: np.ndarray) -> np.ndarray:
    """Reduce ``gray`` so its longer side is at most :data:`WORK_SIDE` (antialiased)."""
    h, w = gray.shape
    if max(h, w) <= WORK_SIDE:
        return gray
    from torchvision.transforms.v2 import functional as TF

    s = WORK_SIDE / max(h, w)
    size = [max(1, round(h * s)), max(1, round(w * s))]
    return TF.resize(torch.from_numpy(gray)[None], size, antialias=True)[0].numpy()


def _border(a: np.ndarray) -> np.ndarray:
    """The outer ring of ``a``, ~4 % of its side wide (at least one pixel)."""
    h, w = a.shape
    b = max(1, round(0.04 * min(h, w)))
    return np.concatenate(
        [a[:b].ravel(), a[-b:].ravel(), a[b:-b, :b].ravel(), a[b:-b, -b:].ravel()]
    )


#: The paper is estimated on a grid of at most this many cells a side (area means), by a median
#: over :data:`PAPER_WINDOW` cells: wider than a pen stroke, so the ink (a minority of any window)
#: does not count, and narrow enough to follow a vignette or a shadow.
PAPER_GRID = 32
PAPER_WINDOW = 7


def _paper(gray: np.ndarray) -> np.ndarray:
    """The paper under the ink, ``gray``'s shape: a median over windows of a coarse grid,
    upsampled bilinearly (uneven light, a shadow, a tinted page)."""
    import torch.nn.functional as F

    h, w = gray.shape
    g = torch.from_numpy(gray)[None, None]
    if max(h, w) > PAPER_GRID:
        s = PAPER_GRID / max(h, w)
        g = F.interpolate(g, size=(max(1, round(h * s)), max(1, round(w * s))), mode="area")
    paper = ndimage.median_filter(g[0, 0].numpy(), size=PAPER_WINDOW, mode="nearest")
    if paper.shape == gray.shape:
        return paper
    up = F.interpolate(torch.from_numpy(paper)[None, None], size=(h, w), mode="bilinear")
    return up[0, 0].numpy()


def _ink(gray: np.ndarray) -> np.ndarray | None:
    """Bright ink on a zero background, in levels above the noise floor (polarity, levelling,
    noise floor); None when its contrast is under :data:`MIN_CONTRAST` (nothing written)."""
    if float(np.median(_border(gray))) > 127.5:  # light paper: dark ink → light ink
        gray = 255.0 - gray
    ink = np.clip(gray - _paper(gray), 0.0, None)
    # The noise floor: the background's robust spread (MAD), ink being the minority of pixels.
    med = float(np.median(ink))
    floor = med + 4.0 * 1.4826 * float(np.median(np.abs(ink - med)))
    # Contrast: the brightest 3×3 patch, so a hot pixel alone is not ink (a percentile would miss
    # a small digit: its strokes can be under 0.5 % of a photo's pixels).
    if float(ndimage.uniform_filter(ink, size=3, mode="constant").max()) - floor < MIN_CONTRAST:
        return None
    return np.clip(ink - floor, 0.0, None)


def _keep_digit(ink: np.ndarray) -> np.ndarray:
    """The digit of ``ink``, stretched to [0, 1]: the strokes (ink over :data:`STROKE_LEVEL` of
    the brightest patch) form connected components (8-neighbours); the heaviest and those near it
    (within half the digit's size: a 5's detached bar, a 4's open top) are the digit, specks (under
    :data:`SPECK_SHARE` of the strokes' mass) and far marks (dust, a shadow's edge) are not. The
    digit's box keeps its faint edges (antialiasing), everything outside it is cleared, levels
    under :data:`FAINT_LEVEL` are background, and the brightest patch becomes 1 (a faint pencil
    digit reads as a full-contrast one; a hot pixel does not set the scale)."""
    top = float(ndimage.uniform_filter(ink, size=3, mode="constant").max())
    labels, n = ndimage.label(ink > STROKE_LEVEL * top, structure=np.ones((3, 3)))
    index = np.arange(1, n + 1)
    mass = ndimage.sum_labels(ink, labels, index=index)
    boxes = ndimage.find_objects(labels)
    first = int(np.argmax(mass))
    y0, y1 = boxes[first][0].start, boxes[first][0].stop
    x0, x1 = boxes[first][1].start, boxes[first][1].stop
    candidates = [i for i in range(n) if i != first and mass[i] >= SPECK_SHARE * mass.sum()]
    grown = True
    while grown:  # add what lies near the digit as it stands, until nothing more does
        grown = False
        reach = 0.5 * max(y1 - y0, x1 - x0)
        for i in list(candidates):
            by, bx = boxes[i]
            gap_y = max(0, by.start - y1, y0 - by.stop)
            gap_x = max(0, bx.start - x1, x0 - bx.stop)
            if max(gap_y, gap_x) <= reach:
                grown = True
                candidates.remove(i)
                y0, y1 = min(y0, by.start), max(y1, by.stop)
                x0, x1 = min(x0, bx.start), max(x1, bx.stop)
    h, w = ink.shape
    y0, y1, x0, x1 = max(0, y0 - 1), min(h, y1 + 1), max(0, x0 - 1), min(w, x1 + 1)  # edges
    out = np.zeros_like(ink)
    out[y0:y1, x0:x1] = np.clip(
        (ink[y0:y1, x0:x1] - FAINT_LEVEL * top) / ((1 - FAINT_LEVEL) * top), 0, 1
    )
    return out


def _frame(ink: np.ndarray) -> np.ndarray:
    """MNIST's framing of bright ``ink`` (non-empty): crop to its bounding box, fit the box in
    20×20 keeping the aspect (antialiased), place it in 28×28 by its centre of mass."""
    from torchvision.transforms.v2 import functional as TF

    ys, xs = np.nonzero(ink)
    box = ink[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    h, w = box.shape
    if max(h, w) != BOX:
        s = BOX / max(h, w)
        size = [max(1, round(h * s)), max(1, round(w * s))]
        box = TF.resize(torch.from_numpy(np.ascontiguousarray(box))[None], size, antialias=True)[0]
        box = box.clamp_(0.0, 1.0).numpy()
        h, w = box.shape
    mass = float(box.sum())
    cy = float(box.sum(1) @ np.arange(h)) / mass
    cx = float(box.sum(0) @ np.arange(w)) / mass
    top = int(np.clip(round(SIDE / 2 - cy), 0, SIDE - h))
    left = int(np.clip(round(SIDE / 2 - cx), 0, SIDE - w))
    out = np.zeros((SIDE, SIDE), np.float32)
    out[top : top + h, left : left + w] = box
    # MNIST's pen saturates: the median stroke pixel of its digits is 0.99 (40 % are 1.0); a
    # photographed stroke, once scaled to 20×20, peaks at its centre only. Its median stroke
    # level becomes 1.
    stroke = out[out > STROKE_LEVEL]
    return np.clip(out / float(np.median(stroke)), 0.0, 1.0) if stroke.size else out


def _already_mnist(gray: np.ndarray) -> bool:
    """``gray`` is an MNIST digit as it is: 28×28, a black outer ring, enough contrast, the ink's
    box 20 on its longer side and its centre of mass within a pixel of the centre. Those are
    served as sent (the construction below would only move a few of them by a pixel)."""
    if gray.shape != (SIDE, SIDE) or gray[[0, -1]].any() or gray[:, [0, -1]].any():
        return False
    if gray.max() < MIN_CONTRAST:
        return False
    rows, cols = gray.sum(1), gray.sum(0)
    r, c = np.flatnonzero(rows), np.flatnonzero(cols)
    if max(r[-1] - r[0], c[-1] - c[0]) + 1 != BOX:
        return False
    mass = rows.sum()
    cy = float(rows @ np.arange(SIDE)) / mass
    cx = float(cols @ np.arange(SIDE)) / mass
    return abs(cy - SIDE / 2) <= 1.0 and abs(cx - SIDE / 2) <= 1.0


def canonicalise(image: torch.Tensor) -> Canonical:
    """uint8 ``(C, H, W)`` (C 1–4) or ``(H, W)`` picture of a digit → :class:`Canonical`: a uint8
    ``(1, 28, 28)`` MNIST digit (white ink on black, box 20×20, centre of mass at the centre), or
    an empty canvas and the :class:`Finding` that says why there is no digit.

    Raises ``ValueError`` for a tensor that is not a uint8 image.
    """
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8:
        raise ValueError("image must be a uint8 torch.Tensor")
    if image.dim() == 2:
        image = image.unsqueeze(0)
    if image.dim() != 3 or image.shape[-1] == 0 or image.shape[-2] == 0:
        raise ValueError(f"image must have shape (C, H, W); got {tuple(image.shape)}")
    gray = _gray(image)
    if _already_mnist(gray):
        return Canonical(torch.from_numpy(gray.astype(np.uint8))[None], Finding.ok)
    ink = _ink(_shrink(gray))
    empty = torch.zeros((1, SIDE, SIDE), dtype=torch.uint8)
    if ink is None:
        return Canonical(empty, Finding.blank)
    ink = _keep_digit(ink)
    if float((ink > 0.5).mean()) > MAX_INK_FRACTION:
        return Canonical(empty, Finding.fills_canvas)
    digit = _frame(ink)
    pixels = torch.from_numpy(np.rint(digit * 255.0).astype(np.uint8))[None]
    return Canonical(pixels, Finding.ok)
