"""Request/response models shared by the /v1 routes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from models.limits import ABSTAIN_K_MAX, ABSTAIN_K_MIN
from models.prepare import PrepareMode
from models.serving import DEFAULT_TOP_K
from models.uncertainty.gate import GATE_K_MAX, K_MIN
from service.frontend.review_queue import ReviewPolicy

AbstainK = Annotated[
    float,
    Field(
        ge=ABSTAIN_K_MIN,
        le=ABSTAIN_K_MAX,
        allow_inf_nan=False,
        description="Abstain margin in standard deviations.",
    ),
]
TopK = Annotated[int, Field(ge=1, le=1000, description="Probabilities returned per image.")]
#: The request options' values and bounds, for /v1 (these models) and V2 over HTTP and gRPC
#: (service.frontend.v2_core.check_parameters reads the same names; the review choices are
#: service.frontend.review_queue.ReviewPolicy): one place for each rule.
VgmuOn = Literal["p", "q"]
TIMEOUT_S_MIN, TIMEOUT_S_MAX = 0.05, 3600.0
TimeoutS = Annotated[
    float,
    Field(
        ge=TIMEOUT_S_MIN,
        le=TIMEOUT_S_MAX,
        allow_inf_nan=False,
        description="Per-request deadline (s), at least 50 ms.",
    ),
]


class PredictOptions(BaseModel):
    """Options for /v1/predict, as query parameters or body fields (given in both, they must agree)."""

    model_config = ConfigDict(extra="forbid")

    abstain_k: AbstainK | None = None
    top_k: TopK = DEFAULT_TOP_K
    vgmu_on: VgmuOn | None = Field(
        None,
        description="Member set the whole answer comes from: q (gated; default for VGN models) "
        "or p (raw; default otherwise). q on a model without a gate is a 422.",
    )
    timeout_s: TimeoutS | None = None
    review: ReviewPolicy | None = Field(
        None,
        description="Human review queue (VGE_REVIEW_QUEUE=on): auto (default) queues the images "
        "whose answer abstains, always every image, never none. Queued answers carry review_id.",
    )
    prepare: PrepareMode | None = Field(
        None,
        description="What the server does to an image before the model reads it: mnist (default "
        "for 1x28x28 digit models) finds the digit on the picture — polarity, uneven light, "
        "its box scaled to 20x20 and centred by its centre of mass, as MNIST was made; none "
        "(default for other models) only converts channels and resizes: for pixels already in "
        "the model's format.",
    )


class PredictJSON(PredictOptions):
    """JSON body of /v1/predict."""

    images: list[str] = Field(min_length=1, description="Base64-encoded images (or data: URLs).")


class ErrorBody(BaseModel):
    """Every error answer: what is wrong, and a stable machine code."""

    error: str = Field(description="What is wrong and how to fix it.")
    code: str = Field(description="bad_input, invalid_value, payload_too_large, not_found, ...")


_ERROR_TEXT = {
    400: "Malformed request (not an image, corrupt data, invalid JSON).",
    401: "Missing API key.",
    403: "Wrong API key, or the endpoint is disabled (no key configured).",
    404: "Unknown model, version or job.",
    409: "Not in a state that allows this (a finished job, a reviewed item, one held by another reviewer, nothing to roll back to).",
    413: "Payload, image or image count over a configured limit.",
    422: "A value out of range or of the wrong type.",
    503: "Queue full, engine (re)starting or server draining; see Retry-After.",
    504: "The request's deadline passed while it was queued; it was not computed.",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses`` for these status codes, all with :class:`ErrorBody`."""
    return {c: {"model": ErrorBody, "description": _ERROR_TEXT[c]} for c in codes}


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
    input_check: Literal["ok", "blank", "fills_canvas", "texture"] = Field(
        description="What prepare=mnist found: ok (a digit, or prepare=none), blank (no ink), "
        "fills_canvas (the 'ink' covers over a third of the picture: noise, a pattern) or texture "
        "(mid-tones, not ink on paper: a photo). Anything but ok is answered with abstain: true."
    )
    review_id: str | None = Field(
        None, description="The review item of a queued image (absent when it was not sent)."
    )
    review_status: Literal["queued", "already_queued", "queue_full", "error"] | None = Field(
        None,
        description="Why review_id is what it is: queued; already_queued (the same image is "
        "pending for this model: its id); queue_full (VGE_REVIEW_MAX_ITEMS reached, not "
        "queued); error (not stored; the prediction stands).",
    )


class PredictResponse(BaseModel):
    model: str
    model_version: str
    results: list[Prediction]


class ScoreRequest(BaseModel):
    """Member probabilities of an ensemble served elsewhere."""

    model_config = ConfigDict(extra="forbid")

    probs: Annotated[
        list[
            Annotated[list[Annotated[list[StrictFloat], Field(min_length=2)]], Field(min_length=2)]
        ],
        Field(min_length=1, description="B×M×C member probabilities (B >= 1, M >= 2, C >= 2)."),
    ]
    gate_k: (
        Annotated[
            float,
            Field(
                ge=K_MIN,
                le=GATE_K_MAX,
                allow_inf_nan=False,
                description="Gate the members with VGN at this fixed k (paper Section 3.1).",
            ),
        ]
        | None
    ) = None
    abstain_k: AbstainK = 1.0
    vgmu_on: VgmuOn | None = Field(
        None, description="q (the gated members; default with gate_k) or p (the raw members)."
    )


class ScoreResponse(BaseModel):
    results: list[dict[str, float | int | bool]]
