"""Hugging Face checkpoints in and out: a folder with config.json and safetensors (one file or an index of shards).

Loading reads each device's slice of each parameter on its own (safetensors `get_slice`, numpy framework) and
places it (`jax.make_array_from_callback`), so host memory holds one shard at a time; saving prepares one layer's
tensor at a time on the devices (cast to the written dtype, transposed) and streams it into shards of bounded size.
HF Linear weights are [out, in]; ours are kernels [in, out], hence the transposes. bfloat16 travels as
ml_dtypes.bfloat16, which safetensors' numpy API reads as BF16 (and `_write_shard` writes as BF16).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import struct
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import gin
import jax
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open

from rstar_jax.files import atomic_path
from rstar_jax.model.causal_lm import CausalLM
from rstar_jax.model.config import DTYPES, ModelConfig
from rstar_jax.model.lm import Params, init_params
from rstar_jax.parallel.params import param_shardings

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_TOP_MODULES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
_LAYER_MODULES = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                  "attn": "self_attn", "mlp": "mlp"}
_LEAVES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor: where it lives in our tree (path, layer index for stacked leaves) and its HF shape."""

    path: tuple[str, ...]
    layer: int | None
    hf_name: str
    hf_shape: tuple[int, ...]

    @property
    def transposed(self) -> bool:
        """Kernels are stored transposed relative to HF Linear weights."""
        return self.path[-1] == "kernel"


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every HF tensor name of this config, in checkpoint order (embeddings, layer by layer, norm, head)."""
    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    leaves = [(tuple(k.key for k in key_path), leaf.shape)
              for key_path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    layer_specs = [
        TensorSpec(path, layer, ".".join([f"model.layers.{layer}", _LAYER_MODULES[path[1]], *path[2:-1],
                                          _LEAVES[path[-1]]]), _hf_shape(path, shape[1:]))
        for layer in range(config.num_layers) for path, shape in leaves if path[0] == "layers"
    ]
    top_specs = {path[0]: TensorSpec(path, None, f"{_TOP_MODULES[path[0]]}.{_LEAVES[path[-1]]}",
                                     _hf_shape(path, shape))
                 for path, shape in leaves if path[0] != "layers"}
    ordered_top = [top_specs[name] for name in ("final_norm", "lm_head") if name in top_specs]
    return [top_specs["embed"], *layer_specs, *ordered_top]


def hf_model_config(path: str | os.PathLike, *, dtype: str | None = None,
                    param_dtype: str | None = None) -> ModelConfig:
    """The ModelConfig `load_hf` builds for the folder at `path` (its config.json, precision by
    `config.model_precision`), without reading any weights: what the dry run plans from (issue 22 item 1)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}; expected a Hugging Face model folder")
    return ModelConfig.from_hf_dict(json.loads(config_path.read_text()), dtype=dtype, param_dtype=param_dtype)


def load_hf(path: str | os.PathLike, *, dtype: str | None = None, param_dtype: str | None = None,
            mesh: Mesh | None = None) -> CausalLM:
    """Read a Hugging Face Qwen2/Qwen3 folder into a CausalLM (issue 2 item 3; issue 22 items 1-2).

    dtype / param_dtype: `ModelConfig.from_hf_dict` decides them (`config.model_precision`: explicit, else gin's
    ModelConfig bindings, else the checkpoint's). With `mesh`, every parameter goes from the safetensors straight
    into its shards by the partition rules of `rstar_jax.parallel` (`jax.make_array_from_callback`: each device's
    slice is read from the file on its own, cast on the host, and placed), so no device ever holds a whole
    unsharded weight and the host holds one shard at a time; without one, everything lands on the default device.
    Errors name the unsupported architecture or feature, the missing tensors, or the tensor whose shape disagrees
    with config.json.
    """
    folder = Path(path)
    config = hf_model_config(folder, dtype=dtype, param_dtype=param_dtype)
    specs = tensor_specs(config)
    locations = _tensor_locations(folder)
    missing = [spec.hf_name for spec in specs if spec.hf_name not in locations]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{folder} is missing tensor(s) {missing[:5]}{more} required by its config.json")

    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    shardings = (param_shardings(shapes, mesh) if mesh is not None
                 else jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), shapes))
    by_leaf: dict[tuple[str, ...], dict[int | None, TensorSpec]] = defaultdict(dict)
    for spec in specs:
        by_leaf[spec.path][spec.layer] = spec
    host_dtype = np.dtype(config.jnp_param_dtype)
    with contextlib.ExitStack() as stack:
        readers = {file: stack.enter_context(safe_open(file, framework="np")) for file in set(locations.values())}
        for spec in specs:
            shape = tuple(readers[locations[spec.hf_name]].get_slice(spec.hf_name).get_shape())
            if shape != spec.hf_shape:
                raise ValueError(f"tensor {spec.hf_name} in {locations[spec.hf_name].name} has shape {shape}, "
                                 f"but config.json implies {spec.hf_shape}")

        def read(spec: TensorSpec, index: tuple[slice, ...]) -> np.ndarray:
            """Our-layout slice `index` of one HF tensor (kernels are read transposed), in the param dtype."""
            tensor = readers[locations[spec.hf_name]].get_slice(spec.hf_name)
            part = tensor[index[::-1]].T if spec.transposed else tensor[index]
            return np.asarray(part).astype(host_dtype, copy=False)

        def place(keypath: tuple[Any, ...], leaf: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
            layers = by_leaf[tuple(key.key for key in keypath)]

            def shard(index: tuple[slice, ...]) -> np.ndarray:
                if None in layers:
                    return read(layers[None], index)
                return np.stack([read(layers[layer], index[1:]) for layer in range(*index[0].indices(leaf.shape[0]))])

            return jax.make_array_from_callback(leaf.shape, sharding, shard, dtype=host_dtype)

        params = jax.tree_util.tree_map_with_path(place, shapes, shardings)
    return CausalLM(config, params)


@dataclasses.dataclass(frozen=True)
class SavedWeights:
    """What `save_hf` wrote: tensor bytes, and where the time went."""

    nbytes: int
    gather_s: float  # waiting for the next tensor (cast, transpose, copy to host), beyond what overlapped the writes
    write_s: float  # writing the safetensors files


@gin.configurable
def save_hf(model: CausalLM | tuple[ModelConfig, Params], path: str | os.PathLike,
            shard_size_mb: float = 4096, dtype: str | None = None) -> SavedWeights:
    """Write a Hugging Face folder (config.json + safetensors) that transformers and vLLM load (issue 2 item 3).

    Tensors and config.json's torch_dtype are in `dtype` (default: the config's param_dtype; a vLLM server's dtype
    for a weight sync, issue 22 item 4). Parameters on devices (jax.Array) are cast and their kernels transposed to
    HF's [out, in] on the devices, one tensor at a time (a jitted call that keeps the leaf's sharding), before they
    are copied to the host: a float32 learner writing for a bfloat16 server moves half the bytes and the host holds
    bfloat16 only. Host (numpy) parameters are converted on the host. Each shard's safetensors header follows from
    the config, so tensors are streamed into the file as they arrive while the devices prepare and copy the next
    ones (`_hf_tensors`); the host holds a few tensors, never a whole shard. Shards hold at most `shard_size_mb` MiB
    (a single larger tensor gets its own shard); more than one shard comes with model.safetensors.index.json.
    Weights in their own dtype are written exactly (bfloat16 round-trips bit for bit).
    """
    config, params = (model.config, model.params) if isinstance(model, CausalLM) else model
    if shard_size_mb <= 0:
        raise ValueError(f"shard_size_mb must be positive, got {shard_size_mb}")
    if dtype is not None:
        config = dataclasses.replace(config, param_dtype=dtype)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_previous_weights(folder)
    (folder / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")

    dtype_np = np.dtype(config.jnp_param_dtype)
    specs = tensor_specs(config)
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for spec in specs:
        size = math.prod(spec.hf_shape) * dtype_np.itemsize
        if shards[-1] and shard_bytes + size > shard_size_mb * 2**20:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(spec)
        shard_bytes += size
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors" for index in range(len(shards))])
    clock = {"gather_s": 0.0, "write_s": 0.0}
    with contextlib.ExitStack() as renames:  # every shard under a temporary name, renamed once all are written
        temporaries = [renames.enter_context(atomic_path(folder / name)) for name in names]
        tensors = _hf_tensors(params, specs, dtype_np)
        try:
            total_bytes = sum(_write_shard(temporary, shard, tensors, dtype_np, clock)
                              for temporary, shard in zip(temporaries, shards))
        finally:
            tensors.close()
    if len(shards) > 1:
        weight_map = {spec.hf_name: name for name, shard in zip(names, shards) for spec in shard}
        index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")
    return SavedWeights(total_bytes, clock["gather_s"], clock["write_s"])


def _hf_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF shape of one (per-layer) leaf: kernels are transposed."""
    return tuple(shape[::-1]) if path[-1] == "kernel" else tuple(shape)


def _leaf(tree: dict, path: tuple[str, ...]) -> Any:
    """tree[path[0]][path[1]]..."""
    for key in path:
        tree = tree[key]
    return tree


def _tensor_locations(folder: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it, from the shard index or the single file."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no weight_map object")
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(file.name) for file in files.values() if not file.is_file()})
        if absent:
            raise FileNotFoundError(f"{index_path} names shard file(s) {absent} that are not in {folder}")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="np") as reader:
            return {name: single for name in reader.keys()}
    raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors are supported)")


def _hf_tensors(params: Params, specs: list[TensorSpec], dtype: np.dtype,
                lookahead_bytes: int = 256 * 2**20) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """(spec, contiguous host tensor in HF layout and `dtype`) for each of `specs`, in order.

    A leaf on devices goes through `_device_hf_tensor` (one layer's slice, cast, transposed, on the devices), dispatched
    up to `lookahead_bytes` ahead of the tensor being handed out, with its copy to the host started; a host (numpy)
    leaf is converted on the host.
    """
    pending: collections.deque[tuple[TensorSpec, jax.Array | None]] = collections.deque()
    queued_bytes = 0

    def handed_out() -> tuple[TensorSpec, np.ndarray]:
        nonlocal queued_bytes
        spec, on_device = pending.popleft()
        if on_device is not None:
            tensor = jax.device_get(on_device)
        else:
            leaf = np.asarray(_leaf(params, spec.path))
            tensor = (leaf if spec.layer is None else leaf[spec.layer]).astype(dtype, copy=False)
            tensor = np.ascontiguousarray(tensor.T if spec.transposed else tensor)
        queued_bytes -= math.prod(spec.hf_shape) * dtype.itemsize
        if tensor.shape != spec.hf_shape:
            raise ValueError(f"parameter {'/'.join(spec.path)} does not fit {spec.hf_name}: shape "
                             f"{tensor.shape} where this config implies {spec.hf_shape}")
        return spec, tensor

    for spec in specs:
        leaf = _leaf(params, spec.path)
        on_device = None
        if isinstance(leaf, jax.Array):
            on_device = _device_hf_tensor(leaf, spec.layer, dtype=dtype.name, transpose=spec.transposed)
            on_device.copy_to_host_async()
        pending.append((spec, on_device))
        queued_bytes += math.prod(spec.hf_shape) * dtype.itemsize
        while queued_bytes > lookahead_bytes:
            yield handed_out()
    while pending:
        yield handed_out()


def _device_hf_tensor(leaf: jax.Array, layer: int | None, dtype: str, transpose: bool) -> jax.Array:
    """One HF tensor of a (stacked) leaf, on the leaf's devices: layer `layer`'s slice cast to `dtype`, then kernels
    transposed to [out, in], in two jitted calls that keep the sharding (each compiles once per leaf shape: the layer
    index is traced). Two calls, not one: XLA:CPU fuses a transpose with the slice into a loop 2.4-3x slower than the
    slice-and-cast and the transpose run apart (measured on a Qwen3-0.6B shape's MLP kernels)."""
    tensor = _slice_and_cast(leaf, layer, dtype=dtype)
    return _transpose(tensor) if transpose else tensor


@functools.partial(jax.jit, static_argnames="dtype")
def _slice_and_cast(leaf: jax.Array, layer: int | None, dtype: str) -> jax.Array:
    tensor = leaf if layer is None else jax.lax.dynamic_index_in_dim(leaf, layer, keepdims=False)
    return tensor.astype(DTYPES[dtype])


@jax.jit
def _transpose(tensor: jax.Array) -> jax.Array:
    return tensor.T


def _write_shard(path: Path, specs: list[TensorSpec], tensors: Iterator[tuple[TensorSpec, np.ndarray]],
                 dtype: np.dtype, clock: dict[str, float]) -> int:
    """Write the next len(specs) tensors of `tensors` as one safetensors file, streamed: its header (names, shapes,
    offsets) follows from the specs, so each tensor goes to the file as it arrives. Returns the tensor bytes; the
    seconds spent waiting for tensors and writing them are added to clock["gather_s"] and clock["write_s"]."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        size = math.prod(spec.hf_shape) * dtype.itemsize
        header[spec.hf_name] = {"dtype": _SAFETENSORS_DTYPES[dtype.name], "shape": list(spec.hf_shape),
                                "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensor data starts 8-byte aligned, as safetensors' own writer does
    with open(path, "wb", buffering=0) as file:
        _write_all(file, struct.pack("<Q", len(text)) + text)
        for spec in specs:
            started = time.perf_counter()
            got, tensor = next(tensors)
            arrived = time.perf_counter()
            if got != spec or tensor.dtype != dtype:
                raise RuntimeError(f"expected {spec.hf_name} in {dtype}, got {got.hf_name} in {tensor.dtype}")
            _write_all(file, tensor.reshape(-1).view(np.uint8).data)
            clock["gather_s"] += arrived - started
            clock["write_s"] += time.perf_counter() - arrived
    return offset


def _write_all(file: Any, data: bytes | memoryview) -> None:
    """file.write until every byte is written (an unbuffered write may take part of a large buffer)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[file.write(view):]


def _remove_previous_weights(folder: Path) -> None:
    """Delete weights an earlier save left in this folder, so stale shards cannot shadow the new ones."""
    for file in [folder / SINGLE_FILE, folder / INDEX_FILE, *folder.glob("model-*-of-*.safetensors")]:
        file.unlink(missing_ok=True)
