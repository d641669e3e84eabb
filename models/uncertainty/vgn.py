"""Variance-Gated Normalisation (VGN): ``q_m = p_m ⊙ Γ / Z_m`` with a closed-form backward.

Forward (paper Section 3.1; SI S6 "Variance-Gated Normalization Implementation")::

    p̄ = mean_m p_m                     (B, C)
    s  = std_m p_m (M−1) + ε            (B, C)
    Γ  = max(1 − exp(−p̄ / (k s)), ε)    (B, C), k clamped ≥ 1e-3
    Z_m = max(p_mᵀ Γ, ε)                (B, M), straight-through where the bound is active
    q_m = p_m ⊙ Γ / Z_m                 (B, M, C)

Backward: the vector–Jacobian product of the forward above, split into the three additive paths
of Proposition 4.1 (SI Table S2) — the direct normalisation path (Γ fixed), the path through the
mean p̄ and the path through the spread s — plus the gradient to k, summed over the batch. Where
the table departs from its own forward the code follows the forward: the spread is the sample
spread (ddof 1, SI "Through the variance"), so ``∂s_c/∂p_mc = (p_mc − p̄_c)/((M−1) std_c)``; the
table and that proposition write ``(p_m − p̄)/(M s)``, which their proof takes from the identity
of the 1/M variance; ``gradcheck`` against the forward decides (tests/models/uncertainty). First
derivatives only (``once_differentiable``: a second derivative raises instead of coming out
silently wrong). ``torch.autograd.gradcheck``
and an equivalence test against :func:`vgn_autograd` (the same forward under plain autograd) keep it
honest; ``benchmarks/uncertainty.py`` measures it against autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from models.uncertainty.gate import K_MIN, as_gate_k
from models.uncertainty.moments import member_std
from models.uncertainty.validation import EPS


def _gated(probs: Tensor, k: Tensor, eps: float) -> tuple[Tensor, ...]:
    """VGN's forward pass (paper Section 3.1, SI S6): ``q = p ⊙ Γ / Z``, ``Γ = 1 − e^{−p̄/(k s)}``.

    Returns ``q`` ``(B, M, C)`` and the intermediates the closed-form backward reuses:
    ``mean, std, s, inv_ks, neg_u, gate_raw, gate, inv_z``.
    """
    mean = probs.mean(dim=1)  # (B, C)
    std = member_std(probs, mean)  # (B, C)
    s = std + eps
    k_c = k.clamp(min=K_MIN)  # (C,)
    inv_ks = (k_c * s).reciprocal_()  # (B, C)
    neg_u = -mean * inv_ks  # −u, u = p̄/(k s)
    gate_raw = torch.expm1(neg_u).neg_()  # (B, C) 1 − e^{−u}, accurate for small u
    gate = gate_raw.clamp(min=eps)
    z = torch.einsum("bmc,bc->bm", probs, gate).clamp(min=eps)  # (B, M)
    inv_z = z.reciprocal_()
    q = probs * (inv_z.unsqueeze(-1) * gate.unsqueeze(1))  # (B, M, C)
    return q, mean, std, s, inv_ks, neg_u, gate_raw, gate, inv_z


class VGNFunction(torch.autograd.Function):
    """``autograd.Function`` computing gated members ``Q`` from ``P`` and per-class ``k``."""

    @staticmethod
    def forward(ctx, probs: Tensor, k: Tensor, eps: float = EPS) -> Tensor:  # type: ignore[override]
        m = probs.shape[1]
        q, mean, std, s, inv_ks, neg_u, gate_raw, gate, inv_z = _gated(probs, k, eps)
        decay = neg_u.exp_()  # e^{−u}
        active = gate_raw >= eps  # where Γ's lower bound is inactive
        # The local derivatives of the gate are (B, C): form them here, once.
        #   ∂Γ/∂p̄ = e^{−u}/(k s)   (zero where Γ's bound is active)
        #   ∂Γ/∂s = −∂Γ/∂p̄ · p̄/s,  ∂Γ/∂k = −∂Γ/∂p̄ · p̄/k
        #   ∂s/∂p_mc = (p_mc − p̄_c)/((M−1) std_c)   (0 where std_c = 0, e.g. M = 1)
        dgate_dmean = decay.mul_(inv_ks).mul_(active)
        if m > 1:
            spread_w = torch.where(std > 0, -1.0 / ((m - 1) * std * s), torch.zeros_like(std))
        else:
            spread_w = torch.zeros_like(std)
        # q is not saved: it is the largest tensor, (B, M, C), and backward never needs it whole.
        ctx.save_for_backward(probs, k, mean, gate, inv_z, dgate_dmean, spread_w)
        return q

    @staticmethod
    @once_differentiable  # the saved intermediates carry no graph: no double backward
    def backward(ctx, grad_q: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        probs, k, mean, gate, inv_z, dgate_dmean, spread_w = ctx.saved_tensors
        m = probs.shape[1]

        # Direct path (Γ fixed), with q = p ⊙ Γ / Z never materialised:
        #   r_m = Σ_c g_mc q_mc = (g_m ⊙ p_m)ᵀ Γ / Z_m,   ∂L/∂p_mc|Γ = Γ_c (g_mc − r_m) / Z_m.
        # Z's lower bound is straight-through, so the same expression holds where it is active.
        gp = grad_q * probs  # (B, M, C)
        r_z = torch.einsum("bmc,bc->bm", gp, gate).mul_(inv_z).mul_(inv_z)  # r_m / Z_m
        # Gradient reaching the shared gate: ∂L/∂Γ_c = Σ_m p_mc (g_mc − r_m) / Z_m.
        grad_gate = torch.einsum("bmc,bm->bc", gp, inv_z).sub_(
            torch.einsum("bmc,bm->bc", probs, r_z)
        )

        # Through-mean path: t = ∂L/∂p̄ (via Γ); each member gets t/M.
        t = grad_gate.mul_(dgate_dmean)  # (B, C)
        tm = t * mean
        # Through-spread path: ∂L/∂s = −t p̄/s, times ∂s/∂p_mc → coef_c (p_mc − p̄_c).
        coef = tm * spread_w  # (B, C)
        shared = torch.addcmul(t / m, mean, coef, value=-1.0)  # (B, C), same for every member

        # Assemble ∂L/∂p on one (B, M, C) buffer:
        #   g_mc Γ_c / Z_m − (r_m / Z_m) Γ_c + shared_c + coef_c p_mc
        grad_p = grad_q * (inv_z.unsqueeze(-1) * gate.unsqueeze(1))
        lhs = torch.stack((-r_z, torch.ones_like(r_z)), dim=-1)  # (B, M, 2)
        grad_p.baddbmm_(lhs, torch.stack((gate, shared), dim=1))  # two outer products at once
        grad_p.addcmul_(probs, coef.unsqueeze(1))

        grad_k = None
        if ctx.needs_input_grad[1]:
            # ∂L/∂k_c = −Σ_b t p̄ / k, summed over the batch; zero where k's lower bound is active.
            k_c = k.clamp(min=K_MIN)
            grad_k = tm.sum(dim=0).div_(k_c).neg_().mul_(k >= K_MIN)
        return grad_p, grad_k, None


def vgn(probs: Tensor, k: float | Tensor, eps: float = EPS) -> Tensor:
    """Gate members with the closed-form-backward VGN. ``probs`` ``(B, M, C)``, ``k`` scalar or ``(C,)``.

    Half-precision inputs are computed (and returned) in float32.
    """
    if probs.dtype in (torch.float16, torch.bfloat16):
        probs = probs.float()
    k_t = k if isinstance(k, Tensor) and k.ndim == 1 else as_gate_k(k, probs.shape[-1], probs)
    k_t = k_t.to(probs.dtype)
    if not (torch.is_grad_enabled() and (probs.requires_grad or k_t.requires_grad)):
        # Inference (a server's forward pass): the same q, op for op, without the backward's
        # intermediates or the autograd.Function call (on the default model at batch 20 on a
        # CPU the layer took ~360 µs per batch, mostly work only backward needs).
        return _gated(probs, k_t, eps)[0]
    return VGNFunction.apply(probs, k_t, eps)


def vgn_autograd(probs: Tensor, k: float | Tensor, eps: float = EPS) -> Tensor:
    """The same forward as :func:`vgn`, differentiated by plain autograd (reference for tests/benchmarks)."""
    if probs.dtype in (torch.float16, torch.bfloat16):
        probs = probs.float()
    k_t = k if isinstance(k, Tensor) and k.ndim == 1 else as_gate_k(k, probs.shape[-1], probs)
    mean = probs.mean(dim=1)
    s = member_std(probs, mean) + eps
    gate = (-torch.expm1(-mean / (k_t.clamp(min=K_MIN) * s))).clamp(min=eps)
    z = torch.einsum("bmc,bc->bm", probs, gate)
    z = z + (z.clamp(min=eps) - z).detach()  # straight-through lower bound
    return probs * gate.unsqueeze(1) / z.unsqueeze(-1)


class VGN(nn.Module):
    """Variance-Gated Normalisation layer for DE/LLE ensembles (paper Section 4, SI S6).

    With ``k=None`` the per-class sensitivity is learned as ``k = softplus(ℓ) + ε`` with ``ℓ``
    initialised to 0 (``k ≈ 0.693``); otherwise ``k`` is fixed (scalar or per-class).

    Input: member probabilities ``(B, M, C)``; output: gated members ``q`` ``(B, M, C)``.
    """

    def __init__(self, num_classes: int, k: float | Tensor | None = None, eps: float = EPS) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"VGN needs at least two classes; got {num_classes}")
        self.num_classes = num_classes
        self.eps = eps
        self.learnable = k is None
        if k is None:
            self.k_logit = nn.Parameter(torch.zeros(num_classes))
        else:
            self.register_buffer("k_fixed", as_gate_k(k, num_classes, torch.zeros(1)).clone())

    @property
    def k(self) -> Tensor:
        """Current per-class sensitivity ``(C,)``."""
        if self.learnable:
            return F.softplus(self.k_logit) + self.eps
        return self.k_fixed

    def forward(self, probs: Tensor) -> Tensor:
        return vgn(
            probs, self.k.to(probs.dtype if probs.is_floating_point() else torch.float32), self.eps
        )

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, learnable={self.learnable}"
