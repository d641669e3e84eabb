"""Ensembles returning member probabilities (B, M, C): DE, LLE, MCD, MCD-LLE (paper Section 4)."""

from .base import BatchedHeads, Ensemble, EnsembleOutput
from .deep import DeepEnsemble
from .factory import KINDS, VGN_KINDS, build_ensemble, normalise_kind
from .lle import LastLayerEnsemble
from .mcd import MCDropoutEnsemble

__all__ = [
    "KINDS",
    "VGN_KINDS",
    "BatchedHeads",
    "DeepEnsemble",
    "Ensemble",
    "EnsembleOutput",
    "LastLayerEnsemble",
    "MCDropoutEnsemble",
    "build_ensemble",
    "normalise_kind",
]
