"""The learner's state as one pytree (DESIGN "Functional learner"): parameters, optimiser state, step counter.

A train step is a pure function TrainState -> TrainState, so the state jits, shards and checkpoints as a whole.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar_jax.parallel import param_shardings, shardings_like_params


@flax.struct.dataclass
class TrainState:
    """params (the model tree), opt_state (the optax state for it) and step (int32 scalar: updates applied)."""

    params: Any
    opt_state: Any
    step: jax.Array


def init_train_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh state at step 0 for `params` and `optimizer`."""
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))


def train_state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    """Shardings of every leaf of `state` on `mesh`: parameters by the partition rules, optimiser moments like
    their parameters, counters replicated. `state` may hold arrays or `jax.ShapeDtypeStruct`s."""
    return TrainState(
        params=param_shardings(state.params, mesh),
        opt_state=shardings_like_params(state.opt_state, state.params, mesh),
        step=NamedSharding(mesh, PartitionSpec()),
    )
