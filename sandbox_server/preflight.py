"""Check, before serving, that this machine lets the server isolate calls and that the workers will have what they
need (issue 3, point 4; issue 13, item 1).

Where namespaces or cgroups are unavailable (an unprivileged container) the server says so at start and refuses to
run unisolated unless explicitly allowed. Where the isolated workers could not read the interpreter or its packages
(a venv only root may read), it refuses with a line naming the path and what to do, instead of letting a worker die
on an import; preload modules that are not installed are reported, for the server to skip with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from sandbox_server import confinement
from sandbox_server.cgroups import missing_cgroup_support
from sandbox_server.pool import start_like_a_zygote

_PROBE_TIMEOUT_S = 120.0


def _namespaces_problem() -> str | None:
    """Try the zygote's unshare in a throw-away child, so the server's own process stays untouched."""
    pid = os.fork()
    if pid == 0:
        try:
            confinement.enter_namespaces()
        except OSError:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return None
    return "cannot create mount/network/IPC/UTS/PID namespaces (unshare failed)"


def isolation_problems() -> list[str]:
    """Every reason full isolation is unavailable here; empty when the server can isolate."""
    if os.geteuid() != 0:
        return ["not running as root: namespaces, cgroups and the per-slot uid need root"]
    problems = missing_cgroup_support()
    namespace_problem = _namespaces_problem()
    if namespace_problem:
        problems.append(namespace_problem)
    return problems


@dataclasses.dataclass(frozen=True)
class WorkerProbe:
    """What an interpreter started like a zygote reported: what its view would lack, which modules it lacks."""

    view_problems: list[str]
    missing_modules: list[str]


def probe_workers(preload_modules: Sequence[str], isolate: bool) -> WorkerProbe:
    """Run `sandbox_server.exposure`'s probe started exactly like a zygote, since its sys.path is the one that counts
    (the server's own may differ: its start folder, PYTHONPATH, user site-packages)."""
    request = json.dumps({"isolate": isolate, "modules": list(preload_modules)})
    probe = start_like_a_zygote("sandbox_server.exposure", [request], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = probe.communicate(timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        probe.kill()
        probe.wait()
        reason = f"the workers' interpreter {sys.executable} did not answer within {_PROBE_TIMEOUT_S} s"
        return WorkerProbe([reason], [])
    if probe.returncode != 0:
        reason = (err.decode(errors="replace").strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return WorkerProbe([f"the workers' interpreter {sys.executable} failed to start: {reason}"], [])
    return WorkerProbe(**json.loads(out.splitlines()[-1]))  # the report is the last line, whatever a .pth printed
