"""Helpers for the processes the supervisor starts (the engine and the front ends)."""

from __future__ import annotations

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
