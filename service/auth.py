"""API-key check for training and model-admin endpoints.

The key travels as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>`` (both, then the same
key), is compared with
:func:`secrets.compare_digest` and is never logged. With no key configured (``VGE_API_KEY``
unset) the management endpoints are disabled: 403 saying so, with or without a key (a 401 asking
for a key no key could satisfy would send clients looking for one). Otherwise a missing key is a
401 and a wrong one a 403.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from service.errors import Forbidden, Unauthorized


def _presented_key(request: Request) -> str | None:
    """The key the request presents; two different keys (Bearer and X-API-Key) are a 401, not a
    silent choice of one."""
    bearer = None
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            bearer = token.strip()
    key = (request.headers.get("x-api-key") or "").strip() or None
    if bearer is not None and key is not None and bearer != key:
        raise Unauthorized(
            "two different keys (Authorization: Bearer and X-API-Key): send one",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return bearer or key


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: pass only with the configured API key."""
    configured = request.app.state.settings.api_key
    if configured is None:
        raise Forbidden(
            "management endpoints are disabled: start the server with VGE_API_KEY / --api-key"
        )
    presented = _presented_key(request)
    if presented is None:
        raise Unauthorized(
            "missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(
        presented.encode("utf-8"), configured.get_secret_value().encode("utf-8")
    ):
        raise Forbidden("wrong API key")


async def require_reviewer(request: Request) -> None:
    """FastAPI dependency for the review API: the reviewer key or the admin API key.

    With neither configured the review endpoints are disabled (403), like the admin endpoints.
    """
    settings = request.app.state.settings
    keys = [k for k in (settings.reviewer_key, settings.api_key) if k is not None]
    if not keys:
        raise Forbidden(
            "the review API is disabled: start the server with VGE_REVIEWER_KEY (or VGE_API_KEY)"
        )
    presented = _presented_key(request)
    if presented is None:
        raise Unauthorized(
            "missing reviewer key: send `Authorization: Bearer <key>` (VGE_REVIEWER_KEY)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # Compare with every key (no early exit) so timing does not tell which one is configured.
    ok = [secrets.compare_digest(presented.encode(), k.get_secret_value().encode()) for k in keys]
    if not any(ok):
        raise Forbidden("wrong reviewer key")


ApiKey = Annotated[None, Depends(require_api_key)]
ReviewerKey = Annotated[None, Depends(require_reviewer)]
