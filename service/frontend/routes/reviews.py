"""``/v1/reviews``: the human review queue's API, and ``GET /review``, the reviewer page.

Thin routes over :class:`service.common.review_store.ReviewStore` (every front end opens the shared store
itself; nothing goes through the engine). All ``/v1/reviews`` endpoints need a reviewer key as
``Authorization: Bearer``: a personal one (``VGE_REVIEWER_KEYS="alice:<key>,bob:<key>"``), whose
name is who acts (a ``reviewer`` in the body is then ignored: the key's name is recorded), or the
shared ``VGE_REVIEWER_KEY`` (or the admin ``VGE_API_KEY``), with which the client names itself
(``reviewer`` in the body, default ``"reviewer"``) and the item records ``reviewer_via:
"shared_key"``: a claimed name, not a verified one. Claim and skip need no body. A store that is
unavailable answers 503 naming it (service.common.review_connection). The page and the images are sent with a
Content-Security-Policy (``frame-ancestors 'none'``) and ``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import re
import tarfile
import time
from collections.abc import Iterator
from importlib.resources import files
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, model_validator

from service.common.errors import Forbidden
from service.frontend.auth import ReviewerKey
from service.frontend.deps import State
from service.frontend.routes.schemas import error_responses

router = APIRouter(
    prefix="/v1/reviews", tags=["reviews"],
    responses=error_responses(400, 401, 403, 404, 422, 503),
)  # fmt: skip
page_router = APIRouter(tags=["reviews"])


def _no_nul(value: str | None) -> str | None:
    """Refuse NUL characters: PostgreSQL's text cannot hold them (the store there answered 503
    and went offline for every request; SQLite stored them)."""
    if value is not None and "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    return value


#: A string without NUL characters (:func:`_no_nul`), for path, query and body fields alike.
Text = Annotated[str, AfterValidator(_no_nul)]

Reviewer = Annotated[  # optional: each model field of this type says "= None"
    Text | None,
    Field(
        min_length=1,
        max_length=200,
        description="Who reviews, with the shared reviewer key (recorded as claimed, "
        "reviewer_via shared_key; default 'reviewer'). A personal key's name wins over it.",
    ),
]
#: The reviewer name of the shared key when the client gives none.
DEFAULT_REVIEWER = "reviewer"
ModelName = Annotated[Text | None, Query(max_length=128, description="Only this model's items.")]


class LabelRequest(BaseModel):
    """A class label, or ``"not_a_digit": true`` (the image is none of the model's classes);
    exactly one of the two."""

    model_config = ConfigDict(extra="forbid")

    label: (
        Annotated[Text, Field(min_length=1, max_length=200)] | Annotated[int, Strict()] | None
    ) = Field(
        None,
        description="One of the model's classes; an integer names the class of that name (9 "
        'for class "9"). Leave it out (or null) with not_a_digit.',
    )
    not_a_digit: Annotated[bool, Strict()] = Field(
        False,
        description="true: the image is none of the model's classes (not a digit). It is no "
        "class: stats count it apart from disagreements, the export puts it under outliers/, "
        "and a training job on reviews+mnist-bundled uses it as an outlier.",
    )
    reviewer: Reviewer = None

    @model_validator(mode="after")
    def _one_answer(self) -> LabelRequest:
        if self.not_a_digit and self.label is not None:
            raise ValueError(
                "give either a label or not_a_digit: true, not both (not a digit is no class)"
            )
        if not self.not_a_digit and self.label is None:
            raise ValueError("give a label (one of the model's classes) or not_a_digit: true")
        return self


class SkipRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reviewer: Reviewer = None


class ClaimRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reviewer: Reviewer = None
    order: Literal["oldest", "vgmu"] = Field(
        "oldest", description="oldest first, or vgmu: the most uncertain (highest VGMU) first"
    )
    model: Text | None = Field(
        None, max_length=128, description="Only this model's items (empty: every model)."
    )


def _who(request: Request, given: str | None) -> tuple[str, str]:
    """Who acts and how they were identified: a personal key's name (``key``), else the name the
    client gives with the shared key (``shared_key``), which may not be the name of a reviewer
    with a personal key (403): a shared-key client cannot claim, label or skip as them."""
    name, via = getattr(request.state, "reviewer", (None, "shared_key"))
    if name is not None:
        return name, via
    who = given or DEFAULT_REVIEWER
    if who in request.app.state.settings.reviewer_names().values():
        raise Forbidden(
            f"reviewer {who!r} has a personal key (VGE_REVIEWER_KEYS): act as them with their "
            "key; with the shared key, give another reviewer name"
        )
    return who, via


def _closed(state: State, item: dict[str, Any]) -> dict[str, Any]:
    """Count a label or skip in the review metrics: every decision on an item that had none, or
    had only a skip (a skipped item labelled later counts both); a relabel counts none. The wait
    is observed once, at the item's first decision (its history is empty until then)."""
    if item.get("relabelled"):
        return item
    m = state.metrics
    if item["state"] == "skipped":
        outcome = "skipped"
    elif item["not_a_digit"]:  # no class was right: neither an agreement nor a disagreement
        outcome = "not_a_digit"
    else:
        outcome = "agree" if item["label"] == item["answer"]["label"] else "disagree"
    m.reviews.labels(model=item["model"], outcome=outcome).inc()
    if not item["history"] and not item["history_dropped"]:  # its first decision
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
    cursor: Annotated[Text | None, Query(max_length=512)] = None,
) -> dict[str, Any]:
    """Items in a state, oldest first (``order=vgmu``: most uncertain, highest VGMU, first), a
    page at a time (``next_cursor`` continues in the same order)."""
    store = state.review_store()
    reviews, nxt = await asyncio.to_thread(
        store.list, state=review_state, model=model, order=order, limit=limit, cursor=cursor
    )
    return {"reviews": reviews, "next_cursor": nxt}


@router.get("/stats")
async def review_stats(_: ReviewerKey, state: State, model: ModelName = None) -> dict[str, Any]:
    """Counts by state, human-vs-model agreement (overall, per predicted class; over the items
    given a class), the items marked not a digit (apart from disagreements), median wait."""
    return await asyncio.to_thread(state.review_store().stats, model)


@router.get(
    "/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}, "description": "ImageFolder tar."}},
)
async def export_reviews(_: ReviewerKey, state: State, model: ModelName = None) -> Response:
    """Stream the reviewed items as an ImageFolder tar: ``<class>/<sha256>.png``, the class's
    name as its folder when it is a safe folder name, else percent-encoded
    (``service.common.review_images.class_folder``), and the images marked not a digit as
    ``outliers/<sha256>.png`` (no class is ever that folder; leave it out to use the tar as a
    plain ImageFolder of classes)."""
    store = state.review_store()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    # The items are read here, before the 200 goes out: a store that is unavailable answers 503
    items = await asyncio.to_thread(store.export_items, model)
    return StreamingResponse(
        _tar_stream(items),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="reviews-{stamp}.tar"'},
    )


def _tar_stream(items: Iterator[tuple[str, bytes]]) -> Iterator[bytes]:
    """A tar written item by item (Starlette runs this sync generator in a thread); its members
    are ``<class folder>/<sha256>.png`` (``ReviewStore.export_items``), never another path."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|") as tar:
        for path, png in items:
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(png), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(png))
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


@router.post("/claim", responses=error_responses(409))
async def claim_review(
    _: ReviewerKey, state: State, request: Request, body: ClaimRequest | None = None
) -> dict[str, Any]:
    """Hand the next pending item to this reviewer for a lease (``review`` null when none);
    no two reviewers hold the same item, across replicas too. The body is optional. One key
    holds at most ``VGE_REVIEW_MAX_CLAIMS`` items (the shared key: all its names together);
    past it a 409. A name with a personal key cannot be given with the shared key (403)."""
    body = body or ClaimRequest()
    store = state.review_store()
    who, via = _who(request, body.reviewer)
    item = await asyncio.to_thread(store.claim, who, order=body.order, model=body.model, via=via)
    pending = await asyncio.to_thread(store.pending_count, body.model)
    return {"review": item, "pending": pending, "lease_s": store.lease_s, "reviewer": who}


@router.get("/{review_id}")
async def get_review(review_id: Text, _: ReviewerKey, state: State) -> dict[str, Any]:
    """One item: the stored answer, its state, label and reviewer."""
    return await asyncio.to_thread(state.review_store().get, review_id)


@router.get(
    "/{review_id}/image",
    response_class=Response,
    responses={200: {"content": {"image/*": {}}, "description": "The original image bytes."}},
)
async def review_image(review_id: Text, _: ReviewerKey, state: State) -> Response:
    """The original bytes of the queued image, with their content type (never run as a page:
    ``nosniff`` and a CSP that allows nothing, not even framing)."""
    data, ctype = await asyncio.to_thread(state.review_store().image, review_id)
    headers = {"Cache-Control": "private, max-age=3600", **IMAGE_HEADERS}
    return Response(data, media_type=ctype, headers=headers)


@router.post("/{review_id}", responses=error_responses(409))
async def label_review(
    review_id: Text, body: LabelRequest, _: ReviewerKey, state: State, request: Request
) -> dict[str, Any]:
    """Record the human label (one of the model's classes, else 422), or ``"not_a_digit": true``
    (none of them: no class; trains as an outlier) → ``reviewed``; a reviewed item is relabelled
    (its earlier labels stay in ``history``)."""
    who, via = _who(request, body.reviewer)
    store = state.review_store()
    if body.not_a_digit:
        item = await asyncio.to_thread(store.mark_not_a_digit, review_id, who, via=via)
    else:
        item = await asyncio.to_thread(store.label, review_id, str(body.label), who, via=via)
    return _closed(state, item)


@router.post("/{review_id}/skip", responses=error_responses(409))
async def skip_review(
    review_id: Text, _: ReviewerKey, state: State, request: Request, body: SkipRequest | None = None
) -> dict[str, Any]:
    """Take a pending item out of the queue without a label → ``skipped`` (the body is
    optional)."""
    who, via = _who(request, body.reviewer if body else None)
    item = await asyncio.to_thread(state.review_store().skip, review_id, who, via=via)
    return _closed(state, item)


_PAGE = files("service.frontend.static").joinpath("review.html")


def _page_headers(html: str) -> dict[str, str]:
    """The page's CSP: its one inline script by hash, requests to this origin only, images from
    the blob: URLs it makes, no framing, no plugins, no forms posted elsewhere."""
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(js.encode()).digest()).decode() + "'"
        for js in scripts
    )
    csp = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; img-src blob:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return {**SECURITY_HEADERS, "Content-Security-Policy": csp}


#: Sent with the page and the images (issue 28: the browser must not sniff, frame or run them).
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
IMAGE_HEADERS = {
    **SECURITY_HEADERS,
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'; sandbox",
}


@page_router.get("/review", response_class=HTMLResponse, include_in_schema=False)
async def review_page() -> HTMLResponse:
    """The reviewer page: plain HTML + JavaScript, no build step, no CDN (works offline)."""
    html = _PAGE.read_text(encoding="utf-8")
    return HTMLResponse(html, headers=_page_headers(html))
