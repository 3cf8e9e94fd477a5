"""Small HTTP helpers the sandbox tests share (stdlib only, so they never depend on the client under test)."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from rstar_jax.processes import SandboxProcess
import sandbox_server

SERVER_SECRET = ("RSTAR_SANDBOX_TEST_SECRET", "do-not-leak-4f1c")  # put in the server's environment by conftest
# uids of the session server's four slots: a range of its own, so other servers on the machine never overlap
SERVER_UID_BASE = 40_000 + (os.getpid() % 2_000) * 8
SERVER_UIDS = range(SERVER_UID_BASE, SERVER_UID_BASE + 4)


def fresh_tmp_listing() -> list[str]:
    """What /tmp holds, sorted, in a worker of a server this interpreter runs from this checkout before any call:
    nothing, unless the venv or the checkout lies under /tmp (then its first folder there, bound back read-only)."""
    needed = (sys.prefix, sys.executable, os.path.dirname(sandbox_server.__file__))
    paths = {form for path in needed for form in (os.path.abspath(path), os.path.realpath(path))}
    return sorted({path.split("/")[2] for path in paths if path.startswith("/tmp/")})


def post(server: SandboxProcess, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    """POST JSON (or raw bytes) and return (HTTP status, decoded body), error statuses included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def run(server: SandboxProcess, code: str, **fields: Any) -> dict[str, Any]:
    """One /run call that must be answered with HTTP 200."""
    status, body = post(server, "/run", {"code": code, **fields})
    assert status == 200, body
    return body
