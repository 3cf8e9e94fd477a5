"""Per-slot cgroup v1 groups (pids and memory), managed from the server's (host) view.

Issue 3, point 4: RLIMIT_NPROC does not bind root and RLIMIT_AS is per process, so a slot's process count and its
summed memory are capped by cgroups. Each server creates its groups under its own cgroup in each hierarchy, with a
unique name, and removes them at shutdown.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import signal
import time

log = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"
_CONTROLLERS = ("pids", "memory")


def _own_cgroup_path(controller: str) -> str:
    """This process's cgroup in the v1 hierarchy of `controller`, as a path under CGROUP_ROOT."""
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return os.path.join(CGROUP_ROOT, controller, path.lstrip("/"))
    raise OSError(errno.ENOENT, f"no cgroup v1 '{controller}' hierarchy in /proc/self/cgroup")


def missing_cgroup_support() -> list[str]:
    """Reasons cgroup v1 pids/memory control is unusable here; empty when the server can create slot groups."""
    problems = []
    for controller in _CONTROLLERS:
        try:
            base = _own_cgroup_path(controller)
        except OSError as exc:
            problems.append(str(exc))
            continue
        if not os.access(base, os.W_OK):
            problems.append(f"cannot create cgroups under {base} (not writable)")
    return problems


@dataclasses.dataclass
class SlotCgroups:
    """The pids and memory groups of one pool slot."""

    pids_dir: str
    memory_dir: str
    baseline_bytes: int = 0
    memory_limit_bytes: int = -1

    @property
    def procs_files(self) -> list[str]:
        """`cgroup.procs` files a zygote writes itself into."""
        return [os.path.join(self.pids_dir, "cgroup.procs"), os.path.join(self.memory_dir, "cgroup.procs")]

    def set_max_processes(self, count: int) -> None:
        """Cap the number of live processes (zygote included)."""
        _write(os.path.join(self.pids_dir, "pids.max"), str(count))

    def memory_usage_bytes(self) -> int:
        """Memory charged to the slot now."""
        with open(os.path.join(self.memory_dir, "memory.usage_in_bytes")) as handle:
            return int(handle.read())

    def record_baseline(self) -> None:
        """Remember what the warm zygote holds; per-call budgets are added on top of it."""
        self.baseline_bytes = self.memory_usage_bytes()

    def limit_call_memory(self, memory_mb: int) -> None:
        """Let the next call use `memory_mb` MiB, summed over all its processes, beyond the zygote's baseline."""
        limit = self.baseline_bytes + memory_mb * 1024 * 1024
        if limit != self.memory_limit_bytes:
            try:
                _write(os.path.join(self.memory_dir, "memory.limit_in_bytes"), str(limit))
            except OSError as exc:  # EBUSY: usage above the new limit could not be reclaimed
                log.warning("slot memory limit stays at %d bytes (wanted %d): %s", self.memory_limit_bytes, limit, exc)
                return
            self.memory_limit_bytes = limit


class CgroupTree:
    """The groups of one server: `<own cgroup>/rstar-sandbox-<pid>-<random>/slot-<i>` in each hierarchy."""

    def __init__(self) -> None:
        name = f"rstar-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        self.roots = {c: os.path.join(_own_cgroup_path(c), name) for c in _CONTROLLERS}
        for root in self.roots.values():
            os.mkdir(root)

    def slot(self, index: int) -> SlotCgroups:
        """Create (or reuse) the groups of slot `index`."""
        dirs = {}
        for controller, root in self.roots.items():
            dirs[controller] = os.path.join(root, f"slot-{index}")
            os.makedirs(dirs[controller], exist_ok=True)
        return SlotCgroups(pids_dir=dirs["pids"], memory_dir=dirs["memory"])

    def remove(self, wait_s: float = 5.0) -> None:
        """Kill whatever is left in the slot groups, then remove them and the server's root groups.

        A dying zygote's namespace empties asynchronously, so removal retries until `wait_s` has passed.
        """
        deadline = time.monotonic() + wait_s
        for root in self.roots.values():
            if not os.path.isdir(root):
                continue
            for entry in os.scandir(root):
                if entry.is_dir():
                    _remove_group(entry.path, deadline)
            _remove_group(root, deadline)


def _remove_group(path: str, deadline: float) -> None:
    while True:
        with open(os.path.join(path, "cgroup.procs")) as handle:
            for pid in handle.read().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.rmdir(path)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)
