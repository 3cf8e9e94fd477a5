"""Learner throughput: forward + backward tokens/s of the JAX model against transformers' PyTorch model.

Both sides run the same training computation (mean next-token cross-entropy, its gradient with respect to every
parameter) on the same weights (the JAX parameters written with `save_hf` and loaded by transformers) and the
same token batch, in the same process. The JAX step's achieved FLOP/s is compared with this machine's float32
matmul peak, measured in the same run by timing a large jitted `jnp.dot`. The three timings alternate round by
round (warm-up rounds, then the median of several timed ones), so a busy shared machine slows them alike.

FLOPs are counted analytically, the same count for both implementations:
  dense     = 6 * (matmul parameters) * tokens  (2 forward + 4 backward per multiply-add; matmul parameters are every
              projection of every layer plus the output head; the embedding lookup and norms are not matmuls)
  attention = 12 * layers * batch * seq^2 * heads * head_dim  (QK^T and PV, 2 FLOPs per multiply-add, times 3 for
              forward + backward, over the full seq x seq score matrix the JAX model computes before masking)

    python -m experiments.bench.learner                      # tiny demo model, batch 4 x 256 tokens
    python -m experiments.bench.learner --batch 4 --seq 512 --json /tmp/learner.json
    python -m experiments.bench.learner --gin_param "ModelConfig.hidden_size = 512"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from experiments.make_tiny_model import TINY_MODEL_GIN
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import ModelConfig, forward, init_params, save_hf

# The tiny demo model; --gin_file / --gin_param bindings of ModelConfig override any of these.


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


def matmul_param_count(config: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all layer projections plus the output head (tied or not)."""
    embed = config.hidden_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = embed * q_width + 2 * embed * kv_width + q_width * embed + 3 * embed * config.intermediate_size
    return config.num_layers * per_layer + embed * config.vocab_size


def train_step_flops(config: ModelConfig, batch: int, seq: int) -> StepFlops:
    """FLOPs of one forward + backward pass over a [batch, seq] token block."""
    matmul_params = matmul_param_count(config)
    attention = 12 * config.num_layers * batch * seq * seq * config.num_heads * config.head_dim
    return StepFlops(matmul_params, 6 * matmul_params * batch * seq, attention)


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


def next_token_cross_entropy(params: Any, config: ModelConfig, ids: jax.Array) -> jax.Array:
    """Mean -log p(ids[:, t+1] | ids[:, :t+1]) over every position of an unpadded batch (HF's labels=ids loss)."""
    mask = jnp.ones_like(ids)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    logprobs = jax.nn.log_softmax(forward(params, config, ids, positions, mask)[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logprobs, ids[:, 1:, None], axis=-1))


def jax_step_call(config: ModelConfig, params: Any, ids: np.ndarray) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The jitted value_and_grad of the next-token loss, compiled; its loss and compile (+ first step) time."""
    step = jax.jit(jax.value_and_grad(next_token_cross_entropy), static_argnums=1)
    ids_on_device = jnp.asarray(ids)
    start = time.perf_counter()
    loss, _ = jax.block_until_ready(step(params, config, ids_on_device))
    info = {"loss": float(loss), "compile_and_first_step_s": time.perf_counter() - start}
    return lambda: jax.block_until_ready(step(params, config, ids_on_device)), info


def torch_step_call(model_dir: str, ids: np.ndarray) -> tuple[Callable[[], Any], dict[str, Any]]:
    """loss.backward() of transformers' model loaded from `model_dir` (labels=ids: the same loss); its loss."""
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    input_ids = torch.from_numpy(ids.astype(np.int64))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return float(loss.detach())

    info = {"loss": step(), "attn_implementation": model.config._attn_implementation,
            "threads": torch.get_num_threads()}
    return step, info


def summarise(side: dict[str, Any], flops: StepFlops, tokens: int, peak_flops_per_s: float) -> dict[str, Any]:
    """Median step time and the rates derived from it."""
    median = statistics.median(side["step_s"])
    rate = flops.total / median
    return {**side, "median_step_s": median, "tokens_per_s": tokens / median, "flops_per_s": rate,
            "fraction_of_peak": rate / peak_flops_per_s}


def run_benchmark(config: ModelConfig, batch: int, seq: int, warmup: int, iters: int, matmul_size: int,
                  seed: int = 0) -> dict[str, Any]:
    """Every figure of the benchmark as one JSON-able dict."""
    minimums = {"batch": (batch, 1), "seq": (seq, 2), "warmup": (warmup, 0), "iters": (iters, 1),
                "matmul_size": (matmul_size, 1)}
    too_small = [f"{name}={value} (needs >= {least})" for name, (value, least) in minimums.items() if value < least]
    if too_small:
        raise ValueError(f"benchmark sizes too small: {', '.join(too_small)}")
    if seq > config.max_position_embeddings:
        raise ValueError(f"seq {seq} exceeds the model's max_position_embeddings {config.max_position_embeddings}")
    params = init_params(config, jax.random.key(seed))
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq), dtype=np.int32)
    flops = train_step_flops(config, batch, seq)
    jax_call, jax_info = jax_step_call(config, params, ids)
    with tempfile.TemporaryDirectory() as model_dir:
        save_hf((config, params), model_dir)
        torch_call, torch_info = torch_step_call(model_dir, ids)
    seconds = time_rounds({"matmul": matmul_call(matmul_size), "jax": jax_call, "torch": torch_call}, warmup, iters)
    matmul_median = statistics.median(seconds["matmul"])
    peak = {"size": matmul_size, "flops": 2 * matmul_size**3, "step_s": seconds["matmul"],
            "median_s": matmul_median, "flops_per_s": 2 * matmul_size**3 / matmul_median}
    tokens = batch * seq
    jax_summary = summarise({**jax_info, "step_s": seconds["jax"]}, flops, tokens, peak["flops_per_s"])
    torch_summary = summarise({**torch_info, "step_s": seconds["torch"]}, flops, tokens, peak["flops_per_s"])
    return {
        "model": config.to_hf_dict() | {"param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(params)))},
        "batch": batch,
        "seq": seq,
        "tokens_per_step": tokens,
        "warmup": warmup,
        "iters": iters,
        "flops_per_step": {"matmul_params": flops.matmul_params, "dense": flops.dense, "attention": flops.attention,
                           "total": flops.total},
        "matmul_peak": peak,
        "jax": jax_summary,
        "torch": torch_summary,
        "jax_over_torch_tokens_per_s": jax_summary["tokens_per_s"] / torch_summary["tokens_per_s"],
        "loss_abs_difference": abs(jax_summary["loss"] - torch_summary["loss"]),
        "environment": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                        "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                        "machine": platform.machine(), "python": platform.python_version(),
                        "load_average_1m_at_end": os.getloadavg()[0]},
    }


def format_table(result: dict[str, Any]) -> str:
    """Human-readable summary of `run_benchmark`'s result."""
    model, flops, peak = result["model"], result["flops_per_step"], result["matmul_peak"]
    lines = [
        f"learner benchmark: {model['model_type']} V={model['vocab_size']} E={model['hidden_size']} "
        f"L={model['num_hidden_layers']} heads={model['num_attention_heads']}/{model['num_key_value_heads']} "
        f"D={model['head_dim']} F={model['intermediate_size']} ({model['param_count']:,} params), "
        f"batch {result['batch']} x {result['seq']} tokens, "
        f"median of {result['iters']} interleaved rounds after {result['warmup']} warm-up",
        f"FLOPs/step: dense 6*{flops['matmul_params']:,}*{result['tokens_per_step']} = {flops['dense'] / 1e9:.2f} G "
        f"+ attention {flops['attention'] / 1e9:.2f} G = {flops['total'] / 1e9:.2f} G",
        f"matmul peak (jnp.dot f32 {peak['size']}x{peak['size']}): {peak['flops_per_s'] / 1e9:.1f} GFLOP/s",
        "",
        f"| {'impl':<24} | {'step ms':>9} | {'tokens/s':>10} | {'GFLOP/s':>8} | {'% of peak':>9} | {'loss':>8} |",
        f"|{'-' * 26}|{'-' * 11}|{'-' * 12}|{'-' * 10}|{'-' * 11}|{'-' * 10}|",
    ]
    for name, label in (("jax", "jax (jit value_and_grad)"),
                        ("torch", f"torch ({result['torch']['attn_implementation']})")):
        side = result[name]
        lines.append(f"| {label:<24} | {side['median_step_s'] * 1e3:>9.1f} | {side['tokens_per_s']:>10.0f} | "
                     f"{side['flops_per_s'] / 1e9:>8.1f} | {side['fraction_of_peak'] * 100:>8.1f}% | "
                     f"{side['loss']:>8.4f} |")
    lines += [
        "",
        f"jax / torch tokens/s: {result['jax_over_torch_tokens_per_s']:.2f}x   "
        f"jax compile + first step: {result['jax']['compile_and_first_step_s']:.1f} s   "
        f"|loss jax - loss torch|: {result['loss_abs_difference']:.2e}",
        f"machine: {result['environment']['cpu_count']} cores, 1-minute load average at the end "
        f"{result['environment']['load_average_1m_at_end']:.1f}",
    ]
    return "\n".join(lines)


def model_config_from_gin(gin_files: Sequence[str], gin_params: Sequence[str]) -> ModelConfig:
    """The tiny demo ModelConfig (gin/model/tiny.gin) with the user's gin files and bindings applied on top."""
    parse_gin([TINY_MODEL_GIN, *gin_files], gin_params)
    return ModelConfig()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line entry point: run, print the table, optionally write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--matmul_size", type=int, default=2048, help="side of the square matmul timed for the peak")
    parser.add_argument("--gin_file", action="append", default=[], help="gin file binding ModelConfig fields")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'ModelConfig.num_layers = 8'")
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    config = model_config_from_gin(args.gin_file, args.gin_param)
    result = run_benchmark(config, args.batch, args.seq, args.warmup, args.iters, args.matmul_size)
    print(format_table(result))
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
