"""The CPU demo, the README's main job: the tiny model learns the tool format, then solves new problems with it.

    python -m experiments.demo [--out runs/demo] [--gin_file ...] [--gin_param ...]

1. Format SFT (SPEC section 5, scaled to 2 CPU cores): the seeded tiny Qwen3-family model is trained on synthetic
   tool transcripts whose tool outputs come from the real sandbox server (`experiments.sft`).
2. Agentic rollouts (SPEC sections 2 and 6): the SFT'd model, served by the in-process JAX engine, solves new
   synthetic problems through the agent loop, its tool calls run by a real sandbox server; every final answer is
   verified (SPEC section 3). The summary (accuracy, tool-call and tool-error counts, finish reasons, speed) goes
   to OUT/demo_summary.json beside the operative gin config.
GRPO-RoC training on these rollouts is the trainer's step, which extends this demo.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

import gin

from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from experiments.sft import train_sft
from rstar_jax.agent.trajectory import sampled_turn_texts
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.gin_setup import parse_gin, write_operative_config
from rstar_jax.reward import verify_batch
from rstar_jax.rollout.agent_loop import AgentLoop
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.rollout import rollout_stats
from rstar_jax.tokenizers import load_tokenizer
from sandbox_server.client import SandboxClient
from sandbox_server.launcher import running_server

DEMO_GIN = "demo/cpu_demo.gin"


@gin.configurable
def rollout_demo(model_dir: Path, problems: int = 16, samples_per_problem: int = 4, problem_seed: int = 1000,
                 engine_slots: int = 16, engine_max_len: int = 1024,
                 sandbox_workers: int = 2) -> dict[str, Any]:
    """Roll out `samples_per_problem` trajectories on each of `problems` new synthetic problems and verify them.

    The problems are drawn like the SFT corpus (`synthetic_tasks` gin bindings, e.g. its difficulty) from another seed.
    """
    tokenizer = load_tokenizer(model_dir)
    tasks = synthetic_problems(problems, seed=problem_seed)
    engine = JaxEngine.from_hf(model_dir, slots=engine_slots, max_len=engine_max_len)
    try:
        with running_server(["--workers", str(sandbox_workers)]) as server:
            started = time.monotonic()
            samples = asyncio.run(_rollout(engine, server.url, tokenizer, tasks, samples_per_problem))
            seconds = time.monotonic() - started
    finally:
        engine.close()
    answers = ["\n".join(sampled_turn_texts(s.trajectory, tokenizer)) for s in samples]  # model text, no tool output
    rewards = verify_batch(answers, [s.problem.answer for s in samples])
    example = samples[next((i for i, r in enumerate(rewards) if r), 0)].trajectory
    stats = rollout_stats(samples, seconds)
    return {
        "trajectories": stats.trajectories,
        "accuracy": sum(rewards) / len(rewards),
        "solved_problems": len({s.group for s, r in zip(samples, rewards) if r}),
        **{k: v for k, v in dataclasses.asdict(stats).items() if k != "trajectories"},
        "trajectories_per_s": stats.trajectories_per_s,
        "tool_calls_per_s": stats.tool_calls_per_s,
        "example_verified": any(rewards),
        "example": tokenizer.decode(example.token_ids[example.prompt_length:]),
    }


async def _rollout(engine: JaxEngine, sandbox_url: str, tokenizer: Any, problems: list, n: int) -> list:
    async with SandboxClient([sandbox_url]) as client:
        return await AgentLoop(engine, client, tokenizer).rollout(problems, n)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: SFT, then rollouts; prints and writes the summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="run folder (an existing one resumes the SFT)")
    parser.add_argument("--gin_file", action="append", default=[], help="gin files after the demo's own")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'rollout_demo.problems = 32'")
    args = parser.parse_args(argv)
    parse_gin([TINY_MODEL_GIN, SFT_GIN, DEMO_GIN, *args.gin_file], args.gin_param)
    out = Path(args.out)
    started = time.monotonic()
    print(f"[1/2] format SFT of the tiny model into {out / 'sft'}", flush=True)
    model_dir = train_sft(out / "sft")
    print(f"[2/2] agentic rollouts with the JAX engine and the sandbox server ({time.monotonic() - started:.0f} s)",
          flush=True)
    summary = {"model_dir": str(model_dir), **rollout_demo(model_dir)}
    summary["total_seconds"] = time.monotonic() - started
    write_operative_config(out)
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "example"}, indent=1))
    label = "a verified trajectory" if summary["example_verified"] else "no answer verified; the first trajectory"
    print(f"{label}:\n{summary['example']}")
    return summary


if __name__ == "__main__":
    main()
