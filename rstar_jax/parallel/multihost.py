"""What a learner split over several JAX processes needs besides the mesh (issue 23 item 1; DESIGN "Scale-out").

With `jax.distributed.initialize` every process holds only its own devices' shards, so a host copy of a sharded
array is a collective (every process calls it), and data that only the driver (process 0) has, such as the step's
rollouts, reaches the others by a broadcast. In one process every function here is the plain local operation, so
callers need no second code path.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding


def is_driver() -> bool:
    """Whether this process drives the run's rollouts, tools, rewards and files (process 0; always in one process)."""
    return jax.process_index() == 0


def multi_process() -> bool:
    """Whether the learner spans several JAX processes."""
    return jax.process_count() > 1


def host_copy(tree: Any, dtype: str | None = None) -> Any:
    """`tree` with every JAX array as a whole numpy array on this host; with `dtype`, floating arrays are cast to it on
    their devices first (a weight push in the servers' dtype gathers half the bytes of float32 for bfloat16). Across
    processes a collective: every process must call it with the same tree (arrays split over other hosts are
    gathered, `process_allgather`)."""
    if dtype is not None:
        tree = _cast_floating(tree, dtype)
    if not multi_process():
        return jax.device_get(tree)

    def whole(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return jax.device_get(leaf)

    return jax.tree.map(whole, tree)


@functools.partial(jax.jit, static_argnames="dtype")
def _cast_floating(tree: Any, dtype: str) -> Any:
    """Floating leaves of `tree` cast to `dtype`, where they are (an elementwise program keeps each leaf's sharding)."""
    return jax.tree.map(lambda leaf: leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf, tree)


def share(value: Any) -> Any:
    """The driver's `value` (JSON-able), on every process: the others pass anything (None). A collective."""
    if not multi_process():
        return value
    text = np.frombuffer(json.dumps(value).encode(), np.uint8) if is_driver() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array([text.size], np.int64))[0])
    if not is_driver():
        text = np.zeros(size, np.uint8)
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(text)).tobytes().decode())


def share_arrays(arrays: Sequence[np.ndarray] | None) -> list[np.ndarray]:
    """The driver's numpy `arrays`, on every process (the others pass None): shapes and dtypes first, then each
    array's bytes (as bytes, so no dtype is narrowed on the way: JAX without x64 would make int64 int32). A
    collective."""
    if not multi_process():
        return list(arrays or ())
    layout = share([(list(a.shape), a.dtype.str) for a in arrays] if is_driver() else None)
    if is_driver():
        local = [np.ascontiguousarray(array).reshape(-1).view(np.uint8) for array in arrays]
    else:
        local = [np.zeros(int(np.prod(shape)) * np.dtype(dtype).itemsize, np.uint8) for shape, dtype in layout]
    return [np.asarray(multihost_utils.broadcast_one_to_all(data)).view(np.dtype(dtype)).reshape(shape)
            for data, (shape, dtype) in zip(local, layout)]


def place(array: np.ndarray, sharding: Sharding) -> jax.Array:
    """A global array of `sharding` from a whole host `array` every process holds (each places its own shards)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
