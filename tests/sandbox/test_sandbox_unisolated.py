"""The explicit unisolated fallback (no namespaces or cgroups): calls still run under rlimits and are killed."""

from __future__ import annotations

import asyncio

import pytest

from sandbox_server.api import RunRequest, Status
from sandbox_server.config import SandboxConfig
from sandbox_server.pool import WorkerPool

pytestmark = pytest.mark.slow


def test_unisolated_pool_runs_answers_and_times_out():
    config = SandboxConfig(workers=1, preload_modules=("math",), default_timeout_s=1.0, allow_unisolated=True)
    answered = []

    async def scenario():
        pool = WorkerPool(config, isolate=False, on_done=lambda result, _: answered.append(result.status))
        await pool.start()
        try:
            codes = ("import math\nmath.factorial(10)", "import time\ntime.sleep(30)", "1/0", "input()")
            return [await pool.submit(RunRequest(code=code)) for code in codes]
        finally:
            await pool.drain(5.0)
            await pool.close()

    results = asyncio.run(scenario())
    assert [r.status for r in results] == [Status.OK, Status.TIMEOUT, Status.ERROR, Status.ERROR]
    assert results[0].stdout == "3628800\n" and "EOFError" in results[3].stderr
    assert answered == [r.status for r in results]
