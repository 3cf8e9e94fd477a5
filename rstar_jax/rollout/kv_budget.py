"""How many rollouts a vLLM fleet's KV cache holds at once (SPEC section 6: the load-balanced rollout scheduler
hands each engine as many rollouts as its free KV cache holds at the current maximum length; issue 11 item 4).

Pure arithmetic from the model shape and the servers' flags (the same `server_command.extra_args` gin gives the
servers this repo launches): a server on `tensor_parallel_size` GPUs may use `gpu_memory_utilization` of their
memory; what its weights (and any stated overhead) leave is KV cache, allocated in blocks of `block_size` tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from rstar_jax.model.config import ModelConfig

# vLLM's own defaults for the flags read here (vllm/engine/arg_utils.py): --gpu-memory-utilization 0.9,
# --tensor-parallel-size 1, --block-size 16 on CUDA/ROCm, --kv-cache-dtype auto (the model's serving dtype).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_TENSOR_PARALLEL = 1
DEFAULT_BLOCK_SIZE = 16
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1}


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes on a server: 2 (k and v) x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag value` or `--flag=value` in a command line's arguments (the last one wins, as in
    argparse), or None when the flag is absent."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag:
            if index + 1 >= len(args):
                raise ValueError(f"{flag} is the last argument and has no value: {list(args)}")
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


@dataclasses.dataclass(frozen=True)
class ServerShape:
    """What one vLLM server may hold: its GPUs, the fraction of their memory it may use, its KV block size, the
    bytes per element of its weights and of its KV cache, and its --max-num-seqs / --max-model-len (None: unset)."""

    tensor_parallel: int = DEFAULT_TENSOR_PARALLEL
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_size: int = DEFAULT_BLOCK_SIZE
    weight_bytes: int = 2
    kv_dtype_bytes: int = 2
    max_num_seqs: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.block_size < 1:
            raise ValueError(f"tensor_parallel and block_size must be >= 1, got {self.tensor_parallel}, "
                             f"{self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


def serving_dtype_bytes(dtype: str) -> int:
    """Bytes per weight of a server started with `--dtype dtype`; "auto" serves float32 and 16-bit checkpoints
    in 16 bits (vLLM downcasts float32 checkpoints to bfloat16 / float16), so 2."""
    if dtype == "auto":
        return 2
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown vLLM dtype {dtype!r}; known: auto, {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def server_shape(extra_args: Sequence[str], dtype: str = "auto", max_model_len: int | None = None) -> ServerShape:
    """A server's shape from its vLLM flags (`server_command`'s `extra_args`, `dtype` and `max_model_len`)."""
    weight_bytes = serving_dtype_bytes(flag_value(extra_args, "--dtype") or dtype)
    kv_dtype = flag_value(extra_args, "--kv-cache-dtype") or "auto"
    kv_bytes = weight_bytes if kv_dtype == "auto" else serving_dtype_bytes(kv_dtype)
    max_num_seqs = flag_value(extra_args, "--max-num-seqs")
    model_len = flag_value(extra_args, "--max-model-len")
    return ServerShape(
        tensor_parallel=int(flag_value(extra_args, "--tensor-parallel-size") or DEFAULT_TENSOR_PARALLEL),
        gpu_memory_utilization=float(flag_value(extra_args, "--gpu-memory-utilization")
                                     or DEFAULT_GPU_MEMORY_UTILIZATION),
        block_size=int(flag_value(extra_args, "--block-size") or DEFAULT_BLOCK_SIZE),
        weight_bytes=weight_bytes,
        kv_dtype_bytes=kv_bytes,
        max_num_seqs=None if max_num_seqs is None else int(max_num_seqs),
        max_model_len=int(model_len) if model_len is not None else max_model_len,
    )


def kv_budget_bytes(shape: ServerShape, gpu_memory_bytes: int, weight_count: int, overhead_bytes: int = 0) -> int:
    """KV-cache bytes of one server: tensor_parallel x gpu_memory x utilization, less its weights
    (weight_count x weight bytes) and `overhead_bytes` per GPU (activations, CUDA graphs; vLLM profiles these at
    start-up). Negative when the weights do not fit."""
    usable = shape.tensor_parallel * gpu_memory_bytes * shape.gpu_memory_utilization
    return int(usable - weight_count * shape.weight_bytes - shape.tensor_parallel * overhead_bytes)


def sequence_kv_bytes(context_tokens: int, bytes_per_token: int, block_size: int) -> int:
    """KV bytes one sequence of `context_tokens` (prompt plus response) takes: whole blocks of `block_size`."""
    return math.ceil(context_tokens / block_size) * block_size * bytes_per_token


def concurrent_sequences(budget_bytes: int, context_tokens: int, bytes_per_token: int, block_size: int,
                         max_num_seqs: int | None = None) -> int:
    """Sequences of `context_tokens` one server's KV budget holds at once (0 when not even one), capped by its
    --max-num-seqs when set."""
    fits = max(0, budget_bytes) // sequence_kv_bytes(context_tokens, bytes_per_token, block_size)
    return fits if max_num_seqs is None else min(fits, max_num_seqs)
