"""`--dry_run`: check a gin-configured RL run against a cluster of N devices without allocating the model (issue 11
item 4; SPEC sections 4-7 give the recipe numbers it reads, DESIGN "Scale-out" the pieces it sizes).

The run comes as the same `RLSetup` object the trainer is built from (`rl_setup()`: settings and stages, selector,
loss, optimiser, rollout backend, mesh axes), so the plan cannot drift from the run; besides it, the model
(`ModelConfig`, or a folder's config with the trainer's precision decision), the servers' flags (`server_command`),
the evaluation's response budget and the hardware (`ClusterSpec`, below). `plan_dry_run` computes the plan with abstract shapes
on an AbstractMesh (`rstar_jax.parallel.plan`, `rstar_jax.train.memory_plan`, `rstar_jax.rollout.kv_budget`);
`format_dry_run` writes it out, and its `problems` say why a config cannot run (nothing fits, lengths exceed the
model's or the servers' limits). A mesh that does not divide N raises `DryRunError` at once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import gin
import numpy as np

from rstar_jax.gin_setup import gin_kwargs
from rstar_jax.model.config import ModelConfig, model_precision
from rstar_jax.model.hf_io import hf_model_config
from rstar_jax.parallel.gpu_placement import check_gpu_placement, learner_devices
from rstar_jax.parallel.plan import ParamPlacement, abstract_mesh, param_placements
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.rollout.kv_budget import (ServerShape, concurrent_sequences, kv_budget_bytes, kv_bytes_per_token,
                                         sequence_kv_bytes, server_shape)
from rstar_jax.rollout.vllm_server import server_command
from rstar_jax.train.batching import bucket_length
from rstar_jax.train.memory_plan import (ACTIVATION_FORMULA, LocalDims, StateMemory, abstract_params,
                                         activation_parts, local_dims, state_memory)
from rstar_jax.train.rl_setup import RLSetup

GIB = 1024 ** 3


class DryRunError(ValueError):
    """A config the dry run cannot even plan (no model, a mesh that does not divide the devices)."""


class ResponseBudget(Protocol):
    """An evaluation's lengths as the dry run reads them (`HeldOutEval`, `BenchmarkEval`)."""

    max_turns: int
    max_response_tokens: int


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The hardware a dry run checks a config against (nothing else reads it).

    device_memory_gib: memory of each learner device; learner_memory_fraction: the part JAX may use (its GPU
    allocator preallocates 0.75 by default; XLA_PYTHON_CLIENT_MEM_FRACTION changes it); fleet_gpu_memory_gib: memory
    of each GPU a vLLM server runs on; fleet_overhead_gib: per server GPU, besides weights and KV cache (vLLM's
    profiled activations, CUDA graphs); prompt_tokens: the prompt allowance in front of a response budget (system
    prompt, tool schema and question).
    """

    device_memory_gib: float = 80.0
    learner_memory_fraction: float = 0.75
    fleet_gpu_memory_gib: float = 80.0
    fleet_overhead_gib: float = 0.0
    prompt_tokens: int = 256
    activation_factor: float = 2.0

    def __post_init__(self) -> None:
        if min(self.device_memory_gib, self.fleet_gpu_memory_gib) <= 0 or self.fleet_overhead_gib < 0:
            raise ValueError(f"ClusterSpec memories must be positive, got {self}")
        if not 0.0 < self.learner_memory_fraction <= 1.0:
            raise ValueError(f"ClusterSpec.learner_memory_fraction must be in (0, 1], got "
                             f"{self.learner_memory_fraction}")
        if self.activation_factor <= 0:
            raise ValueError(f"ClusterSpec.activation_factor must be positive, got {self.activation_factor}")
        if self.prompt_tokens < 1:
            raise ValueError(f"ClusterSpec.prompt_tokens must be >= 1, got {self.prompt_tokens}")


@dataclasses.dataclass(frozen=True)
class LengthPlan:
    """One response budget (an RL stage or the evaluation): its context (prompt allowance + max_response_tokens),
    the learner's padded length and activation terms (stages only), and the fleet's concurrent sequences."""

    name: str
    steps: int
    max_turns: int
    context: int
    padded: int = 0
    dims: LocalDims | None = None
    activations: dict[str, int] = dataclasses.field(default_factory=dict)
    sequences_per_server: int = 0

    @property
    def activation_total(self) -> int:
        """Sum of the activation terms."""
        return sum(self.activations.values())


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    """The rollout engines: backend, servers and GPUs per server, a server's shape and KV budget."""

    backend: str
    servers: int
    attached: bool
    shape: ServerShape
    gpu_memory_bytes: int
    weight_bytes: int
    budget_bytes: int
    bytes_per_token: int
    gpus: tuple[tuple[int, ...], ...] = ()  # launched servers' GPUs on the learner's node (vllm_per_server_gpus)


@dataclasses.dataclass(frozen=True)
class DryRun:
    """Everything `format_dry_run` prints, and the problems that stop the config from running."""

    device_count: int
    mesh_bindings: dict[str, int]
    mesh_shape: dict[str, int]
    config: ModelConfig
    cluster: ClusterSpec
    placements: list[ParamPlacement]
    state: StateMemory
    micro_batch_rows: int
    rollouts_per_step: str
    total_rollouts: int
    stages: list[LengthPlan]
    evaluation: LengthPlan
    fleet: FleetPlan
    chunk: int
    problems: list[str]
    notes: list[str]

    @property
    def usable_bytes(self) -> int:
        """What JAX may allocate on one learner device."""
        return int(self.cluster.device_memory_gib * GIB * self.cluster.learner_memory_fraction)


def model_config(model_dir: str | None = None) -> ModelConfig:
    """The model the trainer would build: from `model_dir`'s config.json as `load_hf` reads it, else from gin's
    ModelConfig; either way with the dtypes of `model_precision`, the decision the trainer makes (issue 22 item 1)."""
    if model_dir is not None:
        return hf_model_config(model_dir)
    try:
        return ModelConfig(**model_precision())
    except TypeError as exc:
        raise DryRunError(f"the gin config defines no model (ModelConfig needs its sizes; give a model gin file such "
                          f"as paper/qwen3_14b.gin or model/tiny.gin): {exc}") from exc


def _mesh(axes: dict[str, int], device_count: int) -> tuple[dict[str, int], Any]:
    try:
        return axes, abstract_mesh(axes, device_count)
    except ValueError as exc:
        raise DryRunError(f"the mesh does not fit {device_count} devices: {exc}") from exc


def _fleet(config: ModelConfig, backend: RolloutBackend, cluster: ClusterSpec, param_count: int) -> FleetPlan:
    command = gin_kwargs(server_command)
    if backend.backend == "vllm":
        gpus = backend.launched_server_gpus  # launched servers get --tensor-parallel-size len(gpus), the last flag
        placed = ["--tensor-parallel-size", str(min(map(len, gpus)))] if gpus else []
        shape = server_shape([*command["extra_args"], *placed], command["dtype"], command["max_model_len"])
        servers = len(backend.vllm_urls) or backend.vllm_servers
        gpu_bytes = int(cluster.fleet_gpu_memory_gib * GIB)
        budget = kv_budget_bytes(shape, gpu_bytes, param_count, int(cluster.fleet_overhead_gib * GIB))
        return FleetPlan("vllm", servers, bool(backend.vllm_urls), shape, gpu_bytes,
                         param_count * shape.weight_bytes, budget, kv_bytes_per_token(config, shape.kv_dtype_bytes),
                         gpus)
    # In-process JAX engines: a fixed cache of `slots` sequences of `max_len` tokens each, in the compute dtype.
    dtype_bytes = np.dtype(config.jnp_dtype).itemsize
    per_token = kv_bytes_per_token(config, dtype_bytes)
    shape = ServerShape(block_size=1, weight_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes,
                        max_num_seqs=backend.slots, max_model_len=backend.max_len)
    return FleetPlan("jax", backend.jax_engines, False, shape, 0, param_count * dtype_bytes,
                     backend.slots * backend.max_len * per_token, per_token)


def _placement_checks(fleet: FleetPlan, device_count: int, cluster: ClusterSpec) -> tuple[list[str], list[str]]:
    """(problems, notes) of one node shared by the learner and the servers it launches: gin `learner_devices`
    against `RolloutBackend.vllm_per_server_gpus` (`rstar_jax.parallel.gpu_placement`) and the devices planned."""
    learner = learner_devices()
    problems, notes = [], []
    try:
        check_gpu_placement(learner.gpus, fleet.gpus, learner.node_gpus)
    except ValueError as exc:
        problems.append(f"GPU placement: {exc}")
    if learner.gpus is not None and len(learner.gpus) != device_count:
        problems.append(f"GPU placement: learner_devices.gpus names {len(learner.gpus)} GPUs "
                        f"({', '.join(map(str, learner.gpus))}) but the plan is for {device_count} learner devices")
    if len(set(map(len, fleet.gpus))) > 1:
        notes.append(f"the launched servers have different GPU counts ({[len(g) for g in fleet.gpus]}); the fleet "
                     f"rows assume the smallest")
    if learner.memory_fraction is not None and learner.memory_fraction != cluster.learner_memory_fraction:
        notes.append(f"learner_devices.memory_fraction = {learner.memory_fraction:g} (what the learner will "
                     f"preallocate) differs from ClusterSpec.learner_memory_fraction = "
                     f"{cluster.learner_memory_fraction:g} (what this plan assumes)")
    return problems, notes


def _sequences(fleet: FleetPlan, context: int) -> int:
    if fleet.backend == "jax":
        return fleet.shape.max_num_seqs if context <= (fleet.shape.max_model_len or 0) else 0
    return concurrent_sequences(fleet.budget_bytes, context, fleet.bytes_per_token, fleet.shape.block_size,
                                fleet.shape.max_num_seqs)


def plan_dry_run(setup: RLSetup, device_count: int, config: ModelConfig, evaluation: ResponseBudget,
                 cluster: ClusterSpec) -> DryRun:
    """The plan of the RL run `setup` describes (the trainer's own `RLSetup`) on `device_count` learner devices
    for the model `config` (`model_config`), with `evaluation`'s response budget, on `cluster` (see the module
    docstring)."""
    settings, backend = setup.settings, setup.backend
    mesh_bindings, mesh = _mesh(dict(setup.mesh_axes), device_count)
    params = abstract_params(config)
    placements = param_placements(params, mesh)
    state = state_memory(config, setup.optimizer, mesh, setup.loss.needs_reference)
    fleet = _fleet(config, backend, cluster, state.param_count)
    chunk = settings.logprob_chunk
    per_prompt = setup.selector.rollouts_per_prompt(settings.group_size)
    problems: list[str] = []
    notes: list[str] = []
    usable = int(cluster.device_memory_gib * GIB * cluster.learner_memory_fraction)

    stages = []
    for stage in settings.stages:
        context = cluster.prompt_tokens + stage.max_response_tokens
        padded = bucket_length(max(context, settings.pack_length or 0), settings.pad_multiple)  # a packed row's length
        dims = local_dims(config, mesh, settings.micro_batch_rows, padded)
        parts = activation_parts(config, dims, chunk)
        stages.append(LengthPlan(stage.name, stage.steps, stage.max_turns, context, padded, dims, parts,
                                 _sequences(fleet, context)))
        needed = state.total + cluster.activation_factor * sum(parts.values())
        if needed > usable:
            problems.append(
                f"stage {stage.name!r}: the learner needs {_gib(needed)} per device (state + "
                f"{cluster.activation_factor:g} x activations) but "
                f"{_gib(usable)} is usable ({cluster.device_memory_gib:g} GiB x {cluster.learner_memory_fraction:g}):"
                f" lower RLSettings.micro_batch_rows, use ModelConfig.remat_policy 'full', or more fsdp devices")
    eval_context = cluster.prompt_tokens + evaluation.max_response_tokens
    eval_plan = LengthPlan("evaluation", 0, evaluation.max_turns, eval_context,
                           sequences_per_server=_sequences(fleet, eval_context))

    for plan in [*stages, eval_plan]:
        if plan.context > config.max_position_embeddings:
            problems.append(f"{plan.name}: context {plan.context:,} tokens exceeds the model's "
                            f"max_position_embeddings ({config.max_position_embeddings:,})")
        if fleet.shape.max_model_len is not None and plan.context > fleet.shape.max_model_len:
            problems.append(f"{plan.name}: context {plan.context:,} tokens exceeds the rollout servers' max model "
                            f"length ({fleet.shape.max_model_len:,})")
        elif plan.sequences_per_server == 0 and fleet.backend == "vllm" and fleet.budget_bytes > 0:
            problems.append(f"{plan.name}: one sequence of {plan.context:,} tokens needs "
                            f"{_gib(sequence_kv_bytes(plan.context, fleet.bytes_per_token, fleet.shape.block_size))}"
                            f" of KV cache, more than a server's budget ({_gib(fleet.budget_bytes)})")
    placement_problems, placement_notes = _placement_checks(fleet, device_count, cluster)
    problems += placement_problems
    notes += placement_notes
    if fleet.backend == "vllm" and fleet.budget_bytes <= 0:
        problems.append(f"rollout fleet: the weights ({_gib(fleet.weight_bytes)}) leave no KV cache on a server of "
                        f"{fleet.shape.tensor_parallel} x {cluster.fleet_gpu_memory_gib:g} GiB at "
                        f"gpu_memory_utilization {fleet.shape.gpu_memory_utilization:g}: raise "
                        f"--tensor-parallel-size or the utilization")
    if stages and stages[0].dims is not None and stages[0].dims.rows == settings.micro_batch_rows \
            and mesh.shape["data"] * mesh.shape["fsdp"] > 1:
        notes.append(f"RLSettings.micro_batch_rows = {settings.micro_batch_rows} is not divisible by data x fsdp = "
                     f"{mesh.shape['data'] * mesh.shape['fsdp']}: every device then computes the whole micro-batch")
    return DryRun(device_count, mesh_bindings, dict(mesh.shape), config, cluster, placements, state,
                  settings.micro_batch_rows, f"{settings.prompts_per_step} prompts x {per_prompt}",
                  settings.prompts_per_step * per_prompt, stages, eval_plan, fleet, chunk, problems, notes)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _spec_text(placement: ParamPlacement) -> str:
    return "(" + ", ".join("None" if axis is None else repr(axis) for axis in placement.spec) + ")"


def _mesh_lines(plan: DryRun) -> list[str]:
    sizes = " x ".join(f"{name} {size}" for name, size in plan.mesh_shape.items())
    bindings = ", ".join(f"{name}={value}" for name, value in plan.mesh_bindings.items())
    lines = [f"== mesh: {plan.device_count} devices = {sizes}   (gin make_mesh: {bindings}; -1 = the rest)",
             "== parameters (PARAM_RULES -> PartitionSpec on this mesh; a split that does not divide stays whole)",
             f"  {'parameter':<28} {'shape':<20} {'logical axes':<38} {'spec':<26} {'per device':<16} bytes/device"]
    for p in plan.placements:
        lines.append(f"  {p.path:<28} {str(p.shape):<20} {str(p.logical_axes):<38} {_spec_text(p):<26} "
                     f"{str(p.local_shape):<16} {p.bytes_per_device / 2 ** 20:,.1f} MiB")
    return lines


def _memory_lines(plan: DryRun) -> list[str]:
    c, s = plan.config, plan.state
    lines = [f"== model: {c.family}, {s.param_count:,} parameters ({_count(s.param_count)}; "
             f"{_gib(s.param_bytes_total)} in {c.param_dtype}); compute {c.dtype}, remat {c.remat_policy!r}, "
             f"attention {c.attention_impl!r} (block {c.attention_block_size})",
             f"== learner memory per device ({plan.cluster.device_memory_gib:g} GiB x "
             f"{plan.cluster.learner_memory_fraction:g} usable = {_gib(plan.usable_bytes)})",
             *(f"  {label:<42} {_gib(value):>12}" for label, value in (
                 (f"parameters ({c.param_dtype})", s.params),
                 (f"optimiser (AdamW: 2 moments, {c.param_dtype})", s.optimizer),
                 ("gradients (running sum + micro-batch)", s.gradients),
                 ("reference policy (only with a KL term)", s.reference),
                 ("state total", s.total),
                 ("build peak (sharded load + jitted init)", s.build_peak))),
             f"  activations: micro-batch of {plan.micro_batch_rows} rows (RLSettings.micro_batch_rows), "
             f"token_logprobs chunk {plan.chunk}",
             f"  {'stage':<10} {'steps':>5} {'T':>7} {'rows/dev':>8} {'saved':>10} {'layer':>10} {'attention':>10} "
             f"{'head':>10} {'residual':>10} {'total':>10} {'x' + format(plan.cluster.activation_factor, 'g') + ' + state':>13}  fits"]
    for st in plan.stages:
        a = st.activations
        total = plan.cluster.activation_factor * st.activation_total + s.total
        lines.append(f"  {st.name:<10} {st.steps:>5} {st.padded:>7,} {st.dims.rows:>8} "
                     + " ".join(f"{a[k] / GIB:>10.2f}" for k in ("saved", "layer", "attention", "head", "residual"))
                     + f" {st.activation_total / GIB:>10.2f} {total / GIB:>13.2f}  "
                     + ("yes" if total <= plan.usable_bytes else "NO"))
    lines.append("  (GiB; T = bucket_length(prompt allowance "
                 f"{plan.cluster.prompt_tokens:,} + max_response_tokens, RLSettings.pad_multiple); the fits check "
                 f"multiplies the estimate by ClusterSpec.activation_factor = {plan.cluster.activation_factor:g})")
    lines += ["  " + line for line in ACTIVATION_FORMULA.splitlines()]
    return lines


def _fleet_lines(plan: DryRun) -> list[str]:
    f, c = plan.fleet, plan.config
    kv = (f"  KV bytes per token = 2 x {c.num_layers} layers x {c.num_kv_heads} kv_heads x {c.head_dim} head_dim x "
          f"{f.shape.kv_dtype_bytes} B = {f.bytes_per_token:,} B ({f.bytes_per_token / 1024:g} KiB)")
    if f.backend == "vllm":
        how = ("attached by URL (RolloutBackend.vllm_urls)" if f.attached
               else "launched here (RolloutBackend.vllm_servers)")
        overhead = plan.cluster.fleet_overhead_gib
        lines = [f"== rollout fleet: {f.servers} vLLM servers, {how}; flags from gin server_command",
                 *([f"  on this node's GPUs {' | '.join(','.join(map(str, g)) for g in f.gpus)} "
                    f"(RolloutBackend.vllm_per_server_gpus; learner on "
                    f"{','.join(map(str, learner_devices().gpus or ())) or 'every GPU JAX sees'})"]
                   if f.gpus else []),
                 f"  per server: {f.shape.tensor_parallel} GPU(s) x {f.gpu_memory_bytes / GIB:g} GiB x "
                 f"gpu_memory_utilization {f.shape.gpu_memory_utilization:g} - weights "
                 f"{_count(plan.state.param_count)} x {f.shape.weight_bytes} B ({_gib(f.weight_bytes)})"
                 + (f" - overhead {overhead:g} GiB/GPU" if overhead else "")
                 + f" = KV budget {_gib(f.budget_bytes)}",
                 kv,
                 f"  sequences at a length's full context (prompt allowance + max_response_tokens, in blocks of "
                 f"{f.shape.block_size}), " + (f"capped by --max-num-seqs {f.shape.max_num_seqs}:"
                                               if f.shape.max_num_seqs else "not capped (vLLM's --max-num-seqs "
                                               "default caps it too):")]
    else:
        lines = [f"== rollout engines: {f.servers} in-process JAX engine(s) of {f.shape.max_num_seqs} slots x "
                 f"{f.shape.max_model_len:,} tokens (RolloutBackend), cache {_gib(f.budget_bytes)} each", kv,
                 "  sequences at a length's full context (a slot holds one sequence up to max_len):"]
    lines.append(f"  {'length':<10} {'turns':>5} {'context':>8} {'KV/sequence':>12} {'per server':>10} "
                 f"{'fleet':>7}   rollouts a step ({plan.rollouts_per_step})")
    for st in [*plan.stages, plan.evaluation]:
        per_seq = sequence_kv_bytes(st.context, f.bytes_per_token, f.shape.block_size)
        fleet_total = st.sequences_per_server * f.servers
        waves = (f"{plan.total_rollouts:,} = {math.ceil(plan.total_rollouts / fleet_total)} waves of the fleet"
                 if fleet_total and st.steps else "-")
        lines.append(f"  {st.name:<10} {st.max_turns:>5} {st.context:>8,} {_gib(per_seq):>12} "
                     f"{st.sequences_per_server:>10,} {fleet_total:>7,}   {waves}")
    lines.append("  (worst case: every sequence at its full budget; a server admits more while most are shorter)")
    return lines


def format_dry_run(plan: DryRun) -> str:
    """The dry run's report: mesh and parameter placement, learner memory per device with its formula, the
    fleet's KV budget, then notes and problems (or that the config fits)."""
    lines = [*_mesh_lines(plan), *_memory_lines(plan), *_fleet_lines(plan)]
    lines += [f"note: {note}" for note in plan.notes]
    if plan.problems:
        lines += [f"PROBLEM: {problem}" for problem in plan.problems]
    else:
        lines.append(f"OK: the config fits {plan.device_count} devices of {plan.cluster.device_memory_gib:g} GiB "
                     f"and its rollout fleet")
    return "\n".join(lines)
