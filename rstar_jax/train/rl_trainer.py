"""The staged RL trainer: GRPO-RoC (or a baseline) from prompts to pushed weights, step after step (SPEC sections
4-5; DESIGN "Data flow of one RL step").

Each step: the stage's prompts (grain) -> `selector.rollouts_per_prompt(G)` rollouts each through `AgentLoop`
(engines behind one router, tools on the sandbox server), verified (`verified_rollouts`) -> selection and
advantages (`training_groups`; groups without reward spread dropped or refilled from the next prompts) -> the
learner's old log-probs and update(s) -> weights pushed to every engine -> the step's hooks (`rl_hooks`: an orbax
checkpoint, metrics as JSONL + TensorBoard, the progress line, and any a user adds). Every random choice derives
from the run's seed and the step, and checkpoints hold the iterator, so a killed run rerun with the same command
continues exactly as the uninterrupted run would have. Everything the run is built from comes in as objects
(`RLSetup`, built from gin at the entry points by `rl_setup`); nothing here reads gin. Over several JAX processes
(`jax.distributed`) every process runs this loop on its own shards; process 0, the driver, alone rolls out,
verifies, selects and filters, and broadcasts each step's batch (`rstar_jax.parallel.multihost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rstar_jax.agent.tool_protocol import ToolExecutor, ToolOutcome
from rstar_jax.console import Progress, say
from rstar_jax.data.difficulty import hard_problem_ids, keep_only, solve_stats
from rstar_jax.data.pipeline import prompt_batches
from rstar_jax.data.problem import Problem
from rstar_jax.model import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.parallel.multihost import host_copy, is_driver, multi_process, share, share_arrays
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rl.metrics import trajectory_metrics
from rstar_jax.rollout.agent_loop import AgentLoop
from rstar_jax.rollout.backends import RolloutEngines, check_prompts_fit, pushed_weights_dtype
from rstar_jax.rollout.engine import GenerationEngine
from rstar_jax.rollout.verified import VerifiedRollouts, verified_rollouts
from rstar_jax.seeds import derived_seed, step_seed
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.metrics import MetricsWriter
from rstar_jax.train.batching import TokenBatch
from rstar_jax.train.rl_batch import RLBatch, logprob_gap, rl_micro_batches
from rstar_jax.train.rl_checkpoint import TrainerRecord, latest_record, restore_rl_checkpoint, rl_checkpoint_manager
from rstar_jax.train.rl_groups import TrainingGroups, training_groups
from rstar_jax.train.rl_hooks import (RunPosition, StepEvent, StepHook, checkpoint_hook, every, metrics_hook,
                                      progress_hook)
from rstar_jax.train.rl_setup import RLSetup
from rstar_jax.train.rl_step import RLLearner
from rstar_jax.train.stages import stage_at
from rstar_jax.train.state import (TrainState, abstract_train_state, init_optimizer_state, new_train_state,
                                   train_state_shardings)
from sandbox_server.client import SandboxClient

RL_BATCH_TREEDEF = jax.tree.structure(RLBatch(TokenBatch(0, 0, 0, 0), 0, 0, 0, 0))  # a micro-batch's leaves, in order


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


class RLTrainer:
    """A resumable RL run in `run_dir` from a model (`config`, initial `params`) and its `setup` (settings,
    selector, loss, rollout backend, optimiser; `rl_setup()` builds it from gin), on `mesh` (default: the setup's
    mesh over every device).

    The run's state takes `params` over (no copy when they are already placed on `mesh` by the partition rules, as
    `load_hf(..., mesh=mesh)` places them; its train steps donate them), so callers must not use them after `run`.

    `run(sandbox_urls, verifier)` trains every stage (resuming from the latest checkpoint in run_dir), writing
    run_dir/metrics.jsonl, run_dir/tensorboard/ and run_dir/checkpoints/; it returns the final parameters. After
    each step the built-in hooks (checkpoint, metrics, progress) and `hooks` run (see `rl_hooks`).
    Misconfiguration (sizes, missing data) raises before any rollout.
    """

    def __init__(self, run_dir: str | Path, config: ModelConfig, params: Params, tokenizer: str, setup: RLSetup,
                 mesh: Mesh | None = None, hooks: Sequence[StepHook] = ()) -> None:
        self.run_dir = Path(run_dir)
        self.config, self.tokenizer_name = config, tokenizer
        self.settings, self.selector, self.loss, self.backend = setup.settings, setup.selector, setup.loss, setup.backend
        self.optimizer, self.schedule = setup.optimizer, setup.schedule
        self.tokenizer = load_tokenizer(tokenizer)
        self.problems = [stage.data.load() for stage in self.settings.stages]
        self._check_sizes()
        self.mesh = mesh if mesh is not None else setup.mesh()
        self._params: Params | None = params  # handed to the state (or dropped on a resume) by `start_state`
        self._abstract = abstract_train_state(params, self.optimizer)
        self.shardings = train_state_shardings(self._abstract, self.mesh)
        self.learner = RLLearner(config, self.optimizer, self.schedule, self.mesh, self.shardings,
                                 self.settings.micro_batch_rows, self.loss, self.settings.logprob_chunk)
        self.manager = rl_checkpoint_manager(self.run_dir / "checkpoints", self.settings.max_to_keep)
        self.hooks: list[StepHook] = list(hooks)
        self.driver = is_driver()

    def add_hook(self, hook: StepHook, every_steps: int = 1) -> None:
        """Call `hook` after every `every_steps`-th step (and the last), after the checkpoint and before the
        metrics are written, on every process of the learner (see `rl_hooks`)."""
        self.hooks.append(every(every_steps, hook) if every_steps > 1 else hook)

    def _check_sizes(self) -> None:
        """Refuse, before any work, stages whose prompts leave no room in the engine's slots."""
        for stage, problems in zip(self.settings.stages, self.problems):
            if not problems:
                raise ValueError(f"stage {stage.name!r} has no problems ({stage.data.describe()})")
            check_prompts_fit(self.tokenizer, problems, stage.max_response_tokens, self.backend.token_limit,
                              f"stage {stage.name!r}", "Stage.max_response_tokens")

    # ---- data ---------------------------------------------------------------------------------------------------

    def _iterator(self, stage_index: int, kept: Mapping[int, Sequence[str]]) -> Any:
        """A fresh prompt iterator of a stage (its difficulty filter applied when it has one)."""
        keep = (keep_only(frozenset(kept[stage_index])),) if stage_index in kept else ()
        dataset = prompt_batches(self.problems[stage_index], batch_size=self.settings.prompts_per_step,
                                 seed=self.settings.seed + stage_index, num_epochs=None, keep=keep,
                                 drop_remainder=True)
        return iter(dataset)

    def _agent_loop(self, stage_index: int, engine: GenerationEngine, executor: ToolExecutor) -> AgentLoop:
        stage = self.settings.stages[stage_index]
        return AgentLoop(engine, executor, self.tokenizer, max_turns=stage.max_turns,
                         max_response_tokens=stage.max_response_tokens, temperature=self.settings.temperature)

    async def _filter_stage(self, stage_index: int, loop: AgentLoop, verifier: Verifier) -> tuple[str, ...]:
        """SPEC 5 stage 3: the ids of the stage's problems the current model does not solve in every attempt."""
        stage = self.settings.stages[stage_index]
        problems = self.problems[stage_index][:stage.filter_problems]
        say(f"  {stage.name}: filtering {len(problems)} problems ({stage.filter_samples} attempts each)")
        solved = await verified_rollouts(loop, problems, stage.filter_samples,
                                         derived_seed(self.settings.seed, 1, stage_index), verifier,
                                         self.settings.verify_timeout_s)
        kept = hard_problem_ids(solve_stats([s.problem.id for s in solved.samples], [float(v) for v in solved.correct]))
        say(f"  {stage.name}: kept {len(kept)} of {len(problems)} problems")
        return tuple(sorted(kept))

    # ---- one step -----------------------------------------------------------------------------------------------

    async def _rollout_round(self, loop: AgentLoop, prompts: list[Problem], seed: int, verifier: Verifier,
                             timings: dict[str, float]) -> tuple[VerifiedRollouts, TrainingGroups]:
        rolled = await verified_rollouts(loop, prompts, self.selector.rollouts_per_prompt(self.settings.group_size),
                                         seed, verifier, self.settings.verify_timeout_s)
        timings["rollout"] += rolled.rollout_seconds
        timings["rewards"] += rolled.verify_seconds
        return rolled, training_groups(rolled.samples, rolled.correct, self.selector, self.settings.group_size, seed)

    async def _collect(self, loop: AgentLoop, iterator: Any, seed: int, verifier: Verifier,
                       timings: dict[str, float]) -> tuple[VerifiedRollouts, TrainingGroups, int]:
        """Roll out the step's prompts; with zero_variance="refill", more prompts until the batch is full. Returns
        every rollout of the step with its verdict, the groups trained on, and how many prompt batches were drawn."""
        rolled, groups = await self._rollout_round(loop, next(iterator), seed, verifier, timings)
        settings = self.settings
        rounds = 0
        while (settings.zero_variance == "refill" and groups.groups_kept < settings.prompts_per_step
               and rounds < settings.max_refill_rounds):
            rounds += 1
            more_rolled, more = await self._rollout_round(loop, next(iterator), derived_seed(seed, rounds), verifier,
                                                          timings)
            rolled = VerifiedRollouts(rolled.samples + more_rolled.samples, rolled.correct + more_rolled.correct,
                                      rolled.rollout_seconds + more_rolled.rollout_seconds,
                                      rolled.verify_seconds + more_rolled.verify_seconds)
            groups = groups.merged(more, settings.prompts_per_step)
        return rolled, groups, 1 + rounds

    def _mini_batches(self, groups: TrainingGroups, seed: int) -> list[list[RLBatch]]:
        """The kept rows in a seeded order cut into `updates_per_step` mini-batches (fewer when there are fewer
        rows), each row in exactly one, each mini-batch as micro-batches of `micro_batch_rows`."""
        settings = self.settings
        order = np.random.default_rng(seed).permutation(len(groups.samples))
        chunks = [chunk for chunk in np.array_split(order, settings.updates_per_step) if len(chunk)]
        pad_id = self.config.pad_token_id or 0
        return [rl_micro_batches([groups.samples[i].trajectory for i in chunk], groups.advantages[chunk],
                                 settings.micro_batch_rows, pad_id, settings.pad_multiple, settings.pack_length)
                for chunk in chunks]

    def _shared(self, mini_batches: list[list[RLBatch]] | None, drawn: int) -> tuple[list[list[RLBatch]], int]:
        """The driver's mini-batches (none: no group had signal) and prompt batches drawn, on every process (a
        broadcast when the learner spans several; `multihost`)."""
        if not multi_process():
            return mini_batches or [], drawn
        sizes = [len(mini) for mini in mini_batches] if mini_batches else []
        sizes, drawn = share([sizes, drawn])
        leaves = share_arrays([np.asarray(leaf) for mini in mini_batches or [] for batch in mini
                               for leaf in jax.tree.leaves(batch)] if is_driver() else None)
        per_batch = RL_BATCH_TREEDEF.num_leaves
        batches = [jax.tree.unflatten(RL_BATCH_TREEDEF, leaves[i:i + per_batch])
                   for i in range(0, len(leaves), per_batch)]
        starts = np.cumsum([0, *sizes])
        return [batches[start:end] for start, end in zip(starts[:-1], starts[1:])], drawn

    def _update(self, state: TrainState, unscored: list[list[RLBatch]],
                reference: Params | None) -> tuple[TrainState, dict[str, float]]:
        """Old log-probs of every kept row under the sampling policy, then one optimiser step per mini-batch. With
        one mini-batch and no KL term the old log-probs come from the update's own forward pass
        (`RLLearner.update(on_policy=True)`), not from a pass of their own. Metrics: the updates' mean, except
        `trained_tokens` and `sequences` (the step's sums) and `updates` (optimiser steps taken)."""
        if len(unscored) == 1 and reference is None:
            state, metrics = self.learner.update(state, unscored[0], on_policy=True)
            return state, {**metrics, "updates": 1}
        mini_batches: list[list[RLBatch]] = [self.learner.with_policy_logprobs(state.params, batches, reference)
                                             for batches in unscored]
        gap = logprob_gap(host_copy([batch for mini in mini_batches for batch in mini]))
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

    def start_position(self) -> RunPosition:
        """Where the run starts: a fresh run before its first stage (which `_enter_stage` enters like any later
        one: header, data filter, optimiser and reference rules), or the latest checkpoint's position."""
        record = latest_record(self.manager)
        if record is not None and record.seed != self.settings.seed:
            raise ValueError(f"{self.run_dir} holds a run with seed {record.seed}, not {self.settings.seed}; use "
                             f"another run folder")
        if record is None:
            state, reference = self.start_state()
            return RunPosition(0, None, {}, state, reference, None)
        kept = {index: tuple(ids) for index, ids in record.kept_problems.items()}
        iterator = self._iterator(record.stage, kept)
        state, reference = self.start_state(record, iterator)
        return RunPosition(record.step, record.stage, kept, state, reference, iterator)

    def run(self, sandbox_urls: Sequence[str], verifier: Verifier | None,
            engines: RolloutEngines | None = None) -> Params:
        """Train (or resume) every stage, answers checked by `verifier` (SPEC 3); returns the final parameters
        (host arrays, on every process).

        Rollouts run on `engines` when given (they are sent the run's current weights first and left running),
        else on engines the setup's `RolloutBackend` starts for the run and stops after it. A learner over several
        JAX processes (`multihost`) calls `run` on every process with the same arguments; only the driver (process
        0) uses the sandbox, the verifier (the others may pass None) and the engines, and writes the metrics; every
        process writes its shards of each checkpoint.
        """
        settings = self.settings
        position = self.start_position()
        if position.step >= settings.total_steps:
            say(f"RL: all {settings.total_steps} steps already done in {self.run_dir}")
            return host_copy(position.state.params)
        if position.step:
            say(f"RL: resuming {self.run_dir} after step {position.step} of {settings.total_steps}")
        hooks = [every(settings.checkpoint_every, checkpoint_hook(self.manager, settings.seed)), *self.hooks]
        with contextlib.ExitStack() as stack:
            push_first = share(engines is not None)  # the driver's engines decide for every process
            if not push_first:
                served = host_copy(position.state.params)  # a collective: every process takes part
                if self.driver:
                    engines = stack.enter_context(self.backend.start(self.config, served, self.run_dir,
                                                                     self.tokenizer_name))
                del served
            if self.driver:
                writer = stack.enter_context(MetricsWriter(self.run_dir, resume_step=position.step))
                progress = stack.enter_context(Progress(settings.total_steps, "RL", initial=position.step, every=1))
                hooks += [metrics_hook(writer), progress_hook(progress)]
            position = asyncio.run(self._train(position, engines, sandbox_urls, verifier, hooks, push_first))
        return host_copy(position.state.params)

    async def _train(self, position: RunPosition, engines: RolloutEngines | None, sandbox_urls: Sequence[str],
                     verifier: Verifier | None, hooks: Sequence[StepHook], push_first: bool) -> RunPosition:
        """Every remaining step, each followed by `hooks`; the engines' HTTP sessions closed at the end."""
        settings = self.settings
        engine = engines.engine if engines is not None else None
        try:
            if push_first:
                await self._push(engine, position.state.params, position.step)
            client = SandboxClient(list(sandbox_urls)) if self.driver else contextlib.nullcontext()
            async with client as sandbox:
                executor = TimedExecutor(sandbox) if sandbox is not None else None
                while position.step < settings.total_steps:
                    index, _ = stage_at(settings.stages, position.step)
                    if index != position.stage:
                        position = await self._enter_stage(position, index, engine, executor, verifier)
                    position, metrics = await self._step(position, engine, executor, verifier)
                    event = StepEvent(position, settings.total_steps, settings.stages[index].name, metrics)
                    for hook in hooks:
                        hook(event)
        finally:
            if engines is not None:
                await engines.aclose()
        return position

    async def _push(self, engine: GenerationEngine | None, params: Params, version: int) -> None:
        """Send `params` to the engines (the driver's); across processes the parameters are first cast to the engines'
        dtype on the devices and gathered, a collective every process takes part in."""
        if multi_process():
            dtype = share(await pushed_weights_dtype(engine) if engine is not None else None)
            params = host_copy(params, dtype)
        if engine is not None:
            await engine.update_weights(params, version)

    async def _enter_stage(self, position: RunPosition, index: int, engine: GenerationEngine | None,
                           executor: ToolExecutor | None, verifier: Verifier | None) -> RunPosition:
        """A stage's start: its difficulty filter, optimiser reset and reference refresh (SPEC 5, stage 3)."""
        stage = self.settings.stages[index]
        say(f"RL stage {stage.name}: {stage.steps} steps, max {stage.max_response_tokens} response tokens, "
            f"T={stage.max_turns}, data: {stage.data.describe()}")
        kept, state, reference = position.kept, position.state, position.reference
        if stage.data_filter == "drop_solved":
            ids = await self._filter_stage(index, self._agent_loop(index, engine, executor), verifier) \
                if self.driver else None
            ids = tuple(share(ids))  # the driver's filter decides for every process
            if not ids:  # a prompt stream filtered down to nothing would wait forever for its first batch
                raise ValueError(f"stage {stage.name!r}: its difficulty filter ('drop_solved', {stage.filter_samples}"
                                 f" attempts each) kept none of the {len(self.problems[index][:stage.filter_problems])}"
                                 f" problems it tried (the model solved every one each time): give the stage "
                                 f"harder data, more Stage.filter_problems, or no data_filter")
            kept = {**kept, index: ids}
        if stage.reset_optimizer:
            state = state.replace(opt_state=init_optimizer_state(state.params, self.optimizer,
                                                                  self.shardings.opt_state))
        if stage.refresh_reference and reference is not None:
            reference = jax.tree.map(jnp.copy, state.params)  # sharded like the parameters
        return dataclasses.replace(position, stage=index, kept=kept, state=state, reference=reference,
                                   iterator=self._iterator(index, kept))

    async def _step(self, position: RunPosition, engine: GenerationEngine | None, executor: TimedExecutor | None,
                    verifier: Verifier | None) -> tuple[RunPosition, dict[str, Any]]:
        """One RL step from `position` (inside its stage): rollouts, verdicts and groups (the driver's), update(s)
        and weight push (every process's)."""
        assert position.stage is not None
        stage, settings, step = self.settings.stages[position.stage], self.settings, position.step
        seed = step_seed(settings.seed, step)
        timings = {"rollout": 0.0, "rewards": 0.0, "update": 0.0, "weight_sync": 0.0, "checkpoint": 0.0}
        metrics: dict[str, Any] = {"stage": stage.name}
        mini_batches, drawn = None, 1
        if self.driver:
            tools_before = executor.busy_s
            loop = self._agent_loop(position.stage, engine, executor)
            rolled, groups, drawn = await self._collect(loop, position.iterator, seed, verifier, timings)
            timings["tools"] = executor.busy_s - tools_before
            metrics.update(trajectory_metrics([s.trajectory for s in rolled.samples], rolled.correct))
            metrics.update(groups_seen=groups.groups_seen, groups_kept=groups.groups_kept,
                           groups_surplus=groups.groups_surplus, kept_trajectories=len(groups.samples),
                           mean_reward=float(np.mean(groups.rewards)) if groups.groups_kept else 0.0)
            mini_batches = self._mini_batches(groups, seed) if groups.groups_kept else None
        mini_batches, drawn = self._shared(mini_batches, drawn)
        if not self.driver:  # the other processes' prompt streams keep the driver's place (they are checkpointed)
            for _ in range(drawn):
                next(position.iterator)
        state = position.state
        if mini_batches:
            started = time.monotonic()
            state, update_metrics = self._update(state, mini_batches, position.reference)
            timings["update"] = time.monotonic() - started
            started = time.monotonic()
            await self._push(engine, state.params, step + 1)
            timings["weight_sync"] = time.monotonic() - started
            metrics.update(update_metrics)
        metrics["seconds"] = timings
        return dataclasses.replace(position, step=step + 1, state=state), metrics
