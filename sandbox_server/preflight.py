"""Check, before serving, that this machine lets the server isolate calls (issue 3, point 4).

Where namespaces or cgroups are unavailable (an unprivileged container) the server says so at start and refuses to
run unisolated unless explicitly allowed.
"""

from __future__ import annotations

import os

from sandbox_server import confinement
from sandbox_server.cgroups import missing_cgroup_support


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
