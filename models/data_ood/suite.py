"""The project's out-of-distribution suite: non-digits the default model must defer on.

Nine groups of 28×28 uint8 images, made offline from what the project installs
(:mod:`models.data_ood.render`; data card: ``docs/ood-suite.md``):

* far OOD, each with an abstain target for the served rule (:data:`ABSTAIN_TARGETS`):
  ``letters`` (Latin letters that do not look like digits, and symbols, in the
  :data:`SUITE_FONTS`), ``photos`` (crops of the :data:`SUITE_PHOTOS`), ``noise`` (i.i.d. uniform
  or Gaussian), ``blank`` (constant gray), ``patterns`` (stripes, checkerboards, gradients);
* near OOD, made from the bundled test-split digits: ``rotated_digits`` (turned by 90°, 180° or
  270°: a turned 0, 1 or 8 and a 6↔9 stay digits; reported only), ``inverted_digits``
  (255 − x; reported only), ``overlaid_digits`` (two digits of different classes, pixelwise
  max: a person would defer; abstain target) and ``shrunk_digits`` (scaled to 35–50 % and placed
  anywhere inside the 28×28 frame; target: deferred *or* answered right,
  :data:`DEFERRED_OR_RIGHT_TARGETS`).

:func:`ood_suite_labels` gives the true classes of the labelled near groups
(:data:`LABELLED_GROUPS`), from the same draws as the images.

Group ``g`` of seed ``s`` is drawn from ``numpy.random.default_rng([SUITE_TAG, s, g])`` alone, so
the same seed gives the same bytes, and the outlier-exposure set
(:mod:`models.data_ood.outliers`: other fonts, other photographs, other generator families, its
own seed tag) never shares a source with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path

import numpy as np

from models.data_ood import render

__all__ = [
    "ABSTAIN_TARGETS",
    "DEFERRED_OR_RIGHT_TARGETS",
    "DIGIT_LOOKALIKES",
    "FAR_GROUPS",
    "LABELLED_GROUPS",
    "NEAR_GROUPS",
    "OOD_GROUPS",
    "SAMPLE_PER_GROUP",
    "SUITE_CHARS",
    "SUITE_FONTS",
    "SUITE_PHOTOS",
    "SUITE_TAG",
    "load_ood_sample",
    "ood_sample_path",
    "ood_suite",
    "ood_suite_labels",
]

SUITE_TAG = 0x0D5E  # first word of every suite generator's seed sequence (outliers: another tag)
#: Letters left out of both the suite and the outlier set: glyphs a reader could take for a digit
#: (O/o/Q/D→0, I/l/i/j→1, S/s→5, Z/z→2, B→8, b/G→6, g/q→9).
DIGIT_LOOKALIKES = "OoQDIlijSsZzBbGgq"
LATIN = "".join(c for c in map(chr, [*range(65, 91), *range(97, 123)]) if c not in DIGIT_LOOKALIKES)
#: Characters of the ``letters`` group: the Latin letters above and symbols.
SUITE_CHARS = LATIN + "+#@%&?*=<>$§¶~÷±∞√"
#: Fonts of the ``letters`` group (matplotlib's bundled TrueType files).
SUITE_FONTS = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
)
#: scikit-image sample photographs of the ``photos`` group.
SUITE_PHOTOS = (
    "astronaut",
    "camera",
    "coffee",
    "coins",
    "moon",
    "grass",
    "brick",
    "hubble_deep_field",
    "retina",
    "page",
)

FAR_GROUPS = ("letters", "photos", "noise", "blank", "patterns")
#: Near groups, new ones appended: a group's index in :data:`OOD_GROUPS` is its seed stream, so
#: appending keeps every older group's bytes.
NEAR_GROUPS = ("rotated_digits", "inverted_digits", "overlaid_digits", "shrunk_digits")
OOD_GROUPS = FAR_GROUPS + NEAR_GROUPS
#: Groups :func:`ood_suite_labels` gives true classes for (``overlaid_digits``: both classes).
LABELLED_GROUPS = ("rotated_digits", "overlaid_digits", "shrunk_digits")
#: Share of a group the served rule must abstain on (issue 33; issue 25 had 0.80 for letters,
#: 0.90 for photos, 0.95 for noise, blank and patterns, and no near-OOD target).
ABSTAIN_TARGETS = {
    "letters": 0.90,
    "photos": 0.98,
    "noise": 0.98,
    "blank": 0.98,
    "patterns": 0.98,
    "overlaid_digits": 0.80,
}
#: Share of a group that must be abstained on *or* answered with the right class (issue 33): a
#: shrunk digit is still a digit, so a right answer is as good as a deferral.
DEFERRED_OR_RIGHT_TARGETS = {"shrunk_digits": 0.98}
#: Scale of a ``shrunk_digits`` digit, as a share of its 28×28 size (uniform in this range).
SHRINK_RANGE = (0.35, 0.50)
SAMPLE_PER_GROUP = 40  # images per group in the committed sample


def _noise(rng: np.random.Generator) -> np.ndarray:
    return render.uniform_noise(rng) if rng.random() < 0.5 else render.gaussian_noise(rng)


def _pattern(rng: np.random.Generator) -> np.ndarray:
    return (render.stripes, render.checkerboard, render.gradient)[int(rng.integers(3))](rng)


_DRAW: dict[str, Callable[[np.random.Generator], np.ndarray]] = {
    "letters": lambda rng: render.glyph(rng, SUITE_CHARS, SUITE_FONTS),
    "photos": lambda rng: render.photo_crop(rng, SUITE_PHOTOS),
    "noise": _noise,
    "blank": render.blank,
    "patterns": _pattern,
}


def _test_digits() -> tuple[np.ndarray, np.ndarray]:
    """The bundled test split's digits and labels."""
    from models.data import bundled_split, load_bundled_mnist

    images, labels = load_bundled_mnist()
    test = bundled_split()["test"]
    return images[test], labels[test]


def _shrink(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``img`` scaled to a factor in :data:`SHRINK_RANGE` of its size (PIL's antialiased
    bilinear) and placed at a random position wholly inside a black 28×28 canvas."""
    from PIL import Image

    side = round(render.SIZE * rng.uniform(*SHRINK_RANGE))
    small = np.asarray(Image.fromarray(img).resize((side, side), Image.BILINEAR))
    top, left = rng.integers(0, render.SIZE - side + 1, size=2)
    out = np.zeros((render.SIZE, render.SIZE), np.uint8)
    out[top : top + side, left : left + side] = small
    return out


def _digits(rng: np.random.Generator, n: int, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A near group's images and true classes (``(n,)``, ``(n, 2)`` for ``overlaid_digits``,
    None for ``inverted_digits``) from one draw of ``rng``."""
    images, labels = _test_digits()
    pick = rng.permutation(labels.size)[:n]
    chosen, y = images[pick], labels[pick]
    if name == "inverted_digits":
        return (255 - chosen).astype(np.uint8), None
    if name == "rotated_digits":
        turns = rng.integers(1, 4, size=chosen.shape[0])
        return np.stack([np.rot90(img, int(k)) for img, k in zip(chosen, turns, strict=True)]), y
    if name == "overlaid_digits":
        other = rng.integers(labels.size, size=pick.size)
        same = labels[other] == y
        while same.any():  # redraw the partner until its class differs
            other[same] = rng.integers(labels.size, size=int(same.sum()))
            same = labels[other] == y
        return np.maximum(chosen, images[other]), np.stack([y, labels[other]], axis=1)
    if name == "shrunk_digits":
        return np.stack([_shrink(img, rng) for img in chosen]), y
    raise AssertionError(name)


def _group(name: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Group ``name`` of ``seed``: images and, for :data:`LABELLED_GROUPS`, true classes."""
    if name not in OOD_GROUPS:
        raise ValueError(f"unknown OOD group {name!r}; groups: {', '.join(OOD_GROUPS)}")
    rng = np.random.default_rng([SUITE_TAG, seed, OOD_GROUPS.index(name)])
    if name in NEAR_GROUPS:
        images, labels = _digits(rng, n, name)
        return images.astype(np.uint8), labels
    draw = _DRAW[name]
    return np.stack([draw(rng) for _ in range(n)]).astype(np.uint8), None


def ood_suite(
    n_per_group: int = 500, seed: int = 0, groups: Iterable[str] = OOD_GROUPS
) -> dict[str, np.ndarray]:
    """``{group: uint8 (n, 28, 28)}``: the raw images a user would upload, white-on-black like
    MNIST where that applies. The near groups hold at most the 1,600 test digits."""
    if n_per_group < 1:
        raise ValueError(f"n_per_group must be >= 1; got {n_per_group}")
    return {name: _group(name, n_per_group, seed)[0] for name in groups}


def ood_suite_labels(
    n_per_group: int = 500, seed: int = 0, groups: Iterable[str] = LABELLED_GROUPS
) -> dict[str, np.ndarray]:
    """``{group: int64 true classes}`` of :func:`ood_suite`'s images (same arguments, same
    draws): ``(n,)`` for ``rotated_digits`` (the digit before turning) and ``shrunk_digits``,
    ``(n, 2)`` for ``overlaid_digits`` (the two classes, always different). Groups in ``groups``
    without labels are left out."""
    if n_per_group < 1:
        raise ValueError(f"n_per_group must be >= 1; got {n_per_group}")
    out: dict[str, np.ndarray] = {}
    for name in groups:
        if name not in OOD_GROUPS:
            raise ValueError(f"unknown OOD group {name!r}; groups: {', '.join(OOD_GROUPS)}")
        if name in LABELLED_GROUPS:
            labels = _group(name, n_per_group, seed)[1]
            assert labels is not None
            out[name] = labels.astype(np.int64)
    return out


def ood_sample_path() -> Path:
    """The committed sample: ``ood_suite(SAMPLE_PER_GROUP, seed=0)`` as an ``.npz`` per group."""
    return Path(str(resources.files("models") / "data" / "ood-suite-sample.npz"))


def load_ood_sample() -> dict[str, np.ndarray]:
    """The committed sample of the suite (:data:`SAMPLE_PER_GROUP` images of every group)."""
    with np.load(ood_sample_path()) as z:
        return {g: z[g] for g in OOD_GROUPS}
