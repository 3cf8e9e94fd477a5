"""What an RL run is built from besides its model, built once from gin at an entry point (issue 25 item 3).

`RLSettings` holds the run's knobs (SPEC 4-5); `RLSetup` holds every object the trainer and the dry run need: the
settings, the selector (RoC, penalty or plain GRPO), the policy-loss options, the rollout backend, the optimiser
with its schedule, and the mesh's axis sizes. `rl_setup()` is the one place that reads gin for them: the entry
points (experiments.train, the demo, a grid point) call it, hand the result to `RLTrainer`, and the dry run plans
from the same object, so the plan and the run cannot drift. Library code below takes these objects as arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import gin
import jax
import optax
from jax.sharding import Mesh

from rstar_jax.gin_setup import gin_kwargs
from rstar_jax.parallel import make_mesh
from rstar_jax.parallel.mesh import MESH_AXES
from rstar_jax.rl import PolicyLossOptions, Selector, make_selector
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.train.optim import rl_optimizer
from rstar_jax.train.stages import Stage, check_stages

ZERO_VARIANCE_MODES = ("drop", "refill")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RLSettings:
    """The run's knobs besides the stages' (SPEC 4-5 numbers in brackets).

    prompts_per_step: prompts a step (512); group_size: G, the rollouts trained on per prompt (16; RoC samples 2G);
    micro_batch_rows: rows of one learner micro-batch (memory, not maths: accumulation is exact); pad_multiple: rows
    are padded to a multiple of this many tokens (None: the next power of two; one multiple bounds the learner's
    compiled shapes); pack_length: trajectories share rows of this many tokens (first fit; None: one a row): the
    same loss on fewer padded positions (`rl_batch.rl_micro_batches`); logprob_chunk: positions per chunk of the
    fused log-prob head (memory, not maths); updates_per_step: optimiser steps a step, on that many mini-batches (1);
    temperature: sampling (1.0); seed; zero_variance: "drop" groups whose rewards are all equal (the release) or
    "refill" from the next prompts (DAPO), at most `max_refill_rounds` extra rollout rounds; checkpoint_every: steps
    between checkpoints (the last step is always saved); max_to_keep: checkpoints kept; verify_timeout_s: per answer.
    """

    stages: tuple[Stage, ...] = ()
    prompts_per_step: int = 8
    group_size: int = 4
    micro_batch_rows: int = 8
    pad_multiple: int | None = None
    pack_length: int | None = None
    logprob_chunk: int = 512
    updates_per_step: int = 1
    temperature: float = 1.0
    seed: int = 0
    zero_variance: str = "drop"
    max_refill_rounds: int = 2
    checkpoint_every: int = 1
    max_to_keep: int = 2
    verify_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", check_stages(self.stages))
        for name in ("prompts_per_step", "micro_batch_rows", "updates_per_step", "checkpoint_every", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"RLSettings.group_size must be >= 2 (an advantage needs a group), got {self.group_size}")
        if self.zero_variance not in ZERO_VARIANCE_MODES:
            raise ValueError(f"RLSettings.zero_variance must be one of {ZERO_VARIANCE_MODES}, "
                             f"got {self.zero_variance!r}")
        if self.pack_length is not None and self.pack_length < 2:
            raise ValueError(f"RLSettings.pack_length must be >= 2 or None, got {self.pack_length}")
        if self.pad_multiple is not None and self.pad_multiple < 1:
            raise ValueError(f"RLSettings.pad_multiple must be >= 1 or None, got {self.pad_multiple}")
        if self.max_refill_rounds < 0:
            raise ValueError(f"RLSettings.max_refill_rounds must be >= 0, got {self.max_refill_rounds}")

    @property
    def total_steps(self) -> int:
        """RL steps over all stages."""
        return sum(stage.steps for stage in self.stages)

    @property
    def optimizer_steps(self) -> int:
        """Optimiser steps the learning-rate schedule spans: up to `updates_per_step` per RL step."""
        return self.total_steps * self.updates_per_step


@dataclasses.dataclass(frozen=True)
class RLSetup:
    """Every object an RL run is built from besides its model (see the module docstring). `mesh_axes`: sizes of
    the (data, fsdp, tensor) axes as `make_mesh` takes them (-1: the rest of the devices)."""

    settings: RLSettings
    selector: Selector
    loss: PolicyLossOptions
    backend: RolloutBackend
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    mesh_axes: Mapping[str, int]

    def mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The learner's mesh over `devices` (default: every device JAX sees)."""
        return make_mesh(**self.mesh_axes, devices=devices)


def rl_setup(settings: RLSettings | None = None, selector: Selector | None = None,
             loss: PolicyLossOptions | None = None, backend: RolloutBackend | None = None,
             axes: Mapping[str, int] | None = None) -> RLSetup:
    """The run's `RLSetup` from the parsed gin config: each part not given is built by its gin configurable
    (`RLSettings`, `make_selector`, `PolicyLossOptions`, `RolloutBackend`, `rl_optimizer` over the settings'
    optimiser steps, `make_mesh`'s axis bindings); with no config parsed, the code defaults."""
    settings = settings if settings is not None else RLSettings()
    optimizer, schedule = rl_optimizer(settings.optimizer_steps)
    if axes is None:
        axes = {name: value for name, value in gin_kwargs(make_mesh).items() if name in MESH_AXES}
    return RLSetup(settings, selector if selector is not None else make_selector(),
                   loss if loss is not None else PolicyLossOptions(),
                   backend if backend is not None else RolloutBackend(), optimizer, schedule, dict(axes))
