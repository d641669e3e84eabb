"""Baseline disagreement measures: mutual information, EPKL, EPJS, EPCE (paper Section 3.3).

EPKL, EPJS and EPCE are reported in bits after clamping probabilities to ``[1e-8, 1]`` and
renormalising each member, so they stay finite when members put exact zeros on a class.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from models.uncertainty.decomposition import entropy, entropy_decomposition

#: Probability floor for the divergence baselines.
PROB_FLOOR = 1e-8
#: Elements per EPJS chunk (B · pairs · C); bounds peak memory at ~64 MiB in float32.
EPJS_CHUNK_ELEMENTS = 1 << 24
_LN2 = math.log(2.0)


def _floored(probs: Tensor) -> Tensor:
    p = probs.clamp(PROB_FLOOR, 1.0)
    return p / p.sum(dim=-1, keepdim=True)


def mutual_information(probs: Tensor) -> Tensor:
    """Mutual information ``H(p̄) − mean_m H(p_m)`` of the raw members — the ungated EU, in units of log C."""
    return entropy_decomposition(probs).eu


def epkl(probs: Tensor) -> Tensor:
    """Expected pairwise KL divergence in bits, in O(MC) by its exact closed form.

    ``EPKL = 1/(M(M−1)) Σ_{i≠j} KL(p_i ‖ p_j)``. Expanding the sum over ordered pairs gives
    ``EPKL = M/(M−1) · (mean_m Σ_c p_mc log p_mc − Σ_c p̄_c · mean_m log p_mc)``; 0 when ``M = 1``.
    """
    m = probs.shape[1]
    if m < 2:
        return probs.new_zeros(probs.shape[0])
    p = _floored(probs)
    logp = p.log()
    neg_entropy = (p * logp).sum(dim=-1).mean(dim=1)  # (B,)
    cross = (p.mean(dim=1) * logp.mean(dim=1)).sum(dim=-1)  # (B,)
    return (m / (m - 1) * (neg_entropy - cross)).clamp(min=0.0) / _LN2


def epkl_pairwise(probs: Tensor) -> Tensor:
    """Naive O(M²C) EPKL, kept as the reference for tests and benchmarks (bits)."""
    m = probs.shape[1]
    if m < 2:
        return probs.new_zeros(probs.shape[0])
    p = _floored(probs)
    logp = p.log()
    # kl[b, i, j] = Σ_c p_ic (log p_ic − log p_jc)
    kl = (p * logp).sum(-1).unsqueeze(-1) - torch.einsum("bic,bjc->bij", p, logp)
    return kl.sum(dim=(1, 2)) / (m * (m - 1)) / _LN2


def epjs(probs: Tensor, chunk_elements: int = EPJS_CHUNK_ELEMENTS) -> Tensor:
    """Expected pairwise Jensen–Shannon divergence in bits.

    ``D_JS(p_i ‖ p_j) = ½ KL(p_i ‖ m_ij) + ½ KL(p_j ‖ m_ij) = H(m_ij) − ½(H(p_i) + H(p_j))`` with
    ``m_ij = ½(p_i + p_j)``; symmetric, so the mean over ordered pairs equals the mean over the
    ``M(M−1)/2`` unordered ones. The pairs are processed in chunks so no ``B·M²·C`` tensor is ever
    materialised (B=128, M=100, C=1000 peaks at ``chunk_elements`` floats).
    """
    b, m, c = probs.shape
    if m < 2:
        return probs.new_zeros(b)
    p = _floored(probs)
    mean_member_entropy = entropy(p).mean(dim=1)  # (B,)
    i_idx, j_idx = torch.triu_indices(m, m, offset=1, device=p.device)
    n_pairs = i_idx.numel()
    step = max(1, chunk_elements // max(1, b * c))
    total = p.new_zeros(b)
    for start in range(0, n_pairs, step):
        i, j = i_idx[start : start + step], j_idx[start : start + step]
        mid = 0.5 * (p[:, i] + p[:, j])  # (B, pairs, C)
        total += entropy(mid).sum(dim=1)
    return (total / n_pairs - mean_member_entropy).clamp(min=0.0) / _LN2


def epce(probs: Tensor) -> Tensor:
    """Expected pairwise cross-entropy in bits: ``1/(M(M−1)) Σ_{i≠j} H(p_i, p_j) = EPKL + mean_m H(p_m)``."""
    p = _floored(probs)
    au_bits = entropy(p).mean(dim=1) / _LN2
    return epkl(probs) + au_bits
