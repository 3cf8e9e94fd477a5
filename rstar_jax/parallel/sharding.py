"""The one place that maps logical array axes to mesh axes.

Model code names the axes of its activations logically ("batch", "seq", "heads", ...) and calls `constrain`;
this module decides which mesh axis each logical axis is split over. With no active mesh (`use_mesh`), `constrain`
is the identity, so the same model code runs unsharded on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
}

_ACTIVE_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("rstar_jax_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[Mesh | None]:
    """Make `mesh` the one `constrain` shards activations over while tracing inside this block."""
    token = _ACTIVE_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE_MESH.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh set by the innermost `use_mesh`, or None."""
    return _ACTIVE_MESH.get()


def logical_to_spec(
    logical_axes: tuple[str | None, ...],
    rules: dict[str, str | tuple[str, ...] | None] = ACTIVATION_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array whose axes have the given logical names (None: replicated axis)."""
    return PartitionSpec(*(None if name is None else rules[name] for name in logical_axes))


def constrain(x: jax.Array, *logical_axes: str | None) -> jax.Array:
    """Sharding constraint on an activation by logical axis names; identity when no mesh is active."""
    mesh = active_mesh()
    if mesh is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain got {len(logical_axes)} axis names for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes)))
