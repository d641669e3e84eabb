"""``/v1/reviews``: the human review queue's API, and ``GET /review``, the reviewer page.

Thin routes over :class:`service.reviews.ReviewStore` (every front end opens the shared store
itself; nothing goes through the engine). All ``/v1/reviews`` endpoints need the reviewer key
(``VGE_REVIEWER_KEY``) or the admin key (``VGE_API_KEY``) as ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import Iterator
from importlib.resources import files
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from service.auth import ReviewerKey
from service.deps import State
from service.reviews import ReviewStore
from service.routes.schemas import error_responses

router = APIRouter(
    prefix="/v1/reviews", tags=["reviews"], responses=error_responses(400, 401, 403, 404, 422)
)
page_router = APIRouter(tags=["reviews"])

Reviewer = Annotated[
    str, Field(min_length=1, max_length=200, description="Who reviews (free text).")
]
ModelName = Annotated[str | None, Query(max_length=128, description="Only this model's items.")]


class LabelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str = Field(min_length=1, max_length=200, description="One of the model's classes.")
    reviewer: Reviewer


class SkipRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reviewer: Reviewer


class ClaimRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reviewer: Reviewer
    order: Literal["oldest", "vgmu"] = "oldest"
    model: str | None = Field(None, max_length=128)


def _closed(state: State, item: dict[str, Any]) -> dict[str, Any]:
    """Count a label or skip in the review metrics."""
    m = state.metrics
    if item["state"] == "skipped":
        outcome = "skipped"
    else:
        outcome = "agree" if item["label"] == item["answer"]["label"] else "disagree"
    m.reviews.labels(model=item["model"], outcome=outcome).inc()
    m.review_latency.labels(model=item["model"]).observe(
        max(0.0, item["reviewed_at"] - item["created_at"])
    )
    return item


@router.get("")
async def list_reviews(
    _: ReviewerKey,
    state: State,
    review_state: Annotated[
        Literal["pending", "reviewed", "skipped"], Query(alias="state")
    ] = "pending",
    model: ModelName = None,
    order: Literal["oldest", "vgmu"] = "oldest",
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> dict[str, Any]:
    """Items in a state, oldest first (``order=vgmu``: most uncertain first), a page at a time."""
    store = state.review_store()
    reviews, nxt = await asyncio.to_thread(
        store.list, state=review_state, model=model, order=order, limit=limit, cursor=cursor
    )
    return {"reviews": reviews, "next_cursor": nxt}


@router.get("/stats")
async def review_stats(_: ReviewerKey, state: State, model: ModelName = None) -> dict[str, Any]:
    """Counts by state, human-vs-model agreement (overall, per predicted class), median wait."""
    return await asyncio.to_thread(state.review_store().stats, model)


@router.get(
    "/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}, "description": "ImageFolder tar."}},
)
async def export_reviews(_: ReviewerKey, state: State, model: ModelName = None) -> Response:
    """Stream the reviewed items as an ImageFolder tar: ``<label>/<sha256>.png``."""
    store = state.review_store()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return StreamingResponse(
        _tar_stream(store, model),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="reviews-{stamp}.tar"'},
    )


def _tar_stream(store: ReviewStore, model: str | None) -> Iterator[bytes]:
    """A tar written item by item (Starlette runs this sync generator in a thread)."""
    from service.decode import to_png

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|") as tar:
        for label, sha, data, ctype in store.reviewed(model):
            png = data if ctype == "image/png" else to_png(data)
            info = tarfile.TarInfo(f"{label}/{sha}.png")
            info.size, info.mtime, info.mode = len(png), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(png))
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


@router.post("/claim")
async def claim_review(body: ClaimRequest, _: ReviewerKey, state: State) -> dict[str, Any]:
    """Hand the next pending item to this reviewer for a lease (``review`` null when none);
    no two reviewers hold the same item, across replicas too."""
    store = state.review_store()
    item = await asyncio.to_thread(store.claim, body.reviewer, order=body.order, model=body.model)
    pending = await asyncio.to_thread(store.pending_count, body.model)
    return {"review": item, "pending": pending, "lease_s": store.lease_s}


@router.get("/{review_id}")
async def get_review(review_id: str, _: ReviewerKey, state: State) -> dict[str, Any]:
    """One item: the stored answer, its state, label and reviewer."""
    return await asyncio.to_thread(state.review_store().get, review_id)


@router.get(
    "/{review_id}/image",
    response_class=Response,
    responses={200: {"content": {"image/*": {}}, "description": "The original image bytes."}},
)
async def review_image(review_id: str, _: ReviewerKey, state: State) -> Response:
    """The original bytes of the queued image, with their content type."""
    data, ctype = await asyncio.to_thread(state.review_store().image, review_id)
    return Response(data, media_type=ctype, headers={"Cache-Control": "private, max-age=3600"})


@router.post("/{review_id}", responses=error_responses(409))
async def label_review(
    review_id: str, body: LabelRequest, _: ReviewerKey, state: State
) -> dict[str, Any]:
    """Record the human label (one of the model's classes, else 422) → ``reviewed``."""
    item = await asyncio.to_thread(state.review_store().label, review_id, body.label, body.reviewer)
    return _closed(state, item)


@router.post("/{review_id}/skip", responses=error_responses(409))
async def skip_review(
    review_id: str, body: SkipRequest, _: ReviewerKey, state: State
) -> dict[str, Any]:
    """Take a pending item out of the queue without a label → ``skipped``."""
    item = await asyncio.to_thread(state.review_store().skip, review_id, body.reviewer)
    return _closed(state, item)


_PAGE = files("service.static").joinpath("review.html")


@page_router.get("/review", response_class=HTMLResponse, include_in_schema=False)
async def review_page() -> HTMLResponse:
    """The reviewer page: plain HTML + JavaScript, no build step, no CDN (works offline)."""
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"))
