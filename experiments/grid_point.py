"""One point of a sweep or ablation (run by experiments/sweep.py and experiments/ablate.py in a subprocess each):
RL of a model folder through experiments.train, then the held-out evaluation of the start model (cached) and the
trained one (gin `HeldOutEval`, SPEC 7) on the engines of gin's `RolloutBackend`, the ones the training used.

    python -m experiments.grid_point --model DIR --out RUN --start_eval_cache CACHE [--sandbox_url URL]
        [--gin_file ...] [--gin_param ...]

Writes what experiments.train writes into RUN (metrics.jsonl, checkpoints/, model/, plots/, ...), then
RUN/operative_config.gin (every binding the run and the evaluation read) and, last, RUN/summary.json: the point is
finished when that file exists. Run again with the same arguments, an interrupted point resumes from its last
checkpoint.

"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Sequence

from experiments.demo import DEMO_GIN
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from experiments.train import main as train_main
from rstar_jax.console import log_to, say
from rstar_jax.eval.heldout import HeldOutEval
from rstar_jax.gin_setup import write_operative_config
from rstar_jax.grid.point_eval import point_summary
from rstar_jax.grid.runner import SUMMARY_FILE, write_json
from rstar_jax.processes import running_sandbox
from rstar_jax.reward import VerifierPool
from rstar_jax.rollout.backends import RolloutBackend

DEFAULT_GIN = (TINY_MODEL_GIN, SFT_GIN, DEMO_GIN)


def main(argv: Sequence[str] | None = None) -> Path:
    """Command-line entry point; returns the point's summary file."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model folder to start from")
    parser.add_argument("--out", required=True, help="the point's run folder (an existing one resumes)")
    parser.add_argument("--start_eval_cache", required=True, help="folder of cached start-model evaluations")
    parser.add_argument("--sandbox_url", default=None, help="a running sandbox server (default: start one)")
    parser.add_argument("--gin_file", action="append", default=None, help=f"default: {', '.join(DEFAULT_GIN)}")
    parser.add_argument("--gin_param", action="append", default=[])
    args = parser.parse_args(argv)
    out = Path(args.out)
    gin_args = [arg for name in args.gin_file or DEFAULT_GIN for arg in ("--gin_file", name)]
    gin_args += [arg for param in args.gin_param for arg in ("--gin_param", param)]
    with contextlib.ExitStack() as stack:
        url = args.sandbox_url or stack.enter_context(running_sandbox(["--workers", "2"])).url
        trained = train_main(["--model", args.model, "--out", str(out), "--sandbox_url", url, *gin_args])
        # experiments.train parsed the point's gin config: the evaluation and the engines are built from it here
        evaluation, backend = HeldOutEval(), RolloutBackend()
        with log_to(out / "point.log"), VerifierPool() as verifier:
            summary = point_summary(evaluation, args.model, trained, url, verifier, backend, args.start_eval_cache,
                                    out)
            write_operative_config(out)
            path = write_json(out / SUMMARY_FILE, summary)
            start, after = (summary[when]["sampled"]["accuracy"] for when in ("start", "after"))
            say(f"point done: held-out T=1 accuracy {100 * start:.1f}% -> {100 * after:.1f}%; {path}")
    return path


if __name__ == "__main__":
    main()
