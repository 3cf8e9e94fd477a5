"""The rollout engines a training run samples from, chosen by one gin switch (DESIGN "Data flow of one RL step").

`backend="jax"`: in-process `JaxEngine`s (the CPU default) built from the learner's parameters. `backend="vllm"`:
a fleet of vLLM servers, launched on an HF folder of the learner's current weights (or attached by URL and given
those weights at once). Either way the run talks to ONE router over the engines, `router="failover"` (the live
engine with the fewest requests in flight) or `"balancer"` (SPEC 6's KV-cache-aware `Balancer`, gin
`gin/rollout/balancer.gin`): rollouts route through it and weights are pushed through its `update_weights`, which
survives a dead engine (it is marked down and the others go on).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Sequence

import gin

from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.data.problem import Problem
from rstar_jax.model import ModelConfig
from rstar_jax.model.folder import save_model_folder
from rstar_jax.model.lm import Params
from rstar_jax.parallel.gpu_placement import check_gpu_placement
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.engine import GenerationEngine
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.router import FailoverEngine
from rstar_jax.rollout.vllm_engine import VLLMServerEngine
from rstar_jax.rollout.vllm_fleet import VLLMFleet

BACKENDS = ("jax", "vllm")
ROUTERS: dict[str, type[FailoverEngine]] = {"failover": FailoverEngine, "balancer": Balancer}


def check_prompts_fit(tokenizer: Any, problems: Sequence[Problem], max_response_tokens: int, token_limit: int | None,
                      what: str, budget: str) -> None:
    """Refuse, before any work, prompts that leave no room for their response budget: the longest of `problems`'
    prompts (as the agent loop renders them) plus `max_response_tokens` must fit in `token_limit` tokens, what one
    engine slot holds (`RolloutBackend.token_limit`; None: unknown, as for a vLLM server, so nothing is checked).
    `what` names the prompts in the error (a stage, a benchmark set), `budget` the binding that sets the budget."""
    if token_limit is None or not problems:
        return
    longest = max(len(prompt_token_ids(tokenizer, problem.question)) for problem in problems)
    if longest + max_response_tokens > token_limit:
        raise ValueError(f"{what}: the longest prompt ({longest} tokens) plus max_response_tokens "
                         f"({max_response_tokens}) exceeds the engine's {token_limit} tokens per sequence; "
                         f"lower {budget} or raise RolloutBackend.max_len")


async def pushed_weights_dtype(engine: GenerationEngine) -> str | None:
    """The dtype in which every live engine behind `engine` loads pushed weights, when all of them say so and agree (a
    vLLM server reports its own: `VLLMServerEngine.served_dtype`); None when they differ or do not say (a JaxEngine
    takes the learner's parameters as they are). A learner over several processes casts to it on its devices before
    it gathers the parameters of a push (issue 23), so only those bytes cross to the driver's host."""
    if isinstance(engine, FailoverEngine):
        dtypes = {await pushed_weights_dtype(engine.engines[index]) for index in engine.live}
        return dtypes.pop() if len(dtypes) == 1 else None
    if isinstance(engine, VLLMServerEngine):
        return await engine.served_dtype()
    return None


class RolloutEngines:
    """`engine`, the router every rollout and weight push goes through, and what must be shut down with it."""

    def __init__(self, engine: FailoverEngine, jax_engines: Sequence[JaxEngine] = (),
                 fleet: VLLMFleet | None = None) -> None:
        self.engine, self._jax_engines, self._fleet = engine, list(jax_engines), fleet

    @property
    def backend(self) -> str:
        """"vllm" or "jax"."""
        return "vllm" if self._fleet is not None else "jax"

    async def aclose(self) -> None:
        """Close the HTTP sessions opened in the running event loop (call it before that loop ends)."""
        if self._fleet is not None:
            await self._fleet.aclose()

    def close(self) -> None:
        """Stop the JAX engines' threads and the vLLM servers this process launched."""
        for engine in self._jax_engines:
            engine.close()
        if self._fleet is not None:
            self._fleet.close()

    def __enter__(self) -> "RolloutEngines":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RolloutBackend:
    """Which engines a run samples from (see the module docstring).

    backend "jax": `jax_engines` in-process engines of `slots` x `max_len` tokens each. backend "vllm":
    `vllm_servers` servers launched on WORK_DIR/serving_model (flags from gin `server_command` / `server_env`; on a CPU
    box each pinned to its `vllm_per_server_cpus` entry; on a GPU node each on its `vllm_per_server_gpus` entry, GPU
    indices of this node: CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES and --tensor-parallel-size, see
    `rstar_jax.parallel.gpu_placement`), or the servers at `vllm_urls`, which are sent the weights first. `router`: "failover" or "balancer" (see the module docstring; with JAX engines, which reuse a whole
    prompt still held in a slot but no shorter prefix, bind `Balancer.part_tokens = None`).
    """

    backend: str = "jax"
    router: str = "failover"
    jax_engines: int = 1
    slots: int = 16
    max_len: int = 1024
    vllm_servers: int = 2
    vllm_urls: tuple[str, ...] = ()
    vllm_per_server_cpus: tuple[tuple[int, ...], ...] = ()
    vllm_per_server_gpus: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown rollout backend {self.backend!r}; choose from {BACKENDS}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown rollout router {self.router!r}; choose from {tuple(ROUTERS)}")
        if min(self.jax_engines, self.slots, self.vllm_servers) < 1 or self.max_len < 2:
            raise ValueError(f"RolloutBackend needs jax_engines, slots, vllm_servers >= 1 and max_len >= 2, got "
                             f"{self.jax_engines}, {self.slots}, {self.vllm_servers}, {self.max_len}")
        object.__setattr__(self, "vllm_urls", tuple(self.vllm_urls))
        object.__setattr__(self, "vllm_per_server_cpus", tuple(tuple(cpus) for cpus in self.vllm_per_server_cpus))
        object.__setattr__(self, "vllm_per_server_gpus", tuple(tuple(gpus) for gpus in self.vllm_per_server_gpus))
        if self.vllm_per_server_gpus:
            if self.vllm_urls:
                raise ValueError("RolloutBackend.vllm_per_server_gpus places the servers this run launches; with "
                                 "vllm_urls it attaches to running servers instead: bind one of the two")
            if len(self.vllm_per_server_gpus) != self.vllm_servers:
                raise ValueError(f"RolloutBackend.vllm_per_server_gpus has {len(self.vllm_per_server_gpus)} entries "
                                 f"for vllm_servers = {self.vllm_servers}")
            check_gpu_placement(None, self.vllm_per_server_gpus)

    @property
    def launched_server_gpus(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of the vLLM servers this run launches on its own node (none when it attaches or uses JAX)."""
        return self.vllm_per_server_gpus if self.backend == "vllm" and not self.vllm_urls else ()

    @property
    def token_limit(self) -> int | None:
        """Tokens one trajectory may hold on these engines (prompt plus response), when known before they start:
        the JAX engine's slot length (a vLLM server's limit is its own --max-model-len)."""
        return self.max_len if self.backend == "jax" else None

    def start(self, config: ModelConfig, params: Params, work_dir: str | Path, tokenizer: str) -> RolloutEngines:
        """Start (or attach to) the engines, serving `params`."""
        if self.backend == "jax":
            engines = [JaxEngine(config, params, slots=self.slots, max_len=self.max_len, seed=index)
                       for index in range(self.jax_engines)]
            return RolloutEngines(ROUTERS[self.router](engines), jax_engines=engines)
        if self.vllm_urls:
            fleet = VLLMFleet.attach(self.vllm_urls, config, router=ROUTERS[self.router])
            asyncio.run(_push_then_close(fleet, params))
        else:
            folder = save_model_folder(config, params, Path(work_dir) / "serving_model", tokenizer)
            fleet = VLLMFleet.launch(folder, self.vllm_servers, config, router=ROUTERS[self.router],
                                     per_server_cpus=self.vllm_per_server_cpus,
                                     per_server_gpus=self.vllm_per_server_gpus)
        return RolloutEngines(fleet.router, fleet=fleet)


async def _push_then_close(fleet: VLLMFleet, params: Params) -> None:
    try:
        await fleet.router.update_weights(params, 0)
    finally:
        await fleet.aclose()
