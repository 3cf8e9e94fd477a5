"""How fast the demo model learns to copy numbers, by how numbers are tokenised (issue 9: the SFT'd model copied
numbers badly, which starved GRPO of signal).

    python -m experiments.bench.copy_probe [--steps 400] [--json PATH]

The same seeded tiny model (gin/model/tiny.gin) is trained from scratch on copy drills (`rstar_jax.data.copy_drills`:
synthetic questions followed by their programs, program outputs followed by the answers that repeat them), once with
the committed tiny tokenizer (numbers in chunks of up to three digits) and once with the same tokenizer built with one
token per digit (as Qwen's). Every `--every` steps it measures teacher-forced copy accuracy: the share of the tokens
of numbers an assistant turn copies from earlier in the text that the model predicts exactly, on 64 held-out drills,
over all and by kind (`COPY_KINDS`: a question's numbers into its first program, a failed program's into its fix,
outputs into answers). Both runs see the same drills in the same order and the same learning-rate schedule.

`--layout demo --seeds 0,1` (issue 24: the demo's SFT copies on some seeds and not on others) instead trains exactly
the demo's drill phase: the model initialised from each seed as `train_sft.model_seed`, the drill rows of
`gin/sft/tiny_format.gin` from that seed as `train_sft.data_seed` (18 rows filled to 192 tokens a step, its share of
retries, its loss weight on number tokens) and its optimiser (`sft_optimizer` over the whole SFT's steps, so the
drill steps see the demo's warm-up and rates; drilling past the demo's 400 steps continues the same cosine). Copy
accuracy is measured the same way, on 64 held-out drills of the transcripts' chat layout (another seed), once with
the committed tokenizer.

    python -m experiments.bench.copy_probe --layout demo --seeds 0,1 --steps 540 --every 20 --json PATH

`--layout transcripts --models DIR ...` trains nothing: it measures the same copy accuracy of trained models (a
demo's OUT/sft/model) on whole held-out SFT transcripts, as rollouts see them (system prompt and tool schema, real
sandbox outputs, half with a failed first call and its fix).

    python -m experiments.bench.copy_probe --layout transcripts --models runs/demo/sft/model --json PATH
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import gin
import jax
import numpy as np

from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.data.copy_drills import copy_drill_text
from rstar_jax.data.synthetic import KINDS
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import ModelConfig, init_params, load_hf
from rstar_jax.parallel import make_mesh
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.batching import make_batch
from rstar_jax.train.copies import copy_accuracy, held_out_copies, shown
from rstar_jax.train.optim import adamw_optimizer, sft_optimizer
from rstar_jax.train.sft import make_sft_step
from rstar_jax.train.sft_data import TrainingSequence, cached_sft_sequences
from rstar_jax.train.sft_run import drill_batch, number_token_weights
from rstar_jax.train.state import init_train_state, train_state_shardings

LAYOUTS = ("pieces", "demo", "transcripts")
HELD_OUT_SEED = 10_000  # held-out drills' seed: no demo seed draws it
NAMES = {1: "single_digits", 2: "two_digit_chunks", 3: "three_digit_chunks"}
_BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_tokenizer.py"


def build_tokenizer(out: Path, digits_per_token: int) -> Path:
    """The tiny tokenizer built with numbers cut into chunks of `digits_per_token` digits."""
    spec = importlib.util.spec_from_file_location("build_tiny_tokenizer", _BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(out, digits_per_token)


def copy_curve(tokenizer: Any, config: ModelConfig, params: Any, optimizer: Any, schedule: Any, steps: int,
               every: int, drills: Callable[[int], list[TrainingSequence]],
               held_out_texts: Sequence[str], target_weights: np.ndarray | None = None) -> list[dict[str, float]]:
    """Train `params` on `drills(step)` for `steps` steps (the loss weighting targets by `target_weights`, as
    `make_sft_step`); the copy accuracy on `held_out_texts` every `every` steps."""
    mesh = make_mesh(devices=jax.devices()[:1])
    state = init_train_state(params, optimizer)
    shardings = train_state_shardings(state, mesh)
    state = jax.device_put(state, shardings)
    step_fns: dict[int, Any] = {}
    batch, kinds, digits = held_out_copies(tokenizer, held_out_texts)
    curve, started = [], time.monotonic()
    for step in range(steps + 1):
        if step % every == 0 or step == steps:
            figures = copy_accuracy(state.params, config, batch, kinds, digits)
            curve.append({"step": step, **figures, "seconds": time.monotonic() - started})
            print(f"  step {step}: {shown(figures)}", flush=True)
        if step < steps:
            rows = drills(step)
            if len(rows) not in step_fns:
                step_fns[len(rows)] = make_sft_step(config, optimizer, schedule, mesh, shardings, len(rows),
                                                    target_weights)
            state, _ = step_fns[len(rows)](state, make_batch(rows))
    return curve


def transcript_copies(model_dirs: Sequence[Path], count: int) -> dict[str, dict[str, Any]]:
    """Teacher-forced copy accuracy of trained models on `count` whole held-out SFT transcripts (system prompt, tool
    schema, real sandbox outputs; data seed HELD_OUT_SEED, generated here against a sandbox server)."""
    tokenizer = load_tokenizer("tiny")
    with tempfile.TemporaryDirectory() as scratch:
        sequences = cached_sft_sequences(Path(scratch) / "transcripts.jsonl", count, HELD_OUT_SEED, tokenizer)
    batch, kinds, digits = held_out_copies(tokenizer, [tokenizer.decode(list(sequence.token_ids))
                                                       for sequence in sequences])
    results = {}
    for model_dir in model_dirs:
        model = load_hf(model_dir)
        results[str(model_dir)] = copy_accuracy(model.params, model.config, batch, kinds, digits)
        print(f"{model_dir}: {shown(results[str(model_dir)])}", flush=True)
    return results


def run(tokenizer_dir: Path, config: ModelConfig, steps: int, batch_size: int, every: int,
        learning_rate: float) -> list[dict[str, float]]:
    """Train on drills of whole pieces with `tokenizer_dir`; the copy accuracy curve."""
    tokenizer = load_tokenizer(tokenizer_dir)
    optimizer, schedule = adamw_optimizer(steps, learning_rate, warmup_fraction=0.1, end_fraction=0.05, b2=0.98)

    def drills(step: int) -> list[TrainingSequence]:
        texts = [copy_drill_text(step * batch_size + row, seed=0) for row in range(batch_size)]
        return [TrainingSequence(tuple(ids), (1,) * len(ids))
                for ids in (tokenizer.encode(text, add_special_tokens=False) for text in texts)]

    return copy_curve(tokenizer, config, init_params(config, jax.random.key(0)), optimizer, schedule, steps, every,
                      drills, [copy_drill_text(index, seed=1) for index in range(64)])


def _bound(parameter: str, default: Any) -> Any:
    """A gin parameter's bound value, or `default` where the config leaves it unbound."""
    try:
        return gin.query_parameter(parameter)
    except ValueError:
        return default


def run_demo_drills(seed: int, config: ModelConfig, steps: int, every: int) -> list[dict[str, float]]:
    """The demo's drill phase from `seed` (model and drill data), with its optimiser over the whole SFT's steps and
    its loss weight on number tokens."""
    tokenizer = load_tokenizer("tiny")
    total = sum(gin.query_parameter(f"train_sft.{name}") for name in ("drill_steps", "short_steps", "steps"))
    optimizer, schedule = sft_optimizer(total)
    batch_size, length = (gin.query_parameter(f"train_sft.{name}") for name in ("drill_batch_size", "drill_length"))
    return copy_curve(tokenizer, config, init_params(config, jax.random.key(seed)), optimizer, schedule, steps, every,
                      lambda step: drill_batch(step, batch_size, tokenizer, seed, snippets=3, length=length,
                                               retries=gin.query_parameter("train_sft.drill_retries"),
                                               kinds=_bound("train_sft.drill_kinds", KINDS)),
                      [copy_drill_text(index, seed=HELD_OUT_SEED) for index in range(64)],
                      number_token_weights(tokenizer, config.vocab_size, _bound("train_sft.number_loss_weight", 1.0)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: the copy-accuracy curves (tokenisations, or the demo's drills from each seed),
    printed and written as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--digits", default="3,1", help="digits per number token to compare, e.g. 3,1 or 3")
    parser.add_argument("--layout", choices=LAYOUTS, default="pieces",
                        help="'demo': the demo's drill phase from each of --seeds (see above)")
    parser.add_argument("--seeds", default="0", help="with --layout demo: the seeds, e.g. 0,1,2")
    parser.add_argument("--models", nargs="+", type=Path, default=[],
                        help="with --layout transcripts: trained model folders (e.g. a demo's OUT/sft/model)")
    parser.add_argument("--transcripts", type=int, default=48, help="with --layout transcripts: how many")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'ModelConfig.num_kv_heads = 8'")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    parse_gin([TINY_MODEL_GIN, *([SFT_GIN] if args.layout != "pieces" else [])], args.gin_param)
    config = ModelConfig()
    results: dict[str, Any] = {"steps": args.steps, "layout": args.layout, "load_average": os.getloadavg()}
    if args.layout == "transcripts":
        results["transcripts"] = args.transcripts
        results["models"] = transcript_copies(args.models, args.transcripts)
        final = {name: figures["by_kind"] for name, figures in results["models"].items()}
    elif args.layout == "demo":
        for seed in (int(value) for value in args.seeds.split(",")):
            print(f"seed {seed}:", flush=True)
            results[f"seed_{seed}"] = run_demo_drills(seed, config, args.steps, args.every)
        final = {name: curve[-1]["copy_accuracy"] for name, curve in results.items() if name.startswith("seed_")}
    else:
        results["batch_size"] = args.batch_size
        with tempfile.TemporaryDirectory() as scratch:
            for digits in (int(value) for value in args.digits.split(",")):
                name = NAMES[digits]
                folder = build_tokenizer(Path(scratch) / name, digits)
                results[name] = run(folder, config, args.steps, args.batch_size, args.every, args.learning_rate)
        final = {name: results[name][-1]["copy_accuracy"] for name in NAMES.values() if name in results}
    print(json.dumps(final))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
