"""The paper's method: variance gate, VGN layer, TU/AU/EU, VGMU + abstain, and baselines."""

from models.uncertainty.decomposition import Decomposition, entropy, entropy_decomposition
from models.uncertainty.divergences import epce, epjs, epkl, epkl_pairwise, mutual_information
from models.uncertainty.gate import variance_gate
from models.uncertainty.margin import MarginScore, margin_score
from models.uncertainty.moments import ensemble_moments
from models.uncertainty.scoring import (
    EnsembleScores,
    decision_scores,
    score_ensemble,
    score_members,
)
from models.uncertainty.validation import EPS, check_probs
from models.uncertainty.vgn import VGN, VGNFunction, vgn, vgn_autograd

__all__ = [
    "EPS",
    "VGN",
    "Decomposition",
    "EnsembleScores",
    "MarginScore",
    "VGNFunction",
    "check_probs",
    "decision_scores",
    "ensemble_moments",
    "entropy",
    "entropy_decomposition",
    "epce",
    "epjs",
    "epkl",
    "epkl_pairwise",
    "margin_score",
    "mutual_information",
    "score_ensemble",
    "score_members",
    "variance_gate",
    "vgn",
    "vgn_autograd",
]
