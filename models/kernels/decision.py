"""The served decision as one Triton kernel: one read of the members, one launch per batch.

:func:`models.serving.decide` is ~60 GPU operations eager and 17 compiled (docs/benchmarks.md,
"Served decision (cuda)"); at the batch sizes a server runs (B ≈ 128) each costs a launch, so the
decision was launch-bound at ~2.2 µs/sample against a memory-read floor of ~0.2.
:func:`fused_decide` computes the same packed block — prediction, abstain, VGMU, SNR (Section
3.2), TU, AU, EU (Section 3.3), and the top-k classes of the mean with their probabilities — in a
single kernel, one program per sample:

* one pass over the sample's ``(M, C)`` members in tiles of ``BLOCK_M`` members: the per-class
  sum ``Σ_m p_m`` and sum of squared deviations ``Σ_m (p_m − p̄)²`` merged tile by tile (Chan et
  al.'s parallel update, as accurate as torch's two-pass std), and ``Σ_m H(p_m)`` for AU;
* then, in registers: ``s = sqrt(M2/(M−1)) + ε`` (0 + ε when ``M = 1``), the top-2 of ``p̄`` and
  their spreads, ``SNR = (p̄1 − p̄2)/(s1 + s2 + ε)``, ``VGMU = 1 − (1 − e^{−SNR}) p̄1``,
  ``abstain = ¬(p̄1 − k s1 > p̄2 + k s2)``, ``TU = H(p̄)/log C``, ``AU = min(mean_m H(p_m)/log C, TU)``
  (both clamped to [0, 1]), ``EU = TU − AU``;
* the top-k by repeated argmax (ties to the lowest class, like the stable sort of
  :func:`models.serving.decision_core` and the argmax that predicts), written straight into the
  ``(B, 7 + 2n)`` float64 block.

Entropies use ``0 log 0 = 0``, like ``torch.special.entr`` on probabilities. The kernel holds one
``C``-vector per statistic in registers, so it serves ``C ≤`` :data:`MAX_CLASSES`; beyond that
(and without Triton, or off CUDA) callers use :func:`models.serving.decide` or its compiled form.

Measured on an H100 (docs/benchmarks.md, "Served decision (cuda)"): 0.307 µs/sample at B = 128,
M = 100, C = 1000 (17 compiled operations: 2.9), bound by the launch itself: Triton's Python launch
costs ~34 µs of host time, 0.27 µs/sample at that batch. So after its first launch a
configuration is launched straight through its compiled kernel (:data:`_DIRECT`, checked once
against the JIT launch; not yet measured on a GPU: ``benchmarks.decision`` prints both). At
B = 4096 the kernel is 1.7× the time to read the members once. Splitting each sample's members
over several programs (a second kernel merging them) was slower at B = 128 (0.374: two
launches), so one program per sample it is.

On a CPU the same kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``): that is how CI,
which has no GPU, checks it against :func:`models.serving.decide`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from models.serving import FIXED_COLUMNS
from models.uncertainty.margin import check_abstain_k
from models.uncertainty.validation import EPS

try:  # Triton ships with torch's CUDA builds on Linux; without it callers use the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported install has it
    triton = None

#: Largest class count the kernel serves (one ``BLOCK_C``-wide vector per statistic in registers).
MAX_CLASSES = 8192
#: Member tile: ``BLOCK_M × BLOCK_C`` elements per load, at most this many.
_TILE = 16384


def _member_stats(base, stride_m, M, C, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """One sample's ``M`` members -> per class ``Σ_m p_m``, ``M2 = Σ_m (p_m − p̄)²`` and
    ``Σ_m −p_m log p_m``, each ``(BLOCK_C,)``.

    Tiles of ``BLOCK_M`` members merged by Chan et al.'s update. Sums, not running means, are
    carried, so classes whose members sum exactly alike (e.g. permuted one-hot members) get
    exactly equal means and tie as they do in torch. Every reduction runs over the member axis,
    which stays inside each thread: no cross-warp step per tile.
    """
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    rows = tl.arange(0, BLOCK_M)
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    ent = tl.zeros([BLOCK_C], dtype=tl.float32)
    seen = 0.0
    for m0 in range(0, M, BLOCK_M):
        r = m0 + rows
        mask = (r < M)[:, None] & cmask[None, :]
        x = tl.load(base + r[:, None] * stride_m + cols[None, :], mask=mask, other=0.0)
        nb = tl.minimum(M - m0, BLOCK_M).to(tl.float32)  # members in this tile
        t_sum = tl.sum(x, axis=0)  # (BLOCK_C,)
        t_mean = t_sum / nb
        d = tl.where(mask, x - t_mean[None, :], 0.0)
        delta = t_mean - total / tl.maximum(seen, 1.0)
        m2 = m2 + tl.sum(d * d, axis=0) + delta * delta * (seen * nb / (seen + nb))
        total += t_sum
        seen += nb
        ent += tl.sum(tl.where(x > 0.0, -x * tl.log(x), 0.0), axis=0)
    return total, m2, ent


def _finish(total, m2, ent, M, row, C, n_top, abstain_k, eps, inv_log_c, BLOCK_C: tl.constexpr):
    """One sample's statistics -> its packed row at ``row`` (``7 + 2 n_top`` float64).

    A NaN among the members (a broken model) answers as torch's ``decide`` does: NaN scores,
    abstain, and the NaN classes ranked first (lowest class first), predicting the first of them.
    """
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    members = M.to(tl.float32)
    mean = total / members
    nan = float("nan")
    inf = float("inf")
    is_nan = (mean != mean) & cmask
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    # Spreads s = std + ε (std := 0 for one member), as models.uncertainty.moments.
    std = tl.where(members > 1.0, tl.sqrt(m2 / tl.maximum(members - 1.0, 1.0)), 0.0)
    s = std + eps
    # The ranking key: the mean, NaN above everything (torch's descending sort), padding last.
    order = tl.where(cmask, tl.where(is_nan, inf, mean), -inf)
    # Top-2 of the mean (ties to the lowest class) and their spreads (Section 3.2).
    p1 = tl.max(order, axis=0)
    i1 = tl.argmax(order, axis=0, tie_break_left=True)
    s1 = tl.sum(tl.where(cols == i1, s, 0.0), axis=0)
    rest = tl.where(cols == i1, -inf, order)
    p2 = tl.max(rest, axis=0)
    i2 = tl.argmax(rest, axis=0, tie_break_left=True)
    s2 = tl.sum(tl.where(cols == i2, s, 0.0), axis=0)
    snr = (p1 - p2) / (s1 + s2 + eps)
    # 1 − e^{−SNR}, accurate near 0 (where 1 − exp loses digits): the series to third order.
    gate = tl.where(snr < 1e-3, snr * (1.0 - snr * 0.5 * (1.0 - snr / 3.0)), 1.0 - tl.exp(-snr))
    vgmu = 1.0 - gate * p1
    abstain = tl.where(p1 - abstain_k * s1 > p2 + abstain_k * s2, 0.0, 1.0)
    # TU/AU/EU in units of log C (Section 3.3).
    tu = tl.sum(tl.where(order > 0.0, -order * tl.log(order), 0.0), axis=0) * inv_log_c
    au = tl.sum(ent, axis=0) / members * inv_log_c
    tu = tl.minimum(tl.maximum(tu, 0.0), 1.0)
    au = tl.minimum(tl.minimum(tl.maximum(au, 0.0), 1.0), tu)
    eu = tu - au
    tl.store(row + 0, i1.to(tl.float64))
    tl.store(row + 1, tl.where(any_nan, 1.0, abstain).to(tl.float64))
    tl.store(row + 2, tl.where(any_nan, nan, vgmu).to(tl.float64))
    tl.store(row + 3, tl.where(any_nan, nan, snr).to(tl.float64))
    tl.store(row + 4, tl.where(any_nan, nan, tu).to(tl.float64))
    tl.store(row + 5, tl.where(any_nan, nan, au).to(tl.float64))
    tl.store(row + 6, tl.where(any_nan, nan, eu).to(tl.float64))
    for j in range(n_top):  # the top-k of the mean, most probable first
        p = tl.max(order, axis=0)
        i = tl.argmax(order, axis=0, tie_break_left=True)
        tl.store(row + 7 + j, i.to(tl.float64))
        tl.store(row + 7 + n_top + j, tl.where(p == inf, nan, p).to(tl.float64))
        order = tl.where(cols == i, -inf, order)


def _decision_kernel(
    x_ptr,  # (B, M, C) float32, last dim contiguous
    out_ptr,  # (B, 7 + 2n) float64, contiguous
    M, C, stride_b, stride_m, n_top, abstain_k, eps, inv_log_c,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program per sample: its members' statistics, then its row."""
    b = tl.program_id(0).to(tl.int64)
    total, m2, ent = _member_stats(x_ptr + b * stride_b, stride_m, M, C, BLOCK_M, BLOCK_C)
    _finish(total, m2, ent, M, out_ptr + b * (7 + 2 * n_top), C, n_top, abstain_k, eps,
            inv_log_c, BLOCK_C)  # fmt: skip


if triton is not None:
    # Sizes and the top-k count vary per batch and per request: one compiled kernel serves them all.
    _member_stats = triton.jit(_member_stats)
    _finish = triton.jit(_finish)
    _decision_kernel = triton.jit(
        _decision_kernel, do_not_specialize=["M", "C", "stride_b", "stride_m", "n_top"]
    )


#: Compiled kernels launched without Triton's per-call binding, by (device index, BLOCK_M,
#: BLOCK_C, warps): each a ``launch(grid, args)``. Triton's JIT launch binds, specializes and
#: looks up every argument on every call; on the H100 host (Triton 3.6) that was ~34 µs of host
#: time per call, more than the kernel's GPU time at B = 128, so the decision was launch-bound.
_DIRECT: dict[
    tuple[int, int, int, int], Callable[[tuple[int, int, int], tuple[Any, ...]], None]
] = {}
#: Set once a direct launch failed or disagreed with Triton's: its launch only, from then on.
_direct_off = False


def _direct_launch(
    kernel: Any, grid: tuple[int, int, int], args: tuple[Any, ...], constexprs: tuple[int, int],
    want: Tensor,
) -> Callable[[tuple[int, int, int], tuple[Any, ...]], None] | None:  # fmt: skip
    """A launcher of ``kernel`` (Triton's compiled kernel, just launched by the JIT with ``args``
    into ``want``) that skips the JIT's binding, or None.

    Triton's compiled-kernel launch takes every argument in order (constexprs too, in 3.3 and
    later; earlier ones take only the rest). Each form is tried once into a fresh output and kept
    only if it writes exactly what the JIT launch wrote; anything else (another Triton, another
    convention) answers None and the JIT launch stays.
    """
    if not callable(getattr(kernel, "__getitem__", None)) or not hasattr(kernel, "function"):
        return None  # not a compiled kernel (e.g. Triton's interpreter)
    for extra in (constexprs, ()):
        trial = torch.empty_like(want)
        try:
            kernel[grid](args[0], trial, *args[2:], *extra)
        except Exception:  # noqa: BLE001 - another launch convention
            continue
        if torch.equal(trial.nan_to_num(-7.0), want.nan_to_num(-7.0)):
            return lambda grid, args, extra=extra: kernel[grid](*args, *extra)
    return None


def supports(members: Tensor) -> bool:
    """Whether :func:`fused_decide` serves ``members`` ``(B, M, C)``: a CUDA tensor, Triton present,
    ``2 ≤ C ≤`` :data:`MAX_CLASSES`."""
    return (
        triton is not None
        and members.device.type == "cuda"
        and members.dim() == 3
        and 2 <= members.shape[-1] <= MAX_CLASSES
    )


def fused_decide(
    members: Tensor,
    abstain_k: float,
    top_k: int,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
    direct: bool = True,
) -> Tensor:
    """:func:`models.serving.decide` in one kernel launch: members ``(B, M, C)`` -> the packed
    ``(B, 7 + 2n)`` float64 block, ``n = min(top_k, C)``, on the members' device.

    CUDA tensors (see :func:`supports`); CPU tensors only under Triton's interpreter
    (``TRITON_INTERPRET=1`` before Triton is imported), which is how CI checks the kernel.
    Arithmetic is float32 (what a server scores: float64 members are converted first).
    ``block_m`` (members per tile, a power of two) and ``num_warps`` override the launch
    configuration chosen from the shape (``benchmarks.decision`` sweeps them). With ``direct``
    (the default), a configuration already launched once goes straight to its compiled kernel
    (:data:`_DIRECT`, verified against Triton's own launch on first use); ``direct=False`` always
    launches through Triton's JIT.
    """
    global _direct_off
    if triton is None:
        raise RuntimeError("fused_decide needs Triton (it ships with torch's CUDA builds)")
    check_abstain_k(abstain_k)
    b, m, c = members.shape
    n = max(0, min(int(top_k), c))
    x = members if members.dtype == torch.float32 else members.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m < 1 or not 2 <= c <= MAX_CLASSES:
        raise ValueError(f"fused_decide needs M >= 1 and 2 <= C <= {MAX_CLASSES}; got {m} and {c}")
    out = torch.empty((b, len(FIXED_COLUMNS) + 2 * n), dtype=torch.float64, device=x.device)
    if b == 0:
        return out
    block_c = 1 << max(0, c - 1).bit_length()
    if block_m is None:
        block_m = max(1, min(1 << max(0, m - 1).bit_length(), _TILE // block_c))
    warps = num_warps or max(1, min(16, block_m * block_c // 1024))
    args = (x, out, m, c, x.stride(0), x.stride(1), n, float(abstain_k), EPS, 1.0 / math.log(c))
    # What the compiled kernel was specialized on must hold for a direct launch: pointers on
    # 16-byte alignment, integers as 32-bit (Triton types larger ones as 64-bit).
    aligned = (
        x.data_ptr() % 16 == 0
        and out.data_ptr() % 16 == 0
        and max(x.stride(0), x.stride(1)) < 2**31
    )
    key = (x.device.index or 0, block_m, block_c, warps)
    launch = _DIRECT.get(key) if direct and aligned else None
    # Triton launches on the current CUDA device: make it the members' (cuda:N, N > 0).
    on_device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with on_device:
        if launch is not None:
            launch((b, 1, 1), args)
            return out
        compiled = _decision_kernel[(b,)](
            *args, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=warps
        )  # fmt: skip
        if direct and aligned and not _direct_off and key not in _DIRECT:
            launch = _direct_launch(compiled, (b, 1, 1), args, (block_m, block_c), out)
            if launch is not None:
                _DIRECT[key] = launch
            else:  # no direct launch fits (or nothing was compiled: Triton's interpreter)
                _direct_off = True
    return out
