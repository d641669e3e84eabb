"""The predictor as the engine holds it: what the batcher, the model manager and the engine call.

:class:`ServedPredictor` is a structural type (``typing.Protocol``): :class:`models.predictor.Predictor`
satisfies it without naming it, and so does a test's stand-in. It lists exactly what the engine
uses — the model card, conforming gate images, the serving forward pass, option resolution and
the served decision — so the engine's code is typed without importing the model code that builds
predictors (torch.compile, checkpoints), and a method it starts to use has to be named here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor

    from models.checkpoint import ModelCard
    from models.ensembles import EnsembleOutput
    from models.serving import ScoreColumns, ScoreOptions


class ServedPredictor(Protocol):
    """A loaded model the engine serves (see :class:`models.predictor.Predictor` for each method).

    Held as a batch's key: a batch holds requests of one predictor (identity), so after a swap the
    requests admitted for the old model finish on it.
    """

    @property
    def card(self) -> ModelCard:
        """The model card: name, version, classes, calibration, input shape, weights' hash."""
        ...

    def conform(self, image: Tensor) -> Tensor:
        """uint8 ``(C, H, W)`` -> uint8 ``(Cin, H', W')``: the card's channels and size."""
        ...

    def run(self, parts: Sequence[Tensor | np.ndarray]) -> EnsembleOutput:
        """The serving forward pass: request inputs in order -> one output on the device."""
        ...

    def options(
        self,
        *,
        abstain_k: float | None = ...,
        vgmu_on: str | None = ...,
        top_k: int = ...,
        default_abstain_k: float | None = ...,
    ) -> ScoreOptions:
        """A request's options resolved for this model."""
        ...

    def score_columns(self, out: EnsembleOutput, options: ScoreOptions) -> ScoreColumns:
        """The served decision for (rows of) a batch's output, one copy to the host."""
        ...
