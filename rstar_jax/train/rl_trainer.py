"""The staged RL trainer: GRPO-RoC (or a baseline) from prompts to pushed weights, step after step (SPEC sections
4-5; DESIGN "Data flow of one RL step").

Each step: the stage's prompts (grain) -> `selector.rollouts_per_prompt(G)` rollouts each through `AgentLoop`
(engines behind one `FailoverEngine`, tools on the sandbox server) -> `verify_batch` -> selection and advantages
(`training_groups`; groups without reward spread dropped or refilled from the next prompts) -> the learner's old
log-probs and update(s) -> weights pushed to every engine -> metrics (JSONL + TensorBoard) -> an orbax checkpoint.
Every random choice derives from the run's seed and the step, and checkpoints hold the iterator, so a killed run
rerun with the same command continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rstar_jax.agent.tool_protocol import ToolExecutor, ToolOutcome
from rstar_jax.agent.trajectory import sampled_turn_texts
from rstar_jax.console import Progress, say
from rstar_jax.data.difficulty import hard_problem_ids, keep_only, solve_stats
from rstar_jax.data.pipeline import prompt_batches
from rstar_jax.data.problem import Problem
from rstar_jax.model import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.parallel import make_mesh
from rstar_jax.reward import verify_batch
from rstar_jax.rl import PolicyLossOptions, Selector, make_selector
from rstar_jax.rl.metrics import trajectory_metrics
from rstar_jax.rollout.agent_loop import AgentLoop, RolloutSample
from rstar_jax.rollout.backends import RolloutBackend, RolloutEngines, check_prompts_fit
from rstar_jax.rollout.engine import GenerationEngine
from rstar_jax.seeds import derived_seed, step_seed
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.metrics import MetricsWriter
from rstar_jax.train.optim import rl_optimizer
from rstar_jax.train.rl_batch import RLBatch, logprob_gap, rl_micro_batches
from rstar_jax.train.rl_checkpoint import (TrainerRecord, latest_record, restore_rl_checkpoint, rl_checkpoint_manager,
                                           save_rl_checkpoint)
from rstar_jax.train.rl_groups import TrainingGroups, training_groups
from rstar_jax.train.rl_step import RLLearner
from rstar_jax.train.stages import Stage, check_stages, stage_at
from rstar_jax.train.state import (TrainState, abstract_train_state, init_optimizer_state, new_train_state,
                                   train_state_shardings)
from sandbox_server.client import SandboxClient

ZERO_VARIANCE_MODES = ("drop", "refill")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RLSettings:
    """The run's knobs besides the stages' (SPEC 4-5 numbers in brackets).

    prompts_per_step: prompts a step (512); group_size: G, the rollouts trained on per prompt (16; RoC samples 2G);
    micro_batch_rows: rows of one learner micro-batch (memory, not maths: accumulation is exact);
    updates_per_step: optimiser steps a step, on that many mini-batches (1); temperature: sampling (1.0); seed;
    zero_variance: "drop" groups whose rewards are all equal (the release) or "refill" from the next prompts (DAPO),
    at most `max_refill_rounds` extra rollout rounds; checkpoint_every: steps between checkpoints (the last step is
    always saved); max_to_keep: checkpoints kept; verify_timeout_s: per answer.
    """

    stages: tuple[Stage, ...] = ()
    prompts_per_step: int = 8
    group_size: int = 4
    micro_batch_rows: int = 8
    updates_per_step: int = 1
    temperature: float = 1.0
    seed: int = 0
    zero_variance: str = "drop"
    max_refill_rounds: int = 2
    checkpoint_every: int = 1
    max_to_keep: int = 2
    verify_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", check_stages(self.stages))
        for name in ("prompts_per_step", "micro_batch_rows", "updates_per_step", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"RLSettings.group_size must be >= 2 (an advantage needs a group), got {self.group_size}")
        if self.zero_variance not in ZERO_VARIANCE_MODES:
            raise ValueError(f"RLSettings.zero_variance must be one of {ZERO_VARIANCE_MODES}, "
                             f"got {self.zero_variance!r}")
        if self.max_refill_rounds < 0:
            raise ValueError(f"RLSettings.max_refill_rounds must be >= 0, got {self.max_refill_rounds}")

    @property
    def total_steps(self) -> int:
        """RL steps over all stages."""
        return sum(stage.steps for stage in self.stages)


class TimedExecutor:
    """A `ToolExecutor` that passes calls on and measures the wall time during which any call was in flight (the
    "tools" share of a rollout: tool calls overlap generation and each other)."""

    def __init__(self, inner: ToolExecutor) -> None:
        self.inner, self.busy_s = inner, 0.0
        self._in_flight, self._since = 0, 0.0

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> ToolOutcome:
        """Run one call on the inner executor."""
        if self._in_flight == 0:
            self._since = time.monotonic()
        self._in_flight += 1
        try:
            return await self.inner.run(code, stdin, timeout_s=timeout_s)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.busy_s += time.monotonic() - self._since


def _answers(samples: Sequence[RolloutSample], tokenizer: Any) -> list[str]:
    """What each rollout's answer is read from: the model's own turns (SPEC 3), never tool output."""
    return ["\n".join(sampled_turn_texts(sample.trajectory, tokenizer)) for sample in samples]


class RLTrainer:
    """A resumable RL run in `run_dir` from a model (`config`, initial `params`) and gin-set `settings`.

    The run's state takes `params` over (no copy when they are already placed on `mesh` by the partition rules, as
    `load_hf(..., mesh=mesh)` places them; its train steps donate them), so callers must not use them after `run`.

    `run(sandbox_urls)` trains every stage (resuming from the latest checkpoint in run_dir), writing
    run_dir/metrics.jsonl, run_dir/tensorboard/ and run_dir/checkpoints/; it returns the final parameters.
    Misconfiguration (sizes, missing data) raises before any rollout.
    """

    def __init__(self, run_dir: str | Path, config: ModelConfig, params: Params, tokenizer: str = "tiny",
                 settings: RLSettings | None = None, selector: Selector | None = None,
                 loss: PolicyLossOptions | None = None, backend: RolloutBackend | None = None,
                 mesh: Mesh | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.config, self.tokenizer_name = config, tokenizer
        self.settings = settings or RLSettings()
        self.selector = selector or make_selector()
        self.loss = loss or PolicyLossOptions()
        self.backend = backend or RolloutBackend()
        self.tokenizer = load_tokenizer(tokenizer)
        self.problems = [stage.data.load() for stage in self.settings.stages]
        self._check_sizes()
        # The schedule counts optimiser steps: up to updates_per_step of them per RL step.
        optimizer, self.schedule = rl_optimizer(self.settings.total_steps * self.settings.updates_per_step)
        self.optimizer = optimizer
        self.mesh = mesh if mesh is not None else make_mesh()
        self._params: Params | None = params  # handed to the state (or dropped on a resume) by `start_state`
        self._abstract = abstract_train_state(params, optimizer)
        self.shardings = train_state_shardings(self._abstract, self.mesh)
        self.learner = RLLearner(config, optimizer, self.schedule, self.mesh, self.shardings,
                                 self.settings.micro_batch_rows, self.loss)
        self.manager = rl_checkpoint_manager(self.run_dir / "checkpoints", self.settings.max_to_keep)

    def _check_sizes(self) -> None:
        """Refuse, before any work, stages whose prompts leave no room in the engine's slots."""
        for stage, problems in zip(self.settings.stages, self.problems):
            if not problems:
                raise ValueError(f"stage {stage.name!r} has no problems ({stage.data.describe()})")
            check_prompts_fit(self.tokenizer, problems, stage.max_response_tokens, self.backend.token_limit,
                              f"stage {stage.name!r}", "Stage.max_response_tokens")

    # ---- data ---------------------------------------------------------------------------------------------------

    def _iterator(self, stage_index: int, kept: dict[int, list[str]]) -> Any:
        """A fresh prompt iterator of a stage (its difficulty filter applied when it has one)."""
        keep = (keep_only(frozenset(kept[stage_index])),) if stage_index in kept else ()
        dataset = prompt_batches(self.problems[stage_index], batch_size=self.settings.prompts_per_step,
                                 seed=self.settings.seed + stage_index, num_epochs=None, keep=keep,
                                 drop_remainder=True)
        return iter(dataset)

    async def _filter_stage(self, stage_index: int, engine: GenerationEngine, executor: ToolExecutor) -> list[str]:
        """SPEC 5 stage 3: the ids of the stage's problems the current model does not solve in every attempt."""
        stage = self.settings.stages[stage_index]
        problems = self.problems[stage_index][:stage.filter_problems]
        say(f"  {stage.name}: filtering {len(problems)} problems ({stage.filter_samples} attempts each)")
        loop = AgentLoop(engine, executor, self.tokenizer, max_turns=stage.max_turns,
                         max_response_tokens=stage.max_response_tokens, temperature=self.settings.temperature)
        samples = await loop.rollout(problems, stage.filter_samples, seed=derived_seed(self.settings.seed, 1, stage_index))
        verified = verify_batch(_answers(samples, self.tokenizer), [s.problem.answer for s in samples],
                                timeout_s=self.settings.verify_timeout_s)
        kept = hard_problem_ids(solve_stats([s.problem.id for s in samples], [float(v) for v in verified]))
        say(f"  {stage.name}: kept {len(kept)} of {len(problems)} problems")
        return sorted(kept)

    # ---- one step -----------------------------------------------------------------------------------------------

    async def _rollout_round(self, loop: AgentLoop, prompts: list[Problem], seed: int,
                             timings: dict[str, float]) -> tuple[list[RolloutSample], list[bool], TrainingGroups]:
        started = time.monotonic()
        samples = await loop.rollout(prompts, self.selector.rollouts_per_prompt(self.settings.group_size), seed=seed)
        verify_started = time.monotonic()
        verified = verify_batch(_answers(samples, self.tokenizer), [s.problem.answer for s in samples],
                                timeout_s=self.settings.verify_timeout_s)
        timings["rollout"] += verify_started - started
        timings["rewards"] += time.monotonic() - verify_started
        return samples, verified, training_groups(samples, verified, self.selector, self.settings.group_size, seed)

    async def _collect(self, loop: AgentLoop, iterator: Any, seed: int,
                       timings: dict[str, float]) -> tuple[list[RolloutSample], list[bool], TrainingGroups]:
        """Roll out the step's prompts; with zero_variance="refill", more prompts until the batch is full."""
        samples, verified, groups = await self._rollout_round(loop, next(iterator), seed, timings)
        settings = self.settings
        rounds = 0
        while (settings.zero_variance == "refill" and groups.groups_kept < settings.prompts_per_step
               and rounds < settings.max_refill_rounds):
            rounds += 1
            more_samples, more_verified, more = await self._rollout_round(
                loop, next(iterator), derived_seed(seed, rounds), timings)
            samples, verified = samples + more_samples, verified + more_verified
            groups = groups.merged(more, settings.prompts_per_step)
        return samples, verified, groups

    def _update(self, state: TrainState, groups: TrainingGroups, seed: int,
                reference: Params | None) -> tuple[TrainState, dict[str, float]]:
        """Old log-probs of every kept row under the sampling policy, then one optimiser step per mini-batch: the
        kept rows in a seeded order cut into `updates_per_step` mini-batches (fewer when there are fewer rows), each
        row in exactly one. With one mini-batch and no KL term the old log-probs come from the update's own forward
        pass (`RLLearner.update(on_policy=True)`), not from a pass of their own. Metrics: the updates' mean, except
        `trained_tokens` and `sequences` (the step's sums) and `updates` (optimiser steps taken)."""
        order = np.random.default_rng(seed).permutation(len(groups.samples))
        chunks = [chunk for chunk in np.array_split(order, self.settings.updates_per_step) if len(chunk)]
        pad_id = self.config.pad_token_id or 0
        with gin.config_scope("rl"):  # `rl/bucket_length.multiple` pads RL rows apart from the SFT's
            unscored = [rl_micro_batches([groups.samples[i].trajectory for i in chunk], groups.advantages[chunk],
                                         self.settings.micro_batch_rows, pad_id) for chunk in chunks]
        if len(unscored) == 1 and reference is None:
            state, metrics = self.learner.update(state, unscored[0], on_policy=True)
            return state, {**metrics, "updates": 1}
        mini_batches: list[list[RLBatch]] = [self.learner.with_policy_logprobs(state.params, batches, reference)
                                             for batches in unscored]
        gap = logprob_gap([batch for mini in mini_batches for batch in mini])
        totals: dict[str, float] = {}
        for mini in mini_batches:
            state, metrics = self.learner.update(state, mini)
            for name, value in metrics.items():
                share = 1 if name in ("trained_tokens", "sequences") else len(mini_batches)
                totals[name] = totals.get(name, 0.0) + value / share
        return state, {**totals, "logprob_gap": gap, "updates": len(mini_batches)}

    # ---- the run ------------------------------------------------------------------------------------------------

    def start_state(self, record: TrainerRecord | None = None,
                    iterator: Any = None) -> tuple[TrainState, Params | None]:
        """The run's state and reference: built from the start parameters, or restored from `record`'s checkpoint
        (which also moves `iterator`, the saved stage's fresh prompt iterator, to its saved position).
        Either way the trainer then drops its hold on the start parameters, so no second copy stays on a device
        (issue 22 item 2); a KL reference is a copy sharded like the parameters."""
        params, self._params = self._params, None
        if record is None:
            if params is None:
                raise RuntimeError(f"this RLTrainer already handed its start parameters to a run and {self.run_dir} "
                                   f"has no checkpoint to resume from: build a new RLTrainer")
            state = new_train_state(params, self.optimizer, self.shardings)
            return state, (jax.tree.map(jnp.copy, state.params) if self.loss.needs_reference else None)
        del params
        reference_like = self._abstract.params if self.loss.needs_reference else None
        return restore_rl_checkpoint(self.manager, record.step, self._abstract, self.shardings, iterator,
                                     reference_like)

    def run(self, sandbox_urls: Sequence[str], engines: RolloutEngines | None = None) -> Params:
        """Train (or resume) every stage; returns the final parameters (host arrays).

        Rollouts run on `engines` when given (they are sent the run's current weights first and left running),
        else on engines the configured `RolloutBackend` starts for the run and stops after it.
        """
        settings = self.settings
        record = latest_record(self.manager)
        if record is not None and record.seed != settings.seed:
            raise ValueError(f"{self.run_dir} holds a run with seed {record.seed}, not {settings.seed}; use another "
                             f"run folder")
        start = 0 if record is None else record.step
        # A fresh run has entered no stage yet: `_steps` enters stage 0 like any later one (its header, its data
        # filter, its optimiser and reference rules); a resumed one is inside the stage its checkpoint saved.
        stage_index = None if record is None else record.stage
        kept = {} if record is None else dict(record.kept_problems)
        iterator = None if record is None else self._iterator(record.stage, kept)
        state, reference = self.start_state(record, iterator)
        if start >= settings.total_steps:
            say(f"RL: all {settings.total_steps} steps already done in {self.run_dir}")
            return jax.device_get(state.params)
        if start:
            say(f"RL: resuming {self.run_dir} after step {start} of {settings.total_steps}")
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(MetricsWriter(self.run_dir, resume_step=start))
            if engines is None:
                engines = stack.enter_context(self.backend.start(self.config, jax.device_get(state.params),
                                                                 self.run_dir, self.tokenizer_name))
                push_first = False
            else:
                push_first = True
            state = asyncio.run(self._loop(engines, sandbox_urls, writer, state, reference, iterator, start,
                                           stage_index, kept, push_first))
        return jax.device_get(state.params)

    async def _loop(self, engines: RolloutEngines, sandbox_urls: Sequence[str], writer: MetricsWriter,
                    state: TrainState, reference: Params | None, iterator: Any, start: int, stage_index: int | None,
                    kept: dict[int, list[str]], push_first: bool) -> TrainState:
        try:
            return await self._steps(engines.engine, sandbox_urls, writer, state, reference, iterator, start,
                                     stage_index, kept, push_first)
        finally:
            await engines.aclose()

    async def _steps(self, engine: GenerationEngine, sandbox_urls: Sequence[str], writer: MetricsWriter,
                     state: TrainState, reference: Params | None, iterator: Any, start: int, stage_index: int | None,
                     kept: dict[int, list[str]], push_first: bool) -> TrainState:
        settings = self.settings
        if push_first:
            await engine.update_weights(state.params, start)
        async with SandboxClient(list(sandbox_urls)) as sandbox:
            executor = TimedExecutor(sandbox)
            with Progress(settings.total_steps, "RL", initial=start, every=1) as progress:
                for step in range(start, settings.total_steps):
                    index, _ = stage_at(settings.stages, step)
                    if index != stage_index:  # entering a new stage
                        stage_index = index
                        state, reference, iterator = await self._enter_stage(index, state, reference, kept, engine,
                                                                             executor)
                    state, metrics = await self._step(step, index, state, reference, iterator, engine, executor)
                    started = time.monotonic()
                    record = TrainerRecord(step + 1, stage_index, settings.seed, kept)
                    if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.total_steps:
                        save_rl_checkpoint(self.manager, state, iterator, record, reference)
                    metrics["seconds"]["checkpoint"] = time.monotonic() - started
                    writer.write(step + 1, metrics)
                    progress.advance(stage=settings.stages[index].name, accuracy=metrics["accuracy"],
                                     kept=metrics["groups_kept"], gap=metrics.get("logprob_gap", 0.0))
        return state

    async def _enter_stage(self, index: int, state: TrainState, reference: Params | None,
                           kept: dict[int, list[str]], engine: GenerationEngine,
                           executor: ToolExecutor) -> tuple[TrainState, Params | None, Any]:
        """A stage's start: its difficulty filter, optimiser reset and reference refresh (SPEC 5, stage 3)."""
        stage = self.settings.stages[index]
        say(f"RL stage {stage.name}: {stage.steps} steps, max {stage.max_response_tokens} response tokens, "
            f"T={stage.max_turns}, data: {stage.data.describe()}")
        if stage.data_filter == "drop_solved":
            kept[index] = await self._filter_stage(index, engine, executor)
            if not kept[index]:  # a prompt stream filtered down to nothing would wait forever for its first batch
                raise ValueError(f"stage {stage.name!r}: its difficulty filter ('drop_solved', {stage.filter_samples}"
                                 f" attempts each) kept none of the {len(self.problems[index][:stage.filter_problems])}"
                                 f" problems it tried (the model solved every one each time): give the stage "
                                 f"harder data, more Stage.filter_problems, or no data_filter")
        if stage.reset_optimizer:
            state = state.replace(opt_state=init_optimizer_state(state.params, self.optimizer,
                                                                  self.shardings.opt_state))
        if stage.refresh_reference and reference is not None:
            reference = jax.tree.map(jnp.copy, state.params)  # sharded like the parameters
        return state, reference, self._iterator(index, kept)

    async def _step(self, step: int, stage_index: int, state: TrainState, reference: Params | None, iterator: Any,
                    engine: GenerationEngine, executor: TimedExecutor) -> tuple[TrainState, dict[str, Any]]:
        stage, settings = self.settings.stages[stage_index], self.settings
        seed = step_seed(settings.seed, step)
        timings = {"rollout": 0.0, "rewards": 0.0, "update": 0.0, "weight_sync": 0.0}
        tools_before = executor.busy_s
        loop = AgentLoop(engine, executor, self.tokenizer, max_turns=stage.max_turns,
                         max_response_tokens=stage.max_response_tokens, temperature=settings.temperature)
        samples, verified, groups = await self._collect(loop, iterator, seed, timings)
        timings["tools"] = executor.busy_s - tools_before
        metrics: dict[str, Any] = {"stage": stage.name, **trajectory_metrics([s.trajectory for s in samples],
                                                                           verified)}
        metrics.update(groups_seen=groups.groups_seen, groups_kept=groups.groups_kept,
                       groups_surplus=groups.groups_surplus, kept_trajectories=len(groups.samples),
                       mean_reward=float(np.mean(groups.rewards)) if groups.groups_kept else 0.0)
        if groups.groups_kept:
            started = time.monotonic()
            state, update_metrics = self._update(state, groups, seed, reference)
            timings["update"] = time.monotonic() - started
            started = time.monotonic()
            await engine.update_weights(state.params, step + 1)
            timings["weight_sync"] = time.monotonic() - started
            metrics.update(update_metrics)
        metrics["seconds"] = timings
        return state, metrics
