"""The outlier-exposure set: non-digits shown in training (Hendrycks et al., ICLR 2019), kept
apart from the evaluation suite (:mod:`models.data_ood.suite`) source by source:

* glyphs: other fonts (:data:`OUTLIER_FONTS`: DejaVu Serif and DejaVu Sans Mono, none of the
  suite's DejaVu Sans / STIX files), the same digit-free Latin letters plus Greek and Cyrillic
  letters and currency symbols that are not in the suite's symbol set;
* photos: crops of other scikit-image sample images (:data:`OUTLIER_PHOTOS`, disjoint from
  :data:`~models.data_ood.suite.SUITE_PHOTOS`);
* noise of other families: salt-and-pepper, low-resolution block noise, blurred noise (the suite
  has i.i.d. uniform and Gaussian pixels only);
* shapes and textures of other families: random ellipses/rectangles/polygons, smooth random
  fields, rings and plaids (the suite has constant images, straight stripes, checkerboards and
  linear/radial ramps);
* a seed sequence of its own (:data:`OUTLIER_TAG`), so no generator state is shared either.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from models.data_ood import render
from models.data_ood.suite import LATIN

__all__ = [
    "OUTLIER_CHARS",
    "OUTLIER_CM_FONTS",
    "OUTLIER_FAMILIES",
    "OUTLIER_FAMILIES_V2",
    "OUTLIER_FAMILIES_V3",
    "OUTLIER_FONTS",
    "OUTLIER_PHOTOS",
    "OUTLIER_TAG",
    "outlier_exposure_set",
]

OUTLIER_TAG = 0x7A1D
OUTLIER_FONTS = (
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
)
#: Greek and Cyrillic letters that do not look like digits, and symbols not in the suite.
OUTLIER_CHARS = LATIN + "αγεηκλμνξπρτφχψωΓΔΛΞΠΣΦΨΩДЖИЙЛФЦШЩЫЮЯжилфцшщыюя^€£¥"
OUTLIER_PHOTOS = (
    "chelsea",
    "rocket",
    "gravel",
    "cell",
    "immunohistochemistry",
    "text",
    "horse",
    "logo",
    "clock",
    "microaneurysms",
    "lfw_subset",
    "stereo_motorcycle",
    "shepp_logan_phantom",
    "colorwheel",
)
#: Families of the set with their share of it.
OUTLIER_FAMILIES: dict[str, tuple[float, Callable[[np.random.Generator], np.ndarray]]] = {
    "glyphs": (0.30, lambda rng: render.glyph(rng, OUTLIER_CHARS, OUTLIER_FONTS)),
    "photos": (0.30, lambda rng: render.photo_crop(rng, OUTLIER_PHOTOS)),
    "salt_pepper": (0.05, render.salt_pepper),
    "block_noise": (0.05, render.block_noise),
    "blurred_noise": (0.05, render.blurred_noise),
    "shapes": (0.10, render.shapes),
    "smooth_field": (0.10, render.smooth_field),
    "plaid": (0.05, render.plaid),
}


#: Computer Modern faces (matplotlib's TeX fonts): a second style of printed Latin letters,
#: added in version 2 of the set (none of them is a suite font).
OUTLIER_CM_FONTS = ("cmr10.ttf", "cmss10.ttf", "cmb10.ttf", "cmti10.ttf", "cmtt10.ttf")
#: Version 2 of the set (``TrainConfig.outlier_set``, issue 33): version 1's families plus Latin
#: letters in the Computer Modern faces, so that more letter styles than two font families are
#: seen. Version 1 stays what the models trained on it drew.
OUTLIER_FAMILIES_V2: dict[str, tuple[float, Callable[[np.random.Generator], np.ndarray]]] = {
    **OUTLIER_FAMILIES,
    "cm_letters": (0.15, lambda rng: render.glyph(rng, LATIN, OUTLIER_CM_FONTS)),
}


#: Version 3 (issue 33): version 2 plus Latin letters in a third style, a proportional sans-serif:
#: Aileron, the scalable font built into Pillow (not a suite font; the suite's sans is DejaVu
#: Sans). Versions 1 and 2 stay what the models trained on them drew.
OUTLIER_FAMILIES_V3: dict[str, tuple[float, Callable[[np.random.Generator], np.ndarray]]] = {
    **OUTLIER_FAMILIES_V2,
    "sans_letters": (0.15, lambda rng: render.glyph(rng, LATIN, (render.PILLOW_FONT,))),
}
_VERSIONS = {1: OUTLIER_FAMILIES, 2: OUTLIER_FAMILIES_V2, 3: OUTLIER_FAMILIES_V3}


def outlier_exposure_set(
    n: int = 12000, seed: int = 0, version: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` outlier images uint8 ``(n, 28, 28)`` and their family index ``(n,)`` (into
    :data:`OUTLIER_FAMILIES`), each family from ``default_rng([OUTLIER_TAG, seed, family])``.
    Constant images (a flat photo crop) are redrawn: those belong to the suite's ``blank`` group.
    ``version`` 2 adds :data:`OUTLIER_FAMILIES_V2`'s Computer Modern letters, 3 also
    :data:`OUTLIER_FAMILIES_V3`'s Aileron letters (family indices then index that dict).
    Different seeds give different sets (training uses the config's seed; a validation set for
    choosing the outlier-exposure recipe uses another)."""
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    families = _VERSIONS.get(version)
    if families is None:
        raise ValueError(f"outlier set version must be 1, 2 or 3; got {version}")
    names = list(families)
    shares = np.array([families[f][0] for f in names])
    counts = np.floor(shares / shares.sum() * n).astype(int)
    counts[0] += n - counts.sum()
    images, family = [], []
    for i, (name, count) in enumerate(zip(names, counts, strict=True)):
        rng = np.random.default_rng([OUTLIER_TAG, seed, i])
        draw = families[name][1]
        for _ in range(count):
            img = draw(rng)
            while img.min() == img.max():  # a flat crop is a blank image: the suite's, not ours
                img = draw(rng)
            images.append(img)
        family += [i] * int(count)
    return np.stack(images).astype(np.uint8), np.asarray(family, np.int64)
