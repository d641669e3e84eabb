"""Request/response models shared by the /v1 routes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.settings import ABSTAIN_K_MAX, ABSTAIN_K_MIN

AbstainK = Annotated[
    float,
    Field(ge=ABSTAIN_K_MIN, le=ABSTAIN_K_MAX, description="Abstain margin in standard deviations."),
]
TopK = Annotated[int, Field(ge=1, le=1000, description="Probabilities returned per image.")]
VgmuOn = Literal["p", "q"]
TimeoutS = Annotated[float, Field(gt=0.0, le=3600.0, description="Per-request deadline (s).")]


class PredictOptions(BaseModel):
    """Options for /v1/predict, as query parameters or JSON body fields (body wins)."""

    model_config = ConfigDict(extra="forbid")

    abstain_k: AbstainK | None = None
    top_k: TopK = 5
    vgmu_on: VgmuOn | None = Field(
        None,
        description="Member set the whole answer comes from: q (gated; default for VGN models) "
        "or p (raw; default otherwise). q on a model without a gate is a 422.",
    )
    timeout_s: TimeoutS | None = None


class PredictJSON(PredictOptions):
    """JSON body of /v1/predict."""

    images: list[str] = Field(description="Base64-encoded images (or data: URLs).")


class LabelProbability(BaseModel):
    label: str
    probability: float


class Prediction(BaseModel):
    """One image's prediction with its uncertainty and abstain decision."""

    prediction: int
    label: str
    probabilities: list[LabelProbability]
    vgmu: float
    snr: float
    tu: float
    au: float
    eu: float
    abstain: bool
    abstain_k: float


class PredictResponse(BaseModel):
    model: str
    model_version: str
    results: list[Prediction]


class ScoreRequest(BaseModel):
    """Member probabilities of an ensemble served elsewhere."""

    model_config = ConfigDict(extra="forbid")

    probs: list[list[list[float]]] = Field(description="B×M×C member probabilities.")
    gate_k: Annotated[float, Field(ge=0.0, le=ABSTAIN_K_MAX)] | None = None
    abstain_k: AbstainK = 1.0
    vgmu_on: VgmuOn | None = Field(
        None, description="q (the gated members; default with gate_k) or p (the raw members)."
    )


class ScoreResponse(BaseModel):
    results: list[dict[str, float | int | bool]]
