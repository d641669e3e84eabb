"""A parent for the tests' ``vge serve`` trees that has imported the server already (issue 35, 5).

Starting ``python -m service.cli.serve`` costs a fresh interpreter ~4.5 s of CPU before the tree
exists: torch, torchvision (which imports ``torch._dynamo``), FastAPI and the front-end app, all
imported by the supervisor so that its forked front ends share them. The suite starts about 55
trees on a 2-core box. This process imports that stack once per pytest worker and forks a
supervisor per :func:`tests.service.conftest.start_server`; what follows the fork is the real
``vge serve``: ``service.cli.serve.main(argv)`` with the test's environment, working directory
and log file, the front ends forked from the supervisor. The engine is forked too
(``VGE_ENGINE_START=fork``, which :func:`tests.service.conftest.start_server` sets for the trees
it forks here, unless a test asks for spawn): a spawned one would import torch afresh in every
tree (~2 s). Spawning still works from here (``service.cli.serve`` is made the main module, as
under ``python -m``), and the trees started as ``python -m service.cli.serve`` spawn it.

Protocol (JSON lines): the test writes ``{"argv", "env", "cwd", "log"}`` on stdin and reads
``{"request", "pid": N}`` (the request's number, as given: servers start from several threads); when a supervisor exits, ``{"exit": N, "code": C}`` follows (``C`` as
``subprocess`` reports it: negative for a signal). The zygote exits when its stdin closes.

The tests' own behaviour does not depend on it: ``VGE_TEST_ZYGOTE=0`` starts every tree as
``python -m service.cli.serve`` instead, and a few tests always do (the CLI's own start-up).
"""

from __future__ import annotations

import json
import os
import select
import sys
import traceback


def _child(request: dict[str, object]) -> None:
    """In the forked child: become ``vge serve argv`` with the request's env, cwd and log."""
    try:
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update(request["env"])  # type: ignore[arg-type]
        log = os.open(str(request["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line-buffered,
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - as PYTHONUNBUFFERED
        import service.cli.serve as serve

        # As under `python -m service.cli.serve`: the engine's spawn re-imports this main module.
        sys.modules["__main__"] = serve
        sys.argv = [serve.__file__ or "serve.py", *request["argv"]]  # type: ignore[misc]
        code = serve.main(list(request["argv"]))  # type: ignore[call-overload]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a traceback in the log, as python -m would print
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit under `python -m` (multiprocessing joins and stops its
    # children, logging flushes), then out without unwinding into the zygote's loop.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    # What the supervisor would import: once, here (the supervisor re-resolves prometheus-client's
    # value class when it was imported before PROMETHEUS_MULTIPROC_DIR was set).
    import service.cli.serve  # noqa: F401
    import service.frontend.app  # noqa: F401
    import service.supervisor  # noqa: F401

    out = sys.stdout
    children: set[int] = set()
    buffer = b""
    stdin = sys.stdin.buffer.raw  # type: ignore[attr-defined]
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                return  # the pytest worker is gone: its trees are stopped by their tests
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children.add(pid)
                out.write(json.dumps({"request": request["request"], "pid": pid}) + "\n")
                out.flush()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                out.write(json.dumps({"exit": pid, "code": code}) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
