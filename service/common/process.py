"""Helpers for the processes the supervisor starts (the engine and the front ends)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
from pathlib import Path


def die_with_parent() -> None:
    """In a child: be killed when the supervisor dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``).

    Without it a ``kill -9`` of ``vge serve`` would leave an engine holding the GPU and front ends
    holding the port. Elsewhere this is a no-op (the engine connection drops, front ends follow).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    # The supervisor died before prctl took effect: this process has another parent now (init,
    # or a subreaper). Compared with the supervisor's own pid, not with 1: in a container
    # without an init the supervisor *is* pid 1, and every child killed itself at start-up.
    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if supervisor is not None and os.getppid() != int(supervisor):
        os._exit(1)


#: Where the supervisor leaves its pid for its children (:func:`mark_supervisor`); not a setting
#: (no ``VGE_`` prefix).
SUPERVISOR_PID_ENV = "_VGE_SUPERVISOR_PID"


def mark_supervisor() -> None:
    """In the supervisor, before it starts a child: its pid, for :func:`die_with_parent`."""
    os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())


#: The names the supervisor's children give themselves (:func:`name_process`), by role.
ENGINE_NAME = "vge-engine"
FRONTEND_NAME = "vge-frontend"


def name_process(name: str) -> None:
    """Set this process's name as ``ps``, ``top`` and ``/proc/PID/comm`` show it (Linux
    ``PR_SET_NAME``, 15 bytes at most): :data:`ENGINE_NAME` and :data:`FRONTEND_NAME` tell the
    roles apart whether the engine was spawned or forked. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_name = 15
        libc.prctl(pr_set_name, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        return


def forget_parent_signals(inherited: tuple[int, ...] = ()) -> None:
    """In a child the supervisor started: drop the supervisor's signal handlers and wake-up
    socket (a fork brings them along), close the descriptors it names (its listeners and wake-up
    socket, which a forked engine must not keep open), then take the signals the supervisor
    blocked around the start (:meth:`service.supervisor.Supervisor._start`; a spawned child
    inherits that mask too)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL or a gRPC target writes it: an IPv6 address in brackets (gRPC read
    ``::1:50051`` as a host name and never listened)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def hold(path: Path) -> int:
    """Open ``path`` and hold an exclusive lock on it for as long as this process (or a forked
    child that inherited the descriptor) lives: how :func:`remove_stale` tells a live server's
    files from a killed one's. Returns the descriptor (kept open on purpose)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_stale(folder: Path, pattern: re.Pattern[str], min_age_s: float = 60.0) -> list[Path]:
    """Remove what servers killed with SIGKILL left in ``folder``: the entries named like
    ``pattern``, owned by this user, older than ``min_age_s``, and not held by anyone (an arena
    file, or a work directory's ``lock`` file, whose :func:`hold` lock can be taken: its server
    is gone, whatever pids say — a container's supervisor is pid 1 at every start, and a server
    in another pid namespace sharing the folder has a pid that means nothing here). An entry
    without a lock to test (a work directory of an older version) is left. Returns what was
    removed."""
    import fcntl
    import time

    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    uid, now = os.getuid(), time.time()
    for entry in entries:
        if pattern.fullmatch(entry.name) is None:
            continue
        try:
            info = entry.lstat()
            if info.st_uid != uid or now - info.st_mtime < min_age_s or entry.is_symlink():
                continue
            lock = entry / LOCK_NAME if entry.is_dir() else entry
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its server is alive
            os.close(fd)
            continue
        try:  # removed while the lock is held: nobody starts using it meanwhile
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


#: The file in a supervisor's work directory it holds locked (:func:`hold`) while it lives.
LOCK_NAME = "lock"
