"""Format SFT of the tiny demo model on synthetic tool transcripts with real sandbox outputs (SPEC section 5).

    python -m experiments.sft --out DIR [--gin_file sft/tiny_format.gin] [--gin_param ...]

Builds the seeded tiny model (as `experiments.make_tiny_model` does), generates or reuses the cached transcripts,
trains with the sharded SFT step, checkpoints the TrainState every `checkpoint_manager.save_every` steps (a killed
run started again with the same DIR resumes and ends with bit-identical parameters), and writes:
  DIR/model/               the trained Hugging Face folder (weights, config, tokenizer files)
  DIR/metrics.json         loss, gradient norm, learning rate and trained tokens per step, and the run time
  DIR/operative_config.gin the gin bindings the run used
  DIR/transcripts.jsonl    the cached training ids;  DIR/checkpoints/  the TrainState checkpoints
With --eval_problems N it then measures the format on N new problems (see `rstar_jax.train.format_probe`) and
writes DIR/format_eval.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

import gin
import jax
import numpy as np

from experiments.make_tiny_model import TINY_MODEL_GIN, make_tiny_model
from rstar_jax.gin_setup import parse_gin, write_operative_config
from rstar_jax.model import save_hf
from rstar_jax.parallel import make_mesh
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.batching import batch_indices, make_batch
from rstar_jax.train.checkpoints import checkpoint_manager, restore_latest, save_state
from rstar_jax.train.format_probe import probe_format
from rstar_jax.train.optim import sft_optimizer
from rstar_jax.train.sft import make_sft_step
from rstar_jax.train.sft_data import cached_sft_sequences
from rstar_jax.train.state import init_train_state, train_state_shardings

DEFAULT_GIN = "sft/tiny_format.gin"
MODEL_DIR, METRICS_FILE, LOG_FILE, TRANSCRIPTS_FILE, CHECKPOINT_DIR = (
    "model", "metrics.json", "train_log.jsonl", "transcripts.jsonl", "checkpoints")


@gin.configurable
def train_sft(out: str | Path, steps: int = 100, batch_size: int = 16, num_transcripts: int = 256,
              data_seed: int = 0, model_seed: int = 0, tokenizer: str = "tiny",
              stop_at_step: int | None = None) -> Path | None:
    """Run (or resume) the format SFT into `out`; returns the trained HF folder, or None when stopped early.

    `stop_at_step` ends the run after that step without saving anything more, exactly as if it were killed
    there (for time-sliced runs and the resume test); running again with the same `out` resumes.
    """
    if steps < 1 or batch_size < 1 or num_transcripts < 1:
        raise ValueError(f"train_sft needs steps, batch_size and num_transcripts >= 1, "
                         f"got {steps}, {batch_size}, {num_transcripts}")
    out = Path(out)
    started = time.monotonic()
    model = make_tiny_model(out / MODEL_DIR, model_seed, tokenizer)
    token_source = load_tokenizer(tokenizer)
    sequences = cached_sft_sequences(out / TRANSCRIPTS_FILE, num_transcripts, data_seed, token_source)
    data_time = time.monotonic() - started

    optimizer, schedule = sft_optimizer(steps)
    mesh = make_mesh()
    state = init_train_state(model.params, optimizer)
    shardings = train_state_shardings(state, mesh)
    manager = checkpoint_manager(out / CHECKPOINT_DIR)
    restored = restore_latest(manager, state, shardings)
    state = jax.device_put(state, shardings) if restored is None else restored
    start = int(state.step)
    log = _read_log(out / LOG_FILE, start)
    sft_step = make_sft_step(model.config, optimizer, schedule, mesh, shardings, batch_size)
    pad_id = model.config.pad_token_id or 0

    with (out / LOG_FILE).open("w") as handle:
        handle.writelines(json.dumps(entry) + "\n" for entry in log)
        for step in range(start, steps):
            batch = make_batch([sequences[i] for i in batch_indices(step, len(sequences), batch_size, data_seed)],
                               pad_id)
            state, metrics = sft_step(state, batch)
            entry = {"step": step + 1, "seq_len": batch.shape[1],
                     **{name: float(value) for name, value in jax.device_get(metrics).items()}}
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            log.append(entry)
            if stop_at_step is not None and step + 1 >= stop_at_step:
                manager.wait_until_finished()
                return None
            save_state(manager, state)
    manager.wait_until_finished()

    save_hf((model.config, jax.device_get(state.params)), out / MODEL_DIR)
    summary = {"steps": steps, "resumed_from_step": start, "num_transcripts": len(sequences),
               "data_seconds": data_time, "total_seconds": time.monotonic() - started,
               "final_loss": log[-1]["loss"], "log": log}
    (out / METRICS_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return out / MODEL_DIR


def _read_log(path: Path, up_to_step: int) -> list[dict[str, Any]]:
    """The per-step entries a previous run logged up to its restored checkpoint (later ones are redone)."""
    if not path.is_file():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [entry for entry in entries if entry["step"] <= up_to_step]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point; returns metrics.json's content (plus the format evaluation when asked)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="run folder (created; an existing one is resumed)")
    parser.add_argument("--gin_file", action="append", default=None,
                        help=f"gin files after {TINY_MODEL_GIN} (default: {DEFAULT_GIN})")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'train_sft.steps = 50'")
    parser.add_argument("--eval_problems", type=int, default=0, help="new problems to measure the format on")
    args = parser.parse_args(argv)
    parse_gin([TINY_MODEL_GIN, *(args.gin_file or [DEFAULT_GIN])], args.gin_param)
    out = Path(args.out)
    model_dir = train_sft(out)
    write_operative_config(out)
    if model_dir is None:
        print(f"stopped early; run again with --out {out} to resume")
        return {}
    summary = json.loads((out / METRICS_FILE).read_text())
    losses = np.array([entry["loss"] for entry in summary["log"]])
    print(f"wrote {model_dir}: {summary['steps']} steps in {summary['total_seconds']:.0f} s "
          f"(data {summary['data_seconds']:.0f} s), loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if args.eval_problems:
        summary["format_eval"] = probe_format(model_dir, args.eval_problems)
        (out / "format_eval.json").write_text(json.dumps(summary["format_eval"], indent=1) + "\n")
        print(json.dumps({k: v for k, v in summary["format_eval"].items() if k != "samples"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
