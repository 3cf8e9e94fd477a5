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

from sandbox_server import exposure, linux

_NAMESPACES = linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWPID
_TMPFS_INODES = 16384  # bounds how many files a call can leave for the wipe


def enter_namespaces() -> None:
    """Unshare mount, network, IPC, UTS and PID namespaces; the caller's next child becomes PID 1 of the new one."""
    linux.unshare(_NAMESPACES)


def join_cgroups(procs_files: list[str]) -> None:
    """Move the calling process into each cgroup whose `cgroup.procs` path is given (before entering namespaces)."""
    for path in procs_files:
        with open(path, "w") as handle:
            handle.write(str(os.getpid()))


def _make_folders(path: str) -> None:
    """Create `path` and its missing parents inside a fresh tmpfs: root-owned and mode 0755 whatever the umask, so
    the slot uid can walk through them and never change them."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        os.mkdir(folder)
        os.chmod(folder, 0o755)


def _graft_into(folder: str, plan: exposure.ViewPlan, trees: dict[str, int]) -> None:
    """Inside the just-mounted tmpfs at `folder`, recreate the plan's symlinks and attach its trees read-only."""
    for link, target in plan.links_under(folder):
        _make_folders(os.path.dirname(link))
        os.symlink(target, link)
    for path in plan.grafts_under(folder):
        _make_folders(os.path.dirname(path))
        tree = trees.pop(path)
        if stat.S_ISDIR(os.fstat(tree).st_mode):
            os.mkdir(path)
        else:
            open(path, "x").close()
        linux.attach_tree(tree, path)
        os.close(tree)
        linux.make_tree_readonly(path)


def _replace_with_tmpfs(folder: str, options: str, plan: exposure.ViewPlan, trees: dict[str, int]) -> None:
    """Mount a fresh tmpfs on `folder`, then put back what the plan needs from beneath it."""
    linux.mount("tmpfs", folder, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, options)
    _graft_into(folder, plan, trees)


def build_file_system_view(plan: exposure.ViewPlan, tmpfs_size_mb: int) -> None:
    """Private mounts: the whole tree read-only, fresh /proc, private writable temp dirs, empty /run, and root-only
    folders replaced by empty ones; into those fresh folders goes back, read-only, only what `plan` names (the
    interpreter and its packages, wherever they live).

    Must run in PID 1 of the new PID namespace (for /proc) after `enter_namespaces`.
    """
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    trees = {path: linux.clone_tree(path) for path in plan.grafts}  # before any tmpfs hides them
    for folder in plan.private_covers:
        _replace_with_tmpfs(folder, "mode=0755,size=1m", plan, trees)
    linux.make_tree_readonly("/")
    linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    for folder in exposure.temp_folders():
        _replace_with_tmpfs(folder, f"mode=1777,size={tmpfs_size_mb}m,nr_inodes={_TMPFS_INODES}", plan, trees)
    for folder in exposure.hidden_folders():
        _replace_with_tmpfs(folder, "mode=0755,size=1m", plan, trees)
        linux.make_tree_readonly(folder)


def isolate_zygote(plan: exposure.ViewPlan, tmpfs_size_mb: int) -> None:
    """Everything PID 1 of a fresh slot does once: file-system view, host name, loopback."""
    build_file_system_view(plan, tmpfs_size_mb)
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


def wipe_directory(path: str, keep: frozenset[str] = frozenset()) -> None:
    """Delete everything inside `path` but the entries named in `keep` (the read-only interpreter trees grafted into
    a temp dir), without following symlinks (the temp dirs after each call)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name in keep:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
