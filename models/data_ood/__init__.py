"""Non-digit images, made offline: the OOD evaluation suite (:mod:`.suite`, data card
``docs/ood-suite.md``) and the disjoint outlier-exposure set used in training (:mod:`.outliers`)."""

from models.data_ood.outliers import OUTLIER_FAMILIES, outlier_exposure_set
from models.data_ood.suite import (
    ABSTAIN_TARGETS,
    DEFERRED_OR_RIGHT_TARGETS,
    FAR_GROUPS,
    LABELLED_GROUPS,
    NEAR_GROUPS,
    OOD_GROUPS,
    load_ood_sample,
    ood_suite,
    ood_suite_labels,
)

__all__ = [
    "ABSTAIN_TARGETS",
    "DEFERRED_OR_RIGHT_TARGETS",
    "FAR_GROUPS",
    "LABELLED_GROUPS",
    "NEAR_GROUPS",
    "OOD_GROUPS",
    "OUTLIER_FAMILIES",
    "load_ood_sample",
    "ood_suite",
    "ood_suite_labels",
    "outlier_exposure_set",
]
