"""Format SFT of the demo model as a resumable run (SPEC section 5, scaled to 2 CPU cores).

Three phases on one optimiser schedule, from short sequences to long:
1. copy drills (`rstar_jax.data.copy_drills`: questions with their programs, outputs with the answers that repeat
   them, ~100 tokens), so the model learns to copy numbers before anything else;
2. transcripts cut after the system turn (~150-300 tokens): the turns' layout, tool calls and answers;
3. whole transcripts (`rstar_jax.train.sft_data`): agent-format chats of the synthetic tool tasks with the real
   sandbox server's outputs, system prompt and tool schema included, as rollouts will see them.
Drill batches are a pure function of the step; transcripts come from grain iterators. Every `save_every` steps
(and after the last) one orbax Composite checkpoint holds the TrainState and both iterators, so a killed run started
again with the same folder resumes and ends with bit-identical parameters. Metrics go through the shared
`MetricsWriter`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Sequence

import gin
import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from rstar_jax.console import Progress, say
from rstar_jax.data.copy_drills import assistant_mask, copy_drill_ids, filled_drill_ids
from rstar_jax.data.synthetic import KINDS
from rstar_jax.model.folder import save_model_folder, seeded_model
from rstar_jax.parallel import abstract_placed, make_mesh
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.tokenizers.special_tokens import IM_START
from rstar_jax.train.batching import make_batch
from rstar_jax.train.copy_gate import GATE_TRANSCRIPTS_FILE, CopyGate, check_copies, gate_batch
from rstar_jax.train.metrics import MetricsWriter
from rstar_jax.train.optim import sft_optimizer
from rstar_jax.train.sft import make_sft_step
from rstar_jax.train.sft_data import TrainingSequence, cached_sft_sequences
from rstar_jax.train.state import TrainState, abstract_train_state, new_train_state, train_state_shardings

MODEL_DIR, SUMMARY_FILE, TRANSCRIPTS_FILE, CHECKPOINT_DIR = "model", "summary.json", "transcripts.jsonl", "checkpoints"


def transcript_batches(sequences: Sequence[TrainingSequence], batch_size: int, seed: int) -> grain.DatasetIterator:
    """Batches (lists) of transcripts in seeded epochs, forever; its state goes into the checkpoints."""
    dataset = grain.MapDataset.source(list(sequences)).shuffle(seed=seed).repeat(None)
    return iter(dataset.to_iter_dataset().batch(batch_size, batch_fn=list))


def drill_batch(step: int, batch_size: int, tokenizer: object, seed: int, snippets: int,
                length: int | None = None, retries: float = 0.0,
                kinds: Sequence[str] = KINDS, repeats: float = 0.0,
                assistant_only: bool = False, long_numbers: float = 0.0) -> list[TrainingSequence]:
    """The copy drills of drill step `step`: drills step * batch_size ... + batch_size - 1 of `seed`, each of
    `snippets` whole pieces, or (with `length`) filled with pieces to exactly `length` predictions; a share `retries`
    of the pieces are retries and a share `repeats` number lists repeated (a share `long_numbers` of the listed
    numbers of 4-6 digits); questions of the synthetic `kinds`, each drawn as often as it is named
    (`rstar_jax.data.copy_drills`). Every token is trained on, or with `assistant_only` only the assistant turns'
    (`assistant_mask`)."""
    indices = range(step * batch_size, (step + 1) * batch_size)
    drills = [copy_drill_ids(index, tokenizer, seed, snippets, kinds, retries, repeats, long_numbers)
              if length is None else filled_drill_ids(index, tokenizer, length, seed, kinds, retries, repeats,
                                                      long_numbers)
              for index in indices]
    return [TrainingSequence(ids, assistant_mask(ids, tokenizer) if assistant_only else (1,) * len(ids))
            for ids in drills]


def number_token_weights(tokenizer: object, vocab_size: int, weight: float) -> np.ndarray | None:
    """[vocab_size] loss weights: `weight` for every token that spells digits only (with or without a leading
    space marker), 1 for the rest; None (the plain loss) for a weight of 1."""
    if weight <= 0:
        raise ValueError(f"a number token's loss weight must be positive, got {weight}")
    if weight == 1.0:
        return None
    weights = np.ones(vocab_size, np.float32)
    for token, index in tokenizer.get_vocab().items():
        if token.lstrip("\u0120").isdigit() and index < vocab_size:
            weights[index] = weight
    return weights


def without_system_turn(sequence: TrainingSequence, im_start_id: int) -> TrainingSequence:
    """The transcript from its user turn on: the system prompt and tool schema (the same for every transcript and
    most of its length) cut off."""
    starts = [index for index, token in enumerate(sequence.token_ids) if token == im_start_id]
    if len(starts) < 2:
        raise ValueError("a transcript must hold a system turn and a user turn")
    return TrainingSequence(sequence.token_ids[starts[1]:], sequence.loss_mask[starts[1]:])


def _save(manager: ocp.CheckpointManager, state: TrainState, iterators: dict[str, grain.DatasetIterator]) -> None:
    items = {name: grain.checkpoint.CheckpointSave(iterator) for name, iterator in iterators.items()}
    manager.save(int(state.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state), **items), force=True)


def _restore(manager: ocp.CheckpointManager, like: TrainState, shardings: TrainState,
             iterators: dict[str, grain.DatasetIterator]) -> TrainState | None:
    step = manager.latest_step()
    if step is None:
        return None
    items = {name: grain.checkpoint.CheckpointRestore(iterator) for name, iterator in iterators.items()}
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_placed(like, shardings)), **items))
    return restored["state"]


@gin.configurable
def train_sft(out: str | Path, steps: int = 100, batch_size: int = 16, num_transcripts: int = 256,
              drill_steps: int = 0, drill_batch_size: int = 16, short_steps: int = 0, short_batch_size: int = 8,
              drill_snippets: int = 3, drill_length: int | None = None, drill_retries: float = 0.0,
              drill_kinds: Sequence[str] = KINDS, data_seed: int = 0, model_seed: int = 0, tokenizer: str = "tiny",
              save_every: int = 25, stop_at_step: int | None = None, pad_multiple: int | None = None,
              number_loss_weight: float = 1.0, copy_gate: CopyGate | None = None,
              drill_repeats: float = 0.0, drill_assistant_only: bool = False,
              drill_long_numbers: float = 0.0) -> Path | None:
    """Run (or resume) the format SFT into `out`; returns the trained HF folder, or None when stopped early.

    `drill_steps` steps of `drill_batch_size` copy drills come first, then `short_steps` steps of `short_batch_size`
    transcripts without their system turn, then `steps` steps of `batch_size` whole transcripts (of
    `num_transcripts`, generated once against a sandbox server and cached in OUT/transcripts.jsonl).
    A drill row holds `drill_snippets` whole pieces, or with `drill_length` as many pieces as fill exactly that many
    tokens (no padding); a share `drill_retries` of the pieces are retries and a share `drill_repeats` lists of
    numbers repeated, a share `drill_long_numbers` of those numbers of two tokens (`rstar_jax.data.copy_drills`),
    and the questions are of `drill_kinds` (a kind named twice is drawn twice as often). Every drill token is
    trained on, or with `drill_assistant_only` only the assistant turns'.
    Rows are padded to a multiple of `pad_multiple` tokens (None: the next power of two; `bucket_length`).
    A trained target that is a number token (digits only) counts `number_loss_weight` times in the loss.
    With a `copy_gate`, the scheduled steps are followed by its check of held-out copies and, while that fails, by
    up to `copy_gate.rounds` rounds of short then whole transcripts (`rstar_jax.train.copy_gate`); each check is an
    entry of phase "copy_check" in OUT/metrics.jsonl, and a resumed run reads it back rather than checking again.
    `stop_at_step` ends the run after that step without saving anything more, exactly as if it were killed there.
    Writes OUT/model/, OUT/metrics.jsonl, OUT/tensorboard/, OUT/summary.json and OUT/checkpoints/.
    """
    if min(steps, batch_size, num_transcripts, drill_batch_size, short_batch_size, save_every,
           drill_length or 1) < 1 or min(drill_steps, short_steps) < 0:
        raise ValueError(f"train_sft needs steps, batch sizes, num_transcripts, save_every and drill_length (when "
                         f"set) >= 1 and drill_steps >= 0, got {steps}, {batch_size}/{drill_batch_size}, "
                         f"{num_transcripts}, {save_every}, {drill_length}, {drill_steps}")
    out = Path(out)
    started = time.monotonic()
    model = seeded_model(out / MODEL_DIR, model_seed, tokenizer)
    token_source = load_tokenizer(tokenizer)
    # A bad weight fails here, before any transcript is made.
    weights = number_token_weights(token_source, model.config.vocab_size, number_loss_weight)
    sequences = cached_sft_sequences(out / TRANSCRIPTS_FILE, num_transcripts, data_seed, token_source)
    check_batch = None if copy_gate is None else gate_batch(out / GATE_TRANSCRIPTS_FILE, copy_gate, token_source)
    scheduled = drill_steps + short_steps + steps
    rounds = (0, 0, 1.0) if copy_gate is None else (copy_gate.rounds, copy_gate.round_steps, copy_gate.peak_fraction)
    optimizer, schedule = sft_optimizer(scheduled, restarts=rounds)
    mesh = make_mesh()
    abstract = abstract_train_state(model.params, optimizer)
    shardings = train_state_shardings(abstract, mesh)
    manager = ocp.CheckpointManager((out / CHECKPOINT_DIR).absolute(),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    short = [without_system_turn(sequence, token_source.convert_tokens_to_ids(IM_START)) for sequence in sequences]
    iterators = {"transcripts": transcript_batches(sequences, batch_size, data_seed),
                 "short_transcripts": transcript_batches(short, short_batch_size, data_seed + 1)}
    restored = _restore(manager, abstract, shardings, iterators)
    state = new_train_state(model.params, optimizer, shardings) if restored is None else restored
    start = int(state.step)
    end = scheduled
    if start > scheduled:
        if copy_gate is None:
            raise ValueError(f"{out} holds a checkpoint of step {start}, past the {scheduled} scheduled steps: it was "
                             f"trained with a copy gate (train_sft.copy_gate); resume it with the same config")
        end += -(-(start - scheduled) // copy_gate.round_steps) * copy_gate.round_steps
    if start:
        say(f"SFT: resuming {out} after step {start} of {end}")
    steps_for = {size: make_sft_step(model.config, optimizer, schedule, mesh, shardings, size, weights)
                 for size in {batch_size, drill_batch_size, short_batch_size}}
    pad_id = model.config.pad_token_id or 0
    phases = _Phases(drill_steps, short_steps, scheduled, copy_gate)
    with MetricsWriter(out, resume_step=start) as writer, Progress(end, "SFT", initial=start) as progress:
        step = start
        while True:
            for step in range(step, end):
                phase = phases.of(step)
                if phase == "drills":
                    rows = drill_batch(step, drill_batch_size, token_source, data_seed, drill_snippets, drill_length,
                                       drill_retries, drill_kinds, drill_repeats, drill_assistant_only,
                                       drill_long_numbers)
                else:
                    rows = next(iterators["short_transcripts" if phase == "short" else "transcripts"])
                batch = make_batch(rows, pad_id, pad_multiple)
                state, metrics = steps_for[len(rows)](state, batch)
                values = {name: float(value) for name, value in jax.device_get(metrics).items()}
                writer.write(step + 1, {"phase": phase, "seq_len": batch.shape[1], **values})
                progress.advance(phase=phase, loss=values["loss"])
                if stop_at_step is not None and step + 1 >= stop_at_step:
                    manager.wait_until_finished()
                    return None
                if (step + 1) % save_every == 0 or step + 1 == end:
                    _save(manager, state, iterators)
            step = end
            if copy_gate is None or _copies_hold(writer, end, state.params, model.config, check_batch, copy_gate):
                break
            if end == scheduled + copy_gate.rounds * copy_gate.round_steps:
                if copy_gate.rounds:
                    say(f"SFT: the copies still fall short after {copy_gate.rounds} extra rounds; the model is kept")
                break
            say(f"SFT: another round of {copy_gate.short_steps} short and {copy_gate.steps} whole transcripts")
            end += copy_gate.round_steps
            progress.extend(copy_gate.round_steps)
        manager.wait_until_finished()
        log = [entry for entry in writer.entries if "loss" in entry]
        checks = [entry for entry in writer.entries if entry["phase"] == "copy_check"]
    save_model_folder(model.config, state.params, out / MODEL_DIR, tokenizer)
    summary = {"steps": end, "drill_steps": drill_steps, "short_steps": short_steps, "scheduled_steps": scheduled,
               "extra_rounds": (end - scheduled) // max(rounds[1], 1), "copy_checks": checks,
               "resumed_from_step": start, "num_transcripts": len(sequences),
               "total_seconds": time.monotonic() - started, "first_loss": log[0]["loss"], "final_loss": log[-1]["loss"]}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return out / MODEL_DIR


@dataclasses.dataclass(frozen=True)
class _Phases:
    """Which phase a step belongs to: the scheduled drills, short and whole transcripts, then the copy gate's
    rounds (short then whole transcripts each)."""

    drill_steps: int
    short_steps: int
    scheduled: int
    gate: CopyGate | None

    def of(self, step: int) -> str:
        if step < self.drill_steps:
            return "drills"
        if step < self.drill_steps + self.short_steps:
            return "short"
        if step < self.scheduled:
            return "transcripts"
        return "short" if (step - self.scheduled) % self.gate.round_steps < self.gate.short_steps else "transcripts"


def _copies_hold(writer: MetricsWriter, step: int, params: object, config: object, batch: tuple,
                 gate: CopyGate) -> bool:
    """The copy gate's verdict after `step`: read back from the metrics when a resumed run already checked there,
    else measured now and recorded as a "copy_check" entry."""
    recorded = [entry for entry in writer.entries if entry["step"] == step and entry["phase"] == "copy_check"]
    figures = recorded[0] if recorded else writer.write(step, {"phase": "copy_check",
                                                              **check_copies(params, config, batch, gate)})
    say(f"SFT: copy gate after step {step}: 2- and 3-digit copies {figures['multi_digit']:.1%} right "
        f"(gate {gate.min_multi_digit:.0%}), by digits "
        + ", ".join(f"{count}: {value:.1%}" for count, value in figures["by_digits"].items()))
    return figures["passed"]
