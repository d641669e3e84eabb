"""One small SQL layer for the service's durable state: SQLite on one host, PostgreSQL for several.

The review queue (:mod:`service.common.review_store`), training-job history (:mod:`service.engine.jobs`) and the
promotion history (:mod:`service.engine.model_manager`) write through :class:`Database`. Statements are
written once, in the dialect both engines share (``?`` placeholders, ``ON CONFLICT DO NOTHING``,
``RETURNING``, ``DOUBLE PRECISION``); :class:`Database` translates placeholders for psycopg and says
whether ``FOR UPDATE SKIP LOCKED`` is available (PostgreSQL) or needed at all (SQLite serialises
writers, so a single ``UPDATE … RETURNING`` already claims a row atomically).

URLs: ``sqlite:///relative/path.sqlite3``, ``sqlite:////absolute/path.sqlite3``,
``postgresql://user:pass@host:port/dbname`` (psycopg 3; ``pip install 'vge-serve[postgres]'``).
Each process opens its own connection (front ends and the engine are separate processes); SQLite
runs in WAL mode (the review queue: a rollback journal, see :class:`Database`) with a busy timeout
so those processes can write concurrently.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote

from service.common.errors import DatabaseUnavailable, InvalidValue

SQLITE_PREFIX = "sqlite:///"
POSTGRES_PREFIXES = ("postgresql://", "postgres://")
_SCHEMA_LOCK = 0x76676573  # "vges": the advisory lock key of schema creation


#: A query parameter whose value is a secret (libpq's ``password``, ``sslpassword``; any name
#: with "pass", "secret" or "token" in it, to be safe).
_SECRET_PARAM = re.compile(r"([?&][^=&#?]*(?:pass|secret|token)[^=&#?]*=)([^&]*)", re.IGNORECASE)


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """``(scheme://user, password, @rest)`` of a URL with a password in its authority, else
    None. The password runs from the first ``:`` after ``scheme://`` to the *last* ``@``: a
    password holding ``/ # ? @`` (which a URL should percent-encode, and people do not) is
    still all of it. A ``@`` later in the URL (a query value) makes the masked part longer,
    never shorter: masking errs towards hiding."""
    head, sep, rest = url.partition("://")
    if not sep:
        return None
    at = rest.rfind("@")
    if at < 0:
        return None
    user, colon, password = rest[:at].partition(":")
    if not colon or not password:
        return None
    return f"{head}{sep}{user}", password, rest[at:]


def secrets_of(url: str) -> list[str]:
    """Every secret a database URL holds, as written and percent-decoded: the authority's
    password and the values of secret query parameters (``?password=``, ``sslpassword=``)."""
    found = []
    if (parts := _userinfo(url)) is not None:
        found.append(parts[1])
    found += [m.group(2) for m in _SECRET_PARAM.finditer(url) if m.group(2)]
    decoded = [unquote(s) for s in found]
    return sorted({s for s in (*found, *decoded) if s}, key=len, reverse=True)


def mask_url(url: str) -> str:
    """``url`` with every secret replaced by ``***`` (the authority's password, however it is
    written, and secret query parameters): safe for logs, error messages and answers."""
    if (parts := _userinfo(url)) is not None:
        head, _, tail = parts
        url = f"{head}:***{tail}"
    return _SECRET_PARAM.sub(lambda m: m.group(1) + "***", url)


def scrub(text: str, url: str) -> str:
    """``text`` without ``url``'s secrets: the URL masked, and each secret itself (a driver
    may echo the URL, its parts or the password alone, decoded or not) replaced by ``***``."""
    text = text.replace(url, mask_url(url))
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text


def check_url(url: str, setting: str) -> str:
    """Validate a database URL eagerly; the error says how to fix it (``setting`` names the knob)
    and never repeats a password."""
    if url.startswith(SQLITE_PREFIX) and len(url) > len(SQLITE_PREFIX):
        return url
    if url.startswith(POSTGRES_PREFIXES):
        return url
    raise ValueError(
        f"{setting} {shown_url(url)} is not supported; use sqlite:///relative/path.sqlite3, "
        "sqlite:////absolute/path.sqlite3 or postgresql://user:password@host:5432/dbname"
    )


def shown_url(url: str) -> str:
    """A database setting as a refusal may show it: a URL with its password masked
    (:func:`mask_url`); a value that is no URL at all (``user:password@host/db``, a libpq
    ``host=… password=…`` string) not repeated, as the mask finds no password in it."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", url):
        return repr(mask_url(url))
    return "(a value with no scheme://)"


def sqlite_path(url: str) -> Path:
    """The file of a ``sqlite:///`` URL."""
    return Path(url[len(SQLITE_PREFIX) :])


class Database:
    """A thread-safe connection to SQLite or PostgreSQL with one statement API for both.

    ``synchronous`` and ``journal`` are SQLite's: ``NORMAL`` (WAL: a commit survives a crash of
    the process, not of the machine) or ``FULL`` (fsync at every commit: the review queue, whose
    ``queued`` answers promise the item is kept); ``WAL`` (readers never wait for the writer) or
    ``DELETE`` (a rollback journal that exists only during a write: the review queue, whose file
    an operator may delete or replace while the server runs — a WAL and its index stay beside the
    path, and a replaced file opened with the old file's WAL would read the old file's pages).
    ``connect_timeout`` is PostgreSQL's, in seconds.
    """

    def __init__(
        self,
        url: str,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        journal: Literal["WAL", "DELETE"] = "WAL",
        connect_timeout: int = 10,
    ) -> None:
        self.url = check_url(url, "database URL")
        self.postgres = url.startswith(POSTGRES_PREFIXES)
        self.synchronous = synchronous
        self.journal = journal
        self.connect_timeout = connect_timeout
        self._lock = threading.RLock()
        if self.postgres:
            try:
                import psycopg
            except ImportError:  # pragma: no cover - depends on the install
                raise ValueError(
                    "a postgresql:// database needs psycopg 3: pip install 'vge-serve[postgres]'"
                ) from None
            self._driver_errors: tuple[type[Exception], ...] = (psycopg.OperationalError,)
            self._data_errors: tuple[type[Exception], ...] = (psycopg.DataError,)
            # Opening also refuses a URL it cannot use (psycopg.ProgrammingError: an unknown
            # query parameter): reported the same way, its text scrubbed of the URL's secrets.
            opening: tuple[type[Exception], ...] = (psycopg.Error,)
        else:
            self._driver_errors = (sqlite3.OperationalError,)
            self._data_errors = ()
            opening = self._driver_errors
        with self._errors(opening):
            self._conn: Any = self._connect()

    def _connect(self) -> Any:
        if self.postgres:
            import psycopg
            from psycopg.rows import dict_row

            return psycopg.connect(
                self.url,
                autocommit=True,
                row_factory=dict_row,
                connect_timeout=self.connect_timeout,
            )
        path = sqlite_path(self.url)
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout=10000")
        conn.execute(f"PRAGMA journal_mode={self.journal}")
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        return conn

    @contextmanager
    def _errors(self, caught: tuple[type[Exception], ...] | None = None) -> Iterator[None]:
        """The driver's connection-level failures (``caught``; default ``_driver_errors``) as a
        503 the client may retry, its text without the URL's secrets; a PostgreSQL connection
        that broke (server restarted, network) is replaced on the next call."""
        caught = caught or self._driver_errors
        try:
            if self.postgres and getattr(self, "_conn", None) is not None and self._conn.broken:
                self._conn = self._connect()
            yield
        except self._data_errors as exc:  # the request's values, not the database: a 422
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
            raise InvalidValue(f"a value of this request cannot be stored: {detail}") from None
        except caught as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
            raise DatabaseUnavailable(
                f"the service database {self.where} is unavailable, retry shortly "
                f"({type(exc).__name__}: {scrub(detail, self.url)})",
                headers={"Retry-After": "2"},
            ) from None

    @property
    def where(self) -> str:
        """The database for messages: its file, or its URL with the password masked."""
        return str(sqlite_path(self.url)) if not self.postgres else mask_url(self.url)

    @property
    def skip_locked(self) -> str:
        """The row-claiming suffix for a ``SELECT`` inside ``UPDATE … WHERE id = (…)``."""
        return " FOR UPDATE SKIP LOCKED" if self.postgres else ""

    @property
    def for_update(self) -> str:
        """The row-locking suffix of a ``SELECT`` inside a transaction (PostgreSQL only)."""
        return " FOR UPDATE" if self.postgres else ""

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.postgres else sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; the number of rows it changed."""
        with self._lock, self._errors():
            cur = self._conn.execute(self._sql(sql), tuple(params))
            return int(cur.rowcount or 0)

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows as dicts."""
        with self._lock, self._errors():
            rows = self._conn.execute(self._sql(sql), tuple(params)).fetchall()
        return [dict(r) for r in rows]

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> dict[str, Any] | None:
        """The first row as a dict, or None."""
        with self._lock, self._errors():
            row = self._conn.execute(self._sql(sql), tuple(params)).fetchone()
        return dict(row) if row is not None else None

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row (None when there is no row)."""
        row = self.fetchone(sql, params)
        return next(iter(row.values())) if row else None

    @contextmanager
    def transaction(self) -> Iterator[Database]:
        """A write transaction (SQLite: ``BEGIN IMMEDIATE``, taking the write lock up front)."""
        with self._lock, self._errors():
            if self.postgres:
                with self._conn.transaction():
                    yield self
            else:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")

    def script(self, statements: str) -> None:
        """Run ``;``-separated DDL (schema creation; every statement idempotent)."""
        stmts = [s.strip() for s in statements.split(";") if s.strip()]
        with self._lock, self._errors():
            if self.postgres:
                # Concurrent CREATE … IF NOT EXISTS can still collide in PostgreSQL's catalogue
                # (several processes start at once): serialise schema changes with a lock.
                with self._conn.transaction():
                    self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                    for stmt in stmts:
                        self._conn.execute(stmt)
            else:
                for stmt in stmts:
                    self._conn.execute(stmt)

    def add_column(self, table: str, column: str, decl: str) -> None:
        """Migrate a table created by an older version: add ``column`` when it is missing."""
        with self._lock, self._errors():
            if self.postgres:
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {decl}")
                return
            cols = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})").fetchall()}
            if column not in cols:
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
