"""API-key check for training and model-admin endpoints, reviewer-key check for the review API.

The key travels as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>`` (both, then the same
key), is compared with
:func:`secrets.compare_digest` and is never logged. With no key configured (``VGE_API_KEY``
unset) the management endpoints are disabled: 403 saying so, with or without a key (a 401 asking
for a key no key could satisfy would send clients looking for one). Otherwise a missing key is a
401 and a wrong one a 403.

Each check is a function of the settings and the request headers (:func:`check_api_key`,
:func:`check_reviewer`), run twice: by :class:`service.frontend.middleware.ServingMiddleware` before a
request's body is read (:func:`keyed_routes` finds the routes from their dependencies, so the two
never disagree), and by the routes' FastAPI dependencies (:data:`ApiKey`, :data:`ReviewerKey`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, compile_path

from service.common.errors import Forbidden, Unauthorized

if TYPE_CHECKING:
    from fastapi.dependencies.models import Dependant

    from service.common.settings import Settings


def _presented_key(headers: Mapping[str, str]) -> str | None:
    """The key the request presents; two different keys (Bearer and X-API-Key) are a 401, not a
    silent choice of one."""
    bearer = None
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            bearer = token.strip()
    key = (headers.get("x-api-key") or "").strip() or None
    if bearer is not None and key is not None and bearer != key:
        raise Unauthorized(
            "two different keys (Authorization: Bearer and X-API-Key): send one",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return bearer or key


def check_api_key(settings: Settings, headers: Mapping[str, str]) -> None:
    """Pass only with the configured API key (``settings.api_key``); else 401/403."""
    configured = settings.api_key
    if configured is None:
        raise Forbidden(
            "management endpoints are disabled: start the server with VGE_API_KEY / --api-key"
        )
    presented = _presented_key(headers)
    if presented is None:
        raise Unauthorized(
            "missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(
        presented.encode("utf-8"), configured.get_secret_value().encode("utf-8")
    ):
        raise Forbidden("wrong API key")


def check_reviewer(settings: Settings, headers: Mapping[str, str]) -> tuple[str | None, str]:
    """Pass with the reviewer key, a personal reviewer key (``VGE_REVIEWER_KEYS``) or the admin
    API key; with none configured the review endpoints are disabled (403), like the admin
    endpoints. Returns who acts: ``(name, "key")`` for a personal key, else
    ``(None, "shared_key")`` (the client names itself; service.frontend.routes.reviews)."""
    personal = settings.reviewer_names()  # key -> reviewer name
    keys = [k.get_secret_value() for k in (settings.reviewer_key, settings.api_key) if k]
    if not keys and not personal:
        raise Forbidden(
            "the review API is disabled: start the server with VGE_REVIEWER_KEY, personal keys "
            "(VGE_REVIEWER_KEYS=name:key,...) or VGE_API_KEY"
        )
    presented = _presented_key(headers)
    if presented is None:
        raise Unauthorized(
            "missing reviewer key: send `Authorization: Bearer <key>` (VGE_REVIEWER_KEY)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # Compare with every key (no early exit) so timing does not tell which one is configured.
    ok = [secrets.compare_digest(presented.encode(), k.encode()) for k in (*keys, *personal)]
    if not any(ok):
        raise Forbidden("wrong reviewer key")
    names = [
        n for k, n in personal.items() if secrets.compare_digest(presented.encode(), k.encode())
    ]
    return (names[0], "key") if names else (None, "shared_key")


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: pass only with the configured API key."""
    check_api_key(request.app.state.settings, request.headers)


async def require_reviewer(request: Request) -> None:
    """FastAPI dependency for the review API: the reviewer key or the admin API key; who acts
    is ``request.state.reviewer`` (:func:`check_reviewer`)."""
    request.state.reviewer = check_reviewer(request.app.state.settings, request.headers)


ApiKey = Annotated[None, Depends(require_api_key)]
ReviewerKey = Annotated[None, Depends(require_reviewer)]

#: The dependency of a keyed route → the check the middleware runs before its body is read.
#: (a check returns what it found, e.g. check_reviewer the reviewer; the middleware only needs it
#: to raise, so the return is object)
_CHECKS: dict[Callable[..., Any], Callable[[Settings, Mapping[str, str]], object]] = {
    require_api_key: check_api_key,
    require_reviewer: check_reviewer,
}


@dataclass(frozen=True)
class KeyCheck:
    """A keyed route: its methods, path regex, the static start of its path and its check."""

    methods: frozenset[str]
    regex: re.Pattern[str]
    prefix: str
    check: Callable[[Settings, Mapping[str, str]], object]


def _dependencies(dependant: Dependant) -> list[Callable[..., Any]]:
    """Every dependency callable of a FastAPI dependant, nested ones included."""
    out = []
    for dep in getattr(dependant, "dependencies", []):
        out.append(dep.call)
        out.extend(_dependencies(dep))
    return out


def _routes(routes: list[BaseRoute]) -> list[BaseRoute]:
    """The API routes of an app or router, through included routers (FastAPI keeps those as
    ``_IncludedRouter`` entries holding the original router; the router's prefix is already in
    its routes' paths)."""
    out = []
    for route in routes:
        router = getattr(route, "original_router", None)
        if router is not None:
            out.extend(_routes(router.routes))
        else:
            out.append(route)
    return out


def keyed_routes(app: FastAPI) -> list[KeyCheck]:
    """The app's routes that depend on :func:`require_api_key` or :func:`require_reviewer`."""
    out = []
    for route in _routes(app.routes):
        # A route with a dependant and methods: FastAPI's APIRoute (a WebSocket route has no
        # methods, Starlette's own routes and mounts no dependant)
        if not isinstance(route, APIRoute) or not route.methods:
            continue
        methods = route.methods
        checks = [_CHECKS[d] for d in _dependencies(route.dependant) if d in _CHECKS]
        if checks:
            regex = compile_path(route.path)[0]
            prefix = route.path.split("{", 1)[0]
            out.append(KeyCheck(frozenset(methods), regex, prefix, checks[0]))
    return out
