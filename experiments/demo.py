"""The CPU demo, the README's main job: a tiny model learns the tool format, then GRPO-RoC teaches it to solve.

    python -m experiments.demo [--out runs/demo] [--gin_file ...] [--gin_param ...]

1. Format SFT (SPEC 5, scaled to 2 cores; gin/sft/tiny_format.gin): copy drills, then synthetic tool transcripts
   whose outputs come from the real sandbox server.
2. Held-out evaluation of the SFT model (gin `HeldOutEval`): problems no SFT transcript or RL stage can draw, solved
   k times at T=1 (avg@k) and once greedily, through the JAX engine, the agent loop and the sandbox.
3. GRPO-RoC (SPEC 4; gin `RLSettings`, `Stage`, `make_selector`): stages of rollouts on the JAX engine, verified
   rewards, Resample-on-Correct, the clipped policy update, weights pushed to the engine after every step.
4. The same held-out evaluation after RL, and the comparison: accuracy at T=1 and greedy with its change paired over
   the problems (and that change's standard error), and the tool-error ratio among correct trajectories (SPEC 4's
   Figure 4 measure). Last, the run's figures beside the range seed runs measured
   (experiments/reports/demo_seeds/range.json, from `experiments.demo_seeds`) and what a figure outside it suggests.
Writes OUT/demo_summary.json (with avg@k per problem kind, the SFT's copy check, the paired changes and the lines
against the range), OUT/heldout_{after_sft,after_rl}_{sampled,greedy}.jsonl (one record per held-out problem: its
samples' verdicts, answers, lengths, tool calls and errors), OUT/demo.log, OUT/operative_config.gin,
OUT/bound_config.gin, OUT/sft/ and OUT/rl/ (metrics.jsonl, tensorboard/, plots/, checkpoints/, model/). An interrupted
demo run again with the same OUT resumes.

"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

from experiments.demo_seeds import against_seed_range
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.console import log_to, phase, say
from rstar_jax.eval.heldout import HeldOutEval
from rstar_jax.eval.benchmark_report import problem_records_jsonl
from rstar_jax.eval.report import (accuracy_by_kind, change_text, comparison_table, example_text, kind_table,
                                   paired_changes)
from rstar_jax.eval.seed_range import SEED_PARAMETERS, config_fingerprint, sft_copies
from rstar_jax.gin_setup import knob_help, parse_gin, write_bound_config, write_operative_config
from rstar_jax.model import load_hf
from rstar_jax.model.folder import save_model_folder
from rstar_jax.processes import running_sandbox
from rstar_jax.reward import VerifierPool
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.metrics import read_metrics
from rstar_jax.train.plots import plot_metrics
from rstar_jax.train.rl_setup import rl_setup
from rstar_jax.train.rl_trainer import RLTrainer
from rstar_jax.train.sft_run import SUMMARY_FILE as SFT_SUMMARY, train_sft

DEMO_GIN = "demo/cpu_demo.gin"

KNOBS = ("train_sft.drill_steps", "train_sft.short_steps", "train_sft.steps", "train_sft.number_loss_weight",
         "train_sft.drill_repeats", "RLSettings.prompts_per_step", "RLSettings.group_size", "short/Stage.steps",
         "longer/Stage.steps", "rl_optimizer.learning_rate", "make_selector.algorithm", "RocSelector.mode",
         "HeldOutEval.samples", "RolloutBackend.backend")

def seed_bindings(seed: int | None) -> list[str]:
    """Gin bindings that give every seeded part of the demo `seed` (none for None); evaluation keeps its own."""
    if seed is None:
        return []
    return [f"{parameter} = {seed}" for parameter in SEED_PARAMETERS]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: SFT, evaluation, GRPO-RoC, evaluation; prints and writes the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=knob_help([TINY_MODEL_GIN, SFT_GIN, DEMO_GIN], KNOBS))
    parser.add_argument("--out", default="runs/demo", help="run folder (an existing one resumes)")
    parser.add_argument("--gin_file", action="append", default=[], help="gin files after the demo's own")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'HeldOutEval.samples = 8'")
    parser.add_argument("--seed", type=int, default=None, help="one seed for the model's initialisation, the SFT "
                        "data and RL (gin's seeds otherwise); the held-out problems stay the same")
    args = parser.parse_args(argv)
    parse_gin([TINY_MODEL_GIN, SFT_GIN, DEMO_GIN, *args.gin_file], args.gin_param + seed_bindings(args.seed))
    out = Path(args.out)
    started = time.monotonic()
    setup, evaluation = rl_setup(), HeldOutEval()  # every object of the run, built once from gin
    settings = setup.settings
    with log_to(out / "demo.log"), running_sandbox(["--workers", "2"]) as sandbox, VerifierPool() as verifier:
        say("rstar-jax CPU demo: format SFT, then GRPO-RoC, then held-out accuracy before and after")
        with phase("[1/4] format SFT of the tiny model") as sft_time:
            model_dir = train_sft(out / "sft")
        model = load_hf(model_dir)
        tokenizer_dir, tokenizer = str(model_dir), load_tokenizer(model_dir)
        problems = f"{evaluation.problems.describe()}, {evaluation.samples} samples at T={evaluation.temperature}" \
                   + (" and greedy" if evaluation.greedy else "")
        with phase(f"[2/4] held-out evaluation of the SFT model ({problems})") as before_time:
            before = evaluation.run(model.config, model.params, tokenizer_dir, tokenizer, [sandbox.url], verifier,
                                    setup.backend, out / "eval_before")
        per_prompt = setup.selector.rollouts_per_prompt(settings.group_size)
        with phase(f"[3/4] GRPO-RoC: {settings.total_steps} steps in {len(settings.stages)} stages, "
                   f"{settings.prompts_per_step} prompts x {per_prompt} rollouts a step") as rl_time:
            trainer = RLTrainer(out / "rl", model.config, model.params, tokenizer_dir, setup)
            params = trainer.run([sandbox.url], verifier)
            save_model_folder(model.config, params, out / "rl" / "model", tokenizer_dir)
            plot_metrics(read_metrics(out / "rl" / "metrics.jsonl"), out / "rl" / "plots", "GRPO-RoC")
        with phase(f"[4/4] held-out evaluation after RL ({problems})") as after_time:
            after = evaluation.run(model.config, params, tokenizer_dir, tokenizer, [sandbox.url], verifier,
                                   setup.backend, out / "eval_after")
        results = {"after_sft": before, "after_rl": after}
        by_kind = {when: {name: accuracy_by_kind(result) for name, result in by_mode.items()}
                   for when, by_mode in results.items()}
        changes = paired_changes(before, after)
        summary = {**{when: {name: result.summary for name, result in by_mode.items()}
                      for when, by_mode in results.items()},
                   "accuracy_by_kind": by_kind,
                   "paired_change": {mode: dataclasses.asdict(change) for mode, change in changes.items()},
                   "sft_copies": sft_copies(json.loads((out / "sft" / SFT_SUMMARY).read_text())),
                   "seed": args.seed, "total_seconds": time.monotonic() - started,
                   "phase_seconds": {"sft": sft_time["seconds"], "eval_before": before_time["seconds"],
                                     "rl": rl_time["seconds"], "eval_after": after_time["seconds"]}}
        write_operative_config(out)
        summary["against_seed_range"] = against_seed_range(
            summary, config_fingerprint(write_bound_config(out).read_text()))
        (out / "demo_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        for when, by_mode in results.items():
            for name, result in by_mode.items():
                (out / f"heldout_{when}_{name}.jsonl").write_text(problem_records_jsonl(result, tokenizer))
        say(comparison_table(before, after))
        say(change_text(changes))
        say(kind_table(by_kind["after_sft"], by_kind["after_rl"]))
        say(example_text(after["sampled"], tokenizer))
        say("\n".join(summary["against_seed_range"]))
        say(f"demo finished in {summary['total_seconds']:.0f} s; figures in {out / 'demo_summary.json'}, "
            f"RL plots in {out / 'rl' / 'plots'}")
    return summary


if __name__ == "__main__":
    main()
