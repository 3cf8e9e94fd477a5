"""A sandbox server dies with the process that started it, however that process ends (SIGKILL included): a killed
experiment leaves no server (and no PID namespace) behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTER = """
import sys, time
from rstar_jax.processes import start_sandbox
server = start_sandbox(["--workers", "1"])
print(server.process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_caller_takes_its_server_namespace_with_it() -> None:
    caller = subprocess.Popen([sys.executable, "-c", STARTER], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    namespace_pid = None
    try:
        namespace_pid = int(caller.stdout.readline())
        assert _alive(namespace_pid)
        os.kill(caller.pid, signal.SIGKILL)  # no clean-up runs in the caller
        caller.wait()
        deadline = time.monotonic() + 20
        while _alive(namespace_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(namespace_pid), "the server's namespace outlived its killed caller"
    finally:
        caller.kill()
        if namespace_pid is not None and _alive(namespace_pid):
            os.kill(namespace_pid, signal.SIGKILL)  # --kill-child: the namespace goes with it
