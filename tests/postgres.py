"""A real PostgreSQL server for tests: ``initdb`` + ``postgres`` in a temporary directory.

Debian's ``postgresql`` package (installed by scripts/install-system-deps.sh) provides the
binaries. The server listens on 127.0.0.1 on a free port with its socket in the data directory,
trusts its one user, and is stopped by its own process id (SIGINT: PostgreSQL's fast shutdown).
``initdb`` refuses to run as root, so as root the cluster belongs to the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _bindir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    return Path(dirs[-1]) if dirs else None


def available() -> bool:
    """Whether the PostgreSQL server binaries and psycopg are installed here."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False
    return _bindir() is not None


class PostgresServer:
    """One throw-away PostgreSQL cluster; ``url`` is a psycopg connection URL."""

    def __init__(self) -> None:
        bindir = _bindir()
        assert bindir is not None, "PostgreSQL is not installed (scripts/install-system-deps.sh)"
        self.dir = Path(tempfile.mkdtemp(prefix="vge-pg-"))
        self.data = self.dir / "data"
        as_root = os.geteuid() == 0
        prefix: list[str] = []
        if as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            prefix = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            [*prefix, str(bindir / "initdb"), "-D", str(self.data), "-U", "vge",
             "--auth=trust", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True,
        )  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = self.dir / "postgres.log"
        with open(self.log, "wb") as log:
            if as_root:
                os.chown(self.log, pw.pw_uid, pw.pw_gid)
            self.proc = subprocess.Popen(
                [*prefix, str(bindir / "postgres"), "-D", str(self.data), "-p", str(self.port),
                 "-k", str(self.data), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                 "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.url = f"postgresql://vge@127.0.0.1:{self.port}/postgres"
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"PostgreSQL did not start: {self.log.read_text()}"
                    ) from None
                time.sleep(0.1)

    def create_database(self, name: str) -> str:
        """A fresh database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://vge@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        """Fast shutdown by the postmaster's own pid (``postmaster.pid``), then clean up."""
        if self.proc.poll() is None:
            pid_file = self.data / "postmaster.pid"
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGINT)
            except (FileNotFoundError, ValueError, ProcessLookupError, IndexError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
