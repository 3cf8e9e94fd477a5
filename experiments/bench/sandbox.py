"""Benchmark the sandbox server against a fresh `python3` per call (issue 3, "must show").

For a trivial snippet and a sympy snippet: calls/s and p50/p99 client-side latency at several concurrency levels
through the batching client, plus the same snippets run as one fresh interpreter per call (the code-judge design
of the paper's release, SPEC section 6) measured in the same run. Nothing may be lost: every call must come back ok.

    .venv/bin/python -m experiments.bench.sandbox --json artifacts/bench_sandbox.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from rstar_jax.processes import SandboxProcess, running_sandbox
from sandbox_server.api import Status
from sandbox_server.client import SandboxClient
from sandbox_server.pool import zygote_environment

SNIPPETS = {
    "trivial": "print(1+1)",
    "sympy": "import sympy\nprint(sympy.factorint(2**64 + 1))",
}
DEFAULT_LEVELS = (1, 64, 1024, 10_000)


def _calls_at(concurrency: int) -> int:
    """Enough calls for stable percentiles, at least one full wave of the concurrency level."""
    return max(4 * concurrency, 200) if concurrency < 1024 else concurrency


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _drive(call: Callable[[], Awaitable[str]], total: int, concurrency: int) -> dict[str, Any]:
    """Issue `total` calls with at most `concurrency` outstanding; time each from issue to answer."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    statuses: list[str] = []

    async def one() -> None:
        async with gate:
            started = time.perf_counter()
            statuses.append(await call())
            latencies.append((time.perf_counter() - started) * 1000.0)

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    wall = time.perf_counter() - started
    return {
        "calls": total,
        "concurrency": concurrency,
        "calls_per_s": round(total / wall, 2),
        "p50_ms": round(_percentile(latencies, 0.5), 2),
        "p99_ms": round(_percentile(latencies, 0.99), 2),
        "lost": sum(status != Status.OK for status in statuses),
        "wall_s": round(wall, 2),
    }


async def bench_sandbox(server: SandboxProcess, code: str, levels: Sequence[int]) -> list[dict[str, Any]]:
    """One row per concurrency level, through the batching client."""
    rows = []
    async with SandboxClient([server.url], batch_size=64, batch_wait_ms=1.0) as client:
        await client.run(code)  # warm the HTTP connection

        async def call() -> str:
            return (await client.run(code)).status

        for level in levels:
            rows.append(await _drive(call, _calls_at(level), level))
    return rows


async def bench_raw_burst(server: SandboxProcess, code: str, total: int) -> dict[str, Any]:
    """`total` simultaneous plain `/run` requests, one connection each, no client batching or retries."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=1800)
    ) as session:

        async def call() -> str:
            try:
                async with session.post(server.url + "/run", json={"code": code}) as response:
                    return (await response.json())["status"]
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return f"lost: {type(exc).__name__}"

        return await _drive(call, total, total)


async def bench_fresh_interpreter(code: str, total: int, concurrency: int) -> dict[str, Any]:
    """The baseline: `python -c CODE` per call, same interpreter and environment, no isolation."""
    env = zygote_environment()

    async def call() -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
        )
        await process.communicate()
        return Status.OK if process.returncode == 0 else Status.ERROR

    return await _drive(call, total, concurrency)


def _server_rss_mb(server: SandboxProcess) -> float:
    pid = server.server_pid()
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def run_benchmark(
    server: SandboxProcess, levels: Sequence[int], baseline_calls: int, raw_burst: int
) -> dict[str, Any]:
    """Measure every snippet on the server and with the baseline; return the report."""
    cores = os.cpu_count() or 1
    report: dict[str, Any] = {"cores": cores, "snippets": {}}
    for name, code in SNIPPETS.items():
        baseline = {
            "latency": await bench_fresh_interpreter(code, max(5, baseline_calls // 2), 1),
            "throughput": await bench_fresh_interpreter(code, baseline_calls, cores),
        }
        rows = await bench_sandbox(server, code, levels)
        best = max(row["calls_per_s"] for row in rows)
        report["snippets"][name] = {
            "code": code,
            "sandbox": rows,
            "fresh_python": baseline,
            "speedup_vs_fresh_python": round(best / baseline["throughput"]["calls_per_s"], 1),
        }
    if raw_burst:
        report["raw_run_burst"] = await bench_raw_burst(server, SNIPPETS["trivial"], raw_burst)
    report["server_rss_mb_after"] = round(_server_rss_mb(server), 1)
    return report


def format_table(report: dict[str, Any]) -> str:
    """The printed summary: one line per (snippet, setting)."""
    lines = [f"{'snippet':8} {'setting':22} {'calls':>6} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'lost':>5}"]
    for name, entry in report["snippets"].items():
        base = entry["fresh_python"]
        for label, row in (("fresh python3, c=1", base["latency"]),
                           (f"fresh python3, c={base['throughput']['concurrency']}", base["throughput"])):  # fmt: skip
            lines.append(f"{name:8} {label:22} {row['calls']:>6} {row['calls_per_s']:>8} {row['p50_ms']:>8} "
                         f"{row['p99_ms']:>8} {row['lost']:>5}")  # fmt: skip
        for row in entry["sandbox"]:
            lines.append(f"{name:8} {'sandbox, c=' + str(row['concurrency']):22} {row['calls']:>6} "
                         f"{row['calls_per_s']:>8} {row['p50_ms']:>8} {row['p99_ms']:>8} {row['lost']:>5}")  # fmt: skip
        lines.append(f"{name:8} speedup (best sandbox calls/s over fresh python3): {entry['speedup_vs_fresh_python']}x")
    if "raw_run_burst" in report:
        row = report["raw_run_burst"]
        lines.append(f"{'trivial':8} {'raw /run, c=' + str(row['concurrency']):22} {row['calls']:>6} "
                     f"{row['calls_per_s']:>8} {row['p50_ms']:>8} {row['p99_ms']:>8} {row['lost']:>5}")  # fmt: skip
    lines.append(f"server RSS after the run: {report['server_rss_mb_after']} MB")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Start a server in its own PID namespace, benchmark it, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)), help="concurrency levels")
    parser.add_argument("--baseline-calls", type=int, default=20, help="calls of the fresh-interpreter baseline")
    parser.add_argument("--raw-burst", type=int, default=10_000, help="simultaneous plain /run calls (0: skip)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for the server (repeatable)")
    args = parser.parse_args(argv)
    levels = [int(level) for level in args.levels.split(",")]
    with running_sandbox(args.server_arg) as server:
        report = asyncio.run(run_benchmark(server, levels, args.baseline_calls, args.raw_burst))
        report["server_args"] = args.server_arg
    print(format_table(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    lost = sum(row["lost"] for entry in report["snippets"].values() for row in entry["sandbox"])
    lost += report.get("raw_run_burst", {}).get("lost", 0)
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
