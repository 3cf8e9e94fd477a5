"""The device mesh the learner runs on: named axes data / fsdp / tensor (DESIGN: "Functional learner").

One config runs on one CPU, 8 simulated CPU devices or a GPU pod: only the axis sizes change, set by gin
(`make_mesh.fsdp = 8`, see gin/mesh/). Axis types are Auto, so jit propagates shardings from the inputs and the
`constrain` hints instead of demanding explicit sharding annotations on every op.
"""

from __future__ import annotations

import math
from typing import Sequence

import gin
import jax
from jax.sharding import AxisType, Mesh

from rstar_jax.parallel.sharding import MESH_AXES

REST = -1  # an axis size of -1 takes every device the other axes leave


def resolve_axis_sizes(sizes: dict[str, int], device_count: int) -> dict[str, int]:
    """Fill in the one axis given as -1 and check that the sizes multiply to `device_count`.

    Pure helper of `make_mesh`, split out so the arithmetic and its error messages are testable without devices.
    """
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != REST):
            raise ValueError(f"mesh axis {name!r} has size {size!r}; expected a positive int or -1 (the rest)")
    rest_axes = [name for name, size in sizes.items() if size == REST]
    if len(rest_axes) > 1:
        raise ValueError(f"only one mesh axis may be -1 (the rest), got {rest_axes} in {sizes}")
    fixed = math.prod(size for size in sizes.values() if size != REST)
    resolved = dict(sizes)
    if rest_axes:
        if device_count % fixed:
            raise ValueError(
                f"mesh axes {sizes} leave no whole size for {rest_axes[0]!r}: "
                f"{device_count} devices are not divisible by {fixed}"
            )
        resolved[rest_axes[0]] = device_count // fixed
    total = math.prod(resolved.values())
    if total != device_count:
        raise ValueError(f"mesh axes {resolved} need {total} devices, but {device_count} are available")
    return resolved


@gin.configurable
def make_mesh(
    data: int = 1,
    fsdp: int = REST,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices); one size may be -1, meaning the rest.

    data: pure data parallelism (parameters replicated); fsdp: data parallelism with parameters and optimiser
    state split (the big non-tensor dimension of each weight, see PARAM_RULES); tensor: heads / MLP / vocabulary
    split within a layer (Megatron style).
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh got an empty device list")
    sizes = resolve_axis_sizes({"data": data, "fsdp": fsdp, "tensor": tensor}, len(devices))
    return jax.make_mesh(
        tuple(sizes[name] for name in MESH_AXES),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )
