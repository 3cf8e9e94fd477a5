"""The RL trainer's paths beyond the demo (issue 25 item 1): the 'drop_solved' difficulty filter on the first and on
a later stage, a filter that keeps nothing, refilling zero-variance groups (`TrainingGroups.merged`'s group sizes)
and several optimiser steps per RL step.

Cheap where outcomes need not vary: a small random model (it solves nothing) on the in-process JAX engine and a real
sandbox server. Where they must vary (refill, a filter that drops solved problems): the format-SFT'd tiny model of
the session fixture `sft_model_dir`, on digit counts, the kind it solves most often.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.data.problem import Problem
from rstar_jax.data.problem_source import ProblemSource
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import ModelConfig, init_params, load_hf
from rstar_jax.parallel import make_mesh
from rstar_jax.processes import running_sandbox
from rstar_jax.rl import GroupOutcome, PlainGrpoSelector, RocSelector, Selection
from rstar_jax.rollout.agent_loop import RolloutSample
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.train.metrics import read_metrics
from rstar_jax.train.rl_checkpoint import TrainerRecord, latest_record
from rstar_jax.train.rl_groups import TrainingGroups, training_groups
from rstar_jax.train.rl_hooks import StepEvent
from rstar_jax.train.rl_setup import RLSettings, rl_setup
from rstar_jax.train.rl_trainer import RLTrainer
from rstar_jax.train.stages import Stage
from tests.engine_shapes import few_engine_shapes

RANDOM_CONFIG = ModelConfig(family="qwen3", vocab_size=2048, hidden_size=32, intermediate_size=40, num_layers=1,
                            num_heads=1, num_kv_heads=1, head_dim=32, max_position_embeddings=1024)
RANDOM_BACKEND = RolloutBackend(slots=8, max_len=512)
SFT_SEED, SFT_RL_SEED = 41, 1  # digit counts the fixture's model solves sometimes, and a run seed that refills
RL_OPTIMIZER = ["rl_optimizer.warmup_steps = 0", "rl_optimizer.learning_rate = 1e-4"]


@pytest.fixture(autouse=True)
def gin_bindings() -> Iterator[None]:
    """The optimiser of a few-step run (no warm-up) and engines of few shapes, cleared after each test."""
    gin.clear_config()
    parse_gin([], [*RL_OPTIMIZER, *few_engine_shapes(RANDOM_BACKEND.max_len)])
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def sandbox_url() -> Iterator[str]:
    with running_sandbox(["--workers", "2"]) as server:
        yield server.url


def _synthetic(seed: int, count: int = 8, kinds: tuple[str, ...] = ("multiply", "digit_sum")) -> ProblemSource:
    return ProblemSource(source="synthetic", count=count, seed=seed, split="train", kinds=kinds)


def _random_stage(name: str, steps: int, seed: int, **options: Any) -> Stage:
    """A stage for the random model: one turn of 8 tokens (it never writes a tool call or an answer)."""
    return Stage(name=name, steps=steps, max_response_tokens=8, max_turns=1, data=_synthetic(seed), **options)


class Observed(RLTrainer):
    """The trainer, recording what it does (nothing changed): each rollout round's step, stage, prompts and groups,
    and each update's groups, learner calls (the rows of each) and the state's step counter before and after."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[int, int, list[str], TrainingGroups]] = []  # (step, stage, prompt ids, groups)
        self.updates: list[dict[str, Any]] = []
        self.now = (-1, -1)

    async def _step(self, position, *args, **kwargs):
        self.now = (position.step, position.stage)
        return await super()._step(position, *args, **kwargs)

    async def _rollout_round(self, loop, prompts, seed, verifier, timings):
        rolled, groups = await super()._rollout_round(loop, prompts, seed, verifier, timings)
        self.rounds.append((*self.now, [problem.id for problem in prompts], groups))
        return rolled, groups

    def _mini_batches(self, groups, seed):
        self.trained = groups
        return super()._mini_batches(groups, seed)

    def _update(self, state, mini_batches, reference):
        before = int(jax.device_get(state.step))
        calls: list[list[Any]] = []
        update = self.learner.update

        def counted(state, batches, on_policy=False):
            rows = []
            for batch in batches:  # each trained row's input ids (rows with no trained token are padding)
                ids, mask = np.asarray(batch.tokens.input_ids), np.asarray(batch.tokens.attention_mask)
                trained = np.asarray(batch.tokens.loss_mask).sum(axis=1) > 0
                rows += [tuple(int(t) for t in ids[row, :mask[row].sum()]) for row in np.flatnonzero(trained)]
            calls.append(rows)
            return update(state, batches, on_policy)

        self.learner.update = counted
        try:
            state, metrics = super()._update(state, mini_batches, reference)
        finally:
            self.learner.update = update
        self.updates.append({"groups": self.trained, "calls": calls, "step_before": before,
                             "step_after": int(jax.device_get(state.step)), "metrics": metrics})
        return state, metrics


def _record_at(trainer: RLTrainer, step: int) -> TrainerRecord:
    restored = trainer.manager.restore(step, args=ocp.args.Composite(trainer=ocp.args.JsonRestore()))
    return TrainerRecord.from_json(restored["trainer"])


def _random_trainer(run_dir: Path, settings: RLSettings, cls: type[RLTrainer] = Observed) -> RLTrainer:
    return cls(run_dir, RANDOM_CONFIG, init_params(RANDOM_CONFIG, jax.random.key(0)), "tiny",
               rl_setup(settings, backend=RANDOM_BACKEND))


# ---- the difficulty filter, with a model that solves nothing -----------------------------------------------------

@pytest.mark.slow
def test_the_filter_runs_on_the_first_and_on_a_later_stage(tmp_path: Path, sandbox_url: str, verifier,
                                                           capsys: pytest.CaptureFixture) -> None:
    """A fresh run filters its first stage too (issue 25's bug: stage 0's filter was skipped with its header), then
    the later stage's at its start; each stage keeps the problems it tried and the model did not always solve (a
    random model: all of them), records them by stage index, and draws its prompts from them alone."""
    settings = RLSettings(stages=(_random_stage("a", 2, 11, data_filter="drop_solved", filter_samples=2,
                                                filter_problems=3),
                                  _random_stage("b", 1, 12, data_filter="drop_solved", filter_samples=2,
                                                filter_problems=5)),
                          prompts_per_step=2, group_size=2, micro_batch_rows=4, max_to_keep=3)
    trainer = _random_trainer(tmp_path, settings)
    positions, every_second = [], []

    def note(event: StepEvent) -> None:  # a user's hook every 2 steps: what it adds to the metrics is logged
        every_second.append((event.position.step, event.stage_name, event.is_last))
        event.metrics["noted_at"] = event.position.step

    trainer.add_hook(lambda event: positions.append(event.position))
    trainer.add_hook(note, every_steps=2)
    trainer.run([sandbox_url], verifier)
    out = capsys.readouterr().out
    tried = [[problem.id for problem in problems[:count]] for problems, count in zip(trainer.problems, (3, 5))]
    assert all(len(set(ids)) == len(ids) for ids in tried) and not set(tried[0]) & set(tried[1])
    lines = out.splitlines()
    order = [next(i for i, line in enumerate(lines) if line.startswith(prefix)) for prefix in (
        "RL stage a: 2 steps", "  a: filtering 3 problems (2 attempts each)", "  a: kept 3 of 3 problems",
        "RL stage b: 1 steps", "  b: filtering 5 problems (2 attempts each)", "  b: kept 5 of 5 problems")]
    assert order == sorted(order), out
    assert sum(line.startswith("RL stage ") for line in lines) == 2  # each stage's header once
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [entry["stage"] for entry in metrics] == ["a", "a", "b"]
    assert all(entry["accuracy"] == 0.0 for entry in metrics)  # so nothing was solved every time: all kept
    assert _record_at(trainer, 1).kept_problems == {0: sorted(tried[0])}  # in stage a, b not yet filtered
    assert latest_record(trainer.manager).kept_problems == {0: sorted(tried[0]), 1: sorted(tried[1])}
    by_stage = {0: [], 1: []}
    for _, stage_index, prompts, _ in trainer.rounds:
        by_stage[stage_index] += prompts
    assert len(by_stage[0]) == 4 and set(by_stage[0]) <= set(tried[0])  # 2 steps x 2 prompts, 3 problems kept
    assert len(by_stage[1]) == 2 and set(by_stage[1]) <= set(tried[1])
    assert not trainer.updates  # no reward spread: no update
    # Hooks (issue 25 item 6): every step's position, nothing changed in place by a later stage's filter; the hook
    # every 2 steps ran after step 2 and the last, and its figure was logged with those steps only.
    assert [(p.step, p.stage, dict(p.kept)) for p in positions] == [
        (1, 0, {0: tuple(sorted(tried[0]))}), (2, 0, {0: tuple(sorted(tried[0]))}),
        (3, 1, {0: tuple(sorted(tried[0])), 1: tuple(sorted(tried[1]))})]
    assert every_second == [(2, "a", False), (3, "b", True)]
    assert [entry.get("noted_at") for entry in metrics] == [None, 2, 3]


class KeepsNothing(Observed):
    """A filter that keeps nothing (as for a model that solves every problem every time, which a test cannot
    cheaply train) on the stage at index `empty_stage`; the filter's rollouts still run."""

    empty_stage = 0

    async def _filter_stage(self, stage_index, loop, verifier):
        kept = await super()._filter_stage(stage_index, loop, verifier)
        return () if stage_index == self.empty_stage else kept


@pytest.mark.slow
@pytest.mark.parametrize("empty_stage", [0, 1], ids=["first-stage", "later-stage"])
def test_a_filter_that_keeps_nothing_stops_with_an_error_naming_the_stage(tmp_path: Path, sandbox_url: str, verifier,
                                                                          empty_stage: int) -> None:
    """An empty kept set is a clear error naming the stage and its filter, not a prompt stream that never yields;
    as the first stage or after a stage that trained."""
    plain = _random_stage("plain", 1, 11)
    filtered = _random_stage("hard", 1, 12, data_filter="drop_solved", filter_samples=3, filter_problems=4)
    settings = RLSettings(stages=(filtered, plain) if empty_stage == 0 else (plain, filtered), prompts_per_step=2,
                          group_size=2, micro_batch_rows=4)
    trainer = _random_trainer(tmp_path, settings, type("KeepsNothingHere", (KeepsNothing,),
                                                       {"empty_stage": empty_stage}))
    with pytest.raises(ValueError, match=r"stage 'hard': its difficulty filter \('drop_solved', 3 attempts each\) "
                                         r"kept none of the 4 problems it tried"):
        trainer.run([sandbox_url], verifier)
    steps_done = read_metrics(tmp_path / "metrics.jsonl") if (tmp_path / "metrics.jsonl").exists() else []
    assert len(steps_done) == empty_stage  # the stage before it trained; nothing of the empty stage ran


def test_the_learning_rate_schedule_spans_every_optimiser_step_of_the_run(tmp_path: Path) -> None:
    """With several updates a step the schedule (counted in optimiser steps) lasts the whole run, not its first
    1 / updates_per_step."""
    parse_gin([], ["rl_optimizer.schedule = 'linear'"])
    settings = RLSettings(stages=(_random_stage("a", 4, 11),), updates_per_step=3)
    schedule = _random_trainer(tmp_path, settings).schedule
    assert float(schedule(6)) == pytest.approx(0.5e-4) and float(schedule(12)) == pytest.approx(0.0, abs=1e-12)


# ---- TrainingGroups: the batch's group sizes are carried, not inferred ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Trajectory:
    """The counts a selector reads of a rollout (the rest of a Trajectory is not needed here)."""

    tool_calls: tuple = ()
    tool_errors: int = 0
    answer_tags: int = 1
    turns: int = 1


def _samples(prompts: int, per_prompt: int, tag: str) -> list[RolloutSample]:
    return [RolloutSample(Problem(id=f"{tag}{group}", question="q", answer="1", source="test"), group, sample, 0, _Trajectory())
            for group in range(prompts) for sample in range(per_prompt)]


def _verdicts(patterns: list[str]) -> list[bool]:
    return [char == "1" for pattern in patterns for char in pattern]


@pytest.mark.parametrize("selector", [RocSelector(mode="release"), PlainGrpoSelector()], ids=["roc", "grpo"])
def test_merged_takes_whole_groups_of_the_group_size_from_a_refill_round(selector) -> None:
    """RoC rolls out 2G a prompt and keeps G: a refill round's groups join the batch G rows at a time, the first of
    them that fit; a group set aside for room is counted apart from the groups without signal."""
    group_size = 4
    per_prompt = selector.rollouts_per_prompt(group_size)
    mixed, wrong, right = "10" * (per_prompt // 2), "0" * per_prompt, "1" * per_prompt
    first = training_groups(_samples(3, per_prompt, "a"), _verdicts([mixed, wrong, mixed]), selector, group_size, 1)
    more = training_groups(_samples(3, per_prompt, "b"), _verdicts([mixed, right, mixed]), selector, group_size, 2)
    assert (first.groups_seen, first.groups_kept, first.group_size, len(first.samples)) == (3, 2, 4, 8)
    merged = first.merged(more, max_groups=3)
    assert (merged.groups_seen, merged.groups_kept, merged.group_size) == (6, 3, 4)
    assert (merged.groups_surplus, merged.groups_without_signal) == (1, 2)  # b2 had no room; a1 and b1 no signal
    assert [sample.problem.id for sample in merged.samples] == ["a0"] * 4 + ["a2"] * 4 + ["b0"] * 4
    assert merged.samples[8:] == more.samples[:4]
    np.testing.assert_array_equal(merged.rewards, np.concatenate([first.rewards, more.rewards[:4]]))
    for group in range(3):
        assert np.sum(merged.advantages[4 * group:4 * group + 4]) == pytest.approx(0.0, abs=1e-9)
    # Refilling an empty batch; merging into a full one takes nothing.
    empty = training_groups(_samples(2, per_prompt, "c"), _verdicts([wrong, right]), selector, group_size, 3)
    assert (empty.groups_kept, empty.group_size, empty.groups_without_signal) == (0, 4, 2)
    refilled = empty.merged(more, max_groups=3)
    assert refilled.groups_kept == 2 and len(refilled.samples) == 8 and refilled.groups_without_signal == 3
    assert merged.merged(more, max_groups=3).groups_kept == 3 and len(merged.merged(more, 3).samples) == 12


def test_a_selector_keeping_other_than_the_group_size_is_refused() -> None:
    """merged() cuts the batch by whole groups of `group_size` rows, so the selector contract (keep exactly G) is
    checked where the groups are made."""

    class KeepsOneMore(PlainGrpoSelector):
        def select(self, group: GroupOutcome, group_size: int, seed: int) -> Selection:
            indices = np.arange(group_size + 1) % group.size
            return Selection(indices, np.asarray(group.rewards, np.float64)[indices])

    with pytest.raises(ValueError, match="kept 5 rollouts of group 0, not group_size = 4"):
        training_groups(_samples(1, 4, "a"), _verdicts(["1010"]), KeepsOneMore(), 4, 0)
    with pytest.raises(ValueError, match="cannot merge groups of 4 with groups of 2"):
        training_groups(_samples(1, 8, "a"), _verdicts(["10" * 4]), RocSelector(), 4, 0).merged(
            training_groups(_samples(1, 4, "b"), _verdicts(["1010"]), RocSelector(), 2, 0), 4)


# ---- refill and several updates per step, on a model whose outcomes vary ------------------------------------------

def _whole_groups(rounds: list[TrainingGroups], max_groups: int) -> list[RolloutSample]:
    """What the step must train on, worked out from its rollout rounds: every kept group of the first round, then
    the kept groups of the next rounds in order, whole (G rows each), until `max_groups`."""
    samples, groups = [], 0
    for round_groups in rounds:
        size = round_groups.group_size
        for start in range(0, len(round_groups.samples), size):
            if groups < max_groups:
                samples += round_groups.samples[start:start + size]
                groups += 1
    return samples


@pytest.mark.slow
def test_refill_and_two_updates_a_step_with_the_sft_model(sft_model_dir: Path, tmp_path: Path, sandbox_url: str,
                                                          verifier) -> None:
    """With the format-SFT'd model on digit counts (solved sometimes): the first stage's filter drops the problems
    solved in every attempt (one each here) and keeps the rest (exactly those, recorded); zero-variance groups are refilled from the
    next prompts, whole groups of G rows, up to the batch's prompts; and each step with signal makes two optimiser
    steps, on two mini-batches holding every kept row once, the state's step counter advanced by two."""
    # The SFT's system prompt; RL rows padded to one length (one compiled shape for every update of the run).
    parse_gin([SFT_GIN], [*RL_OPTIMIZER, *few_engine_shapes()])
    verdicts: list[tuple[list[str], list[bool]]] = []

    class Recorded:  # the session's verifier pool, its verdicts recorded
        def verify_batch(self, responses, references, timeout_s=None):
            result = verifier.verify_batch(responses, references, timeout_s=timeout_s)
            verdicts.append((list(references), list(result)))
            return result

    model = load_hf(sft_model_dir)
    stage = Stage(name="digits", steps=2, max_response_tokens=384, max_turns=3,
                  data=_synthetic(SFT_SEED, count=32, kinds=("digit_count",)), data_filter="drop_solved",
                  filter_samples=1, filter_problems=12)
    settings = RLSettings(stages=(stage,), prompts_per_step=4, group_size=2, micro_batch_rows=4, updates_per_step=2,
                          zero_variance="refill", max_refill_rounds=2, seed=SFT_RL_SEED, pad_multiple=1024)
    trainer = Observed(tmp_path, model.config, model.params, str(sft_model_dir),
                       rl_setup(settings, backend=RolloutBackend(slots=16)), make_mesh(devices=jax.devices()[:1]))
    trainer.run([sandbox_url], Recorded())

    # The filter: its own rollouts' verdicts decide, problem by problem.
    tried = trainer.problems[0][:12]
    answers, solved = verdicts[0]
    assert answers == [p.answer for p in tried]
    expected_kept = sorted(p.id for p, right in zip(tried, solved) if not right)
    assert 0 < len(expected_kept) < 12, "some problems solved in their attempt (dropped), some not"
    assert latest_record(trainer.manager).kept_problems == {0: expected_kept}
    assert all(set(prompts) <= set(expected_kept) for _, _, prompts, _ in trainer.rounds)

    # Refill: a step's rounds until 4 groups with signal (or 2 refill rounds), trained as whole groups of G = 2.
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    rounds_per_step = [[groups for step, _, _, groups in trainer.rounds if step == index] for index in range(2)]
    # Precondition of the data and seeds: a step refilled (at ~15% accuracy and G = 2, a round of 4 groups all with
    # signal has odds below 1%). Whether a refill round brings more groups with signal than the batch has room for is
    # the draw's (it needed luck here, and a CI host's rounding lost it); the accounting below holds either way, and
    # test_merged_takes_whole_groups_of_the_group_size_from_a_refill_round pins the surplus itself.
    assert [len(rounds) for rounds in rounds_per_step] != [1, 1], "a step refilled zero-variance groups"
    for rounds in rounds_per_step:
        kept = np.cumsum([groups.groups_kept for groups in rounds])
        assert len(rounds) <= 3 and (kept[:-1] < 4).all() and (len(rounds) == 3 or kept[-1] >= 4)
    updated = iter(trainer.updates)
    for entry, groups in zip(metrics, rounds_per_step):
        assert entry["groups_seen"] == 4 * len(groups)
        assert entry["groups_kept"] == min(4, sum(g.groups_kept for g in groups))
        assert entry["groups_surplus"] == sum(g.groups_kept for g in groups) - entry["groups_kept"]
        if not entry["groups_kept"]:
            continue
        update = next(updated)
        trained = update["groups"]
        assert trained.group_size == 2 and len(trained.samples) == 2 * entry["groups_kept"]
        assert list(trained.samples) == _whole_groups(groups, 4)
        # Two optimiser steps, on mini-batches holding every kept row once.
        assert len(update["calls"]) == 2 and update["step_after"] - update["step_before"] == 2
        assert entry["updates"] == 2
        rows = sorted(row for call in update["calls"] for row in call)
        assert rows == sorted(tuple(s.trajectory.token_ids[:-1]) for s in trained.samples)
        assert all(update["calls"])
        assert entry["trained_tokens"] == sum(sum(s.trajectory.loss_mask[1:]) for s in trained.samples)
        assert entry["grad_norm"] > 0
    assert next(updated, None) is None and trainer.updates, "some step had reward spread"
