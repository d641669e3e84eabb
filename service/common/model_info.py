"""The served model as a front end knows it: sent by the engine over the wire (service.common.wire)
on connect and after every swap; built by the engine's model manager (service.engine.model_manager)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.serving import ScoreOptions, resolve_options
from service.common.errors import InvalidValue


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs to prepare inputs, resolve options and encode answers."""

    generation: int
    name: str
    version: str
    class_names: tuple[str, ...]
    vgn: bool
    in_channels: int
    input_size: tuple[int, int]
    calibrated_k: dict[str, float | None]  # by member set, "p" / "q"
    description: dict[str, Any] = field(compare=False)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, *self.input_size)

    @property
    def answer_members(self) -> str:
        return "q" if self.vgn else "p"

    def options(
        self,
        *,
        abstain_k: float | None,
        vgmu_on: str | None,
        top_k: int,
        default_abstain_k: float | None,
    ) -> ScoreOptions:
        """Request options for the served model (:func:`models.serving.resolve_options`, as
        :meth:`models.predictor.Predictor.options` does in the engine); a misuse is a 422."""
        try:
            return resolve_options(
                model=self.name,
                vgn=self.vgn,
                calibrated_k=self.calibrated_k,
                num_classes=len(self.class_names),
                abstain_k=abstain_k,
                vgmu_on=vgmu_on,
                top_k=top_k,
                default_abstain_k=default_abstain_k,
            )
        except ValueError as exc:
            raise InvalidValue(str(exc)) from None
