"""``POST /v1/predict`` (images → predictions with uncertainty) and ``POST /v1/score``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import torch
from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from models.problems import validation_problems
from service.common.decode import b64_images, multipart_images
from service.common.errors import BadInput, InvalidValue, PayloadTooLarge
from service.common.settings import Settings
from service.frontend.deps import ServiceState, service_state
from service.frontend.multipart import INLINE_PARSE_BYTES, parse_form_async
from service.frontend.pipeline import Call, Encoded, infer, parse_json
from service.frontend.routes.direct import add_direct_route
from service.frontend.routes.schemas import (
    PredictJSON,
    PredictOptions,
    PredictResponse,
    ScoreRequest,
    ScoreResponse,
    error_responses,
)

router = APIRouter(
    prefix="/v1", tags=["predict"], responses=error_responses(400, 413, 422, 503, 504)
)


def _query_parameters() -> list[dict[str, Any]]:
    """:class:`PredictOptions` as OpenAPI query parameters (as FastAPI would document them).

    The route reads them itself and validates query and body options together, once: FastAPI's
    per-request query-model dependency cost ~15 % of a front end's CPU per single-image request.
    """
    props = PredictOptions.model_json_schema()["properties"]
    return [
        {"name": name, "in": "query", "required": False, "schema": schema}
        | ({"description": schema["description"]} if "description" in schema else {})
        for name, schema in props.items()
    ]


_BODY_DOC = {
    "parameters": _query_parameters(),
    "requestBody": {
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["images"],
                    "properties": {
                        "images": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "string", "format": "binary"},
                        }
                    },
                }
            },
            "application/json": {"schema": PredictJSON.model_json_schema()},
        }
    },
}


#: ``json.dumps(body, separators=(",", ":"))`` without building a ``JSONEncoder`` per call (json.dumps
#: makes one whenever an argument is not its default: ~2 µs of a one-image answer's ~10).
_ENCODE_JSON = json.JSONEncoder(separators=(",", ":")).encode
#: The options of a request that gives none (no query string, no body fields): validated once.
_NO_OPTIONS = PredictOptions.model_validate({})


def _invalid(exc: ValidationError) -> InvalidValue:
    """A 422 naming each invalid field (names cut at 64 characters: an unknown query parameter's
    name is the client's, of any length)."""
    return InvalidValue(validation_problems(exc.errors(), max_name=64))


def _predict_json(raw: bytes, settings: Settings) -> tuple[list[bytes], dict[str, Any]]:
    """A /v1/predict JSON body's images (base64-decoded) and options, validated (a 400 or 422
    naming the problem)."""
    try:
        parsed = PredictJSON.model_validate(parse_json(raw, "body"))
    except ValidationError as exc:
        raise _invalid(exc) from None
    options = parsed.model_dump(exclude={"images"}, exclude_unset=True)
    options = {k: v for k, v in options.items() if v is not None}  # null: not given
    return b64_images(parsed.images, settings), options


async def _read_payload(
    request: Request, state: ServiceState
) -> tuple[list[bytes], dict[str, Any]]:
    """Images and body options from a multipart or JSON request."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    settings = state.settings
    if ctype == "multipart/form-data":
        raw = await request.body()  # complete and capped (ServingMiddleware)
        form = await parse_form_async(  # off the event loop when large; parts counted
            raw, request.headers["content-type"], max_files=settings.max_images, max_fields=64,
            file_field="images",
        )  # fmt: skip
        return multipart_images(form.files, settings), form.fields
    if ctype in ("application/json", ""):
        raw = await request.body()
        if len(raw) > INLINE_PARSE_BYTES:  # parsing holds the interpreter: not on the loop
            return await asyncio.to_thread(_predict_json, raw, settings)
        return _predict_json(raw, settings)
    raise BadInput(
        f"unsupported content type {ctype!r}: send multipart/form-data files or "
        'application/json {"images": ["<base64>", ...]}'
    )


async def predict(request: Request) -> Response:
    """Predict one or many images: top-k probabilities, VGMU, SNR, TU/AU/EU and abstain.

    One distribution per answer: for VGN models everything comes from the gated members q (the
    mixture the model was trained on), unless ``vgmu_on=p``; ``probabilities[0]`` is the prediction.
    """
    state = service_state(request)  # not the State dependency: see service_state
    model = state.model()
    blobs, body_options = await _read_payload(request, state)
    if not body_options and not request.scope["query_string"]:
        opts = _NO_OPTIONS
    else:
        opts = _options(request, body_options)
    call = Call(
        model, Encoded(blobs), request.headers, abstain_k=opts.abstain_k, vgmu_on=opts.vgmu_on,
        top_k=opts.top_k, prepare=opts.prepare, review=opts.review, timeout_s=opts.timeout_s,
    )  # fmt: skip
    answer = await infer(state, call)  # the one scoring path (service/frontend/pipeline.py)
    # Plain floats, ints, bools and strings built by ScoreColumns.records: json.dumps (C) encodes
    # them directly; validating them through a pydantic response model cost ~10 % of a request.
    body = {"model": model.name, "model_version": model.version, "results": answer.records}
    return Response(_ENCODE_JSON(body), media_type="application/json")


def _options(request: Request, body_options: dict[str, Any]) -> PredictOptions:
    """The request's options from its query and body, validated together (422s naming each
    problem; a parameter repeated in the query, or given in both with different values)."""
    query = request.query_params
    if len(query.multi_items()) != len(query):  # a repeated parameter: which one was meant?
        key = next(k for k in query if len(query.getlist(k)) > 1)
        raise InvalidValue(f"{key[:64]} is given {len(query.getlist(key))} times in the query: "
                           "give it once")  # fmt: skip
    try:
        opts = PredictOptions.model_validate({**query, **body_options})
        if (
            twice := body_options.keys() & query.keys()
        ):  # given once is unambiguous, twice must agree
            in_query = PredictOptions.model_validate(dict(query))
            for key in sorted(twice):
                if getattr(in_query, key) != getattr(opts, key):
                    raise InvalidValue(
                        f"{key} is given twice, {query[key]!r} in the query and "
                        f"{body_options[key]!r} in the body: give it once"
                    )
    except ValidationError as exc:
        raise _invalid(exc) from None
    return opts


add_direct_route(  # the request in, the Response out, past FastAPI (routes/direct.py)
    router,
    "/predict",
    predict,
    responses={
        200: {"model": PredictResponse, "description": "One result per image."},
        **error_responses(401, 403),  # review=always without the API or a reviewer key
    },
    openapi_extra=_BODY_DOC,
)


def _score(raw: bytes) -> Response:
    """Parse, validate, score and encode a ``/v1/score`` body: all of it in a worker thread (a
    6 MiB body took 4 s, and the front end's event loop answered nothing else for 1.1 s of it)."""
    from models.uncertainty.scoring import score_ensemble

    try:
        body = ScoreRequest.model_validate(parse_json(raw, "request body"))
    except ValidationError as exc:
        raise _invalid(exc) from None
    try:
        P = torch.tensor(body.probs, dtype=torch.float64)
    except (ValueError, TypeError) as exc:
        raise InvalidValue(f"probs must be a rectangular B×M×C array of numbers: {exc}") from None
    try:
        scores = score_ensemble(
            P, gate_k=body.gate_k, abstain_k=body.abstain_k, vgmu_on=body.vgmu_on
        )
    except ValueError as exc:
        raise InvalidValue(f"probs: {exc}") from None
    out = {"results": scores.to_records()}
    return Response(_ENCODE_JSON(out), media_type="application/json")


@router.post(
    "/score",
    response_model=ScoreResponse,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ScoreRequest.model_json_schema()}},
        }
    },
)
async def score(request: Request) -> Response:
    """Score member probabilities (B×M×C) of an ensemble served elsewhere, like ``vge score``.

    The body is read here and handled in a thread (:func:`_score`), capped at
    ``VGE_MAX_SCORE_BYTES``: parsing JSON holds the interpreter, so the cap bounds how long one
    request can hold a front end. Larger batches: ``vge score`` on a file.
    """
    limit = service_state(request).settings.max_score_bytes
    raw = await request.body()  # complete and capped at VGE_MAX_PAYLOAD_BYTES (ServingMiddleware)
    if len(raw) > limit:
        raise PayloadTooLarge(
            f"request body of {len(raw)} bytes exceeds the /v1/score limit of {limit} bytes "
            "(VGE_MAX_SCORE_BYTES); split the batch, or score a file with `vge score`"
        )
    return await asyncio.to_thread(_score, raw)
