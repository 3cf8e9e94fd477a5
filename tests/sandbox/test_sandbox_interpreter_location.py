"""The sandbox works wherever its interpreter lives (issue 13, item 1).

Every worker replaces /tmp with a private tmpfs, which used to hide a venv living there (a checkout cloned under /tmp:
"a worker failed to start: No module named 'numpy'"). Each test here starts a real server, in its own PID namespace,
with the interpreter of a venv made under /tmp: `python -m venv` of this interpreter's base (or of the system's
Python), with numpy, sympy and mpmath hard-linked (copied where links fail) into its own site-packages, and a .pth
that appends the project venv's site-packages for the server's own dependencies (aiohttp, gin). Snippets must import
the math stack from that venv, run its interpreter, and still see nothing else of the host's /tmp.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import mpmath
import numpy
import pytest
import sympy
from sandbox_http import run

from rstar_jax.processes import running_sandbox, start_sandbox

pytestmark = pytest.mark.slow

_SERVER_ARGS = ("--workers", "1", "--preload-modules", "numpy,sympy,mpmath")
_PROJECT_SITE_PACKAGES = os.path.dirname(os.path.dirname(numpy.__file__))
_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
_SYSTEM_PYTHON = f"/usr/bin/python{_VERSION}"  # same minor version: the linked numpy wheels must load in it


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another file system
        shutil.copy2(source, destination)


def _make_venv(base_python: str, venv: str) -> str:
    """A venv at `venv` holding the math stack itself and finding the server's dependencies through a .pth;
    returns its bin/python (a symlink to the base interpreter, as venv makes it)."""
    subprocess.run([base_python, "-m", "venv", "--without-pip", venv], check=True)
    site_packages = os.path.join(venv, "lib", f"python{_VERSION}", "site-packages")
    for module in (numpy, sympy, mpmath):
        package = os.path.dirname(module.__file__)
        for tree in (package, package + ".libs"):  # numpy's wheels keep their OpenBLAS in numpy.libs
            if os.path.isdir(tree):
                shutil.copytree(tree, os.path.join(site_packages, os.path.basename(tree)), copy_function=_link_or_copy)
    with open(os.path.join(site_packages, "project-packages.pth"), "w") as handle:
        handle.write(_PROJECT_SITE_PACKAGES + "\n")
    scratch = os.path.join(venv, "world-writable")
    os.mkdir(scratch)
    os.chmod(scratch, 0o1777)  # writable by the slot uid on the host: only the read-only graft stops a snippet
    return os.path.join(venv, "bin", "python")


@pytest.fixture(scope="module")
def tmp_folder() -> Iterator[str]:
    """A folder under /tmp (mode 0700, as mkdtemp makes it), with a file beside whatever the test puts there."""
    folder = tempfile.mkdtemp(prefix="rstar-venv-", dir="/tmp")
    with open(os.path.join(folder, "beside-the-venv.txt"), "w") as handle:
        handle.write("host secret")
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.fixture(scope="module")
def venv_python(tmp_folder: str) -> str:
    """The interpreter of a venv of this interpreter's base, under /tmp."""
    return _make_venv(sys.executable, os.path.join(tmp_folder, "venv"))


def _plain_venv(tmp_folder: str, venv_python: str) -> str:
    return venv_python


def _symlinked_venv_folder(tmp_folder: str, venv_python: str) -> str:
    """The same venv reached through a folder symlink in another folder under /tmp (an absolute link)."""
    links = os.path.join(tmp_folder, "links")
    os.makedirs(links, exist_ok=True)
    link = os.path.join(links, "venv")
    if not os.path.islink(link):
        os.symlink(os.path.dirname(os.path.dirname(venv_python)), link)
    return os.path.join(link, "bin", "python")


def _system_python_venv(tmp_folder: str, venv_python: str) -> str:
    """A venv of the system's Python (base prefix /usr), under /tmp."""
    if not os.path.exists(_SYSTEM_PYTHON):
        pytest.skip(f"no system Python {_SYSTEM_PYTHON} on this machine")
    venv = os.path.join(tmp_folder, "system-venv")
    if not os.path.isdir(venv):
        _make_venv(_SYSTEM_PYTHON, venv)
    return os.path.join(venv, "bin", "python")


def _probe(prefix: str, tmp_folder: str) -> str:
    """A snippet reporting where numpy came from, whether the math stack and the interpreter work after the uid
    drop, what it sees of the host's /tmp, and whether the venv's world-writable folder is writable."""
    beside = os.path.join(tmp_folder, "beside-the-venv.txt")
    return (
        "import os, subprocess, sys, numpy, sympy\n"
        "import sympy.physics.units  # not preloaded: found on disk after the fork\n"
        f"print(numpy.__file__.startswith({prefix + '/lib/'!r}), sys.executable.startswith({prefix!r}))\n"
        "print(sympy.factorint(2**64 + 1), numpy.linalg.det(numpy.eye(3)))\n"
        "child = [sys.executable, '-c', 'import numpy; print(numpy.arange(4).sum())']\n"
        "print(subprocess.run(child, capture_output=True, text=True).stdout.strip())\n"
        f"print(os.path.exists({beside!r}), sorted(os.listdir({tmp_folder!r})))\n"
        "print(sorted(os.listdir('/tmp')))\n"
        "try:\n"
        f"    open({prefix + '/world-writable/planted'!r}, 'w')\n"
        "except OSError as error:\n"
        "    print(error.strerror)\n"
        "_ = open('/tmp/left-by-a-call', 'w').write('x')\n"
    )


@pytest.mark.parametrize(
    ("make_interpreter", "seen_in_tmp_folder"),
    [(_plain_venv, ["venv"]), (_symlinked_venv_folder, ["links", "venv"]), (_system_python_venv, ["system-venv"])],
    ids=["venv", "symlinked-venv-folder", "system-python-venv"],
)
def test_venv_under_tmp_serves_the_math_stack_and_hides_host_tmp(
    tmp_folder, venv_python, make_interpreter, seen_in_tmp_folder
):
    interpreter = make_interpreter(tmp_folder, venv_python)
    prefix = os.path.dirname(os.path.dirname(interpreter))
    stray = tempfile.NamedTemporaryFile(dir="/tmp", prefix="rstar-host-tmp-")  # a host file directly in /tmp
    with stray, running_sandbox(_SERVER_ARGS, interpreter=interpreter) as server:
        for _ in range(2):  # the second call runs after the wipe, which must leave the venv in place
            body = run(server, _probe(prefix, tmp_folder))
            assert body["status"] == "ok", body
            lines = body["stdout"].splitlines()
            expected = ["True True", "{274177: 1, 67280421310721: 1} 1.0", "6", f"False {seen_in_tmp_folder}"]
            assert lines[:4] == expected, body
            tmp_listing = ast.literal_eval(lines[4])
            assert os.path.basename(tmp_folder) in tmp_listing and "left-by-a-call" not in tmp_listing, lines
            assert os.path.basename(stray.name) not in tmp_listing
            assert lines[5:] == ["Read-only file system"], body


def _start_failure(interpreter: str) -> list[str]:
    """The lines a server that must refuse to start wrote before exiting (the test fails if it started)."""
    try:
        server = start_sandbox(_SERVER_ARGS, interpreter=interpreter)
    except RuntimeError as exc:
        return str(exc).splitlines()
    server.stop()
    pytest.fail("the server started although its workers could not read their interpreter's packages")


def test_a_venv_the_workers_cannot_read_is_refused_in_one_line(venv_python):
    lib = os.path.join(os.path.dirname(os.path.dirname(venv_python)), "lib")
    os.chmod(lib, 0o700)
    try:
        lines = _start_failure(venv_python)
    finally:
        os.chmod(lib, 0o755)
    assert lines[0] == "sandbox server exited with 3:", lines
    assert len(lines) == 2 and lines[1].startswith("sandbox_server: refusing to start: the sandbox workers need ")
    assert f"other users may not read {lib} (mode 0700); run `chmod -R o+rX {lib}`" in lines[1]


def test_missing_preload_module_is_skipped_with_a_warning():
    args = ("--workers", "1", "--preload-modules", "math,no_such_module_13,numpy.no_such_sub")
    with running_sandbox(args) as server:
        assert server.health()["workers_alive"] == 1
        log = server.log_tail()
        assert "WARNING preload_modules not installed for " in log and "Traceback" not in log, log
        assert ", skipped: no_such_module_13, numpy.no_such_sub\n" in log, log
        assert run(server, "import math\nprint(math.factorial(5))")["stdout"] == "120\n"
        missing = run(server, "import no_such_module_13")
        assert missing["status"] == "error" and "ModuleNotFoundError" in missing["stderr"]
