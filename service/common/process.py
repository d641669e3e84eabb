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


def name_process(name: str) -> None:
    """Set this process's name as ``ps``, ``top`` and ``/proc/PID/comm`` show it (Linux
    ``PR_SET_NAME``, 15 bytes at most): ``vge-engine`` and ``vge-frontend`` tell the roles apart
    whether the engine was spawned or forked. Elsewhere a no-op."""
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
    """In a child forked by the supervisor: drop the supervisor's signal handlers and wake-up
    socket (they came with the fork), close the descriptors it names (its listeners and wake-up
    socket, which a child must not keep open), then take the signals the supervisor blocked
    around the fork (:meth:`service.supervisor.Supervisor.fork_child`)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
