"""``Predictor``: what the service calls — prepare an image, run the ensemble, score the members.

* :meth:`Predictor.prepare` turns a decoded uint8 image ``(C, H, W)`` into the model's input
  (channels converted grayscale <-> RGB, resized to the card's input size, scaled to [0, 1] and
  normalised with the card's mean/std) using ``torchvision.transforms.v2``.
* :meth:`Predictor.forward` runs a batch under ``torch.inference_mode()`` on the predictor's device
  and returns CPU tensors (:class:`~models.ensembles.EnsembleOutput`).
* :meth:`Predictor.score` computes VGMU/SNR, the entropy decomposition and the abstain decision
  with :func:`models.uncertainty.scoring.score_members` and adds the top-k labels/probabilities.
  The served class probabilities are the mean of the gated members ``q̄`` for VGN models
  (the prediction trained with the mixture loss, Section 3.1) and ``p̄`` otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torchvision.transforms.v2 import functional as TF

from models.checkpoint import ModelCard, load_checkpoint
from models.data import normalise_uint8
from models.ensembles import EnsembleOutput

__all__ = ["Predictor", "default_device"]


def default_device() -> torch.device:
    """``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Predictor:
    """A loaded, verified model plus its card; safe to call from several threads for inference."""

    def __init__(self, module: nn.Module, card: ModelCard, device: torch.device) -> None:
        self.module = module.eval()
        self.card = card
        self.device = device
        self._mean = list(card.mean)
        self._std = list(card.std)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device | None = None) -> Predictor:
        """Load and verify ``model_dir`` (see :func:`models.checkpoint.load_checkpoint`)."""
        dev = torch.device(device) if device is not None else default_device()
        module, card = load_checkpoint(model_dir, dev)
        return cls(module, card, dev)

    @property
    def name(self) -> str:
        return self.card.name

    @property
    def version(self) -> str:
        return self.card.version

    @property
    def class_names(self) -> list[str]:
        return self.card.class_names

    def prepare(self, image: Tensor) -> Tensor:
        """uint8 ``(C, H, W)`` (C in 1, 3, 4; or ``(H, W)``) -> float ``(Cin, H', W')`` model input."""
        if not isinstance(image, Tensor):
            raise ValueError("image must be a torch.Tensor")
        if image.dim() == 2:
            image = image.unsqueeze(0)
        if image.dim() != 3:
            raise ValueError(f"image must have shape (C, H, W); got {tuple(image.shape)}")
        if image.dtype != torch.uint8:
            raise ValueError(f"image must be uint8; got {image.dtype}")
        c = image.shape[0]
        if c == 4:  # RGBA: drop alpha
            image, c = image[:3], 3
        if c == 2:  # grayscale + alpha
            image, c = image[:1], 1
        if c not in (1, 3):
            raise ValueError(f"image must have 1, 3 or 4 channels; got {c}")
        want = self.card.in_channels
        if c == 1 and want == 3:
            image = image.expand(3, -1, -1)
        elif c == 3 and want == 1:
            image = TF.rgb_to_grayscale(image, num_output_channels=1)
        size = list(self.card.input_size)
        if list(image.shape[-2:]) != size:
            image = TF.resize(image, size, antialias=True)
        return normalise_uint8(image.contiguous(), self._mean, self._std)

    def forward(self, x: Tensor) -> EnsembleOutput:
        """``x`` (B, Cin, H', W') -> ``EnsembleOutput`` of CPU tensors ``(B, M, C)``."""
        with torch.inference_mode():
            out = self.module(x.to(self.device, non_blocking=True))
            return EnsembleOutput(
                out.p.float().cpu(), None if out.q is None else out.q.float().cpu()
            )

    __call__ = forward

    def answer_members(self, vgmu_on: str | None = None) -> str:
        """``"q"``/``"p"``: the member set an answer comes from (``vgmu_on`` or the model's default).

        Raises ``ValueError`` for ``vgmu_on="q"`` on a model without a variance gate.
        """
        if vgmu_on is None:
            return self.card.answer_members
        if vgmu_on not in ("p", "q"):
            raise ValueError(f"vgmu_on must be 'p' or 'q'; got {vgmu_on!r}")
        if vgmu_on == "q" and not self.card.vgn:
            raise ValueError(
                f"vgmu_on='q' needs a VGN model; {self.card.name!r} has no variance gate "
                "(use vgmu_on='p' or leave it unset)"
            )
        return vgmu_on

    def default_abstain_k(self, vgmu_on: str | None = None) -> float:
        """The card's ``abstain_k`` calibrated for the answer's member set, or 1.0 without one."""
        k = self.card.abstain_k_for(self.answer_members(vgmu_on))
        return 1.0 if k is None else k

    def score(
        self,
        out: EnsembleOutput,
        *,
        abstain_k: float | None = None,
        vgmu_on: str | None = None,
        top_k: int = 3,
    ) -> list[dict[str, Any]]:
        """One dict per row: ``prediction, label, probabilities [{label, probability}], vgmu, snr,
        tu, au, eu, abstain, abstain_k`` — all of one member set, so ``probabilities[0]`` is the
        predicted class."""
        from models.uncertainty.scoring import decision_scores

        which = self.answer_members(vgmu_on)
        k = self.default_abstain_k(which) if abstain_k is None else float(abstain_k)
        members = out.q if which == "q" else out.p
        margin, dec = decision_scores(
            out.p, out.q, abstain_k=k, vgmu_on=which,  # type: ignore[arg-type]
            validate=False,
        )  # fmt: skip
        probs = members.mean(dim=1)  # (B, C), the mean VGMU's prediction is the argmax of
        n = max(1, min(int(top_k), probs.shape[-1]))
        # Stable descending sort: ties keep the lowest index first, exactly like argmax, so the
        # first listed probability is always the prediction.
        top_p, top_i = (t[:, :n] for t in probs.sort(dim=-1, descending=True, stable=True))
        names = self.card.class_names
        columns = zip(
            margin.prediction.tolist(),
            margin.abstain.tolist(),
            margin.vgmu.tolist(),
            margin.snr.tolist(),
            dec.tu.tolist(),
            dec.au.tolist(),
            dec.eu.tolist(),
            top_p.tolist(),
            top_i.tolist(),
            strict=True,
        )
        rows = [
            {
                "prediction": pred,
                "label": names[pred],
                "probabilities": [
                    {"label": names[i], "probability": float(v)}
                    for i, v in zip(ti, tp, strict=True)
                ],
                "vgmu": vgmu,
                "snr": snr,
                "tu": tu,
                "au": au,
                "eu": eu,
                "abstain": bool(abstain),
                "abstain_k": k,
            }
            for pred, abstain, vgmu, snr, tu, au, eu, tp, ti in columns
        ]
        return rows
