"""``vge`` run in this process, for the tests of its answers and its error paths.

``python -m service.cli ...`` as a subprocess costs a fresh interpreter and its torch import
(~2 s of a 2-core box each); the same ``main`` called here, with its standard streams captured,
gives the same exit status and the same output. A test of what only a real process shows (a
reader that closes the pipe, the interpreter's own traceback) keeps a subprocess; each command
keeps at least one test that runs it as one.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import traceback


def run_vge(*args: str) -> subprocess.CompletedProcess[str]:
    """``vge *args`` in this process: its exit status, stdout and stderr. An exception that
    escapes ``main`` is what the interpreter would print (a traceback, status 1), so a test that
    asserts "one line, no traceback" fails on it as it would on the real command."""
    from service.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=err)
        except Exception:
            traceback.print_exc(file=err)
            code = 1
    return subprocess.CompletedProcess(["vge", *args], code, out.getvalue(), err.getvalue())
