"""Isolation steps: once per zygote (namespaces, file-system view) and once per call (process confinement).

Issue 3, point 4. The zygote pays for namespaces and mounts once at start; each call then only forks and confines
the child: its own session, a high OOM score, fresh fds 0-2, rlimits, an unprivileged uid without groups and with
no_new_privs. Every function here either succeeds or raises OSError naming the failed step.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import stat

from sandbox_server import linux

WRITABLE_TEMP_DIRS = ("/tmp", "/dev/shm", "/var/tmp")
_HIDDEN_DIRS = ("/run",)
_NAMESPACES = linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWPID
_STAGING = "/tmp/.sandbox-staging"
_TMPFS_INODES = 16384  # bounds how many files a call can leave for the wipe


def enter_namespaces() -> None:
    """Unshare mount, network, IPC, UTS and PID namespaces; the caller's next child becomes PID 1 of the new one."""
    linux.unshare(_NAMESPACES)


def join_cgroups(procs_files: list[str]) -> None:
    """Move the calling process into each cgroup whose `cgroup.procs` path is given (before entering namespaces)."""
    for path in procs_files:
        with open(path, "w") as handle:
            handle.write(str(os.getpid()))


def _first_private_ancestor(path: str) -> str | None:
    """The highest directory on `path` that other users cannot traverse, or None if all of it is reachable."""
    parts = os.path.abspath(path).split("/")[1:]
    current = ""
    for part in parts:
        current += "/" + part
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def expose_to_unprivileged(paths: list[str]) -> None:
    """Make `paths` (the interpreter's prefix) readable by the slot uid inside this mount namespace.

    The machine's Python lives under /root (mode 0700). Rather than chmod the host, the zygote covers each private
    ancestor with an empty world-traversable tmpfs and binds the needed tree back into it; the rest of the private
    directory (root's secrets) disappears from the sandbox's view.
    """
    covered: dict[str, list[str]] = {}
    for path in paths:
        ancestor = _first_private_ancestor(path)
        if ancestor is not None:
            covered.setdefault(ancestor, []).append(os.path.abspath(path))
    if not covered:
        return
    linux.mount("tmpfs", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=0700,size=1m")
    for ancestor, inner_paths in covered.items():
        staged = []
        for index, inner in enumerate(inner_paths):
            stage = f"{_STAGING}-{index}"
            os.makedirs(stage, exist_ok=True)
            linux.mount(inner, stage, None, linux.MS_BIND | linux.MS_REC)
            staged.append((stage, inner))
        linux.mount("tmpfs", ancestor, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=0755,size=1m")
        for stage, inner in staged:
            os.makedirs(inner, mode=0o755, exist_ok=True)
            linux.mount(stage, inner, None, linux.MS_BIND | linux.MS_REC)
            linux.umount(stage)
    linux.umount("/tmp")


def build_file_system_view(expose: list[str], tmpfs_size_mb: int) -> None:
    """Private mounts: the whole tree read-only, fresh /proc, private writable temp dirs, empty /run.

    Must run in PID 1 of the new PID namespace (for /proc) after `enter_namespaces`.
    """
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    expose_to_unprivileged(expose)
    linux.make_tree_readonly("/")
    linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    for directory in WRITABLE_TEMP_DIRS:
        if os.path.isdir(directory):
            linux.mount(
                "tmpfs", directory, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"mode=1777,size={tmpfs_size_mb}m,nr_inodes={_TMPFS_INODES}",
            )
    for directory in _HIDDEN_DIRS:
        if os.path.isdir(directory) and not os.path.islink(directory):
            linux.mount("tmpfs", directory, "tmpfs", linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV, "size=4k")


def isolate_zygote(expose: list[str], tmpfs_size_mb: int) -> None:
    """Everything PID 1 of a fresh slot does once: file-system view, host name, loopback."""
    build_file_system_view(expose, tmpfs_size_mb)
    linux.sethostname("sandbox")
    linux.bring_loopback_up()


@dataclasses.dataclass(frozen=True)
class CallLimits:
    """Per-call resource limits applied in the child before the snippet runs."""

    memory_mb: int
    cpu_seconds: int
    max_processes: int
    max_open_files: int
    max_file_size_mb: int


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def apply_rlimits(limits: CallLimits) -> None:
    """Set AS (what the warm image already maps plus the call's budget), CPU, NPROC, FSIZE, NOFILE and CORE=0."""
    address_space = _address_space_bytes() + limits.memory_mb * 1024 * 1024
    for kind, soft, hard in (
        (resource.RLIMIT_AS, address_space, address_space),
        (resource.RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 1),
        (resource.RLIMIT_NPROC, limits.max_processes, limits.max_processes),
        (resource.RLIMIT_FSIZE, limits.max_file_size_mb * 1024 * 1024, limits.max_file_size_mb * 1024 * 1024),
        (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(kind, (soft, hard))


def attach_standard_fds(stdin_fd: int, stdout_fd: int, stderr_fd: int) -> None:
    """Make the given fds the child's 0, 1 and 2 and close every other descriptor (nothing else is inherited)."""
    for target, source in ((0, stdin_fd), (1, stdout_fd), (2, stderr_fd)):
        os.dup2(source, target)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def enter_private_ipc() -> None:
    """Give the call its own System V IPC and POSIX message-queue namespace; it dies with the call's processes,
    so no shared-memory segment or semaphore outlives the call (cheap, unlike a per-call network namespace)."""
    linux.unshare(linux.CLONE_NEWIPC)


def drop_privileges(uid: int) -> None:
    """Become `uid`/`uid` with no supplementary groups, and never regain privileges."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    linux.set_no_new_privs()


def prefer_for_oom_kill() -> None:
    """Make this process the OOM killer's first choice, so a memory bomb never takes the zygote down."""
    with open("/proc/self/oom_score_adj", "w") as handle:
        handle.write("1000")


def wipe_directory(path: str) -> None:
    """Delete everything inside `path` without following symlinks (the temp dirs after each call)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
