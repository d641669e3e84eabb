"""Helpers for the processes the supervisor starts (the engine and the front ends)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys


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
    if os.getppid() == 1:  # the supervisor died before prctl took effect
        os._exit(1)


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
