"""Out-of-distribution detection (paper §4.6, SI S4.7) and an offline natural-image OOD set.

Detection treats OOD as the positive class and an uncertainty score as the detector (higher = more
likely OOD):

* AUROC ``= P(u_ood > u_id) + ½ P(u_ood = u_id)`` (``sklearn.metrics.roc_auc_score``)
* FPR@95 = false-positive rate (fraction of ID samples flagged) at the first ROC operating point
  whose true-positive rate (fraction of OOD samples flagged) reaches 95 %:
  ``min {FPR_t : TPR_t ≥ 0.95}`` over the thresholds ``t`` of ``sklearn.metrics.roc_curve``.

The paper uses SVHN → CIFAR-10. Nothing here may download, so :func:`natural_image_patches` builds a
deterministic OOD set from the sample photographs that ship inside the scikit-image wheel
(``skimage.data``): square crops on a fixed grid, converted to the model's channels and size.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from sklearn.metrics import roc_auc_score, roc_curve

from models.evaluation.classification import as_numpy

#: Natural photographs bundled in the scikit-image wheel (``skimage/data/*.png|jpg``): loading them
#: never touches the network (checked for scikit-image 0.26; pooch-fetched images are excluded).
BUNDLED_IMAGES = (
    "astronaut",
    "camera",
    "chelsea",
    "coffee",
    "coins",
    "moon",
    "rocket",
    "grass",
    "gravel",
    "brick",
    "clock",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "cell",
    "page",
    "text",
)

TPR_LEVEL = 0.95


def _split(id_scores: ArrayLike, ood_scores: ArrayLike) -> tuple[NDArray, NDArray]:
    a = as_numpy(id_scores).astype(np.float64).ravel()
    b = as_numpy(ood_scores).astype(np.float64).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError("OOD detection needs at least one ID and one OOD sample")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("OOD scores must be finite")
    y = np.concatenate([np.zeros(a.size), np.ones(b.size)])
    return y, np.concatenate([a, b])


def ood_auroc(id_scores: ArrayLike, ood_scores: ArrayLike) -> float:
    """AUROC of separating OOD (positive) from ID by the score (higher = more OOD)."""
    y, s = _split(id_scores, ood_scores)
    return float(roc_auc_score(y, s))


def fpr_at_tpr(id_scores: ArrayLike, ood_scores: ArrayLike, tpr_level: float = TPR_LEVEL) -> float:
    """FPR at the first ROC point with TPR ≥ ``tpr_level`` (FPR@95 for the default 0.95)."""
    y, s = _split(id_scores, ood_scores)
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    return float(fpr[np.argmax(tpr >= tpr_level)])


def ood_metrics(
    id_scores: Mapping[str, ArrayLike], ood_scores: Mapping[str, ArrayLike]
) -> dict[str, dict[str, float]]:
    """``{name: {"auroc", "fpr95"}}`` for every score present in both mappings."""
    return {
        name: {
            "auroc": ood_auroc(id_scores[name], ood_scores[name]),
            "fpr95": fpr_at_tpr(id_scores[name], ood_scores[name]),
        }
        for name in id_scores
        if name in ood_scores
    }


@lru_cache(maxsize=len(BUNDLED_IMAGES))
def _load_gray_or_rgb(name: str) -> NDArray[np.float32]:
    """One bundled image as float32 ``(H, W, 3)`` in [0, 1] (grayscale replicated)."""
    import skimage.data

    img = np.asarray(getattr(skimage.data, name)())
    if img.dtype == np.bool_:
        img = img.astype(np.float32)
    elif np.issubdtype(img.dtype, np.integer):
        img = img.astype(np.float32) / float(np.iinfo(img.dtype).max)
    img = img.astype(np.float32)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.ascontiguousarray(img[..., :3])


def natural_image_patches(
    n: int = 1000,
    channels: int = 1,
    size: int | tuple[int, int] = 28,
    crop: int = 64,
    seed: int = 0,
) -> torch.Tensor:
    """Deterministic OOD set: ``n`` natural-image patches as uint8 ``(n, channels, H, W)``.

    Every image in :data:`BUNDLED_IMAGES` is cut into non-overlapping ``crop × crop`` squares on a
    fixed grid; each square is area-resized (antialiased bilinear) to ``size`` and converted to
    ``channels`` (1: ITU-R 601 luma ``0.299R + 0.587G + 0.114B``; 3: RGB). ``n`` patches are then
    drawn without replacement by a ``numpy.random.default_rng(seed)`` permutation of the pool
    (cycled if ``n`` exceeds the pool). The output is the raw uint8 image a user would upload, so
    it goes through the model's own ``Predictor.prepare`` (normalisation) like any other input.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3; got {channels}")
    h, w = (size, size) if isinstance(size, int) else size
    crops = []
    for name in BUNDLED_IMAGES:
        img = _load_gray_or_rgb(name)
        rows, cols = img.shape[0] // crop, img.shape[1] // crop
        t = torch.from_numpy(img[: rows * crop, : cols * crop])  # (H, W, 3)
        t = t.reshape(rows, crop, cols, crop, 3).permute(0, 2, 4, 1, 3)  # (r, c, 3, crop, crop)
        crops.append(t.reshape(rows * cols, 3, crop, crop))
    pool = torch.cat(crops)
    order = np.random.default_rng(seed).permutation(pool.shape[0])
    order = np.resize(order, n)  # cycles through the permutation when n > pool size
    chosen = pool[torch.from_numpy(order)]
    resized = torch.nn.functional.interpolate(
        chosen, size=(h, w), mode="bilinear", align_corners=False, antialias=True
    )
    if channels == 1:
        weights = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
        resized = (resized * weights).sum(dim=1, keepdim=True)
    return (resized.clamp(0, 1) * 255).round().to(torch.uint8)
