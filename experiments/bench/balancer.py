"""Rollout balancer policies in the fleet simulator (SPEC section 6; issue 10): makespan, throughput, preemptions.

One simulated RL rollout batch (`rstar_jax.rollout.sim_workload.Workload`: prompts x samples multi-turn
trajectories with long-tailed lengths and tool calls, from --seed) is rolled out over --engines simulated engines
of one calibrated profile (`rstar_jax.rollout.sim_profiles`, default gpu_h100) once per policy, each time through
the real `Balancer` in virtual time. Per policy: makespan of the rollout phase, generated-token throughput,
preemptions and the tokens they made the engines recompute, prefix-cache hit rate, engine idle fraction, mean
running batch, KV utilisation, trajectory latency p50/p99/max, the balancer's longest queue. Ratios: kv_aware's
throughput over static_split's and over least_requests'. Policies run in parallel processes (--workers).

    python -m experiments.bench.balancer --engines 64 --prompts 512 --samples 32 --json artifacts/bench_balancer.json
    python -m experiments.bench.balancer --engines 8 --prompts 64 --samples 8 --policies kv_aware,static_split

`--replay PATH` instead predicts a recorded real-server run (`balancer_servers --workload kv_pressure --json
PATH`, issue 26 item 3): each policy's recorded trajectories replayed over simulated engines of the profile fitted
to those servers, with the same balancer settings; the prediction's tokens/s beside the measured.

    python -m experiments.bench.balancer --replay artifacts/bench_balancer_pressure.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from rstar_jax.rollout.balancing import POLICIES
from rstar_jax.rollout.sim_profiles import PROFILES, profile
from rstar_jax.rollout.sim_engine import EngineProfile
from rstar_jax.rollout.sim_workload import TrajectoryPlan, Workload
from rstar_jax.rollout.simulate import simulate

WHOLE_TURNS = "kv_aware_whole_turns"  # ablation: kv_aware reserving each turn's whole budget (no parts)
CHOICES = (*POLICIES, WHOLE_TURNS)
COLUMNS = (("throughput_tokens_per_s", "tokens/s", "{:,.0f}"), ("makespan_s", "makespan s", "{:.1f}"),
           ("preemptions", "preemptions", "{:,}"), ("recomputed_tokens", "recomputed", "{:,}"),
           ("prefix_hit_rate", "prefix hits", "{:.1%}"), ("idle_fraction", "idle", "{:.1%}"),
           ("mean_batch", "batch", "{:.0f}"), ("kv_utilization", "KV used", "{:.1%}"),
           ("latency_p50_s", "p50 s", "{:.0f}"), ("latency_p99_s", "p99 s", "{:.0f}"),
           ("max_queue", "max queue", "{:,}"))


def run_policy(name: str, engines: int, profile_name: str, workload: Workload,
               part_tokens: int | None) -> dict[str, Any]:
    """One policy's figures (a worker process runs this)."""
    policy, parts = ("kv_aware", None) if name == WHOLE_TURNS else (name, part_tokens)
    result = simulate(policy, [profile(profile_name)] * engines, workload, part_tokens=parts)
    return {**result.figures(), "policy": name}


def run_benchmark(names: Sequence[str], engines: int, profile_name: str, workload: Workload,
                  part_tokens: int | None, workers: int) -> dict[str, Any]:
    """Every policy's figures, the target ratios and the set-up, as one JSON-able dict."""
    unknown = sorted(set(names) - set(CHOICES))
    if unknown or not names:
        raise ValueError(f"unknown or no policies {unknown or list(names)}; choose from {CHOICES}")
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # not fork: the caller may hold threads (JAX in a test run)
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, min(workers, len(names))),
                                                mp_context=context) as pool:
        futures = {name: pool.submit(run_policy, name, engines, profile_name, workload, part_tokens)
                   for name in names}
        policies = {name: future.result() for name, future in futures.items()}
    return {
        "policies": policies,
        "ratios": ratios(policies),
        "setup": {"engines": engines, "profile": dataclasses.asdict(profile(profile_name)),
                  "workload": dataclasses.asdict(workload), "part_tokens": part_tokens},
        "environment": {"wall_s": time.perf_counter() - start, "workers": workers, "cpu_count": os.cpu_count(),
                        "load_average_1m": os.getloadavg()[0]},
    }


def ratios(policies: dict[str, dict[str, Any]]) -> dict[str, float]:
    """kv_aware's throughput over each other policy's (the issue's targets: >= 1.5 over static_split, > 1 over
    least_requests)."""
    if "kv_aware" not in policies:
        return {}
    mine = policies["kv_aware"]["throughput_tokens_per_s"]
    return {f"kv_aware_vs_{name}": mine / figures["throughput_tokens_per_s"]
            for name, figures in policies.items() if name != "kv_aware"}


def format_report(result: dict[str, Any]) -> str:
    """The markdown table of `run_benchmark`'s result, then the ratios."""
    setup, environment = result["setup"], result["environment"]
    workload = setup["workload"]
    lines = [f"balancer benchmark: {setup['engines']} x {setup['profile']['name']} engines, {workload['prompts']} "
             f"prompts x {workload['samples']} samples, budget {workload['max_response_tokens']} tokens, "
             f"parts of {setup['part_tokens']} tokens; {environment['wall_s']:.1f} s wall, load average "
             f"{environment['load_average_1m']:.1f}", "",
             "| policy | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for name, figures in result["policies"].items():
        lines.append(f"| {name} | " + " | ".join(form.format(figures[key]) for key, _, form in COLUMNS) + " |")
    if result["ratios"]:
        lines += ["", "throughput ratios: " + ", ".join(f"{name} {value:.2f}x"
                                                       for name, value in result["ratios"].items())]
    return "\n".join(lines)


def predict_recorded(recorded: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The simulator's prediction of a recorded KV-pressure run (`balancer_servers`' JSON): per policy, its
    figures replaying that policy's trajectories over the run's servers as fitted profiles, and the relative
    error of its tokens/s against the measured (issue 26 item 3)."""
    setup = recorded["setup"]
    fleet = [EngineProfile(**recorded["calibration"]["profile"])] * len(recorded["kv_tokens"])
    workload = Workload(prompts=setup["problems"], samples=setup["samples"], max_response_tokens=setup["budget"])
    predicted = {}
    for name, measured in recorded["policies"].items():
        plans = [TrajectoryPlan(**{**plan, **{key: tuple(plan[key]) for key in
                                              ("turn_tokens", "tool_tokens", "tool_latency_s")}})
                 for plan in measured["plans"]]
        result = simulate(name, fleet, workload, plans=plans, part_tokens=setup["part_tokens"] or None,
                          scrape_interval_s=setup["scrape_interval_s"])
        figures = result.figures()
        predicted[name] = {**figures, "error": figures["throughput_tokens_per_s"]
                           / measured["throughput_tokens_per_s"] - 1}
    return predicted


def format_replay(recorded: dict[str, Any], predicted: dict[str, dict[str, Any]]) -> str:
    """Measured against simulated, per policy."""
    lines = ["| policy | measured tokens/s | simulated tokens/s | error | measured preemptions | simulated preemptions "
             "| measured s | simulated s |", "|---|---|---|---|---|---|---|---|"]
    for name, figures in predicted.items():
        measured = recorded["policies"][name]
        lines.append(f"| {name} | {measured['throughput_tokens_per_s']:,.0f} | "
                     f"{figures['throughput_tokens_per_s']:,.0f} | {figures['error']:+.1%} | "
                     f"{measured['preemptions']} | {figures['preemptions']} | {measured['seconds']:.1f} | "
                     f"{figures['makespan_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: simulate every policy, print the table, maybe write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {CHOICES}")
    parser.add_argument("--profile", default="gpu_h100", choices=sorted(PROFILES))
    parser.add_argument("--max_response_tokens", type=int, default=Workload.max_response_tokens)
    parser.add_argument("--response_tokens_mean", type=float, default=Workload.response_tokens_mean)
    parser.add_argument("--part_tokens", type=int, default=256, help="kv_aware's part size (0: whole turns)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    parser.add_argument("--replay", help="a balancer_servers kv_pressure JSON to predict (the other flags unused)")
    args = parser.parse_args(argv)
    if args.replay:
        recorded = json.loads(Path(args.replay).read_text())
        predicted = predict_recorded(recorded)
        emit(format_replay(recorded, predicted), {"replayed": args.replay, "predicted": predicted}, args.json_path)
        return predicted
    workload = Workload(prompts=args.prompts, samples=args.samples, max_response_tokens=args.max_response_tokens,
                        response_tokens_mean=args.response_tokens_mean, seed=args.seed)
    names = [name.strip() for name in args.policies.split(",") if name.strip()]
    result = run_benchmark(names, args.engines, args.profile, workload, args.part_tokens or None, args.workers)
    result["environment"]["command"] = command_line("experiments.bench.balancer", argv)
    emit(format_report(result), result, args.json_path)
    return result


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def emit(report: str, result: dict[str, Any], json_path: str | None) -> None:
    """Print the report; write every figure to `json_path` if given."""
    print(report)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
