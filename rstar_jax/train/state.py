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


def abstract_train_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """The shapes and dtypes of `init_train_state(params, optimizer)` as ShapeDtypeStructs; nothing is allocated.

    What checkpoint restores and shardings are computed from, so a trainer keeps no second copy of the weights."""
    return jax.eval_shape(lambda p: init_train_state(p, optimizer), params)


def init_optimizer_state(params: Any, optimizer: optax.GradientTransformation, shardings: Any) -> Any:
    """`optimizer.init(params)` created by one jitted call straight into `shardings` (issue 22 item 2: the AdamW
    moments of a 14B model never exist whole on one device)."""
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def new_train_state(params: Any, optimizer: optax.GradientTransformation, shardings: TrainState) -> TrainState:
    """A fresh state at step 0 built where it lives (issue 22 item 2): the parameters placed by `shardings.params`
    (the same arrays, not a copy, when they are placed so already, e.g. by `load_hf(..., mesh=...)`), the optimiser
    state and counter created sharded. The state takes the parameters over: a train step donates them."""
    params = jax.device_put(params, shardings.params)
    return TrainState(params=params, opt_state=init_optimizer_state(params, optimizer, shardings.opt_state),
                      step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step))


def train_state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    """Shardings of every leaf of `state` on `mesh`: parameters by the partition rules, optimiser moments like
    their parameters, counters replicated. `state` may hold arrays or `jax.ShapeDtypeStruct`s."""
    return TrainState(
        params=param_shardings(state.params, mesh),
        opt_state=shardings_like_params(state.opt_state, state.params, mesh),
        step=NamedSharding(mesh, PartitionSpec()),
    )
