"""Thin ctypes bindings for the Linux calls Python 3.11's `os` module lacks.

The zygote isolates itself with namespaces, mounts and prctl flags (issue 3, point 4); these are the only calls that
need libc directly. Every wrapper raises OSError with the failing call's name and errno text.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 0x40000

# x86_64 and aarch64 share the numbers of syscalls added since Linux 5.1
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442  # Linux 5.12
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 0x1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def _check(result: int, what: str) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def unshare(flags: int) -> None:
    """Move the calling process into new namespaces (unshare(2))."""
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    """mount(2) with str arguments; None passes NULL."""
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}",
    )


def clone_tree(path: str) -> int:
    """A detached recursive bind of `path` as an fd (open_tree(2) with OPEN_TREE_CLONE).

    Taken before a fresh tmpfs covers `path`'s folder, it is how a tree hidden by that tmpfs gets attached again
    inside it (no staging folder needed).
    """
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE
    result = _libc.syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(_AT_FDCWD), path.encode(), ctypes.c_uint(flags))
    return _check(result, f"open_tree {path}")


def attach_tree(tree_fd: int, target: str) -> None:
    """Mount a tree from `clone_tree` on `target` (move_mount(2))."""
    result = _libc.syscall(
        ctypes.c_long(_SYS_MOVE_MOUNT),
        ctypes.c_int(tree_fd),
        b"",
        ctypes.c_int(_AT_FDCWD),
        target.encode(),
        ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
    )
    _check(result, f"move_mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def make_tree_readonly(path: str) -> None:
    """Make the mount at `path` and every mount below it read-only and nosuid, in one call (mount_setattr(2))."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        path.encode(),
        ctypes.c_uint(_AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, f"mount_setattr {path}")


def sethostname(name: str) -> None:
    """Set the host name of the current UTS namespace."""
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")


def set_parent_death_signal(signum: int) -> None:
    """Ask the kernel to send `signum` to this process when its parent dies (PR_SET_PDEATHSIG)."""
    _check(_libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def set_no_new_privs() -> None:
    """Forbid this process and its children from ever gaining privileges (setuid binaries, file caps)."""
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def bring_loopback_up() -> None:
    """Set IFF_UP on `lo` so code in a fresh network namespace can still use 127.0.0.1 internally."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
