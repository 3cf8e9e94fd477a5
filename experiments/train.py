"""RL training (GRPO-RoC or a baseline, SPEC 4-5) of a model folder: `rstar_jax.train.rl_trainer.RLTrainer`.

    python -m experiments.train --model DIR --out RUN [--gin_file ...] [--gin_param ...]

DIR is any Hugging Face Qwen2/Qwen3 folder with its tokenizer (e.g. the demo's SFT model, OUT/sft/model). Starts a
sandbox server (or uses `--sandbox_url`), trains every stage of `RLSettings.stages`, and writes RUN/metrics.jsonl,
RUN/tensorboard/, RUN/plots/, RUN/checkpoints/, RUN/model/ and RUN/operative_config.gin. A killed run started again
with the same command resumes from its last checkpoint and continues exactly as the uninterrupted run would.

"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from experiments.demo import DEMO_GIN
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.console import log_to, say
from rstar_jax.gin_setup import knob_help, parse_gin, write_operative_config
from rstar_jax.model import load_hf
from rstar_jax.model.folder import save_model_folder
from rstar_jax.train.metrics import read_metrics
from rstar_jax.train.plots import plot_metrics
from rstar_jax.train.rl_trainer import RLTrainer
from sandbox_server.launcher import running_server

KNOBS = ("RLSettings.prompts_per_step", "RLSettings.group_size", "RLSettings.zero_variance", "RLSettings.seed",
         "make_selector.algorithm", "RocSelector.mode", "PenaltySelector.penalty_lambda", "PolicyLossOptions.eps_high",
         "rl_optimizer.learning_rate", "RolloutBackend.backend")

def main(argv: Sequence[str] | None = None) -> Path:
    """Command-line entry point; returns the trained model folder."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=knob_help([TINY_MODEL_GIN, SFT_GIN, DEMO_GIN], KNOBS))
    parser.add_argument("--model", required=True, help="HF model folder to start from")
    parser.add_argument("--out", required=True, help="run folder (an existing one resumes)")
    parser.add_argument("--sandbox_url", action="append", default=[], help="running sandbox servers (default: "
                        "start one here)")
    parser.add_argument("--gin_file", action="append", default=None,
                        help=f"gin files (default: {TINY_MODEL_GIN}, {SFT_GIN}, {DEMO_GIN})")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'make_selector.algorithm = \"grpo\"'")
    args = parser.parse_args(argv)
    parse_gin(args.gin_file or [TINY_MODEL_GIN, SFT_GIN, DEMO_GIN], args.gin_param)
    out = Path(args.out)
    model = load_hf(args.model)
    with log_to(out / "train.log"):
        trainer = RLTrainer(out, model.config, model.params, args.model)
        if args.sandbox_url:
            params = trainer.run(args.sandbox_url)
        else:
            with running_server(["--workers", "2"]) as sandbox:
                params = trainer.run([sandbox.url])
        folder = save_model_folder(model.config, params, out / "model", args.model)
        plot_metrics(read_metrics(out / "metrics.jsonl"), out / "plots", "RL")
        write_operative_config(out)
        say(f"wrote {folder}; metrics in {out / 'metrics.jsonl'}, plots in {out / 'plots'}")
    return folder


if __name__ == "__main__":
    main()
