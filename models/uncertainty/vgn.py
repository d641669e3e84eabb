"""Variance-Gated Normalisation (VGN): ``q_m = p_m ⊙ Γ / Z_m`` with a closed-form backward.

Forward (paper Section 3.1; SI S6 "Variance-Gated Normalization Implementation")::

    p̄ = mean_m p_m                     (B, C)
    s  = std_m p_m (M−1) + ε            (B, C)
    Γ  = max(1 − exp(−p̄ / (k s)), ε)    (B, C), k clamped ≥ 1e-3
    Z_m = max(p_mᵀ Γ, ε)                (B, M), straight-through where the bound is active
    q_m = p_m ⊙ Γ / Z_m                 (B, M, C)

Backward: the vector–Jacobian product of SI Table S2, split into the three additive paths of
Proposition 4.1 — the direct normalisation path (Γ fixed), the path through the mean p̄ and the path
through the spread s — plus the gradient to k, summed over the batch. ``torch.autograd.gradcheck``
and an equivalence test against :func:`vgn_autograd` (the same forward under plain autograd) keep it
honest; ``benchmarks/uncertainty.py`` measures it against autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.uncertainty.gate import K_MIN, as_gate_k
from models.uncertainty.validation import EPS


class VGNFunction(torch.autograd.Function):
    """``autograd.Function`` computing gated members ``Q`` from ``P`` and per-class ``k``."""

    @staticmethod
    def forward(ctx, probs: Tensor, k: Tensor, eps: float = EPS) -> Tensor:  # type: ignore[override]
        m = probs.shape[1]
        mean = probs.mean(dim=1)  # (B, C)
        std = probs.std(dim=1, correction=1) if m > 1 else torch.zeros_like(mean)  # (B, C)
        s = std + eps
        k_c = k.clamp(min=K_MIN)  # (C,)
        gate_raw = -torch.expm1(-mean / (k_c * s))  # (B, C) = 1 − exp(−u)
        gate = gate_raw.clamp(min=eps)
        z = torch.einsum("bmc,bc->bm", probs, gate).clamp(min=eps)  # (B, M)
        q = probs * (gate.unsqueeze(1) / z.unsqueeze(-1))  # (B, M, C)
        # q is not saved: it is the largest tensor, (B, M, C), and backward never needs it whole.
        ctx.save_for_backward(probs, k, mean, std, gate_raw, z)
        ctx.eps = eps
        return q

    @staticmethod
    def backward(ctx, grad_q: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        probs, k, mean, std, gate_raw, z = ctx.saved_tensors
        eps = ctx.eps
        m = probs.shape[1]
        s = std + eps
        k_c = k.clamp(min=K_MIN)
        gate = gate_raw.clamp(min=eps)  # (B, C)
        inv_z = 1.0 / z  # (B, M)

        # Direct path (Γ fixed), with q never materialised (it is p ⊙ Γ / Z):
        #   r_m = Σ_c g_mc q_mc = (g_m ⊙ p_m)ᵀ Γ / Z_m
        #   ∂L/∂p_mc|Γ = Γ_c (g_mc − r_m) / Z_m
        # Z's lower bound is straight-through, so the same expression holds where it is active.
        gp = grad_q * probs  # (B, M, C)
        r = torch.einsum("bmc,bc->bm", gp, gate) * inv_z  # (B, M)
        # Gradient reaching the shared gate: ∂L/∂Γ_c = Σ_m p_mc (g_mc − r_m) / Z_m.
        grad_gate = torch.einsum("bmc,bm->bc", gp, inv_z) - torch.einsum(
            "bmc,bm->bc", probs, r * inv_z
        )
        grad_gate = grad_gate * (gate_raw >= eps)  # clamp Γ ≥ ε
        # Γ = 1 − e^{−u}, u = p̄/(k s):  ∂Γ/∂u = e^{−u} = 1 − Γ_raw.
        grad_u = grad_gate * (1 - gate_raw)  # (B, C)
        inv_ks = 1.0 / (k_c * s)

        # Through-mean path: ∂u/∂p̄ = 1/(k s), ∂p̄/∂p_m = 1/M  → a (B, C) term shared by all members.
        shared = grad_u * inv_ks / m  # (B, C)
        # Through-spread path: ∂u/∂s = −p̄/(k s²), ∂s/∂p_mc = (p_mc − p̄_c) / ((M−1) std_c).
        coef = None
        if m > 1:
            grad_s = -grad_u * mean * inv_ks / s  # (B, C)
            safe_std = torch.where(std > 0, std, torch.ones_like(std))
            coef = torch.where(std > 0, grad_s / ((m - 1) * safe_std), torch.zeros_like(std))
            shared = shared - mean * coef

        # Assemble ∂L/∂p with in-place ops on one (B, M, C) buffer:
        #   Γ_c g_mc / Z_m − (r_m / Z_m) Γ_c + shared_c + coef_c p_mc
        grad_p = grad_q * gate.unsqueeze(1)
        grad_p.mul_(inv_z.unsqueeze(-1))
        grad_p.baddbmm_((-r * inv_z).unsqueeze(-1), gate.unsqueeze(1))
        grad_p.add_(shared.unsqueeze(1))
        if coef is not None:
            grad_p.addcmul_(probs, coef.unsqueeze(1))

        grad_k = None
        if ctx.needs_input_grad[1]:
            # ∂u/∂k = −p̄/(k² s); summed over the batch; zero where k's lower bound is active.
            grad_kc = (-grad_u * mean * inv_ks / k_c).sum(dim=0)  # (C,)
            grad_k = grad_kc * (k >= K_MIN)
        return grad_p, grad_k, None


def vgn(probs: Tensor, k: float | Tensor, eps: float = EPS) -> Tensor:
    """Gate members with the closed-form-backward VGN. ``probs`` ``(B, M, C)``, ``k`` scalar or ``(C,)``.

    Half-precision inputs are computed (and returned) in float32.
    """
    if probs.dtype in (torch.float16, torch.bfloat16):
        probs = probs.float()
    k_t = k if isinstance(k, Tensor) and k.ndim == 1 else as_gate_k(k, probs.shape[-1], probs)
    return VGNFunction.apply(probs, k_t.to(probs.dtype), eps)


def vgn_autograd(probs: Tensor, k: float | Tensor, eps: float = EPS) -> Tensor:
    """The same forward as :func:`vgn`, differentiated by plain autograd (reference for tests/benchmarks)."""
    if probs.dtype in (torch.float16, torch.bfloat16):
        probs = probs.float()
    k_t = k if isinstance(k, Tensor) and k.ndim == 1 else as_gate_k(k, probs.shape[-1], probs)
    m = probs.shape[1]
    mean = probs.mean(dim=1)
    std = probs.std(dim=1, correction=1) if m > 1 else torch.zeros_like(mean)
    s = std + eps
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
