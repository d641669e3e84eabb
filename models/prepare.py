"""What the model reads: an uploaded picture of a digit turned into an MNIST digit.

MNIST's digits are white ink on black, the ink's bounding box scaled to fit 20×20 (aspect kept,
antialiased) and placed in 28×28 by its centre of mass (LeCun et al., the MNIST database page).
People send something else: a phone photo or a scan, dark ink on light paper, the digit somewhere
on a larger canvas, under uneven light, JPEG-compressed, in colour. :func:`canonicalise` applies
MNIST's own construction to such a picture, so the model sees what it was trained on:

1. alpha flattened onto white, then grayscale with the ITU-R 601 luma rule
   (:func:`conform_image`'s, bit-identical to PIL's ``convert("L")``);
2. large canvases reduced (antialiased) to :data:`WORK_SIDE` on their longer side, so the cost per
   image is bounded whatever the upload's size;
3. background levelled: a cubic surface fitted robustly to the paper (not the ink) models
   uneven light and is subtracted, and the ink's departure divided by the paper's brightness
   (flat field); the sensor's noise floor (a robust spread of the background) is cut off;
4. polarity from that departure: dark ink on light paper departs darker, and is inverted;
5. the digit: the heaviest connected component of ink and those near it (specks and far marks
   dropped), stretched to the full range; its bounding box scaled to fit 20×20 keeping its
   aspect, placed in 28×28 by its centre of mass.

Three kinds of picture have no digit to find, and say so (:class:`Finding`) instead of being made
into one: ``blank`` (no contrast: an empty page, a constant colour), ``fills_canvas`` (the "ink"
covers over a third of the picture: noise, a pattern, a close-up) and ``texture`` (a picture of
mid-tones, not ink on paper: a photo). The server answers them with ``abstain: true``: cropping
and centring must not turn a photo crop or noise into a confident digit.

An MNIST digit itself (white on black, 20×20 box, centred) comes out unchanged: its border is
black, its background zero, its box already 20 on the longer side.
"""

from __future__ import annotations

import enum
import operator
from functools import lru_cache
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
    "conform_image",
    "default_prepare",
    "prepare_image",
    "resolve_prepare",
]

SIDE = 28  # MNIST's canvas
BOX = 20  # MNIST's digit box, inside the canvas
#: Longer side the canonicalisation works at: a 4000×3000 photo is reduced to this first (a digit
#: filling a tenth of it keeps ~40 px, twice the 20 px it ends at).
WORK_SIDE = 256
#: The kept ink's box must reach this many pixels on its longer side (at the work scale) to be a
#: digit; smaller is a speck, read as blank. MNIST's box is 20; a digit shrunk to 35 % of it, the
#: OOD suite's smallest, is 7.
MIN_DIGIT_SIDE = 7
#: Ink contrast (levels of 255, after levelling) below which an image is ``blank``.
MIN_CONTRAST = 40.0
#: The darkest paper brightness the flat-field correction divides by (a black board's is ~30).
MIN_LIT = 32.0
#: Share of the picture the ink (over FAINT_LEVEL of its brightest patch) may cover before the
#: image is ``fills_canvas``: an MNIST digit covers 9–29 % of its canvas (5th–95th percentile),
#: a photographed digit 1–14 %; uniform noise 36–47 %, the suite's patterns 40–50 %.
MAX_INK_FRACTION = 0.33
#: Share of the picture in mid-tones (between FAINT_LEVEL and STROKE_LEVEL of the brightest
#: patch, after a 3×3 median: :func:`_midtone_share`) before the image is ``texture``: ink on
#: paper is two-toned, its edges under 5 % of an MNIST canvas and 3 % of a photographed page or
#: board (95th percentiles); a photo crop's median is 10 %.
MAX_MIDTONE_FRACTION = 0.07
#: Components holding less than this share of the strokes' mass are specks (dust, JPEG ringing).
SPECK_SHARE = 0.02
#: Strokes are ink over this share of the brightest 3×3 patch; under FAINT_LEVEL is background.
STROKE_LEVEL = 0.35
FAINT_LEVEL = 0.1

PrepareMode = Literal["mnist", "none"]
#: ``mnist``: :func:`canonicalise` (the default for a 1×28×28 model); ``none``: pixels already in
#: the model's format, only converted to its channels and resized (:func:`conform_image`).
PREPARE_MODES: tuple[PrepareMode, ...] = ("mnist", "none")


class Finding(enum.IntEnum):
    """What :func:`canonicalise` found; anything but ``ok`` is answered with ``abstain: true``."""

    ok = 0
    blank = 1  # no ink: contrast under MIN_CONTRAST
    fills_canvas = 2  # the "ink" covers over MAX_INK_FRACTION of the picture: not a written digit
    texture = 3  # over MAX_MIDTONE_FRACTION of the picture is mid-tones: a photo, not ink on paper


class Canonical(NamedTuple):
    """A canonicalised image: uint8 ``(1, 28, 28)``, white ink on black, and what was found."""

    image: torch.Tensor
    finding: Finding


def conform_image(image: torch.Tensor, in_channels: int, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``(C, H, W)`` (C in 1..4) or ``(H, W)`` -> uint8 ``(in_channels, *size)``.

    Drops alpha, converts grayscale <-> RGB, resizes (antialiased) when the size differs; returns
    the input itself when it already conforms. Raises ``ValueError`` naming the problem.
    """
    from torchvision.transforms.v2 import functional as TF

    if not isinstance(image, torch.Tensor):
        raise ValueError("image must be a torch.Tensor")
    if image.dim() == 2:
        image = image.unsqueeze(0)
    if image.dim() != 3:
        raise ValueError(f"image must have shape (C, H, W); got {tuple(image.shape)}")
    if image.dtype != torch.uint8:
        raise ValueError(f"image must be uint8; got {image.dtype}")
    c = image.shape[0]
    if c == 4:  # RGBA: drop alpha
        image, c = image[:3], 3
    if c == 2:  # grayscale + alpha
        image, c = image[:1], 1
    if c not in (1, 3):
        raise ValueError(f"image must have 1, 3 or 4 channels; got {c}")
    if c == 1 and in_channels == 3:
        image = image.expand(3, -1, -1)
    elif c == 3 and in_channels == 1:
        image = _luma(image)
    if tuple(image.shape[-2:]) != tuple(size):
        image = TF.resize(image, list(size), antialias=True)
    return image.contiguous()


#: ITU-R 601-2 luma weights (0.299, 0.587, 0.114) in 16-bit fixed point, as PIL's "L"
#: conversion computes them; they sum to 65536, so a gray pixel stays itself.
_LUMA_FIXED = torch.tensor([19595, 38470, 7471], dtype=torch.int32).view(3, 1, 1)


def _luma(image: torch.Tensor) -> torch.Tensor:
    """uint8 RGB ``(3, H, W)`` -> uint8 luma ``(1, H, W)``, rounded, bit-identical to PIL's
    ``convert("L")``.

    Not ``torchvision``'s ``rgb_to_grayscale``: on uint8 it truncates, and its weights sum to
    0.9999, so the same digit sent as RGB came out one level darker than sent as grayscale
    (every v >= 1 became v - 1), which moved VGMU and SNR near the abstain threshold.
    """
    y = ((image.int() * _LUMA_FIXED).sum(0, keepdim=True) + 32768) >> 16  # (1, H, W)
    return y.to(torch.uint8)


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
    (``mnist``) or :func:`conform_image` (``none``: channels and size only, always
    ``Finding.ok``). The one function the server, training data and evaluation call."""
    if mode == "mnist":
        return canonicalise(image)
    return Canonical(conform_image(image, in_channels, input_size), Finding.ok)


def _over_white(a: np.ndarray) -> np.ndarray:
    """uint8 ``(C, H, W)`` with alpha last (C 2 or 4) → int32 ``(C − 1, H, W)``: the colour
    over white, ``v·a + 255·(1 − a)``, rounded."""
    alpha = a[-1].astype(np.int32)
    return (a[:-1].astype(np.int32) * alpha + 255 * (255 - alpha) + 127) // 255


def over_white(image: torch.Tensor) -> torch.Tensor:
    """uint8 ``(C, H, W)`` → uint8 ``(C, H, W)`` without alpha: an image with an alpha channel
    (C 2 or 4) flattened onto white, as the reading does (:func:`canonicalise`), so a file made
    from it (the review queue's exports, what training jobs on reviews read) holds what the
    default reading saw; others as given. (``prepare=none``'s :func:`conform_image` drops alpha.)"""
    if image.dim() != 3 or image.shape[0] not in (2, 4):
        return image
    return torch.from_numpy(_over_white(image.numpy()).astype(np.uint8))


def _gray(image: torch.Tensor) -> np.ndarray:
    """uint8 ``(C, H, W)`` (C 1–4) → float32 ``(H, W)`` in [0, 255]: alpha over white, then the
    ITU-R 601 luma of :func:`conform_image` (16-bit fixed point, rounded: the same
    levels as PIL's ``convert("L")``), in NumPy integers."""
    a = image.numpy()
    c = a.shape[0]
    if c in (2, 4):  # alpha over white
        a = _over_white(a)
        c -= 1
    if c == 3:
        r, g, b = a.astype(np.int32, copy=False)
        return ((r * 19595 + g * 38470 + b * 7471 + 32768) >> 16).astype(np.float32)
    if c != 1:
        raise ValueError(f"image must have 1, 2, 3 or 4 channels; got {c}")
    return a[0].astype(np.float32)


def _shrink(gray: np.ndarray) -> np.ndarray:
    """Reduce ``gray`` so its longer side is at most :data:`WORK_SIDE` (antialiased)."""
    h, w = gray.shape
    if max(h, w) <= WORK_SIDE:
        return gray
    from torchvision.transforms.v2 import functional as TF

    s = WORK_SIDE / max(h, w)
    size = [max(1, round(h * s)), max(1, round(w * s))]
    return TF.resize(torch.from_numpy(gray)[None], size, antialias=True)[0].numpy()


#: The paper is fitted on a grid of at most this many cells a side (area means).
PAPER_GRID = 32
#: The cubic surface's monomials ``x^i y^j`` (``i + j ≤ 3``), as ``(i, j)``.
_MONOMIALS = [(i, j) for i in range(4) for j in range(4 - i)]


def _median(a: np.ndarray) -> float:
    """``float(np.median(a))`` for a NaN-free array, by :func:`numpy.partition` alone: the same
    value (the two middle values' mean in ``a``'s dtype for an even size), without
    ``np.median``'s ~30 µs of generic checks, which a picture's reading pays 6–7 times."""
    a = a.ravel()
    k = a.size // 2
    if a.size % 2:
        return float(np.partition(a, k)[k])
    part = np.partition(a, (k - 1, k))
    return float((part[k - 1] + part[k]) / 2)


@lru_cache(maxsize=64)
def _powers(n: int) -> np.ndarray:
    """``(n, 4)``: 1, t, t², t³ at ``n`` points evenly spaced over [−1, 1] (read-only: cached per
    ``n``, as :func:`_surface` per grid, since every picture of a size has the same ones)."""
    out = np.linspace(-1.0, 1.0, n)[:, None] ** np.arange(4)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=256)
def _surface(h: int, w: int) -> np.ndarray:
    """The cubic surface's basis on an ``h × w`` grid: ``(h·w, 10)``, one column a monomial."""
    ys, xs = _powers(h), _powers(w)
    out = np.stack([np.outer(ys[:, j], xs[:, i]).ravel() for i, j in _MONOMIALS], 1)
    out.setflags(write=False)
    return out


def _evaluate(coef: np.ndarray, h: int, w: int) -> np.ndarray:
    """The surface of ``coef`` on an ``h × w`` grid, separably: ``Y (h, 4) · C (4, 4) · Xᵀ``."""
    c = np.zeros((4, 4))
    for (i, j), value in zip(_MONOMIALS, coef, strict=True):
        c[j, i] = value
    return (_powers(h) @ c @ _powers(w).T).astype(np.float32)


def _paper(gray: np.ndarray) -> np.ndarray:
    """The paper under the ink, ``gray``'s shape: a cubic surface — uneven light, a gradient, a
    vignette — fitted robustly to a coarse grid of the picture. The fit starts on the cells
    between the quartiles and is refitted three times without the cells far from it on either
    side (ink of either polarity), so strokes of any width are not part of the paper (a local
    filter hollows thick ones)."""
    import torch.nn.functional as F

    h, w = gray.shape
    g = torch.from_numpy(gray)[None, None]
    if max(h, w) > PAPER_GRID:
        s = PAPER_GRID / max(h, w)
        g = F.interpolate(g, size=(max(2, round(h * s)), max(2, round(w * s))), mode="area")
    cells = g[0, 0].numpy().ravel().astype(np.float64)
    basis = _surface(*g.shape[-2:])
    lo, hi = np.percentile(cells, [25, 75])
    use = (cells >= lo) & (cells <= hi)
    if not use.any():  # a picture of two cells (1×2): none lies between its quartiles
        use[:] = True
    for _ in range(3):  # least squares by its normal equations: 10 unknowns
        b = basis[use]
        coef = np.linalg.solve(b.T @ b + 1e-6 * np.eye(b.shape[1]), b.T @ cells[use])
        resid = cells - basis @ coef
        spread = 1.4826 * _median(np.abs(resid[use])) + 1.0
        kept = np.abs(resid) <= 2.5 * spread
        if not kept.any():  # nothing near the fit: keep the cells it was made from
            break
        use = kept
    return _evaluate(coef, h, w)


def _ink(gray: np.ndarray) -> np.ndarray | None:
    """Bright ink on a zero background, in levels above the noise floor (levelling, polarity,
    noise floor); None when its contrast is under :data:`MIN_CONTRAST` (nothing written).

    The polarity is the side the picture departs from its paper on: dark ink on light paper
    leaves a long dark tail beyond the paper's noise, chalk on a board a bright one (a fixed
    brightness rule fails on a page photographed in dim light). Light multiplies: a stroke in a
    shadow is as much darker than the paper *around it* as one in full light, relative to that
    paper, so the ink's departure is divided by the paper's brightness there (a flat-field
    correction) and the whole digit has one contrast however the page was lit."""
    paper = _paper(gray)
    resid = gray - paper
    med = _median(resid)
    noise = 3.0 * 1.4826 * _median(np.abs(resid - med))
    dark = float(np.clip(med - noise - resid, 0.0, None).sum())
    bright = float(np.clip(resid - med - noise, 0.0, None).sum())
    ink = np.clip(-resid if dark > bright else resid, 0.0, None)
    ink *= 255.0 / np.clip(paper, MIN_LIT, 255.0)
    # The noise floor: the background's robust spread (MAD), ink being the minority of pixels.
    med = _median(ink)
    floor = med + 4.0 * 1.4826 * _median(np.abs(ink - med))
    # Contrast: the brightest 3×3 patch, so a hot pixel alone is not ink (a percentile would miss
    # a small digit: its strokes can be under 0.5 % of a photo's pixels).
    if float(ndimage.uniform_filter(ink, size=3, mode="constant").max()) - floor < MIN_CONTRAST:
        return None
    return np.clip(ink - floor, 0.0, None)


def _brightest(ink: np.ndarray) -> float:
    """The mean of ``ink``'s brightest 3×3 patch: the scale of its levels (a hot pixel alone does
    not set it)."""
    return float(ndimage.uniform_filter(ink, size=3, mode="constant").max())


def _midtone_share(level: np.ndarray) -> float:
    """Share of the picture in mid-tones — over :data:`FAINT_LEVEL`, at most
    :data:`STROKE_LEVEL` — after a 3×3 median of ``level`` (ink over :func:`_brightest`).

    The median is why a noisy chalk board is not a photo: sensor noise and JPEG blocks on a dark
    board, amplified by the flat field, are isolated pixels a median removes, where a photo's
    mid-tones are areas it keeps. Without it 8.5 % of the board digits of
    :mod:`models.data_photos` (seed 0) read as ``texture``, with it none. The suite's photo crops
    found as no digit go from 74.2 % to 69.6 % and its noise from 98.6 % to 98.8 %; the default
    model, which defers most of the photos the reading lets through, then defers 95.8 % of them
    where it deferred 95.4 % (docs/benchmarks.md, "Input pipeline").

    The median itself is not computed (scipy's costs ~1 ms at 100×100): the median of nine
    values is over ``FAINT_LEVEL`` exactly when at least five of them are, and at most
    ``STROKE_LEVEL`` exactly when at most four are over it, so two 3×3 counts give it."""

    def over(threshold: float) -> np.ndarray:  # share of the 3×3 around each pixel over it
        return ndimage.uniform_filter((level > threshold).astype(np.float32), 3, mode="reflect")

    return float(((over(FAINT_LEVEL) > 4.5 / 9) & (over(STROKE_LEVEL) < 4.5 / 9)).mean())


def _keep_digit(ink: np.ndarray, top: float) -> np.ndarray:
    """The digit of ``ink``, stretched to [0, 1]: the strokes (ink over :data:`STROKE_LEVEL` of
    the brightest patch) form connected components (8-neighbours); the heaviest and those near it
    (within half the digit's size: a 5's detached bar, a 4's open top) are the digit, specks (under
    :data:`SPECK_SHARE` of the strokes' mass) and far marks (dust, a shadow's edge) are not. The
    digit's box keeps its faint edges (antialiasing), everything outside it is cleared, levels
    under :data:`FAINT_LEVEL` are background, and the brightest patch becomes 1 (a faint pencil
    digit reads as a full-contrast one); ``top`` is :func:`_brightest` of ``ink``."""
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
    out = np.clip(out / _median(stroke), 0.0, 1.0) if stroke.size else out
    return out


def _already_mnist(gray: np.ndarray) -> bool:
    """``gray`` is an MNIST digit as it is: 28×28, a black outer ring, enough contrast, the ink's
    box 20 on its longer side and its centre of mass within a pixel of the centre. Those are
    served as sent (the construction below would only move a few of them by a pixel).

    ``gray`` is :func:`_gray`'s (float32) or a grayscale image's own uint8 pixels: whole levels
    in [0, 255] either way. So a row or column is black exactly
    when its sum is 0, and every sum and moment below is a whole number well under 2**24, exact
    in float32 and in Python floats alike: the test runs on the 28 row and 28 column sums as
    Python floats (one image's dozen small NumPy calls cost ~20 µs, most of reading an MNIST
    digit on the serving path)."""
    if gray.shape != (SIDE, SIDE):
        return False
    rows, cols = gray.sum(1).tolist(), gray.sum(0).tolist()
    if rows[0] or rows[-1] or cols[0] or cols[-1]:
        return False
    peak = float(gray.max())
    if peak < MIN_CONTRAST:
        return False
    if max(_extent(rows), _extent(cols)) != BOX:
        return False
    mass = sum(rows)
    cy = sum(map(operator.mul, _INDEX, rows)) / mass
    cx = sum(map(operator.mul, _INDEX, cols)) / mass
    if abs(cy - SIDE / 2) > 1.0 or abs(cx - SIDE / 2) > 1.0:
        return False
    # Framed like a digit is not yet a digit: noise, a filled square or a checkerboard in a 20×20
    # box passed the tests above and were served as MNIST digits ("8" at p = 1.00 from the old
    # default). Those go the long way, whose checks read them as texture or fills_canvas: too
    # much of the canvas inked, or edges everywhere (total variation over mass). The bounds lie
    # above every one of the 10,000 bundled and held-out digits (at most 0.370 and 1.056), so
    # every digit that took this path before still does.
    if np.count_nonzero(gray > FAINT_LEVEL * peak) > FAST_MAX_INK_FRACTION * SIDE * SIDE:
        return False
    level = gray if gray.dtype == np.float32 else gray.astype(np.int32)  # uint8 would wrap
    down, across = np.diff(level, axis=0), np.diff(level, axis=1)
    edges = float(np.abs(down, out=down).sum()) + float(np.abs(across, out=across).sum())
    return edges <= 2.0 * FAST_MAX_ROUGHNESS * mass


_INDEX = range(SIDE)
#: :func:`_already_mnist`'s bounds on a digit served as sent: the share of its canvas over
#: ``FAINT_LEVEL`` of its peak, and its edges (summed absolute differences of neighbours, both
#: directions, over twice its mass). MNIST's boldest digits reach 0.370 and 1.056; noise 0.47,
#: a filled box 0.51, a checkerboard 2.0.
FAST_MAX_INK_FRACTION = 0.42
FAST_MAX_ROUGHNESS = 1.3


def _extent(sums: list[float]) -> int:
    """From the first to the last nonzero entry of ``sums`` (at least one), inclusive."""
    first = next(i for i, v in enumerate(sums) if v)
    last = next(i for i in range(len(sums) - 1, -1, -1) if sums[i])
    return last - first + 1


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
    # A grayscale image is checked on its own uint8 pixels: an MNIST digit (what most clients of
    # an MNIST model send) is then served as sent, without a float copy and a tensor rebuilt.
    one_channel = image.shape[0] == 1
    gray = image.numpy()[0] if one_channel else _gray(image)
    if _already_mnist(gray):
        return Canonical(image if one_channel else torch.from_numpy(gray.astype(np.uint8))[None],
                         Finding.ok)  # fmt: skip
    gray = gray.astype(np.float32, copy=False)  # _gray's float levels from here on
    ink = _ink(_shrink(gray))
    empty = torch.zeros((1, SIDE, SIDE), dtype=torch.uint8)
    if ink is None:  # nothing stands out: an empty page, or a picture that is all noise
        small = _shrink(gray)
        spread = 1.4826 * _median(np.abs(small - _median(small)))
        return Canonical(empty, Finding.texture if spread > MIN_CONTRAST / 2 else Finding.blank)
    top = _brightest(ink)  # the digit's scale, read once for the checks and the digit itself
    level = ink / top
    if float((level > FAINT_LEVEL).mean()) > MAX_INK_FRACTION:
        return Canonical(empty, Finding.fills_canvas)
    if _midtone_share(level) > MAX_MIDTONE_FRACTION:
        return Canonical(empty, Finding.texture)
    kept = _keep_digit(ink, top)
    ys, xs = np.nonzero(kept)
    if ys.size == 0 or max(np.ptp(ys), np.ptp(xs)) + 1 < MIN_DIGIT_SIDE:
        # a speck (dust on a blank page) would be blown up to a 20×20 blot and read "ok"
        return Canonical(empty, Finding.blank)
    digit = _frame(kept)
    pixels = torch.from_numpy(np.rint(digit * 255.0).astype(np.uint8))[None]
    return Canonical(pixels, Finding.ok)
