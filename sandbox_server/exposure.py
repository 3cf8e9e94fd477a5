"""What of the host the workers must still see in their private file-system view, and whether they can.

Issue 13, item 1. Each zygote replaces /tmp, /dev/shm, /var/tmp and /run with fresh tmpfs mounts, and covers each
folder other users cannot enter on the way to what it needs (/root, where the machine's Python lives) with an empty
one. The interpreter and its packages may live in any of those places (a venv in a checkout under /tmp, a conda under
/root) and be reached through symlinks (a venv's bin/python, a venv folder that is itself a link). `plan_view` works
out, from the paths a worker needs, which symlinks to recreate and which real trees to bind back, read-only, into
those fresh mounts: the workers see exactly that and nothing else of the replaced folders. `view_problems` says, one
line per blocking folder, what the unprivileged slot uid still could not read and what to do about it.

`python -m sandbox_server.exposure REQUEST_JSON` is the server's preflight probe: started exactly like a zygote (so
its sys.path is the zygote's), it prints those problems and the preload modules this interpreter lacks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import stat
import sys
from collections.abc import Sequence

_WRITABLE_TEMP_DIRS = ("/tmp", "/dev/shm", "/var/tmp")
_HIDDEN_DIRS = ("/run",)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_MAX_SYMLINKS = 40  # the kernel's limit while resolving one path


@dataclasses.dataclass(frozen=True)
class Resolution:
    """How a path resolves: the symlinks met on the way (their own path and target as written) and the real path."""

    links: tuple[tuple[str, str], ...]
    real: str


@dataclasses.dataclass(frozen=True)
class ViewPlan:
    """What a zygote mounts so its workers see the interpreter wherever it lives.

    private_covers: folders other users cannot enter, each covered by an empty world-traversable tmpfs.
    grafts: real paths inside a replaced folder (a cover or a fixed one), bound back read-only at the same place.
    links: symlinks inside a replaced folder that lead to what is needed, recreated as they are on the host.
    """

    private_covers: tuple[str, ...]
    grafts: tuple[str, ...]
    links: tuple[tuple[str, str], ...]

    def grafts_under(self, folder: str) -> tuple[str, ...]:
        """The grafts that belong inside `folder` once it has been replaced."""
        return tuple(path for path in self.grafts if _strictly_inside(path, folder))

    def links_under(self, folder: str) -> tuple[tuple[str, str], ...]:
        """The symlinks to recreate inside `folder` once it has been replaced."""
        return tuple(link for link in self.links if _strictly_inside(link[0], folder))

    def kept_names(self, folder: str) -> frozenset[str]:
        """Entries directly in `folder` that hold grafts or links: the per-call wipe must leave them alone."""
        paths = [*self.grafts_under(folder), *(path for path, _ in self.links_under(folder))]
        return frozenset(path[len(folder) :].split("/")[1] for path in paths)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _strictly_inside(path: str, folder: str) -> bool:
    return path != folder and _inside(path, folder)


def needed_paths() -> list[str]:
    """Everything a zygote and its calls read from the host: the prefixes, the interpreter, each import path entry.

    Call it in a process started like a zygote (`python -s -m ...`): there sys.path[0] is the folder it started in,
    the checkout, of which the workers need only this package, so the rest of a checkout under /tmp stays hidden.
    """
    candidates = [
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, sys.executable, *sys.path[1:], _PACKAGE_DIR,
    ]  # fmt: skip
    absolute = (os.path.join(os.getcwd(), path) for path in candidates if path)
    return list(dict.fromkeys(path for path in absolute if os.path.exists(path)))


def resolve(path: str) -> Resolution:
    """Follow an existing absolute `path` one component at a time, as the kernel does, noting each symlink met."""
    links: list[tuple[str, str]] = []
    pending = [part for part in reversed(path.split("/")) if part not in ("", ".")]
    current = "/"
    while pending:
        part = pending.pop()
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if not os.path.islink(candidate):
            current = candidate
            continue
        if len(links) == _MAX_SYMLINKS:
            raise OSError(f"too many levels of symbolic links resolving {path}")
        target = os.readlink(candidate)
        links.append((candidate, target))
        if target.startswith("/"):
            current = "/"
        pending.extend(part for part in reversed(target.split("/")) if part not in ("", "."))
    return Resolution(tuple(links), current)


def _first_private_ancestor(path: str) -> str | None:
    """The highest folder on the real `path` (itself included) that other users cannot enter, or None."""
    current = ""
    for part in path.split("/")[1:]:
        current += "/" + part
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def temp_folders() -> list[str]:
    """The temp folders here that every zygote replaces with a fresh writable tmpfs (wiped after each call)."""
    return [folder for folder in _WRITABLE_TEMP_DIRS if os.path.isdir(folder)]


def hidden_folders() -> list[str]:
    """The folders here that every zygote replaces with a fresh read-only tmpfs (a symlink is left as it is)."""
    return [folder for folder in _HIDDEN_DIRS if os.path.isdir(folder) and not os.path.islink(folder)]


def _fixed_folders() -> list[str]:
    """The folders every zygote replaces with a fresh tmpfs, whatever the interpreter needs."""
    return [*temp_folders(), *hidden_folders()]


def _reached(resolution: Resolution) -> list[tuple[str, bool]]:
    """The real paths a worker walks to for one needed path: each symlink's folder (to enter), then the real path
    (to read); each with whether it must be readable."""
    return [(os.path.dirname(link), False) for link, _ in resolution.links] + [(resolution.real, True)]


def _plan(resolutions: Sequence[Resolution]) -> ViewPlan:
    fixed = _fixed_folders()
    reached = [path for resolution in resolutions for path, _ in _reached(resolution)]
    private = {
        ancestor
        for path in reached
        if not any(_inside(path, folder) for folder in fixed) and (ancestor := _first_private_ancestor(path))
    }
    replaced = [*fixed, *private]
    reals = {r.real for r in resolutions if any(_strictly_inside(r.real, folder) for folder in replaced)}
    grafts = sorted(path for path in reals if not any(_strictly_inside(path, other) for other in reals))
    links = sorted({
        link
        for resolution in resolutions
        for link in resolution.links
        if any(_strictly_inside(link[0], folder) for folder in replaced)
        and not any(_inside(link[0], graft) for graft in grafts)
    })  # fmt: skip
    return ViewPlan(tuple(sorted(private)), tuple(grafts), tuple(links))


def plan_view(paths: Sequence[str]) -> ViewPlan:
    """The mounts that make the existing absolute `paths` visible to the workers (see `ViewPlan`)."""
    return _plan([resolve(path) for path in paths])


def _is_fresh(folder: str, plan: ViewPlan) -> bool:
    """Whether the worker sees `folder` as a new tmpfs or a folder the zygote made in one (not the host's own)."""
    replaced = [*_fixed_folders(), *plan.private_covers]
    in_replaced = any(_inside(folder, other) for other in replaced)
    return in_replaced and not any(_inside(folder, graft) for graft in plan.grafts)


def _blocked(path: str, needed: str, plan: ViewPlan, must_read: bool) -> tuple[str, str] | None:
    """Where and why the slot uid could not reach the real `path` (enter each folder on the way; read `path` itself
    if `must_read`): (the folder, one line saying what to do), or None. `needed` is the path the workers use."""
    if must_read and path in _fixed_folders():
        return path, (
            f"the sandbox workers need {needed}, but {path} is replaced by an empty private folder in every worker; "
            "install what is there in a folder below it"
        )
    prefixes = ["/".join(path.split("/")[: i + 1]) for i in range(1, path.count("/") + 1)]
    for folder in prefixes:
        read = must_read and folder == path
        if _is_fresh(folder, plan) and not (read and folder in plan.private_covers):
            continue
        mode = os.stat(folder).st_mode
        required = (stat.S_IXOTH if stat.S_ISDIR(mode) else 0) | (stat.S_IROTH if read else 0)
        if mode & required != required:
            return folder, (
                f"the sandbox workers need {needed}, but other users may not read {folder} (mode "
                f"{stat.S_IMODE(mode):04o}); run `chmod -R o+rX {folder}` or keep the Python environment in a "
                "folder all users can read"
            )
    return None


def view_problems(paths: Sequence[str]) -> list[str]:
    """What the workers still could not read after `plan_view`'s mounts: one line per blocking folder, naming it, a
    path that needs it, and what to do."""
    resolutions = [resolve(path) for path in paths]
    plan = _plan(resolutions)
    problems: dict[str, str] = {}
    for path, resolution in zip(paths, resolutions):
        for reached, must_read in _reached(resolution):
            blocked = _blocked(reached, path, plan, must_read)
            if blocked is not None:
                problems.setdefault(*blocked)
                break
    return list(problems.values())


def missing_modules(names: Sequence[str]) -> list[str]:
    """The modules among `names` that this interpreter cannot find (not installed), found without importing them."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def probe_report(isolate: bool, modules: Sequence[str]) -> dict[str, list[str]]:
    """What the preflight needs to know from an interpreter started like a zygote."""
    return {
        "view_problems": view_problems(needed_paths()) if isolate else [],
        "missing_modules": missing_modules(modules),
    }


if __name__ == "__main__":
    print(json.dumps(probe_report(**json.loads(sys.argv[1]))))
