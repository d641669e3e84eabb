"""The front ends' side of the review queue: which answers a request queues (its ``review``
policy and key), and queuing them in the process's :class:`~service.common.review_store.ReviewStore`
for ``/v1/predict``, V2 HTTP and V2 gRPC."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from service.common.errors import InvalidValue
from service.common.review_connection import ReviewStoreUnavailable
from service.common.review_store import Enqueued, ReviewStore

if TYPE_CHECKING:
    import numpy as np

    from models.serving import ScoreColumns
    from service.common.metrics import Metrics
    from service.common.model_info import ModelInfo
    from service.common.settings import Settings
    from service.frontend.deps import ServiceState

log = logging.getLogger("vge.reviews")

ReviewPolicy = Literal["auto", "always", "never"]


def chosen_for_review(policy: ReviewPolicy, records: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the answers to queue: ``auto`` the abstained ones, ``always`` all, ``never``
    none."""
    if policy == "always":
        return list(range(len(records)))
    if policy == "auto":
        return [i for i, r in enumerate(records) if r["abstain"]]
    return []


def has_review_key(settings: Settings, headers: Mapping[str, str]) -> bool:
    """Whether a request carries the API key or a reviewer key (shared or personal)."""
    from service.common.errors import ServiceError
    from service.frontend.auth import check_reviewer

    try:
        check_reviewer(settings, headers)
    except ServiceError:
        return False
    return True


def check_policy(settings: Settings, headers: Mapping[str, str], policy: str | None) -> None:
    """``review=always`` needs the API key or a reviewer key (401/403): anonymous clients could
    otherwise fill the queue, and real abstentions would find it full. Without a key only
    ``auto`` (the server decides) and ``never``."""
    if policy != "always":
        return
    from service.common.errors import Forbidden, Unauthorized
    from service.frontend.auth import check_reviewer

    try:
        check_reviewer(settings, headers)
    except (Unauthorized, Forbidden) as exc:
        raise type(exc)(
            f"review=always needs the API key or a reviewer key ({exc.message}); without a key "
            "use review=auto (the server queues what abstains) or leave review out",
            headers=exc.headers,
        ) from None


def queue_answers(
    store: ReviewStore,
    metrics: Metrics,
    *,
    model: str,
    model_version: str,
    classes: Sequence[str],
    policy: ReviewPolicy,
    blobs: Sequence[bytes],
    records: list[dict[str, Any]],
    reveal: bool = True,
) -> None:
    """Queue the chosen images and mark their answers with ``review_id`` and ``review_status``.

    ``reveal`` False (a client without a key): ``queued`` and ``already_queued`` both answer
    ``queued`` with ``review_id`` null, so an anonymous client learns neither another client's
    item id nor whether an image was already pending.

    Runs in a thread (file and database writes). A failure to store never fails the prediction:
    an unavailable store (see the module's docstring) answers ``review_status: "unavailable"``
    (logged once per outage by the store), anything else ``"error"`` (logged); both are counted.
    """
    chosen = chosen_for_review(policy, records)
    if not chosen:
        return
    try:
        results = store.enqueue(
            model=model,
            model_version=model_version,
            classes=classes,
            images=[blobs[i] for i in chosen],
            answers=[records[i] for i in chosen],
        )
    except ReviewStoreUnavailable:
        results = [Enqueued(None, "unavailable")] * len(chosen)
    except Exception:  # noqa: BLE001 - the prediction itself succeeded; say so, keep serving
        log.exception("review queue: storing %d images failed", len(chosen))
        results = [Enqueued(None, "error")] * len(chosen)
    for i, res in zip(chosen, results, strict=True):
        hide = not reveal and res.status in ("queued", "already_queued")
        records[i]["review_id"] = None if hide else res.review_id
        records[i]["review_status"] = "queued" if hide else res.status
        metrics.review_enqueued.labels(model=model, status=res.status).inc()


def png_image(pixels: np.ndarray) -> bytes:
    """One V2 ``UINT8`` image (``[C, H, W]`` or ``[H, W]``, C 1, 3 or 4: channels first, as
    :func:`service.frontend.pipeline.channels_first` lays a batch out) as a PNG file a person can
    label: the pixels the client sent, an alpha channel kept (a PNG of 4 channels, which
    torchvision's encoder does not write: Pillow's), as an uploaded PNG is stored as sent. The
    review export flattens it as it does any transparent upload
    (:func:`service.common.decode.to_png`)."""
    import numpy as np
    import torch
    from torchvision.io import encode_png

    # a copy: the pixels may be a request's read-only bytes (V2 binary, gRPC); one image a review
    a = np.array(pixels, order="C")
    if a.ndim == 2:
        a = a[None]
    if a.shape[0] == 4:
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(a.transpose(1, 2, 0)), "RGBA").save(buf, "PNG")
        return buf.getvalue()
    return bytes(encode_png(torch.from_numpy(a)).numpy())


def review_policy(
    state: ServiceState, asked: ReviewPolicy | None, headers: Mapping[str, str]
) -> ReviewPolicy:
    """The request's review policy: ``auto`` by default when the queue is on, else ``never``; asking
    for a queue that is off is a 422 (the images would silently not reach a human); ``always``
    needs a key in ``headers`` (service.frontend.review_queue.check_policy). V2 HTTP and gRPC use it too."""
    if state.reviews is None:
        if asked in ("auto", "always"):
            raise InvalidValue(
                f"review={asked} but the review queue is off: start the server with "
                "VGE_REVIEW_QUEUE=on, or leave review out"
            )
        return "never"
    check_policy(state.settings, headers, asked)
    return asked or "auto"


async def queue_tensor_answers(
    state: ServiceState,
    model: ModelInfo,
    policy: ReviewPolicy,
    columns: ScoreColumns,
    pixels: np.ndarray | None,
    abstain_k: float,
    headers: Mapping[str, str],
) -> dict[str, str]:
    """Queue a V2 (HTTP or gRPC) batch's chosen answers, as :func:`queue_answers` does for
    ``/v1/predict``; the V2 response parameters that say what happened, per image in order:
    ``review_status`` and ``review_id``, comma-separated (V2 parameters are scalars; an image not
    chosen has an empty entry). Empty when nothing was chosen.

    ``pixels``: the ``UINT8`` input (stored as PNG), or None for ``FP32`` input, which is already
    normalised model input, not an image a person can label: those answers say
    ``unsupported_input`` and nothing is queued (send pixels as ``UINT8`` to have them reviewed).
    """
    store = state.reviews  # None: the queue is off, and review_policy said "never"
    if store is None or policy == "never":
        return {}
    if policy == "auto" and not columns.column("abstain").any():
        return {}  # the common case: one vectorised check, no records built
    records = columns.records(list(model.class_names), abstain_k)
    reveal = policy == "always" or has_review_key(state.settings, headers)

    def work() -> dict[str, str]:
        chosen = chosen_for_review(policy, records)
        if not chosen:
            return {}
        if pixels is None:
            for i in chosen:
                records[i]["review_id"], records[i]["review_status"] = None, "unsupported_input"
            state.metrics.review_enqueued.labels(model=model.name, status="unsupported_input").inc(
                len(chosen)
            )
        else:
            blobs = [b""] * len(records)
            try:
                for i in chosen:
                    blobs[i] = png_image(pixels[i])
            except Exception:  # noqa: BLE001 - the prediction itself succeeded; say so, keep serving
                log.exception("review queue: encoding %d images as PNG failed", len(chosen))
                for i in chosen:
                    records[i]["review_id"], records[i]["review_status"] = None, "error"
                state.metrics.review_enqueued.labels(model=model.name, status="error").inc(
                    len(chosen)
                )
                return _said(records)
            queue_answers(
                store, state.metrics, model=model.name, model_version=model.version,
                classes=model.class_names, policy=policy, blobs=blobs, records=records,
                reveal=reveal,
            )  # fmt: skip
        return _said(records)

    return await asyncio.to_thread(work)


def _said(records: list[dict[str, object]]) -> dict[str, str]:
    """The V2 response parameters of a batch's review outcomes, comma-separated per image."""
    return {
        "review_status": ",".join(str(r.get("review_status", "")) for r in records),
        "review_id": ",".join(str(r.get("review_id") or "") for r in records),
    }
