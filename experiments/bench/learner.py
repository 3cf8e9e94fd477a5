"""Learner throughput: tokens/s of the JAX training step against transformers' PyTorch model, per configuration.

Issue 12. Each configuration (a model size and a batch of [rows, tokens]) times two steps on both sides, on the same
weights (the JAX parameters written with `save_hf` and loaded by transformers) and the same tokens:
  loss  forward + backward of the mean next-token cross-entropy: the library's SFT loss (`train.sft.sft_loss`,
        fused log-softmax-gather) under `jax.jit(value_and_grad)`, against `model(labels=ids).loss.backward()`;
  grpo  the whole RL update: `RLLearner.update` (forward, backward, clipped policy loss of SPEC 4.6 with Clip-Higher
        0.2 / 0.28 and token-mean, gradient accumulated over the micro-batches of `rl_micro_batches`, AdamW with
        global-norm clipping, donated state) against the same loss on Qwen3ForCausalLM's logits, `backward()` per
        micro-batch, `clip_grad_norm_` and `torch.optim.AdamW`.
Old log-probs are filled in (and perturbed, so the ratio clips) before timing, on both sides. The step's achieved
FLOP/s is compared with this machine's float32 matmul peak, measured in the same run by timing a large jitted
`jnp.dot`. All timings alternate round by round (warm-up rounds, then the median of the timed ones), so load from
other processes hits every one alike and the ratios stay meaningful; the load average and the share of the CPUs
other processes took during the timed rounds are reported with them (torch's thread pool suffers far more from
contention than JAX's, so only figures from a quiet machine say how the two compare).

FLOPs are counted analytically, the same count for both implementations and both steps:
  dense     = 6 * (matmul parameters) * tokens  (2 forward + 4 backward per multiply-add; every projection of every
              layer plus the output head; the embedding lookup and norms are not matmuls)
  attention = 6 * layers * rows * seq^2 * heads * head_dim  (QK^T and PV, 2 FLOPs per multiply-add, times 3 for
              forward + backward, over the causal half of the seq x seq scores: the work a causal step needs)

`--profile` adds, per configuration, the JAX loss step's per-op profile grouped by `op_profile.CATEGORIES`: where the
time that is not matmul at peak goes. `--variant` times the JAX loss step under other gin bindings in the same
rounds: the measured effect of each training option against torch and against the default.

    python -m experiments.bench.learner --json artifacts/bench_learner.json          # every configuration
    python -m experiments.bench.learner --configs tiny_256 --gin_param "ModelConfig.remat_policy = 'none'"
    python -m experiments.bench.learner --configs tiny_256 --variant "dense=ModelConfig.attention_impl = 'dense'"
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from experiments.bench.op_profile import by_category, profile_step
from experiments.make_tiny_model import TINY_MODEL_GIN
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import ModelConfig, init_params, save_hf
from rstar_jax.parallel import make_mesh
from rstar_jax.rl.losses import PolicyLossOptions
from rstar_jax.train.batching import TokenBatch, make_batch
from rstar_jax.train.optim import rl_optimizer
from rstar_jax.train.rl_batch import RLBatch, batch_totals, rl_micro_batches
from rstar_jax.train.rl_step import RLLearner
from rstar_jax.train.sft import sft_loss
from rstar_jax.train.state import init_train_state, train_state_shardings

WIDE_MODEL_GIN = "model/wide.gin"
STEPS = ("loss", "grpo")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """A model (gin files on top of the tiny demo model's) and the token block of one step."""

    gin_files: tuple[str, ...]
    rows: int
    seq: int
    micro_batches: int = 2


CONFIGURATIONS: dict[str, Configuration] = {
    "tiny_256": Configuration((), rows=4, seq=256),
    "tiny_1024": Configuration((), rows=4, seq=1024),
    "wide_1024": Configuration((WIDE_MODEL_GIN,), rows=2, seq=1024),
}


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Analytic FLOPs of one forward + backward step (see the module docstring for the formula)."""

    matmul_params: int
    dense: int
    attention: int

    @property
    def total(self) -> int:
        """Dense plus attention FLOPs of the step."""
        return self.dense + self.attention


@dataclasses.dataclass(frozen=True)
class Rollout:
    """A synthetic kept trajectory: what `rl_micro_batches` and `make_batch` read."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]


def matmul_param_count(config: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all layer projections plus the output head (tied or not)."""
    embed = config.hidden_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = embed * q_width + 2 * embed * kv_width + q_width * embed + 3 * embed * config.intermediate_size
    return config.num_layers * per_layer + embed * config.vocab_size


def train_step_flops(config: ModelConfig, batch: int, seq: int) -> StepFlops:
    """FLOPs of one forward + backward pass over a [batch, seq] token block (causal attention)."""
    matmul_params = matmul_param_count(config)
    attention = 6 * config.num_layers * batch * seq * seq * config.num_heads * config.head_dim
    return StepFlops(matmul_params, 6 * matmul_params * batch * seq, attention)


def reuse_freed_memory() -> None:
    """Keep freed heap memory for reuse instead of returning it to the OS (glibc `mallopt`: one arena, no mmap,
    no trimming). XLA:CPU allocates each step's temporaries afresh (250 MB for the tiny model's step before issue
    12's changes); returned pages fault in again, zero-filled, on every step (measured then: 61,000 faults and a
    sixth of the step; 3-5% of the step now). It applies to the whole process, the torch side too (whose GRPO
    step it slowed by about 4%), so the benchmark leaves it off unless asked (`--reuse_freed_memory`). Must run
    before JAX starts its threads."""
    libc = ctypes.CDLL("libc.so.6")
    for option, value in ((-4, 0), (-1, 2**31 - 1), (-8, 1)):  # M_MMAP_MAX, M_TRIM_THRESHOLD, M_ARENA_MAX
        if not libc.mallopt(option, value):
            raise OSError(f"mallopt({option}, {value}) failed")


def busy_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process of the machine has used since boot, CPU seconds this process has used): their
    difference over a run is what other processes took from it, a sharper measure of contention than the load
    average (which lags by a minute)."""
    with open("/proc/stat") as handle:
        fields = [float(value) for value in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    own = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def time_rounds(calls: dict[str, Callable[[], Any]], warmup: int, iters: int) -> dict[str, list[float]]:
    """Wall-clock seconds of each call in `iters` rounds, after `warmup` untimed rounds; each call must block until
    its work is done. The calls alternate within a round, so load from other processes on a shared machine hits
    all of them alike and their ratios stay meaningful."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iters):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def matmul_call(size: int) -> Callable[[], Any]:
    """One jitted float32 [size, size] @ [size, size] jnp.dot, compiled: the probe of this machine's matmul peak."""
    keys = jax.random.split(jax.random.key(1))
    a, b = (jax.random.normal(key, (size, size), jnp.float32) for key in keys)
    matmul = jax.jit(jnp.dot)
    matmul(a, b).block_until_ready()
    return lambda: matmul(a, b).block_until_ready()


def synthetic_rollouts(rows: int, seq: int, vocab_size: int, seed: int) -> tuple[list[Rollout], np.ndarray]:
    """`rows` trajectories of seq + 1 tokens (so exactly [rows, seq] inputs): a prompt and a tool response masked
    out, the model's own turns trained, with sampled log-probs; and one advantage per trajectory."""
    rng = np.random.default_rng(seed)
    prompt, tool = seq // 8, seq // 8
    mask = np.ones(seq + 1, np.int64)
    mask[:prompt] = 0
    mask[seq // 2:seq // 2 + tool] = 0
    rollouts = [Rollout(tuple(int(t) for t in rng.integers(1, vocab_size, seq + 1)), tuple(int(m) for m in mask),
                        tuple(float(-rng.exponential()) if m else 0.0 for m in mask)) for _ in range(rows)]
    return rollouts, rng.normal(size=rows).astype(np.float32)


def perturbed_old_logprobs(batch: RLBatch) -> RLBatch:
    """Old log-probs moved off the current policy by a fixed function of the tokens, so some ratios clip."""
    ids = np.asarray(batch.tokens.input_ids)
    offsets = 0.3 * np.sin(7.0 * ids + np.arange(ids.shape[1])[None, :]).astype(np.float32)
    return batch.replace(old_logprobs=np.asarray(batch.old_logprobs) + offsets)


def jax_loss_call(config: ModelConfig, params: Any, batch: TokenBatch) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The jitted value_and_grad of the SFT loss, compiled: the call, and its loss and compile (+ first step) time."""
    step = jax.jit(jax.value_and_grad(sft_loss), static_argnums=1)
    batch = jax.device_put(batch)
    start = time.perf_counter()
    loss, _ = jax.block_until_ready(step(params, config, batch))
    info = {"loss": float(loss), "compile_and_first_step_s": time.perf_counter() - start}
    return lambda: jax.block_until_ready(step(params, config, batch)), info


def exact_length(rollouts: Sequence[Rollout]) -> int:
    """The padding multiple that pads the rollouts' rows to exactly their longest (targets: tokens - 1)."""
    return max(len(rollout.token_ids) for rollout in rollouts) - 1


def jax_grpo_call(config: ModelConfig, params: Any, rollouts: list[Rollout], advantages: np.ndarray,
                  micro_batches: int) -> tuple[Callable[[], Any], dict[str, Any], list[RLBatch]]:
    """`RLLearner.update` on the rollouts' micro-batches (state donated and replaced every call), compiled by one
    first update: the call, its first loss and compile time, and the micro-batches with their old log-probs."""
    rows = len(rollouts) // micro_batches
    optimizer, schedule = rl_optimizer(total_steps=1000)
    mesh = make_mesh(devices=jax.devices()[:1])
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)  # a copy: the loss step keeps `params`
    shardings = train_state_shardings(state, mesh)
    learner = RLLearner(config, optimizer, schedule, mesh, shardings, rows, PolicyLossOptions())
    batches = [perturbed_old_logprobs(batch) for batch in learner.with_policy_logprobs(
        params, rl_micro_batches(rollouts, advantages, rows, multiple=exact_length(rollouts)))]
    holder = {"state": jax.device_put(state, shardings)}

    def update() -> dict[str, float]:
        holder["state"], metrics = learner.update(holder["state"], batches)
        return metrics

    start = time.perf_counter()
    metrics = update()
    info = {"loss": metrics["loss"], "compile_and_first_step_s": time.perf_counter() - start}
    return update, info, batches


def jax_old_logprob_calls(config: ModelConfig, params: Any, rollouts: list[Rollout], advantages: np.ndarray,
                          micro_batches: int) -> dict[str, Callable[[], Any]]:
    """The trainer's whole update of one RL step, both ways (compiled by a first call each): "own pass" fills the
    old log-probs in a forward pass of their own, then updates (`with_policy_logprobs` + `update`); "update's pass"
    takes them from the update's own forward (`update(on_policy=True)`, the trainer's path for a step's only
    update). The same loss and gradient: the difference is the forward pass saved."""
    rows = len(rollouts) // micro_batches
    optimizer, schedule = rl_optimizer(total_steps=1000)
    mesh = make_mesh(devices=jax.devices()[:1])
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    shardings = train_state_shardings(state, mesh)
    learner = RLLearner(config, optimizer, schedule, mesh, shardings, rows, PolicyLossOptions())
    batches = rl_micro_batches(rollouts, advantages, rows, multiple=exact_length(rollouts))
    holder = {"state": jax.device_put(state, shardings)}

    def own_pass() -> dict[str, float]:
        scored = learner.with_policy_logprobs(holder["state"].params, batches)
        holder["state"], metrics = learner.update(holder["state"], scored)
        return metrics

    def updates_pass() -> dict[str, float]:
        holder["state"], metrics = learner.update(holder["state"], batches, on_policy=True)
        return metrics

    calls = {"own pass": own_pass, "update's pass": updates_pass}
    for call in calls.values():
        call()
    return calls


def torch_model(model_dir: str) -> torch.nn.Module:
    """transformers' model of `model_dir` in float32, in training mode."""
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.train()


def torch_loss_call(model: torch.nn.Module, batch: TokenBatch) -> tuple[Callable[[], Any], dict[str, Any]]:
    """backward() of the mean cross-entropy of transformers' float32 logits against the batch's targets (what
    `labels=` computes, without its shift, so both sides read the same [rows, seq] inputs); the call, first loss."""
    input_ids = torch.from_numpy(np.asarray(batch.input_ids).astype(np.int64))
    targets = torch.from_numpy(np.asarray(batch.targets).astype(np.int64))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=input_ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return float(loss.detach())

    return step, {"loss": step(), "attn_implementation": model.config._attn_implementation,
                  "threads": torch.get_num_threads()}


def torch_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      loss_mask: torch.Tensor, total_tokens: float, eps_low: float = 0.2,
                      eps_high: float = 0.28) -> torch.Tensor:
    """`rl.losses.policy_loss` with its defaults (Clip-Higher, token mean over the whole batch) in torch."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages[:, None]
    per_token = torch.maximum(-ratio * advantages, -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages)
    return torch.sum(per_token * loss_mask) / max(total_tokens, 1.0)


def torch_grpo_call(model: torch.nn.Module, batches: list[RLBatch]) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The GRPO update on transformers' model: per micro-batch forward, log p of the targets, the policy loss and
    backward (gradients accumulate), then clip_grad_norm_(1.0) and AdamW (lr 1e-6, as `rl_optimizer`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    total_tokens = batch_totals(batches)[0]
    tensors = [{name: torch.from_numpy(np.asarray(value)) for name, value in (
        ("input_ids", batch.tokens.input_ids.astype(np.int64)), ("attention_mask", batch.tokens.attention_mask),
        ("targets", batch.tokens.targets.astype(np.int64)), ("loss_mask", batch.loss_mask.astype(np.float32)),
        ("old", batch.old_logprobs), ("advantages", batch.advantages))} for batch in batches]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in tensors:
            logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, micro["targets"][..., None])[..., 0]
            loss = torch_policy_loss(logprobs, micro["old"], micro["advantages"], micro["loss_mask"], total_tokens)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return total

    return step, {"loss": step()}


def model_config(configuration: Configuration, gin_files: Sequence[str], gin_params: Sequence[str]) -> ModelConfig:
    """The tiny demo ModelConfig (gin/model/tiny.gin), the configuration's gin files, then the user's on top."""
    gin.clear_config()
    parse_gin([TINY_MODEL_GIN, *configuration.gin_files, *gin_files], gin_params)
    return ModelConfig()


def summarise(side: dict[str, Any], flops: StepFlops, tokens: int, peak_flops_per_s: float) -> dict[str, Any]:
    """Median step time and the rates derived from it."""
    median = statistics.median(side["step_s"])
    rate = flops.total / median
    return {**side, "median_step_s": median, "tokens_per_s": tokens / median, "flops_per_s": rate,
            "fraction_of_peak": rate / peak_flops_per_s}


def run_configuration(config: ModelConfig, configuration: Configuration, warmup: int, iters: int, matmul_size: int,
                      profile: bool, variants: dict[str, ModelConfig] | None = None,
                      seed: int = 0) -> dict[str, Any]:
    """Every figure of one configuration: both steps on both sides, interleaved with the matmul probe; and the JAX
    loss step of each variant config (same parameters: only the arithmetic may differ) in the same rounds."""
    rows, seq = configuration.rows, configuration.seq
    if seq > config.max_position_embeddings:
        raise ValueError(f"seq {seq} exceeds the model's max_position_embeddings {config.max_position_embeddings}")
    if rows % configuration.micro_batches:
        raise ValueError(f"{rows} rows do not split into {configuration.micro_batches} micro-batches")
    params = init_params(config, jax.random.key(seed))
    rollouts, advantages = synthetic_rollouts(rows, seq, config.vocab_size, seed)
    loss_batch = make_batch(rollouts, multiple=exact_length(rollouts))  # no padding: torch would read it
    loss_batch = loss_batch.replace(loss_mask=np.ones_like(loss_batch.loss_mask))  # every next token: HF's loss
    calls, infos = {}, {}
    calls["jax loss"], infos["jax loss"] = jax_loss_call(config, params, loss_batch)
    for name, variant in (variants or {}).items():
        if jax.eval_shape(init_params, variant, jax.random.key(seed)) != jax.eval_shape(init_params, config,
                                                                                       jax.random.key(seed)):
            raise ValueError(f"variant {name!r} changes the parameters' shapes; a variant may change arithmetic only")
        calls[f"jax loss [{name}]"], infos[f"jax loss [{name}]"] = jax_loss_call(variant, params, loss_batch)
    calls["jax grpo"], infos["jax grpo"], batches = jax_grpo_call(config, params, rollouts, advantages,
                                                                   configuration.micro_batches)
    with tempfile.TemporaryDirectory() as model_dir:
        save_hf((config, params), model_dir)
        model = torch_model(model_dir)
    calls["torch loss"], infos["torch loss"] = torch_loss_call(model, loss_batch)
    calls["torch grpo"], infos["torch grpo"] = torch_grpo_call(model, batches)
    old_logprobs = {f"old log-probs: {name}": call for name, call in jax_old_logprob_calls(
        config, params, rollouts, advantages, configuration.micro_batches).items()}
    probe = matmul_call(matmul_size)
    (machine_before, own_before), wall_before = busy_cpu_seconds(), time.perf_counter()
    seconds = time_rounds({"matmul": probe, **calls, **old_logprobs}, warmup, iters)
    (machine_after, own_after), wall = busy_cpu_seconds(), time.perf_counter() - wall_before
    others = (machine_after - machine_before) - (own_after - own_before)
    old_logprob_s = {name.removeprefix("old log-probs: "): statistics.median(seconds.pop(name))
                     for name in old_logprobs}
    peak_s = statistics.median(seconds.pop("matmul"))
    peak = {"size": matmul_size, "median_s": peak_s, "flops_per_s": 2 * matmul_size**3 / peak_s}
    flops = train_step_flops(config, rows, seq)
    sides = {name: summarise({**infos[name], "step_s": step_s}, flops, rows * seq, peak["flops_per_s"])
             for name, step_s in seconds.items()}
    result = {
        "model": config.to_hf_dict() | {"param_count": int(sum(x.size for x in jax.tree.leaves(params))),
                                        "attention_impl": config.attention_impl,
                                        "attention_block_size": config.attention_block_size,
                                        "remat_policy": config.remat_policy,
                                        "compute_dtype": config.dtype},
        "rows": rows, "seq": seq, "micro_batches": configuration.micro_batches, "tokens_per_step": rows * seq,
        "flops_per_step": dataclasses.asdict(flops) | {"total": flops.total},
        "matmul_peak": peak,
        "steps": sides,
        "jax_over_torch": {step: sides[f"jax {step}"]["tokens_per_s"] / sides[f"torch {step}"]["tokens_per_s"]
                           for step in STEPS},
        "variants": {name: {"model": dataclasses.asdict(variant),
                            "jax_over_torch": (sides[f"jax loss [{name}]"]["tokens_per_s"]
                                               / sides["torch loss"]["tokens_per_s"]),
                            "step_time_vs_default": (sides[f"jax loss [{name}]"]["median_step_s"]
                                                     / sides["jax loss"]["median_step_s"])}
                     for name, variant in (variants or {}).items()},
        "loss_abs_difference": {step: abs(sides[f"jax {step}"]["loss"] - sides[f"torch {step}"]["loss"])
                                for step in STEPS},
        "rl_update_old_logprobs_s": old_logprob_s | {
            "speedup": old_logprob_s["own pass"] / old_logprob_s["update's pass"]},
        "load_average_1m_at_end": os.getloadavg()[0],
        "other_processes_cpu_share": max(others, 0.0) / (wall * os.cpu_count()),
    }
    if profile:
        step = jax.jit(jax.value_and_grad(sft_loss), static_argnums=1)
        times = profile_step(step, (params, config, jax.device_put(loss_batch)))
        result["jax_loss_profile_ms"] = by_category(times)
    return result


def run_benchmark(names: Sequence[str], warmup: int, iters: int, matmul_size: int, profile: bool = False,
                  gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
                  overrides: dict[str, int] | None = None,
                  variants: dict[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """Every configuration in `names` (its rows, seq or micro_batches replaced by `overrides`), one after the
    other, as one JSON-able dict; `variants` names gin bindings whose JAX loss step is timed beside the default's
    (the measured effect of a gin option, e.g. {"dense": ["ModelConfig.attention_impl = 'dense'"]})."""
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose from {sorted(CONFIGURATIONS)}")
    minimums = {"warmup": (warmup, 0), "iters": (iters, 1), "matmul_size": (matmul_size, 1)}
    too_small = [f"{name}={value} (needs >= {least})" for name, (value, least) in minimums.items() if value < least]
    if too_small:
        raise ValueError(f"benchmark sizes too small: {', '.join(too_small)}")
    chosen = {name: dataclasses.replace(CONFIGURATIONS[name], **(overrides or {})) for name in names}
    results = {}
    for name, configuration in chosen.items():
        configs = {variant: model_config(configuration, gin_files, [*gin_params, *bindings])
                   for variant, bindings in (variants or {}).items()}
        config = model_config(configuration, gin_files, gin_params)  # parsed last: the gin state of the run
        results[name] = run_configuration(config, configuration, warmup, iters, matmul_size, profile, configs)
    return {"configurations": results, "warmup": warmup, "iters": iters,
            "environment": {"jax": jax.__version__, "torch": torch.__version__,
                            "transformers": transformers.__version__, "jax_backend": jax.default_backend(),
                            "cpu_count": os.cpu_count(), "machine": platform.machine(),
                            "python": platform.python_version(), "load_average_1m_at_end": os.getloadavg()[0]}}


def format_table(result: dict[str, Any]) -> str:
    """Human-readable summary of `run_benchmark`'s result: one row per configuration and step."""
    lines = [f"| configuration | step | JAX ms | torch ms | JAX tokens/s | torch tokens/s | JAX / torch | "
             f"JAX % of peak | torch % of peak | |loss diff| | load | others' CPU |", "|---" * 12 + "|"]
    for name, config in result["configurations"].items():
        for step in STEPS:
            jax_side, torch_side = config["steps"][f"jax {step}"], config["steps"][f"torch {step}"]
            lines.append(
                f"| {name} [{config['rows']} x {config['seq']}] | {step} | {jax_side['median_step_s'] * 1e3:.1f} | "
                f"{torch_side['median_step_s'] * 1e3:.1f} | {jax_side['tokens_per_s']:,.0f} | "
                f"{torch_side['tokens_per_s']:,.0f} | {config['jax_over_torch'][step]:.2f}x | "
                f"{jax_side['fraction_of_peak'] * 100:.1f}% | {torch_side['fraction_of_peak'] * 100:.1f}% | "
                f"{config['loss_abs_difference'][step]:.1e} | {config['load_average_1m_at_end']:.1f} | "
                f"{config['other_processes_cpu_share'] * 100:.0f}% |")
        for variant, figures in config["variants"].items():
            side = config["steps"][f"jax loss [{variant}]"]
            lines.append(
                f"| {name} [{config['rows']} x {config['seq']}] | loss [{variant}] | "
                f"{side['median_step_s'] * 1e3:.1f} | | {side['tokens_per_s']:,.0f} | | "
                f"{figures['jax_over_torch']:.2f}x | {side['fraction_of_peak'] * 100:.1f}% | | "
                f"{abs(side['loss'] - config['steps']['torch loss']['loss']):.1e} | | |")
    lines.append("")
    for name, config in result["configurations"].items():
        model, flops = config["model"], config["flops_per_step"]
        lines.append(
            f"{name}: {model['model_type']} V={model['vocab_size']} E={model['hidden_size']} "
            f"L={model['num_hidden_layers']} heads={model['num_attention_heads']}/{model['num_key_value_heads']} "
            f"D={model['head_dim']} F={model['intermediate_size']} ({model['param_count']:,} params), attention "
            f"{model['attention_impl']} (block {model['attention_block_size']}), remat {model['remat_policy']}, "
            f"compute {model['compute_dtype']}; "
            f"{flops['total'] / 1e9:.1f} GFLOP/step; matmul peak {config['matmul_peak']['flops_per_s'] / 1e9:.1f} "
            f"GFLOP/s; JAX compile + first step {config['steps']['jax loss']['compile_and_first_step_s']:.1f} s")
        old = config["rl_update_old_logprobs_s"]
        own_ms, fused_ms = old["own pass"] * 1e3, old["update's pass"] * 1e3
        lines.append(f"  RL step's update (JAX): old log-probs in a pass of their own {own_ms:.1f} ms, from the "
                     f"update's own forward {fused_ms:.1f} ms ({old['speedup']:.2f}x)")
        if "jax_loss_profile_ms" in config:
            profile = config["jax_loss_profile_ms"]
            total = sum(profile.values())
            lines.append("  JAX loss step per-op profile: " + "; ".join(
                f"{category} {ms:.1f} ms ({100 * ms / total:.0f}%)" for category, ms in profile.items()))
    environment = result["environment"]
    lines.append(f"machine: {environment['cpu_count']} cores, median of {result['iters']} interleaved rounds after "
                 f"{result['warmup']} warm-up, 1-minute load average at the end "
                 f"{environment['load_average_1m_at_end']:.1f}")
    return "\n".join(lines)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """"NAME=BINDING;BINDING" -> (NAME, [BINDING, BINDING])."""
    name, separator, bindings = text.partition("=")
    if not separator or not name.strip() or not bindings.strip():
        raise ValueError(f"a variant reads NAME=BINDING[;BINDING...], got {text!r}")
    return name.strip(), [binding.strip() for binding in bindings.split(";") if binding.strip()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line entry point: run, print the table, optionally write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS),
                        help=f"comma-separated, from {', '.join(CONFIGURATIONS)}")
    for field in ("rows", "seq", "micro_batches"):
        parser.add_argument(f"--{field}", type=int, help=f"replaces every chosen configuration's {field}")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--matmul_size", type=int, default=2048, help="side of the square matmul timed for the peak")
    parser.add_argument("--profile", action="store_true", help="add the JAX loss step's per-op profile")
    parser.add_argument("--reuse_freed_memory", action="store_true",
                        help="call reuse_freed_memory() first (a process-wide glibc setting; see its docstring)")
    parser.add_argument("--gin_file", action="append", default=[], help="gin file binding ModelConfig fields")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. \"ModelConfig.remat_policy = 'none'\"")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=BINDING[;BINDING...]: also time the JAX loss step under these ModelConfig "
                             "bindings, e.g. \"dense=ModelConfig.attention_impl = 'dense'\"")
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.reuse_freed_memory:
        reuse_freed_memory()
    overrides = {field: getattr(args, field) for field in ("rows", "seq", "micro_batches")
                 if getattr(args, field) is not None}
    variants = dict(parse_variant(text) for text in args.variant)
    result = run_benchmark(args.configs.split(","), args.warmup, args.iters, args.matmul_size, args.profile,
                           args.gin_file, args.gin_param, overrides, variants)
    result["environment"]["reuse_freed_memory"] = args.reuse_freed_memory
    print(format_table(result))
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
