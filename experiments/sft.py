"""Format SFT of the tiny demo model (SPEC section 5, scaled down): copy drills, then tool transcripts whose outputs
come from a real sandbox server; resumable (`rstar_jax.train.sft_run.train_sft`).

    python -m experiments.sft --out DIR [--eval_problems N] [--gin_file ...] [--gin_param ...]

Writes DIR/model/ (HF folder), DIR/metrics.jsonl and DIR/tensorboard/ (loss, gradient norm, learning rate per step),
DIR/summary.json, DIR/operative_config.gin, DIR/transcripts.jsonl (cached ids) and DIR/checkpoints/. A killed run
started again with the same DIR resumes. With --eval_problems N it then measures the format on N held-out problems
(`rstar_jax.eval.format_probe`) and writes DIR/format_eval.json.

"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from experiments.make_tiny_model import TINY_MODEL_GIN
from rstar_jax.console import say
from rstar_jax.eval.format_probe import probe_format
from rstar_jax.gin_setup import knob_help, parse_gin, write_operative_config
from rstar_jax.reward import VerifierPool
from rstar_jax.train.sft_run import SUMMARY_FILE, train_sft

DEFAULT_GIN = "sft/tiny_format.gin"

KNOBS = ("train_sft.drill_steps", "train_sft.drill_batch_size", "train_sft.short_steps", "train_sft.steps",
         "train_sft.batch_size", "train_sft.num_transcripts", "sft_optimizer.learning_rate", "ModelConfig.hidden_size",
         "ModelConfig.num_layers")

def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point; returns summary.json's content (plus the format evaluation when asked)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=knob_help([TINY_MODEL_GIN, DEFAULT_GIN], KNOBS))
    parser.add_argument("--out", required=True, help="run folder (created; an existing one is resumed)")
    parser.add_argument("--gin_file", action="append", default=None,
                        help=f"gin files after {TINY_MODEL_GIN} (default: {DEFAULT_GIN})")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'train_sft.steps = 50'")
    parser.add_argument("--eval_problems", type=int, default=0, help="held-out problems to measure the format on")
    args = parser.parse_args(argv)
    parse_gin([TINY_MODEL_GIN, *(args.gin_file or [DEFAULT_GIN])], args.gin_param)
    out = Path(args.out)
    say(f"format SFT into {out} (log: {out / 'metrics.jsonl'})")
    model_dir = train_sft(out)
    write_operative_config(out)
    if model_dir is None:
        say(f"stopped early; run again with --out {out} to resume")
        return {}
    summary = json.loads((out / SUMMARY_FILE).read_text())
    say(f"wrote {model_dir}: {summary['steps']} steps in {summary['total_seconds']:.0f} s, "
        f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
    if args.eval_problems:
        with VerifierPool() as verifier:
            summary["format_eval"] = probe_format(model_dir, verifier, args.eval_problems)
        (out / "format_eval.json").write_text(json.dumps(summary["format_eval"], indent=1) + "\n")
        say(json.dumps({k: v for k, v in summary["format_eval"].items() if k != "samples"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
