"""Load and failure behaviour: a 2,000-call burst, backpressure, batching, fail-over, worker crashes, shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import aiohttp
import pytest
from sandbox_http import run

from rstar_jax.processes import SandboxProcess, free_port, start_sandbox
from sandbox_server.api import RunRequest, Status
from sandbox_server.client import SandboxClient

pytestmark = pytest.mark.slow

SMALL_SERVER = ("--workers", "1", "--preload-modules", "math", "--max-queue", "4", "--default-timeout-s", "5")


@pytest.fixture(scope="module")
def small_server():
    server = start_sandbox(SMALL_SERVER)
    try:
        yield server
    finally:
        server.stop()


def _metric(server: SandboxProcess, prefix: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics") as response:
        lines = [line for line in response.read().decode().splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_burst_of_2000_calls_is_answered_completely(sandbox):
    async def burst():
        async with SandboxClient([sandbox.url], batch_size=64, batch_wait_ms=5) as client:
            return await asyncio.gather(*(client.run(f"print({i} * {i})") for i in range(2000)))

    before = _metric(sandbox, 'sandbox_completed_total{status="ok"}')
    started = time.monotonic()
    results = asyncio.run(burst())
    elapsed = time.monotonic() - started
    assert [r.status for r in results] == ["ok"] * 2000
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(2000)]
    assert _metric(sandbox, 'sandbox_completed_total{status="ok"}') - before == 2000
    assert _metric(sandbox, "sandbox_queue_depth") == 0 and _metric(sandbox, "sandbox_in_flight") == 0
    print(f"2000 calls in {elapsed:.1f} s ({2000 / elapsed:.0f} calls/s)")


def test_client_batches_by_size_and_by_wait(sandbox):
    async def calls(count, **settings):
        async with SandboxClient([sandbox.url], **settings) as client:
            return await client.run_batch([RunRequest(code=f"{i} + 1") for i in range(count)])

    before = _metric(sandbox, 'sandbox_http_requests_total{endpoint="/run_batch"}')
    results = asyncio.run(calls(20, batch_size=8, batch_wait_ms=50))
    assert [r.stdout for r in results] == [f"{i + 1}\n" for i in range(20)]
    assert _metric(sandbox, 'sandbox_http_requests_total{endpoint="/run_batch"}') - before == 3  # 8 + 8 + 4

    async def trickle():
        async with SandboxClient([sandbox.url], batch_size=64, batch_wait_ms=200) as client:
            first = asyncio.create_task(client.run("'a'"))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(client.run("'b'"))  # joins the first call's batch, still waiting
            return await asyncio.gather(first, second)

    before = _metric(sandbox, 'sandbox_http_requests_total{endpoint="/run_batch"}')
    assert [r.stdout for r in asyncio.run(trickle())] == ["'a'\n", "'b'\n"]
    assert _metric(sandbox, 'sandbox_http_requests_total{endpoint="/run_batch"}') - before == 1


def test_batch_larger_than_the_queue_bound_is_admitted_with_backpressure(small_server):
    async def calls():
        async with SandboxClient([small_server.url], batch_size=16) as client:
            return await client.run_batch([RunRequest(code=f"{i} * 3") for i in range(16)])

    assert [r.stdout for r in asyncio.run(calls())] == [f"{i * 3}\n" for i in range(16)]


def test_full_queue_is_answered_with_503_and_the_client_retries(small_server):
    async def flood_raw():
        async with aiohttp.ClientSession() as session:

            async def one():
                async with session.post(small_server.url + "/run", json={"code": "import time; time.sleep(0.05)"}) as r:
                    return r.status, await r.json()

            return await asyncio.gather(*(one() for _ in range(40)))

    answers = asyncio.run(flood_raw())
    overloaded = [body for status, body in answers if status == 503]
    assert overloaded and all(b["status"] == "rejected" and "queue is full" in b["stderr"] for b in overloaded)
    assert all(body["status"] == "ok" for status, body in answers if status == 200)

    async def flood_client():
        async with SandboxClient([small_server.url], batch_size=1, attempts=50, retry_backoff_s=0.02) as client:
            return await asyncio.gather(*(client.run("import time; time.sleep(0.02)") for _ in range(30)))

    assert [r.status for r in asyncio.run(flood_client())] == ["ok"] * 30


def test_client_spreads_batches_and_fails_over(sandbox, small_server):
    async def calls():
        urls = [_dead_url(), sandbox.url, small_server.url]
        async with SandboxClient(urls, batch_size=2, batch_wait_ms=1, retry_backoff_s=0.01) as client:
            return await asyncio.gather(*(client.run(f"print({i})") for i in range(8)))

    before = [_metric(s, "sandbox_completed_total") for s in (sandbox, small_server)]
    results = asyncio.run(calls())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
    after = [_metric(s, "sandbox_completed_total") for s in (sandbox, small_server)]
    assert all(a > b for a, b in zip(after, before))  # both live servers took batches


def test_all_servers_down_gives_unavailable_results_not_exceptions():
    async def calls():
        async with SandboxClient([_dead_url(), _dead_url()], attempts=3, retry_backoff_s=0.01) as client:
            return await asyncio.gather(client.run("print(1)"), client.run("print(2)", timeout_s=1))

    results = asyncio.run(calls())
    assert [r.status for r in results] == [Status.UNAVAILABLE] * 2
    assert not results[0].ok and "no server answered after 3 attempts" in results[0].stderr


def _zygote_launchers(server: SandboxProcess) -> list[int]:
    server_pid = server.server_pid()
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as handle:
        return [int(pid) for pid in handle.read().split()]


def test_crashed_worker_is_replaced(small_server):
    async def long_call():
        async with SandboxClient([small_server.url]) as client:
            task = asyncio.create_task(client.run("import time; time.sleep(3)"))
            await asyncio.sleep(1.0)
            for pid in _zygote_launchers(small_server):
                os.kill(pid, signal.SIGKILL)
            return await task

    result = asyncio.run(long_call())
    assert result.status == Status.KILLED and "died" in result.stderr
    deadline = time.monotonic() + 60
    while small_server.health()["workers_alive"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # replaced right away, before any further call arrives
    assert small_server.health()["workers_alive"] == 1
    assert run(small_server, "print('fresh')")["stdout"] == "fresh\n"


def test_graceful_shutdown_finishes_calls_in_flight():
    server = start_sandbox(("--workers", "1", "--preload-modules", "math"))

    async def calls_then_stop():
        async with SandboxClient([server.url], batch_size=1) as client:
            tasks = [asyncio.create_task(client.run(f"import time; time.sleep(0.5); print({i})")) for i in range(3)]
            await asyncio.sleep(0.3)
            os.kill(server.server_pid(), signal.SIGTERM)
            return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(calls_then_stop())
        assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"] and all(r.ok for r in results)
        assert server.process.wait(30) == 0
        assert server.health() is None
    finally:
        server.stop()
