"""service/common/process.py: what the supervisor's children do about their parent, and the
addresses they listen on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from service.common.process import SUPERVISOR_PID_ENV, host_port
from tests.service.conftest import REPO

CHILD = "from service.common.process import die_with_parent; die_with_parent(); print('alive')"


def test_a_child_lives_while_its_parent_is_the_supervisor() -> None:
    """The child compares its parent with the supervisor's pid (it left it in the environment):
    the same, it runs; another (the supervisor died before the death signal was set, the child
    was re-parented), it exits at once."""
    for supervisor, alive in ((os.getpid(), True), (os.getpid() + 1_000_000, False)):
        env = {**os.environ, SUPERVISOR_PID_ENV: str(supervisor)}
        done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (done.returncode, done.stdout.strip()) == ((0, "alive") if alive else (1, "")), (
            done.stderr
        )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a new pid namespace needs root and util-linux's unshare",
)
def test_a_supervisor_that_is_pid_1_keeps_its_children() -> None:
    """Found by review (2026-11-29): in a container without an init (the Dockerfile's
    ENTRYPOINT vge serve, the Kubernetes Deployment) the supervisor is pid 1, and every child
    took "my parent is pid 1" for "my parent died": the server could not start. Here a pid
    namespace makes this test's Python pid 1, and its child must live."""
    script = (
        "import os, sys\n"
        f"os.environ[{SUPERVISOR_PID_ENV!r}] = str(os.getpid())\n"
        "assert os.getpid() == 1\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        f"    exec({CHILD!r}); os._exit(7)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 7 and "alive" in done.stdout, (done.returncode, done.stderr)


def test_an_ipv6_host_is_bracketed() -> None:
    """gRPC read "::1:50051" as a host name and never listened (front ends failed five times,
    the server exited 1); the start-up line printed an unusable URL."""
    assert host_port("::1", 50051) == "[::1]:50051"
    assert host_port("::", 8000) == "[::]:8000"
    assert host_port("127.0.0.1", 8000) == "127.0.0.1:8000"
    assert host_port("[::1]", 1) == "[::1]:1"
