"""The project's out-of-distribution suite: non-digits the default model must defer on.

Seven groups of 28×28 uint8 images, made offline from what the project installs
(:mod:`models.data_ood.render`; data card: ``docs/ood-suite.md``):

* far OOD, each with an abstain target for the served rule (:data:`ABSTAIN_TARGETS`):
  ``letters`` (Latin letters that do not look like digits, and symbols, in the
  :data:`SUITE_FONTS`), ``photos`` (crops of the :data:`SUITE_PHOTOS`), ``noise`` (i.i.d. uniform
  or Gaussian), ``blank`` (constant gray), ``patterns`` (stripes, checkerboards, gradients);
* near OOD, reported but without a target: ``rotated_digits`` (test-split digits turned by 90°,
  180° or 270°: a turned 0, 1 or 8 and a 6↔9 stay digits) and ``inverted_digits`` (255 − x).

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
    "DIGIT_LOOKALIKES",
    "FAR_GROUPS",
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
NEAR_GROUPS = ("rotated_digits", "inverted_digits")
OOD_GROUPS = FAR_GROUPS + NEAR_GROUPS
#: Share of each far group the served rule must abstain on (issue 25).
ABSTAIN_TARGETS = {"letters": 0.80, "photos": 0.90, "noise": 0.95, "blank": 0.95, "patterns": 0.95}
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


def _digits(rng: np.random.Generator, n: int, inverted: bool) -> np.ndarray:
    from models.data import bundled_split, load_bundled_mnist

    images, _ = load_bundled_mnist()
    test = bundled_split()["test"]
    chosen = images[test[rng.permutation(test.size)[:n]]]
    if inverted:
        return (255 - chosen).astype(np.uint8)
    turns = rng.integers(1, 4, size=chosen.shape[0])
    return np.stack([np.rot90(img, int(k)) for img, k in zip(chosen, turns, strict=True)])


def ood_suite(
    n_per_group: int = 500, seed: int = 0, groups: Iterable[str] = OOD_GROUPS
) -> dict[str, np.ndarray]:
    """``{group: uint8 (n, 28, 28)}``: the raw images a user would upload, white-on-black like
    MNIST where that applies. The near groups hold at most the 1,600 test digits."""
    if n_per_group < 1:
        raise ValueError(f"n_per_group must be >= 1; got {n_per_group}")
    out: dict[str, np.ndarray] = {}
    for name in groups:
        if name not in OOD_GROUPS:
            raise ValueError(f"unknown OOD group {name!r}; groups: {', '.join(OOD_GROUPS)}")
        rng = np.random.default_rng([SUITE_TAG, seed, OOD_GROUPS.index(name)])
        if name in NEAR_GROUPS:
            out[name] = _digits(rng, n_per_group, inverted=name == "inverted_digits")
        else:
            draw = _DRAW[name]
            out[name] = np.stack([draw(rng) for _ in range(n_per_group)]).astype(np.uint8)
    return out


def ood_sample_path() -> Path:
    """The committed sample: ``ood_suite(SAMPLE_PER_GROUP, seed=0)`` as an ``.npz`` per group."""
    return Path(str(resources.files("models") / "data" / "ood-suite-sample.npz"))


def load_ood_sample() -> dict[str, np.ndarray]:
    """The committed sample of the suite (:data:`SAMPLE_PER_GROUP` images of every group)."""
    with np.load(ood_sample_path()) as z:
        return {g: z[g] for g in OOD_GROUPS}
