"""Session-wide fixtures shared by several test folders."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests import postgres

# Property tests draw the same examples on every run, so a run passes or fails on the code, not on
# the draw (CI is one run). HYPOTHESIS_PROFILE=explore draws fresh examples when hunting for bugs.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[postgres.PostgresServer]:
    """One real PostgreSQL server for the session (the README's test command installs it)."""
    assert postgres.available(), (
        "PostgreSQL or psycopg is missing: run scripts/install-system-deps.sh and "
        "pip install -e '.[test]'"
    )
    server = postgres.PostgresServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_database(pg_server: postgres.PostgresServer) -> Callable[[], str]:
    """A factory of fresh, empty databases on the session's server (their URLs)."""
    counter = itertools.count()

    def make() -> str:
        import uuid

        return pg_server.create_database(f"t{next(counter)}_{uuid.uuid4().hex[:8]}")

    return make


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database of each kind the service supports: a SQLite file, a real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state.sqlite3"
    make: Callable[[], str] = request.getfixturevalue("pg_database")
    return make()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The whole-tree tests (tests/service/system/: a real ``vge serve`` each, 10–75 s) run first,
    in their own order. pytest-xdist hands tests out in collection order, and collected last they
    left one worker running a minute-long test alone at the end of CI (13.5 min against ~10.5 with
    them spread through the run). The type check (tests/test_types.py, ~25 s of mypy) goes first
    of all, for the same reason."""

    def order(item: pytest.Item) -> int:
        if item.path.name == "test_types.py":
            return 0
        return 1 if "system" in item.path.parent.parts[-1:] else 2

    items.sort(key=order)
