"""GPU check (issue 22 item 6): the figures to take whenever a GPU machine is at hand, in under 8 minutes on one
H200-class GPU, as one JSON file.

1. Attention on a Qwen3-1.7B-shaped layer (gin/model/qwen3_1_7b.gin: 16 query heads, 8 KV heads, head_dim 128), one
   row of T = 4,096 and 8,192 tokens in bfloat16, through `rstar_jax.model.attention.causal_attention` with
   impl 'pallas' (the FlashAttention-2 Pallas/Triton kernel), 'causal_blockwise' (block 512) and 'dot_product'
   (`jax.nn.dot_product_attention`, cuDNN's fused kernel on CUDA): forward and forward + backward times, tokens/s,
   attention TFLOP/s, each impl's speed against 'dot_product' (the baseline, measured in the same run), whether
   cuDNN's fused attention is in the compiled program, and its parity: max |x - ref| / max |ref| of the output and of
   dq, dk, dv against one float32 reference (XLA's dense attention, `jax.nn.dot_product_attention` with
   implementation "xla", on the same bfloat16-rounded inputs in float32 at precision HIGHEST; the first H200 run
   used 'causal_blockwise' there, which took 90 s at T = 4,096 and left T = 8,192 no time). An impl that this
   checkout or this backend does not offer is recorded "unavailable", one that fails "failed" with its error: the
   run goes on.
2. One full GRPO learner step of a Qwen3-0.6B-shaped model (gin/model/qwen3_0_6b.gin), `RLLearner.update(...,
   on_policy=True)` (the trainer's path for a step's only update: forward, backward, clipped policy loss,
   gradient accumulated over the micro-batches, AdamW, donated state) on rows of 8,192 tokens, float32 parameters,
   bfloat16 compute, remat 'full', with each attention of 'pallas', 'dot_product' and 'causal_blockwise' while the
   budget lasts (the fastest that ran is the headline; failures and why are recorded): tokens/s and model FLOPs
   utilisation
     MFU = (6 N T + 6 L R S^2 H D) / step time / peak
   with N the parameters in a matmul per token (every projection and the output head), T = R x S tokens (R rows of
   S), L layers, H query heads, D head_dim (the attention term: QK^T and PV over the causal half of the S x S
   scores, forward + backward; as experiments/bench/learner.py counts). Model FLOPs: remat's recomputed forward is
   not counted. The peak is `--peak_tflops`, by default 989 TFLOP/s: NVIDIA's H200 (SXM) datasheet gives 1,979
   TFLOP/s of BF16 tensor-core throughput "with sparsity", i.e. 989.5 dense (the same as the H100 SXM's). The run
   also times a large bfloat16 matmul, so the JSON has the step against what this GPU reaches in practice too.

`--smoke` runs the same code at tiny sizes (2 KV heads, head_dim 64, T = 128 in blocks of 32; the tiny demo model on
2 rows of 128 tokens in one micro-batch) on a CPU, in about a minute, nearly all of it XLA compiling
(tests/parallel/test_gpu_check.py), so the script cannot rot. The JSON is rewritten after each part, so a run cut
short keeps what it measured; `--budget_s` skips what would start after the budget.

    python -m experiments.bench.gpu_check --json artifacts/gpu_check.json
    python -m experiments.bench.gpu_check --smoke

On a GPU machine whose own Python has JAX (CUDA), flax, optax, orbax and transformers but not gin-config and grain,
fetch their wheels here first (scripts/gpu_wheels.sh writes .whl/), then on that machine, from the checkout:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 -m experiments.bench.gpu_check --json $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import ModelConfig, init_params
from rstar_jax.model.attention import causal_attention
from rstar_jax.model.config import ATTENTION_IMPLS
from rstar_jax.parallel import make_mesh
from rstar_jax.rl.losses import PolicyLossOptions
from rstar_jax.train.optim import rl_optimizer
from rstar_jax.train.rl_batch import rl_micro_batches
from rstar_jax.train.rl_step import RLLearner
from rstar_jax.train.state import init_train_state, train_state_shardings

ATTENTION_CHECKED = ("pallas", "causal_blockwise", "dot_product")
BASELINE = "dot_product"
LEARNER_ATTENTION = ("pallas", "dot_product", "causal_blockwise")  # each, while the budget lasts
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 SXM datasheet: 1,979 TFLOP/s BF16 "with sparsity"; dense is half
PARITY_TOLERANCE = {"out": 2e-2, "grads": 5e-2}  # bfloat16 inputs and outputs: 8 significant bits


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the attention layer's shape and lengths, the learner's model, rows and length."""

    kv_heads: int
    groups: int
    head_dim: int
    lengths: tuple[int, ...]
    block_size: int
    model_gin: str
    rows: int
    seq: int
    micro_batches: int
    warmup: int
    iters: int
    matmul_size: int


FULL = Sizes(kv_heads=8, groups=2, head_dim=128, lengths=(4096, 8192), block_size=512,
             model_gin="model/qwen3_0_6b.gin", rows=4, seq=8192, micro_batches=2, warmup=2, iters=5,
             matmul_size=8192)
SMOKE = Sizes(kv_heads=2, groups=2, head_dim=64, lengths=(128,), block_size=32,
              model_gin="model/tiny.gin", rows=2, seq=128, micro_batches=1, warmup=1, iters=2, matmul_size=256)


def timed(call: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Wall-clock seconds of `iters` calls after `warmup` untimed ones; `call` must block until its work is done."""
    for _ in range(warmup):
        call()
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def error_text(exc: BaseException, limit: int = 600) -> str:
    """An exception as one short line for the JSON (XLA's messages run to pages)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def attention_flops(length: int, heads: int, head_dim: int, rows: int = 1, layers: int = 1) -> int:
    """Forward + backward FLOPs of causal attention: QK^T and PV (2 FLOPs per multiply-add) over the causal half of
    the [length, length] scores, times 3 for forward + backward: 6 L R S^2 H D."""
    return 6 * layers * rows * length * length * heads * head_dim


def matmul_param_count(config: ModelConfig) -> int:
    """Parameters in a matmul per token: every layer projection plus the output head (tied or not); the same count
    as experiments/bench/learner.py (not imported: that module needs torch, which a GPU machine may lack)."""
    embed = config.hidden_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = embed * q_width + 2 * embed * kv_width + q_width * embed + 3 * embed * config.intermediate_size
    return config.num_layers * per_layer + embed * config.vocab_size


def relative_error(value: jax.Array, reference: jax.Array) -> float:
    """max |value - reference| / max |reference|, in float32."""
    value, reference = (jnp.asarray(x, jnp.float32) for x in (value, reference))
    return float(jnp.max(jnp.abs(value - reference)) / jnp.maximum(jnp.max(jnp.abs(reference)), 1e-30))


def attention_inputs(sizes: Sizes, length: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """q [1, T, Hkv, G, D], k, v [1, T, Hkv, D], a cotangent like q (bfloat16) and one segment per row (int32)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q_shape = (1, length, sizes.kv_heads, sizes.groups, sizes.head_dim)
    kv_shape = (1, length, sizes.kv_heads, sizes.head_dim)
    q, ct = (jax.random.normal(key, q_shape, jnp.float32).astype(jnp.bfloat16) for key in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, kv_shape, jnp.float32).astype(jnp.bfloat16) for key in keys[1:3])
    return q, k, v, ct, jnp.ones((1, length), jnp.int32)


def attention_calls(impl: str, segments: jax.Array, block_size: int, precision=jax.lax.Precision.DEFAULT):
    """(forward, forward + backward) of `impl`, jitted: out = attention(q, k, v); the loss sum(out * ct) in float32
    and its gradients with respect to q, k and v."""
    def forward(q, k, v):
        return causal_attention(q, k, v, segments, impl, precision, block_size)

    def loss(q, k, v, ct):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def unavailable_reason(impl: str) -> str | None:
    """Why this checkout cannot run `impl` at all (not one of ModelConfig's attention_impl values), else None."""
    if impl not in ATTENTION_IMPLS:
        return f"attention_impl {impl!r} is not in this checkout's ModelConfig ({', '.join(ATTENTION_IMPLS)})"
    return None


def check_attention_length(sizes: Sizes, length: int, deadline: float) -> dict[str, Any]:
    """Every impl of ATTENTION_CHECKED at one length: timings, rates, parity against the float32 reference."""
    q, k, v, ct, segments = attention_inputs(sizes, length)
    heads = sizes.kv_heads * sizes.groups
    flops = attention_flops(length, heads, sizes.head_dim)
    start = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        reference_forward, reference_grad = attention_calls("dot_product", segments, sizes.block_size,
                                                            jax.lax.Precision.HIGHEST)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]  # float32: XLA's dense form, never cuDNN
        reference_out = reference_forward(*f32[:3])
        _, reference_grads = reference_grad(*f32)
        jax.block_until_ready((reference_out, reference_grads))
    result: dict[str, Any] = {"tokens": length, "heads": heads, "kv_heads": sizes.kv_heads,
                              "head_dim": sizes.head_dim, "block_size": sizes.block_size,
                              "flops_forward_backward": flops,
                              "reference": {"impl": "dot_product (xla)", "dtype": "float32", "precision": "highest",
                                            "seconds": time.perf_counter() - start},
                              "impls": {}}
    for impl in ATTENTION_CHECKED:
        entry: dict[str, Any]
        reason = unavailable_reason(impl)
        if reason is not None:
            entry = {"status": "unavailable", "error": reason}
        elif time.perf_counter() > deadline:
            entry = {"status": "skipped", "error": "past the attention part's share of --budget_s"}
        else:
            entry = measure_attention(impl, sizes, (q, k, v, ct), segments, (reference_out, reference_grads))
            if entry.get("status") == "ok":
                entry["tokens_per_s"] = length / entry["forward_backward_s"]
                entry["tflops_per_s"] = flops / entry["forward_backward_s"] / 1e12
        result["impls"][impl] = entry
        print(f"  attention T={length:,} {impl}: {entry.get('status')}"
              + (f" {entry['forward_backward_s'] * 1e3:.2f} ms fwd+bwd" if entry.get("status") == "ok"
                 else f" ({entry.get('error', '')[:160]})"), flush=True)
    baseline = result["impls"].get(BASELINE, {})
    for impl, entry in result["impls"].items():
        if entry.get("status") == "ok" and baseline.get("status") == "ok":
            entry["speed_vs_" + BASELINE] = baseline["forward_backward_s"] / entry["forward_backward_s"]
    return result


def measure_attention(impl: str, sizes: Sizes, inputs: Sequence[jax.Array], segments: jax.Array,
                      reference: tuple[jax.Array, Sequence[jax.Array]]) -> dict[str, Any]:
    """One impl at one length, every failure caught: "ok" with times and parity, "unavailable" when the impl
    refuses this backend (a ValueError naming it), else "failed" with the error."""
    q, k, v, ct = inputs
    try:
        forward, forward_backward = attention_calls(impl, segments, sizes.block_size)
        start = time.perf_counter()
        out = jax.block_until_ready(forward(q, k, v))
        _, grads = jax.block_until_ready(forward_backward(q, k, v, ct))
        compile_s = time.perf_counter() - start
        cudnn = "cudnn" in forward.lower(q, k, v).compile().as_text().lower()
        forward_s = timed(lambda: jax.block_until_ready(forward(q, k, v)), sizes.warmup, sizes.iters)
        both_s = timed(lambda: jax.block_until_ready(forward_backward(q, k, v, ct)), sizes.warmup, sizes.iters)
    except ValueError as exc:
        if "attention_impl" in str(exc) or "attention implementation" in str(exc):
            return {"status": "unavailable", "error": error_text(exc)}
        return {"status": "failed", "error": error_text(exc)}
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to lower or run is a result, not the end of the run
        return {"status": "failed", "error": error_text(exc)}
    reference_out, reference_grads = reference
    parity = {"out": relative_error(out, reference_out),
              **{f"d{name}": relative_error(grad, ref) for name, grad, ref in zip("qkv", grads, reference_grads)}}
    within = (parity["out"] <= PARITY_TOLERANCE["out"]
              and all(parity[f"d{name}"] <= PARITY_TOLERANCE["grads"] for name in "qkv"))
    return {"status": "ok", "compile_and_first_call_s": compile_s,
            "forward_s": statistics.median(forward_s), "forward_backward_s": statistics.median(both_s),
            "relative_error_vs_float32": parity, "parity_ok": within, "cudnn_in_program": cudnn}


def matmul_peak(size: int, iters: int) -> dict[str, Any]:
    """TFLOP/s of a jitted bfloat16 [size, size] @ [size, size]: what this device reaches on a plain matmul."""
    a, b = (jax.random.normal(key, (size, size), jnp.float32).astype(jnp.bfloat16)
            for key in jax.random.split(jax.random.key(1)))
    matmul = jax.jit(jnp.dot)
    jax.block_until_ready(matmul(a, b))
    seconds = statistics.median(timed(lambda: jax.block_until_ready(matmul(a, b)), 2, max(iters, 5)))
    return {"size": size, "dtype": "bfloat16", "median_s": seconds, "tflops_per_s": 2 * size ** 3 / seconds / 1e12}


@dataclasses.dataclass(frozen=True)
class Rollout:
    """A synthetic kept trajectory (what `rl_micro_batches` reads): prompt and a tool response masked out."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]


def synthetic_rollouts(rows: int, seq: int, vocab_size: int, seed: int = 0) -> tuple[list[Rollout], np.ndarray]:
    """`rows` trajectories of seq + 1 tokens (exactly [rows, seq] inputs), as experiments/bench/learner.py makes
    them, and one advantage each."""
    rng = np.random.default_rng(seed)
    mask = np.ones(seq + 1, np.int64)
    mask[:seq // 8] = 0
    mask[seq // 2:seq // 2 + seq // 8] = 0
    rollouts = [Rollout(tuple(int(t) for t in rng.integers(1, vocab_size, seq + 1)), tuple(int(m) for m in mask),
                        tuple(float(-rng.exponential()) if m else 0.0 for m in mask)) for _ in range(rows)]
    return rollouts, rng.normal(size=rows).astype(np.float32)


def learner_config(sizes: Sizes) -> ModelConfig:
    """The model of `sizes.model_gin` in the recipe's precision: float32 parameters, bfloat16 compute, remat
    'full', attention blocks of `sizes.block_size` (the impl is set per attempt)."""
    parse_gin([sizes.model_gin], ["ModelConfig.param_dtype = 'float32'", "ModelConfig.dtype = 'bfloat16'",
                                  "ModelConfig.remat_policy = 'full'", "ModelConfig.attention_impl = 'causal_blockwise'",
                                  f"ModelConfig.attention_block_size = {sizes.block_size}"])
    return ModelConfig()


def learner_step(config: ModelConfig, sizes: Sizes, rollouts: list[Rollout], advantages: np.ndarray,
                 peak_tflops: float) -> dict[str, Any]:
    """Compile and time `RLLearner.update(on_policy=True)` on one device; tokens/s and MFU."""
    rows = sizes.rows // sizes.micro_batches
    optimizer, schedule = rl_optimizer(total_steps=1000)
    mesh = make_mesh(devices=jax.devices()[:1])
    params = init_params(config, jax.random.key(0))
    state = init_train_state(params, optimizer)
    shardings = train_state_shardings(state, mesh)
    learner = RLLearner(config, optimizer, schedule, mesh, shardings, rows, PolicyLossOptions())
    batches = rl_micro_batches(rollouts, advantages, rows, multiple=sizes.seq)
    if batches[0].shape[1] != sizes.seq:
        raise ValueError(f"rows of {sizes.seq} tokens padded to {batches[0].shape[1]}")
    holder = {"state": jax.device_put(state, shardings)}
    del params, state

    def update() -> dict[str, float]:
        holder["state"], metrics = learner.update(holder["state"], batches, on_policy=True)
        jax.block_until_ready(holder["state"])
        return metrics

    start = time.perf_counter()
    metrics = update()
    compile_s = time.perf_counter() - start
    step_s = statistics.median(timed(update, sizes.warmup, sizes.iters))
    tokens = sizes.rows * sizes.seq
    dense = 6 * matmul_param_count(config) * tokens
    attention = attention_flops(sizes.seq, config.num_heads, config.head_dim, sizes.rows, config.num_layers)
    return {"status": "ok", "compile_and_first_step_s": compile_s, "median_step_s": step_s,
            "tokens_per_s": tokens / step_s, "model_flops": {"dense_6NT": dense, "attention": attention,
                                                              "total": dense + attention},
            "model_tflops_per_s": (dense + attention) / step_s / 1e12,
            "mfu": (dense + attention) / step_s / (peak_tflops * 1e12),
            "first_step": {name: metrics[name] for name in ("loss", "grad_norm") if name in metrics}}


def check_learner(sizes: Sizes, peak_tflops: float, deadline: float) -> dict[str, Any]:
    """The GRPO step with each attention of LEARNER_ATTENTION while the budget lasts, every attempt recorded; the
    headline figures are the fastest attempt's."""
    base = learner_config(sizes)
    rollouts, advantages = synthetic_rollouts(sizes.rows, sizes.seq, base.vocab_size)
    result: dict[str, Any] = {
        "model_gin": sizes.model_gin, "param_count": None, "matmul_params": matmul_param_count(base),
        "layers": base.num_layers, "hidden": base.hidden_size, "heads": base.num_heads,
        "kv_heads": base.num_kv_heads, "head_dim": base.head_dim, "vocab": base.vocab_size,
        "param_dtype": base.param_dtype, "compute_dtype": base.dtype, "remat_policy": base.remat_policy,
        "rows": sizes.rows, "seq": sizes.seq, "micro_batches": sizes.micro_batches,
        "tokens_per_step": sizes.rows * sizes.seq, "peak_tflops": peak_tflops,
        "formula": "MFU = (6 N T + 6 L R S^2 H D) / step_s / peak; N matmul parameters, T = R S tokens",
        "attempts": {}}
    result["param_count"] = int(sum(np.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(
        jax.eval_shape(init_params, base, jax.random.key(0)))))
    for impl in LEARNER_ATTENTION:
        reason = unavailable_reason(impl)
        if reason is not None:
            result["attempts"][impl] = {"status": "unavailable", "error": reason}
            continue
        if time.perf_counter() > deadline:
            result["attempts"][impl] = {"status": "skipped", "error": "past --budget_s"}
            continue
        try:
            entry = learner_step(dataclasses.replace(base, attention_impl=impl), sizes, rollouts, advantages,
                                 peak_tflops)
        except Exception as exc:  # noqa: BLE001 - recorded; the next attention is tried
            entry = {"status": "failed", "error": error_text(exc)}
        result["attempts"][impl] = entry
        print(f"  learner step with attention {impl}: {entry['status']}"
              + (f" {entry['median_step_s']:.3f} s, MFU {entry['mfu']:.1%}" if entry["status"] == "ok"
                 else f" ({entry['error'][:160]})"), flush=True)
    ran = {impl: entry for impl, entry in result["attempts"].items() if entry["status"] == "ok"}
    if ran:
        fastest = min(ran, key=lambda impl: ran[impl]["median_step_s"])
        result["attention_impl"] = fastest
        result.update({key: ran[fastest][key] for key in ("median_step_s", "tokens_per_s", "mfu",
                                                          "model_tflops_per_s")})
    return result


def environment() -> dict[str, Any]:
    """The machine: JAX and its backend, the first device's kind, Python."""
    device = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device_kind": device.device_kind,
            "device_count": jax.device_count(), "python": platform.python_version(),
            "platform_version": getattr(getattr(device, "client", None), "platform_version", None)}


def run_check(sizes: Sizes, peak_tflops: float, budget_s: float, json_path: str | None = None,
              parts: Sequence[str] = ("attention", "learner")) -> dict[str, Any]:
    """Both parts (or those in `parts`), writing the JSON after each."""
    start = time.perf_counter()
    result: dict[str, Any] = {"environment": environment(), "sizes": dataclasses.asdict(sizes),
                              "peak_tflops": peak_tflops,
                              "peak_source": "--peak_tflops; default: NVIDIA H200 SXM dense BF16 tensor-core peak "
                                             "(datasheet 1,979 TFLOP/s with sparsity / 2)",
                              "parity_tolerance": PARITY_TOLERANCE, "budget_s": budget_s}

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - start
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(result, indent=2) + "\n")

    result["matmul_peak"] = matmul_peak(sizes.matmul_size, sizes.iters)
    save()
    if "attention" in parts:
        result["attention"] = {}
        for length in sizes.lengths:
            try:
                result["attention"][str(length)] = check_attention_length(sizes, length, start + budget_s / 2)
            except Exception as exc:  # noqa: BLE001 - e.g. the float32 reference ran out of memory
                result["attention"][str(length)] = {"status": "failed", "error": error_text(exc)}
            save()
    if "learner" in parts:
        result["learner"] = check_learner(sizes, peak_tflops, start + budget_s)
        learner = result["learner"]
        if "median_step_s" in learner:
            learner["fraction_of_measured_matmul_peak"] = (learner["model_tflops_per_s"]
                                                           / result["matmul_peak"]["tflops_per_s"])
        save()
    return result


def format_table(result: dict[str, Any]) -> str:
    """The figures as text: one row per attention impl and length, then the learner step."""
    env, peak = result["environment"], result["matmul_peak"]
    lines = [f"GPU check on {env['device_kind']} ({env['backend']}, JAX {env['jax']}); bf16 matmul "
             f"{peak['size']}^3: {peak['tflops_per_s']:.1f} TFLOP/s; peak for MFU {result['peak_tflops']:g} TFLOP/s"]
    if "attention" in result:
        lines.append(f"{'T':>6} {'impl':<17} {'status':<11} {'fwd ms':>8} {'fwd+bwd ms':>10} {'tokens/s':>11} "
                     f"{'TFLOP/s':>8} {'vs ' + BASELINE:>15} {'err out':>8} {'err dq':>8} {'err dk':>8} "
                     f"{'err dv':>8}")
        for length, part in result["attention"].items():
            for impl, entry in part.get("impls", {"-": part}).items():
                if entry.get("status") != "ok":
                    lines.append(f"{length:>6} {impl:<17} {entry.get('status', '?'):<11} "
                                 f"{entry.get('error', '')[:90]}")
                    continue
                errors = entry["relative_error_vs_float32"]
                speed = entry.get("speed_vs_" + BASELINE)
                lines.append(f"{length:>6} {impl:<17} {'ok':<11} {entry['forward_s'] * 1e3:>8.2f} "
                             f"{entry['forward_backward_s'] * 1e3:>10.2f} {entry['tokens_per_s']:>11,.0f} "
                             f"{entry['tflops_per_s']:>8.1f} {'-' if speed is None else format(speed, '.2f') + 'x':>15} "
                             + " ".join(f"{errors[key]:>8.1e}" for key in ("out", "dq", "dk", "dv")))
    learner = result.get("learner")
    if learner:
        lines.append(f"GRPO step, {learner['model_gin']} ({learner['param_count']:,} parameters), "
                     f"{learner['rows']} x {learner['seq']:,} tokens in {learner['micro_batches']} micro-batch(es), "
                     f"{learner['param_dtype']} params / {learner['compute_dtype']} compute, remat "
                     f"{learner['remat_policy']!r}:")
        for impl, entry in learner["attempts"].items():
            if entry["status"] == "ok":
                lines.append(f"  attention {impl}: {entry['median_step_s']:.3f} s a step (compile + first "
                             f"{entry['compile_and_first_step_s']:.1f} s), {entry['tokens_per_s']:,.0f} tokens/s, "
                             f"{entry['model_tflops_per_s']:.1f} model TFLOP/s, MFU {entry['mfu']:.1%}")
            else:
                lines.append(f"  attention {impl}: {entry['status']} ({entry.get('error', '')[:120]})")
        lines.append(f"  {learner['formula']}")
    lines.append(f"elapsed {result.get('elapsed_s', 0.0):.1f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: run, print the table, optionally write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU: the code path, not figures")
    parser.add_argument("--peak_tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                        help="the GPU's dense bf16 peak for MFU (default: H200 SXM, 989)")
    parser.add_argument("--budget_s", type=float, default=420.0,
                        help="start nothing after this many seconds (attention: after half of it)")
    parser.add_argument("--parts", default="attention,learner", help="comma-separated subset of attention,learner")
    parser.add_argument("--iters", type=int, help="timed calls per measurement (default 5; smoke 2)")
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if args.iters is not None:
        sizes = dataclasses.replace(sizes, iters=args.iters)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    result = run_check(sizes, args.peak_tflops, args.budget_s, args.json_path, parts)
    print(format_table(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
