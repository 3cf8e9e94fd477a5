"""The RL learner's update at the demo's shape: one trajectory a row against trajectories packed into shared rows.

Issue 24 item 3 (the demo within 12 minutes). `RLLearner.update` (forward, backward, the clipped policy loss, AdamW;
on-policy, as the demo's only update a step) on the tiny demo model (`gin/model/tiny.gin`) over batches of kept
trajectories shaped like the demo's: its first-stage prompts in its SFT's wording, 1-3 turns of 20-95 sampled
tokens, tool responses between them (`experiments.bench.engine.demo_trajectories`), 24-44 trajectories a step as
RoC keeps them. Each layout is an `RLSettings`-style pair (micro-batch rows, pack length); the baseline is one
trajectory a row, 8 rows a micro-batch padded to a multiple of 256 (the demo before packing). Every step is timed for
every layout in turn, on the same trajectories, twice over the batches: the first pass includes each layout's
compiles, the second does not. Ratios are of the second pass, against the baseline measured in the same run.

    python -m experiments.bench.rl_update --json artifacts/bench_rl_update.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
import optax

from experiments.bench.engine import demo_trajectories
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import ModelConfig, init_params
from rstar_jax.parallel import make_mesh
from rstar_jax.rl import PolicyLossOptions
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.rl_batch import rl_micro_batches
from rstar_jax.train.rl_step import RLLearner
from rstar_jax.train.state import init_train_state, train_state_shardings

LAYOUTS = {"rows": (8, None), "packed_2x1024": (2, 1024), "packed_4x1024": (4, 1024)}  # name -> (rows, pack length)
BASELINE = "rows"
KEPT = (24, 32, 36, 40, 44, 28, 36, 32)  # trajectories kept a step (the demo: 24-44)


@dataclasses.dataclass(frozen=True)
class KeptTrajectory:
    """A trajectory as the learner reads it (`rl_batch.RolloutSequence`)."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]


def kept_trajectories(tokenizer: Any, step: int, kept: int, seed: int) -> list[KeptTrajectory]:
    """`kept` trajectories of the demo's shape (step `step` of `demo_trajectories`, 4 a prompt as RoC keeps them):
    the prompt, each turn's sampled tokens (random ids, loss mask 1) and the tool responses between (mask 0)."""
    rng = np.random.default_rng([seed, step])
    rows = []
    for scripted in demo_trajectories(tokenizer, step, -(-kept // 4), 4, seed)[:kept]:
        ids, mask = list(scripted.prompt), [0] * len(scripted.prompt)
        for turn, count in enumerate(scripted.turn_tokens):
            ids += rng.integers(10, 1000, count).tolist()
            mask += [1] * count
            if turn < len(scripted.tool_responses):
                ids += scripted.tool_responses[turn]
                mask += [0] * len(scripted.tool_responses[turn])
        logprobs = np.where(np.asarray(mask) == 1, -rng.exponential(size=len(mask)), 0.0)
        rows.append(KeptTrajectory(tuple(ids), tuple(mask), tuple(logprobs.tolist())))
    return rows


def run(config: ModelConfig, tokenizer: Any, seed: int, pad_multiple: int,
        kept: Sequence[int] = KEPT) -> dict[str, Any]:
    """Seconds of every layout's updates, first pass and second, over steps of `kept` trajectories each; each layout
    its own state and learner; the positions each layout computes against the tokens."""
    mesh = make_mesh(devices=jax.devices()[:1])
    learners = {}
    for name, (rows, _) in LAYOUTS.items():
        optimizer = optax.adamw(1e-4)
        state = init_train_state(init_params(config, jax.random.key(seed)), optimizer)
        shardings = train_state_shardings(state, mesh)
        learners[name] = [jax.device_put(state, shardings),
                          RLLearner(config, optimizer, optax.constant_schedule(1e-4), mesh, shardings, rows,
                                    PolicyLossOptions())]
    batches = [kept_trajectories(tokenizer, step, count, seed) for step, count in enumerate(kept)]
    advantages = [np.random.default_rng([seed, 1, i]).normal(size=len(b)) for i, b in enumerate(batches)]
    micro_batches = {name: [rl_micro_batches(batch, advantage, rows, 0, pad_multiple, pack_length)
                            for batch, advantage in zip(batches, advantages)]
                     for name, (rows, pack_length) in LAYOUTS.items()}
    seconds = {name: [] for name in LAYOUTS}
    for _ in range(2):
        for step in range(len(batches)):
            for name, (state, learner) in learners.items():
                start = time.perf_counter()
                state, _ = learner.update(state, micro_batches[name][step], on_policy=True)
                jax.block_until_ready(state.params)
                seconds[name].append(time.perf_counter() - start)
                learners[name][0] = state
    tokens = sum(len(t.token_ids) - 1 for batch in batches for t in batch)
    positions = {name: sum(b.shape[0] * b.shape[1] for micro in per_step for b in micro)
                 for name, per_step in micro_batches.items()}
    steps = len(kept)
    result = {"tokens": tokens, "kept": list(kept), "layouts": {}}
    for name, (rows, pack_length) in LAYOUTS.items():
        first, second = sum(seconds[name][:steps]), sum(seconds[name][steps:])
        result["layouts"][name] = {"rows": rows, "pack_length": pack_length, "positions": positions[name],
                                   "tokens_share": tokens / positions[name], "first_pass_s": first,
                                   "second_pass_s": second}
    base = result["layouts"][BASELINE]["second_pass_s"]
    for figures in result["layouts"].values():
        figures["time_vs_baseline"] = figures["second_pass_s"] / base
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pad_multiple", type=int, default=256, help="RLSettings.pad_multiple (the demo's)")
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    parse_gin([TINY_MODEL_GIN, SFT_GIN], [])  # the model, and the demo's prompt wording
    config = ModelConfig()
    result = run(config, load_tokenizer("tiny"), args.seed, args.pad_multiple)
    print(f"{len(KEPT)} steps of {min(KEPT)}-{max(KEPT)} kept trajectories, {result['tokens']:,} tokens a pass")
    print(f"{'layout':<15} {'rows':>4} {'pack':>5} {'tokens/positions':>17} {'pass 1 s':>9} {'pass 2 s':>9} "
          f"{'vs ' + BASELINE:>8}")
    for name, f in result["layouts"].items():
        print(f"{name:<15} {f['rows']:>4} {str(f['pack_length'] or '-'):>5} {f['tokens_share']:>17.1%} "
              f"{f['first_pass_s']:>9.1f} {f['second_pass_s']:>9.1f} {f['time_vs_baseline']:>7.2f}x")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
