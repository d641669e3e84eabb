"""The typed seam between the library and a model server: options in, packed columns out.

A server asks one question per batch — "what is the answer for these rows under these options?" —
and gets back plain numbers it can encode without any math of its own:

* :class:`ScoreOptions` — frozen and hashable: it *is* the key a batcher groups requests by, so
  requests with equal options are scored in one call.
* :func:`decide` — the served decision (paper Section 3.2: VGMU, SNR, abstain; Section 3.3:
  TU/AU/EU; the top-k of the answer's mean) for one member set, packed into one ``(B, 7 + 2n)``
  tensor on the model's device, so a GPU copies one small block back to the host.
* :class:`ScoreColumns` — that block on the host as a NumPy array with named column accessors;
  slicing rows is a view.

The answer's member set is chosen once, in :meth:`models.predictor.Predictor.options`
(``q`` for VGN models: one distribution per answer, :func:`models.uncertainty.scoring.answer_members`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from models.uncertainty.decomposition import entropy_decomposition
from models.uncertainty.margin import check_abstain_k, margin_score_unchecked

Members = Literal["p", "q"]

#: Fixed columns of the packed block, in order; then ``n`` top-k class indices, then their probabilities.
FIXED_COLUMNS: tuple[str, ...] = ("prediction", "abstain", "vgmu", "snr", "tu", "au", "eu")


@dataclass(frozen=True, slots=True)
class ScoreOptions:
    """Resolved per-request options; hashable, so equal options share one scoring call.

    ``abstain_k``: deferral threshold (§3.2), ``members``: ``"p"``/``"q"``, the member set the whole
    answer comes from; ``top_k``: probabilities listed per image (``1 <= top_k <= C``).
    """

    abstain_k: float
    members: Members
    top_k: int

    def __reduce__(self) -> tuple[type[ScoreOptions], tuple[float, str, int]]:
        # Pickled as a constructor call: a server sends options with every request, and this
        # unpickles in ~half the time of the default frozen-dataclass state restore.
        return ScoreOptions, (self.abstain_k, self.members, self.top_k)


#: Probabilities listed per image when a request does not say: the API's default, served by every
#: entry point (the request schemas, :func:`resolve_options`, :class:`models.predictor.Predictor`).
DEFAULT_TOP_K = 5


def resolve_options(
    *,
    model: str,
    vgn: bool,
    calibrated_k: Mapping[str, float | None],
    num_classes: int,
    abstain_k: float | None = None,
    vgmu_on: str | None = None,
    top_k: int = DEFAULT_TOP_K,
    default_abstain_k: float | None = None,
) -> ScoreOptions:
    """Request options -> :class:`ScoreOptions`: the one place the defaults are chosen.

    Members: ``vgmu_on``, else ``q`` for VGN models and ``p`` otherwise (one distribution per
    answer); ``abstain_k``: the request's, else ``default_abstain_k`` (a server-wide setting), else
    ``calibrated_k[members]`` (the card's calibration for that rule), else 1.0; ``top_k`` clipped
    to ``[1, num_classes]``. Raises ``ValueError`` for ``vgmu_on="q"`` without a gate.
    """
    which = vgmu_on or ("q" if vgn else "p")
    if which not in ("p", "q"):
        raise ValueError(f"vgmu_on must be 'p' or 'q'; got {vgmu_on!r}")
    if which == "q" and not vgn:
        raise ValueError(
            f"vgmu_on=q needs a VGN model; {model!r} has no variance gate "
            "(use vgmu_on=p or leave it unset)"
        )
    for k in (abstain_k, default_abstain_k, calibrated_k.get(which), 1.0):
        if k is not None:
            break
    n = max(1, min(int(top_k), num_classes))
    return ScoreOptions(abstain_k=float(k), members=which, top_k=n)  # type: ignore[arg-type]


def decision_core(members: Tensor, abstain_k: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The served decision's arithmetic, with no host synchronisation (what ``torch.compile`` fuses).

    ``members`` ``(B, M, C)``; ``abstain_k`` a float or a 0-d tensor on ``members``' device (not
    checked here). Returns ``fixed`` ``(B, 7)`` float64 (:data:`FIXED_COLUMNS`), and the classes of
    the mean sorted by descending probability ``(B, C)`` with those probabilities ``(B, C)``
    (stable: ties list the lowest class first, like the argmax that predicts).
    """
    margin = margin_score_unchecked(members, abstain_k)  # Section 3.2
    dec = entropy_decomposition(members)  # Section 3.3
    mean = members.mean(dim=1)  # (B, C)
    top_p, top_i = mean.sort(dim=-1, descending=True, stable=True)
    fixed = torch.stack(
        (margin.prediction, margin.abstain, margin.vgmu, margin.snr, dec.tu, dec.au, dec.eu), dim=1
    ).to(torch.float64)  # (B, 7)
    return fixed, top_i, top_p


def pack(fixed: Tensor, top_i: Tensor, top_p: Tensor, top_k: int) -> Tensor:
    """``(B, 7)``, ``(B, C)``, ``(B, C)`` -> the packed ``(B, 7 + 2n)`` float64 block, ``n = top_k``."""
    n = top_k
    return torch.cat((fixed, top_i[:, :n].to(torch.float64), top_p[:, :n].to(torch.float64)), 1)


def decide(members: Tensor, abstain_k: float, top_k: int) -> Tensor:
    """The served decision for member probabilities ``(B, M, C)``, packed as ``(B, 7 + 2n)`` float64.

    Columns: :data:`FIXED_COLUMNS`, then the ``n = top_k`` most probable classes of the mean
    (stable order: ties list the lowest class first, exactly like the argmax that predicts, so the
    first listed class *is* the prediction), then their mean probabilities. Everything is computed
    where ``members`` lives; float64 holds the class indices exactly.
    """
    check_abstain_k(abstain_k)
    return pack(*decision_core(members, abstain_k), top_k)


def compile_decide(bucketed: bool = True) -> Callable[[Tensor, float, int], Tensor]:
    """:func:`decide`, with :func:`decision_core` compiled by ``torch.compile`` (a few fused kernels
    instead of dozens of small ones).

    Compiled once per batch shape and never per request option: ``abstain_k`` enters as a 0-d
    tensor on the device (cached per value) and ``top_k`` is sliced after the compiled part, so
    arbitrary request options cannot trigger recompilation. With ``bucketed`` the batch is padded
    to the next power of two (repeating its last row) and the padding dropped from the result, so
    only ``log2(max batch)`` shapes are ever compiled.
    """
    core = torch.compile(decision_core, dynamic=False)
    k_cache: dict[tuple[float, torch.device, torch.dtype], Tensor] = {}

    def compiled_decide(members: Tensor, abstain_k: float, top_k: int) -> Tensor:
        check_abstain_k(abstain_k)
        n = members.shape[0]
        if bucketed and n & (n - 1):
            pad = (1 << n.bit_length()) - n
            members = torch.cat((members, members[-1:].expand(pad, *members.shape[1:])))
        key = (float(abstain_k), members.device, members.dtype)
        k = k_cache.get(key)
        if k is None:
            if len(k_cache) >= 256:  # arbitrary per-request values: keep the cache bounded
                k_cache.clear()
            k = k_cache[key] = torch.tensor(abstain_k, dtype=members.dtype, device=members.device)
        fixed, top_i, top_p = core(members, k)
        return pack(fixed[:n], top_i[:n], top_p[:n], top_k)

    return compiled_decide


@dataclass(frozen=True, slots=True)
class ScoreColumns:
    """A packed decision block on the host: ``data`` ``(B, 7 + 2n)`` float64 (see :func:`decide`)."""

    data: np.ndarray

    @classmethod
    def from_tensor(cls, packed: Tensor) -> ScoreColumns:
        """One device→host copy of the packed block."""
        return cls(packed.detach().to("cpu").numpy())

    @classmethod
    def from_bytes(cls, data: bytes, top_k: int) -> ScoreColumns:
        """The block from its raw float64 bytes (``data.tobytes()``), ``n = top_k`` classes per
        row: how a server passes rows between processes without pickling an array."""
        width = len(FIXED_COLUMNS) + 2 * top_k
        return cls(np.frombuffer(data, np.float64).reshape(-1, width))

    def __len__(self) -> int:
        return int(self.data.shape[0])

    @property
    def top_k(self) -> int:
        return (self.data.shape[1] - len(FIXED_COLUMNS)) // 2

    def abstaining(self, rows: np.ndarray) -> ScoreColumns:
        """These columns with ``abstain`` set on ``rows`` (bool ``(B,)``): the answer for an
        image that holds no digit to read (:class:`models.prepare.Finding`) is a deferral,
        whatever the model made of the empty canvas it was given. ``self`` when no row is set."""
        if not rows.any():
            return self
        data = self.data.copy()
        data[rows, FIXED_COLUMNS.index("abstain")] = 1.0
        return ScoreColumns(data)

    def rows(self, start: int, stop: int) -> ScoreColumns:
        """Rows ``[start, stop)`` (a view)."""
        return ScoreColumns(self.data[start:stop])

    def column(self, name: str) -> np.ndarray:
        """One fixed column by name, ``(B,)``: ints for prediction, bools for abstain."""
        values = self.data[:, FIXED_COLUMNS.index(name)]
        if name == "prediction":
            return values.astype(np.int64)
        if name == "abstain":
            return values.astype(bool)
        return values

    @property
    def top_indices(self) -> np.ndarray:
        """``(B, n)`` int64 class indices, most probable first."""
        f = len(FIXED_COLUMNS)
        return self.data[:, f : f + self.top_k].astype(np.int64)

    @property
    def top_probabilities(self) -> np.ndarray:
        """``(B, n)`` mean probabilities of :attr:`top_indices`."""
        f = len(FIXED_COLUMNS)
        return self.data[:, f + self.top_k :]

    def records(
        self, class_names: list[str], abstain_k: float, findings: np.ndarray | None = None
    ) -> list[dict[str, object]]:
        """One JSON-ready dict per row: ``prediction, label, probabilities [{label, probability}],
        vgmu, snr, tu, au, eu, abstain, abstain_k``, and ``input_check`` (the name of each row's
        :class:`models.prepare.Finding`) when ``findings`` are given."""
        f = len(FIXED_COLUMNS)
        n = self.top_k
        out = []
        for row in self.data.tolist():
            pred = int(row[0])
            idx = row[f : f + n]
            prob = row[f + n :]
            out.append(
                {
                    "prediction": pred,
                    "label": class_names[pred],
                    "probabilities": [
                        {"label": class_names[int(i)], "probability": p}
                        for i, p in zip(idx, prob, strict=True)
                    ],
                    "vgmu": row[2],
                    "snr": row[3],
                    "tu": row[4],
                    "au": row[5],
                    "eu": row[6],
                    "abstain": row[1] != 0.0,
                    "abstain_k": abstain_k,
                }
            )
        if findings is not None:
            from models.prepare import Finding

            for record, finding in zip(out, findings.tolist(), strict=True):
                record["input_check"] = Finding(finding).name
        return out
