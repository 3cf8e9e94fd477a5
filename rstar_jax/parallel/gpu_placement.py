"""Which GPUs of one node the learner and each launched vLLM server get (issue 22 item 5: the one-node recipe).

On one host of G GPUs the learner takes some (`learner_devices.gpus`) and every vLLM server the trainer launches
takes others (`RolloutBackend.vllm_per_server_gpus`, one tuple of GPU indices per server). Both sides must keep off
the other's GPUs: JAX preallocates 75% of every GPU it can see, and a vLLM server claims
`--gpu-memory-utilization` of each GPU it runs on. So:

- the learner restricts JAX to its GPUs with JAX's `jax_cuda_visible_devices` / `jax_rocm_visible_devices`
  options (JAX's own CUDA_VISIBLE_DEVICES: the process environment, which the servers inherit, stays as it is) and
  sets `XLA_PYTHON_CLIENT_MEM_FRACTION` to `memory_fraction`, both before JAX creates its GPU client
  (`apply_learner_devices`, called by `experiments.train` before anything touches a device);
- each server gets CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES naming its GPUs and `--tensor-parallel-size` =
  their count (`server_gpu_placement`, used by `vllm_server.launch_servers`).

GPU indices are positions among the GPUs this process sees: when the trainer itself runs under CUDA_VISIBLE_DEVICES
(or HIP_VISIBLE_DEVICES, e.g. a scheduler's allocation), index i is the i-th GPU of that list, for the learner (JAX
numbers the GPUs it sees the same way) and for the servers (their variables are translated through the list).
`check_gpu_placement` refuses overlapping or out-of-range placements before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, MutableMapping, Sequence

import gin
import jax
from jax._src import xla_bridge  # private: the only way to ask whether the backends exist yet

VISIBLE_DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")  # NVIDIA, AMD (vLLM's ROCm build
# requires the two to agree when both are set)
JAX_VISIBLE_DEVICE_OPTIONS = ("jax_cuda_visible_devices", "jax_rocm_visible_devices")
MEM_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def gpu_tuple(gpus: Sequence[int], what: str) -> tuple[int, ...]:
    """`gpus` as a tuple of distinct non-negative ints; ValueError naming `what` otherwise."""
    if isinstance(gpus, (str, bytes)) or not gpus:
        raise ValueError(f"{what} must be a non-empty sequence of GPU indices, got {gpus!r}")
    if any(isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0 for gpu in gpus):
        raise ValueError(f"{what} must hold non-negative int GPU indices, got {list(gpus)}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"{what} names a GPU twice: {list(gpus)}")
    return tuple(gpus)


def check_gpu_placement(learner: Sequence[int] | None, servers: Sequence[Sequence[int]],
                        node_gpus: int | None = None) -> None:
    """Raise ValueError unless the learner's GPUs and each server's GPUs are pairwise disjoint and, when
    `node_gpus` is given, all below it. `learner` None: the learner's GPUs are not placed (not checked)."""
    owners: dict[int, str] = {}
    groups = ([("the learner (learner_devices.gpus)", learner)] if learner is not None else []) + [
        (f"vLLM server {index} (RolloutBackend.vllm_per_server_gpus[{index}])", gpus)
        for index, gpus in enumerate(servers)]
    for name, gpus in groups:
        for gpu in gpu_tuple(gpus, name):
            if node_gpus is not None and gpu >= node_gpus:
                raise ValueError(f"{name} is placed on GPU {gpu}, but the node has {node_gpus} GPUs "
                                 f"(0-{node_gpus - 1}; learner_devices.node_gpus)")
            if gpu in owners:
                raise ValueError(f"GPU {gpu} is given to both {owners[gpu]} and {name}: the learner and every "
                                 f"server need GPUs of their own (JAX preallocates its memory fraction of each GPU "
                                 f"it sees, vLLM its --gpu-memory-utilization)")
            owners[gpu] = name


def _visible_list(environ: Mapping[str, str]) -> list[str] | None:
    for name in VISIBLE_DEVICE_VARIABLES:
        value = environ.get(name)
        if value is not None and value.strip():
            return [entry.strip() for entry in value.split(",") if entry.strip()]
    return None


def server_gpu_placement(gpus: Sequence[int], environ: Mapping[str, str] | None = None,
                         ) -> tuple[dict[str, str], list[str]]:
    """(environment additions, extra vLLM flags) that put one server on `gpus`: CUDA_VISIBLE_DEVICES and
    HIP_VISIBLE_DEVICES naming them, `--tensor-parallel-size len(gpus)`.

    Indices are positions among the GPUs `environ` (default: this process's environment) makes visible, so under
    CUDA_VISIBLE_DEVICES=4,5,6,7 the server on (1,) gets CUDA_VISIBLE_DEVICES=5."""
    gpus = gpu_tuple(gpus, "a server's GPUs")
    visible = _visible_list(os.environ if environ is None else environ)
    if visible is not None:
        if max(gpus) >= len(visible):
            raise ValueError(f"a server is placed on GPU {max(gpus)}, but this process sees only {len(visible)} "
                             f"GPUs (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES = {','.join(visible)})")
        names = [visible[gpu] for gpu in gpus]
    else:
        names = [str(gpu) for gpu in gpus]
    value = ",".join(names)
    return {name: value for name in VISIBLE_DEVICE_VARIABLES}, ["--tensor-parallel-size", str(len(gpus))]


@dataclasses.dataclass(frozen=True)
class LearnerDevices:
    """The learner's GPUs on this node (None: every GPU JAX sees), the fraction of each it preallocates (None:
    JAX's default, 0.75, or an XLA_PYTHON_CLIENT_MEM_FRACTION already set), and the node's GPU count (None: not
    checked)."""

    gpus: tuple[int, ...] | None = None
    memory_fraction: float | None = None
    node_gpus: int | None = None

    def __post_init__(self) -> None:
        if self.gpus is not None:
            object.__setattr__(self, "gpus", gpu_tuple(self.gpus, "learner_devices.gpus"))
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"learner_devices.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.node_gpus is not None and self.node_gpus < 1:
            raise ValueError(f"learner_devices.node_gpus must be >= 1, got {self.node_gpus}")


@gin.configurable
def learner_devices(gpus: Sequence[int] | None = None, memory_fraction: float | None = None,
                    node_gpus: int | None = None) -> LearnerDevices:
    """The learner's GPU placement from gin (see the module docstring), e.g. on an 8-GPU node whose GPUs 4-7 run
    vLLM: `learner_devices.gpus = (0, 1, 2, 3)`, `learner_devices.memory_fraction = 0.9`,
    `learner_devices.node_gpus = 8`."""
    return LearnerDevices(None if gpus is None else tuple(gpus), memory_fraction, node_gpus)


def jax_backends_initialized() -> bool:
    """Whether JAX has created its backends (after which device options no longer take effect)."""
    return bool(xla_bridge.backends_are_initialized())


def apply_learner_devices(devices: LearnerDevices, server_gpus: Sequence[Sequence[int]] = (),
                          environ: MutableMapping[str, str] | None = None) -> None:
    """Check `devices` against the launched servers' GPUs, then restrict JAX to the learner's GPUs and set its
    memory fraction. Must run before anything touches a device (RuntimeError otherwise)."""
    check_gpu_placement(devices.gpus, server_gpus, devices.node_gpus)
    if devices.gpus is None and devices.memory_fraction is None:
        return
    if jax_backends_initialized():
        raise RuntimeError("learner_devices must be applied before JAX creates its backends (before the first "
                           "jax.devices() or array); apply_learner_devices ran too late")
    environ = os.environ if environ is None else environ
    if devices.memory_fraction is not None:
        environ[MEM_FRACTION_VARIABLE] = f"{devices.memory_fraction:g}"
    if devices.gpus is not None:
        value = ",".join(str(gpu) for gpu in devices.gpus)
        for option in JAX_VISIBLE_DEVICE_OPTIONS:
            jax.config.update(option, value)
