"""Which models exist and which one is served: one seam, two implementations.

Three questions used to be answered in three places: which model a name or a directory means
(the zoo resolver), which models may be promoted and are listed by the V2 repository index, and
which model is served and why (the model history). :class:`ModelRepository` answers all three;
the engine's :class:`~service.engine.model_manager.ModelManager` asks it and never SQL.

* :class:`LocalModelRepository` (no ``VGE_DB_URL``, or one replica): the served model is this
  replica's newest history entry; a promote or rollback changes this replica only (as before).
* :class:`FleetModelRepository` (``VGE_DB_URL`` set): the served model is the **fleet's** newest
  history entry in the shared database, whoever recorded it. Every record is announced with
  PostgreSQL ``NOTIFY`` on :data:`FLEET_CHANNEL`; every replica ``LISTEN`` s on its own connection
  and re-reads the record every :data:`FLEET_POLL_S` seconds as the fallback (a lost
  notification, a reconnect, SQLite), then loads the model itself, load-then-swap, after
  verifying the weights' sha256 (:meth:`~service.engine.model_manager.ModelManager.follow_fleet`).
  Each replica reports what it serves in ``model_fleet_replicas`` (``GET /v1/models/history``
  shows it) and ``vge_fleet_converged``.

This module imports neither torch nor the web framework. The catalogue itself (which directory a
name means, which models the operator exposes) lives in :mod:`service.common.catalogue`, which the
front ends read directly: they may not import ``service.engine``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.common.catalogue import loadable_models, resolve_by_name
from service.common.db import Database
from service.common.errors import Conflict, NotFound
from service.common.settings import Settings

if TYPE_CHECKING:
    from service.common.model_info import ModelInfo

log = logging.getLogger("vge.models")

#: The PostgreSQL notification channel a fleet's history records are announced on.
FLEET_CHANNEL = "vge_fleet_model"
#: How often a fleet replica re-reads the fleet's model without a notification (seconds): the
#: bound on convergence when notifications are lost (with the load time on top).
FLEET_POLL_S = 2.0
#: A fleet model that failed to load on this replica is tried again this often (seconds).
FLEET_RETRY_S = 15.0
#: A replica that reported within this long is ``live`` in the fleet's list (seconds).
REPLICA_LIVE_S = 30.0
#: A replica silent this long is dropped from the fleet's list (a pod long gone; seconds).
REPLICA_FORGET_S = 86_400.0

_HISTORY_SCHEMA = """
CREATE TABLE IF NOT EXISTS model_history (
    id TEXT PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
    replica TEXT NOT NULL,
    action TEXT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    model_dir TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS model_history_replica_at ON model_history (replica, at);
CREATE TABLE IF NOT EXISTS model_start_config (
    replica TEXT PRIMARY KEY,
    configured TEXT NOT NULL,
    at DOUBLE PRECISION NOT NULL
)
"""

_FLEET_SCHEMA = """
CREATE INDEX IF NOT EXISTS model_history_at ON model_history (at);
CREATE TABLE IF NOT EXISTS model_fleet_configs (
    configured TEXT PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS model_fleet_replicas (
    replica TEXT PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
    converged INTEGER NOT NULL,
    history_id TEXT,
    model TEXT,
    version TEXT,
    model_dir TEXT,
    weights_sha256 TEXT,
    fleet_history_id TEXT,
    error TEXT
)
"""

#: Columns added after the table was first created; older databases get them at start
#: (:meth:`Database.add_column`). ``comparison`` holds the promote gate's comparison as JSON text.
_HISTORY_COLUMNS = (("weights_sha256", "TEXT"), ("comparison", "TEXT"), ("note", "TEXT"))

#: :meth:`ModelRepository.previous_configuration` of a start naming no model (the default).
CONFIGURED_DEFAULT = ""


def iso(at: float) -> str:
    """An epoch time as ISO 8601 UTC (seconds), as ``/v1/models`` shows times."""
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- the catalogue


def resolve_model_dir(model_dir: Path | None) -> Path:
    """``model_dir`` as given; a bare name of a shipped model when no such directory exists; the
    shipped default when unset (:func:`models.zoo.resolve_model_dir`)."""
    from models.zoo import resolve_model_dir as zoo_resolve

    return zoo_resolve(model_dir)


def configured_model(model_dir: Path | None) -> str:
    """How a start's configured model is recorded and compared: ``--model-dir`` /
    ``VGE_MODEL_DIR`` resolved to an absolute directory (a shipped model's name to its
    directory), or :data:`CONFIGURED_DEFAULT` when none is given. "None" is its own
    configuration: it follows the shipped default wherever the package is installed."""
    if model_dir is None or str(model_dir) == "":
        return CONFIGURED_DEFAULT
    return str(resolve_model_dir(model_dir).resolve())


def describe_configured(configured: str | None) -> str:
    """A recorded configuration as a person reads it in the log and the history's notes."""
    if configured is None:
        return "not recorded"
    return "none (the shipped default)" if configured == CONFIGURED_DEFAULT else configured


# --------------------------------------------------------------------------- the repositories


class ModelRepository:
    """The served-model state, its history and the catalogue, wherever they live.

    An entry is a model some replica chose to serve (start, promote, promote_job, reload,
    rollback), with the weights' sha256 and the promote gate's comparison; it is recorded before
    the model is swapped in, and only once it loaded. :meth:`latest` is what should be served.
    Subclasses say whose entries count (:meth:`_scope`): one replica's, or the fleet's.
    """

    #: Whether every replica serves this repository's :meth:`latest` (a fleet).
    fleet = False

    def __init__(self, db: Database, replica: str, settings: Settings) -> None:
        self.db = db
        self.replica = replica
        self.settings = settings
        db.script(_HISTORY_SCHEMA)
        for column, decl in _HISTORY_COLUMNS:
            db.add_column("model_history", column, decl)

    # -- the catalogue
    def start_dir(self) -> Path:
        """The configured model's directory (``--model-dir``; none: the shipped default)."""
        return resolve_model_dir(self.settings.model_dir)

    def resolve(self, name: str) -> Path:
        """:func:`resolve_by_name`."""
        return resolve_by_name(self.settings, name)

    def loadable(self) -> dict[str, Path]:
        """:func:`loadable_models`."""
        return loadable_models(self.settings)

    # -- whose entries count
    def _scope(self) -> tuple[str, tuple[str, ...]]:
        """A ``WHERE`` condition (and its parameters) selecting the entries that count."""
        raise NotImplementedError

    # -- the history
    def record(
        self,
        action: str,
        info: ModelInfo,
        model_dir: Path,
        *,
        weights_sha256: str = "",
        comparison: dict[str, Any] | None = None,
        note: str | None = None,
    ) -> dict[str, Any]:
        """Insert one entry for ``info`` (a :class:`~service.common.model_info.ModelInfo`) before
        it is swapped in; returns it as :meth:`entries` shows it, and announces it."""
        row: dict[str, Any] = {
            "id": uuid.uuid4().hex[:16],
            "at": time.time(),
            "replica": self.replica,
            "action": action,
            "model": info.name,
            "version": info.version,
            "model_dir": str(Path(model_dir).resolve()),
            "weights_sha256": weights_sha256 or None,
            "comparison": None if comparison is None else json.dumps(comparison),
            "note": note,
        }
        self.db.execute(
            f"INSERT INTO model_history ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )
        self._announce(row["id"])
        return self._decoded(row)

    def _announce(self, entry_id: str) -> None:
        """Tell the other replicas a new entry exists (a fleet's; nobody to tell here)."""

    @staticmethod
    def _decoded(row: dict[str, Any]) -> dict[str, Any]:
        """A row with its comparison parsed from JSON."""
        out = dict(row)
        raw = out.get("comparison")
        out["comparison"] = json.loads(raw) if isinstance(raw, str) and raw else None
        return out

    def entries(self, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first."""
        where, params = self._scope()
        rows = self.db.fetchall(
            f"SELECT * FROM model_history WHERE {where} ORDER BY at DESC, id DESC LIMIT ?",
            (*params, limit),
        )
        return [self._decoded(r) for r in rows]

    def latest(self) -> dict[str, Any] | None:
        """The newest entry: the model that should be served (None: nothing recorded yet)."""
        rows = self.entries(1)
        return rows[0] if rows else None

    def latest_start(self) -> dict[str, Any] | None:
        """The newest ``start`` entry: the configured model of the last start that recorded one."""
        where, params = self._scope()
        row = self.db.fetchone(
            f"SELECT * FROM model_history WHERE {where} AND action = 'start' "
            "ORDER BY at DESC, id DESC LIMIT 1",
            params,
        )
        return self._decoded(row) if row is not None else None

    def entry(self, entry_id: str) -> dict[str, Any]:
        """The entry ``entry_id`` among those that count (404 naming it otherwise)."""
        where, params = self._scope()
        row = self.db.fetchone(
            f"SELECT * FROM model_history WHERE id = ? AND {where}", (entry_id, *params)
        )
        if row is None:
            raise NotFound(f"no model history entry {entry_id!r} on this {self._whose()}")
        return self._decoded(row)

    def _whose(self) -> str:
        return "replica"

    def target(self, entry_id: str | None) -> dict[str, Any]:
        """The entry to roll back to: ``entry_id``, else the one before the latest (undo)."""
        if entry_id is not None:
            return self.entry(entry_id)
        entries = self.entries(2)
        if len(entries) < 2:
            raise Conflict(
                f"nothing to roll back to: this {self._whose()} has served only one model"
            )
        return entries[1]

    def previous_configuration(self, configured: str) -> str | None:
        """The configured model (:func:`configured_model`) this start is compared with: equal,
        the history's newest entry is restored; another, ``configured`` is served and recorded.
        None: no start recorded one (a database from before configurations were kept)."""
        row = self.db.fetchone(
            "SELECT configured FROM model_start_config WHERE replica = ?", (self.replica,)
        )
        return None if row is None else str(row["configured"])

    def set_configured(self, configured: str) -> None:
        """Record the configured model of this start (one row per replica: the latest)."""
        self.db.execute(
            "INSERT INTO model_start_config (replica, configured, at) VALUES (?, ?, ?) "
            "ON CONFLICT (replica) DO UPDATE SET configured = excluded.configured, "
            "at = excluded.at",
            (self.replica, configured, time.time()),
        )

    # -- the fleet (nothing to do for one replica)
    def report(self, state: dict[str, Any]) -> None:
        """Record what this replica serves, for the fleet's view (:meth:`replicas`)."""

    def replicas(self) -> list[dict[str, Any]] | None:
        """Which replica serves which model (a fleet's; None for one replica)."""
        return None

    def listen(self, wake: Callable[[], object]) -> None:
        """Call ``wake`` (from any thread) whenever another replica records an entry."""

    def close(self) -> None:
        """Stop listening and close the database connection."""
        self.db.close()


class LocalModelRepository(ModelRepository):
    """One replica's own history (no ``VGE_DB_URL``: its SQLite file; the behaviour of every
    version before fleets). The newest entry is the model this replica restores at its next
    start; an engine restart that restores it adds no entry, so "roll back" without a target
    still means "the model before the latest change"."""

    def _scope(self) -> tuple[str, tuple[str, ...]]:
        return "replica = ?", (self.replica,)


class FleetModelRepository(ModelRepository):
    """One history for every replica on the shared database (``VGE_DB_URL``): the fleet's newest
    entry is what every replica serves, whichever replica recorded it (its ``replica`` column
    says who acted).

    The start rule, fleet-wide: a start whose configured model the fleet has never seen (a
    rolling restart onto a new ``VGE_MODEL_DIR`` or image default) serves it and records a
    ``start``, which the running replicas then follow; a start with a configuration the fleet has
    seen (a restart, an old replica restarting in the middle of a rollout) serves the fleet's
    model. So a rollout never flips back and forth, and a promote survives every restart.
    """

    fleet = True

    def __init__(self, db: Database, replica: str, settings: Settings) -> None:
        super().__init__(db, replica, settings)
        db.script(_FLEET_SCHEMA)
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        #: Whether the LISTEN connection is up (False on SQLite and while reconnecting).
        self.listening = False

    def _scope(self) -> tuple[str, tuple[str, ...]]:
        return "1 = 1", ()

    def _whose(self) -> str:
        return "fleet"

    def _announce(self, entry_id: str) -> None:
        if self.db.postgres:
            self.db.execute("SELECT pg_notify(?, ?)", (FLEET_CHANNEL, entry_id))

    def target(self, entry_id: str | None) -> dict[str, Any]:
        """``entry_id``, else the newest entry serving other weights than the latest (several
        replicas that started together each recorded the same model: undo skips those)."""
        if entry_id is not None:
            return self.entry(entry_id)
        entries = self.entries(1000)
        if entries:
            now = (entries[0]["model_dir"], entries[0].get("weights_sha256"))
            for entry in entries[1:]:
                if (entry["model_dir"], entry.get("weights_sha256")) != now:
                    return entry
        raise Conflict("nothing to roll back to: this fleet has served only one model")

    def previous_configuration(self, configured: str) -> str | None:
        """``configured`` itself when the fleet has seen it (restore the fleet's model), else the
        configuration the fleet saw last (the start serves its own and records it); a fleet that
        recorded none yet: this replica's own, as before fleets."""
        rows = self.db.fetchall("SELECT configured FROM model_fleet_configs ORDER BY at DESC")
        if not rows:
            return super().previous_configuration(configured)
        seen = [str(r["configured"]) for r in rows]
        return configured if configured in seen else seen[0]

    def set_configured(self, configured: str) -> None:
        super().set_configured(configured)
        self.db.execute(
            "INSERT INTO model_fleet_configs (configured, at) VALUES (?, ?) "
            "ON CONFLICT (configured) DO NOTHING",
            (configured, time.time()),
        )

    def report(self, state: dict[str, Any]) -> None:
        """Upsert this replica's row: what it serves, whether that is the fleet's model, why
        not; rows of replicas silent for :data:`REPLICA_FORGET_S` are deleted."""
        now = time.time()
        row = {
            "replica": self.replica,
            "at": now,
            "converged": 1 if state.get("converged") else 0,
            "history_id": state.get("history_id"),
            "model": state.get("model"),
            "version": state.get("version"),
            "model_dir": state.get("model_dir"),
            "weights_sha256": state.get("weights_sha256"),
            "fleet_history_id": state.get("fleet_history_id"),
            "error": state.get("error"),
        }
        cols = ", ".join(row)
        updates = ", ".join(f"{c} = excluded.{c}" for c in row if c != "replica")
        self.db.execute(
            f"INSERT INTO model_fleet_replicas ({cols}) VALUES ({', '.join('?' * len(row))}) "
            f"ON CONFLICT (replica) DO UPDATE SET {updates}",
            tuple(row.values()),
        )
        self.db.execute("DELETE FROM model_fleet_replicas WHERE at < ?", (now - REPLICA_FORGET_S,))

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica that reported in the last day: what it serves, whether that is the
        fleet's model (``converged``), why not (``error``), when it last reported and whether
        that was recent (``live``: within :data:`REPLICA_LIVE_S`)."""
        now = time.time()
        rows = self.db.fetchall("SELECT * FROM model_fleet_replicas ORDER BY replica")
        for r in rows:
            r["converged"] = bool(r["converged"])
            r["live"] = now - float(r["at"]) < REPLICA_LIVE_S
            r["seen_at"] = iso(float(r.pop("at")))
        return rows

    def listen(self, wake: Callable[[], object]) -> None:
        """``LISTEN`` on :data:`FLEET_CHANNEL` on a connection of its own, in a daemon thread;
        ``wake`` on every notification and after every (re)connect (what was announced while
        it was down is read again). Reconnects after a second when the connection breaks.
        SQLite has no notifications: the caller's periodic re-read is all there is."""
        if not self.db.postgres or self._listener is not None:
            return
        self._listener = threading.Thread(
            target=self._listen_loop, args=(wake,), name="vge-fleet-listen", daemon=True
        )
        self._listener.start()

    def _listen_loop(self, wake: Callable[[], object]) -> None:
        import psycopg

        from service.common.db import scrub

        down_logged = False
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self.db.url, autocommit=True, connect_timeout=self.db.connect_timeout
                ) as conn:
                    conn.execute(f"LISTEN {FLEET_CHANNEL}")
                    self.listening = True
                    if down_logged:
                        log.warning("fleet: listening for model changes again")
                        down_logged = False
                    wake()
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=1.0):
                            wake()
            except Exception as exc:  # noqa: BLE001 - a database outage must not end the thread
                self.listening = False
                if not down_logged:
                    problem = scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else
                                    type(exc).__name__, self.db.url)  # fmt: skip
                    log.warning(
                        "fleet: the LISTEN connection to %s failed (%s); re-reading the fleet's "
                        "model every %g s until it is back", self.db.where, problem, FLEET_POLL_S,
                    )  # fmt: skip
                    down_logged = True
                self._stop.wait(1.0)
        self.listening = False

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=3)
        super().close()


def open_model_repository(settings: Settings) -> ModelRepository:
    """The repository the engine serves from: the fleet's on ``VGE_DB_URL``, else this
    replica's own (in ``VGE_JOBS_DB_URL``)."""
    db = Database(settings.jobs_database_url)
    cls = FleetModelRepository if settings.db_url else LocalModelRepository
    return cls(db, settings.resolved_replica_name(), settings)
