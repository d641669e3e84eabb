"""Non-digit images, made offline: the OOD evaluation suite (:mod:`.suite`, data card
``docs/ood-suite.md``) and the disjoint outlier-exposure set used in training (:mod:`.outliers`)."""

from models.data_ood.outliers import OUTLIER_FAMILIES, outlier_exposure_set
from models.data_ood.suite import (
    ABSTAIN_TARGETS,
    FAR_GROUPS,
    NEAR_GROUPS,
    OOD_GROUPS,
    load_ood_sample,
    ood_suite,
)

__all__ = [
    "ABSTAIN_TARGETS",
    "FAR_GROUPS",
    "NEAR_GROUPS",
    "OOD_GROUPS",
    "OUTLIER_FAMILIES",
    "load_ood_sample",
    "ood_suite",
    "outlier_exposure_set",
]
