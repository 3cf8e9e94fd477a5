"""The rollout fleet: N vLLM servers, launched here from an HF folder or attached by URL (issue 5 item 2).

A fleet holds one `VLLMServerEngine` per server and `router`, the `FailoverEngine` over them that rollouts go
through (or its KV-aware subclass `Balancer`, SPEC 6). Weights take the one push path of every engine set: `router.update_weights`, which skips servers marked
down and marks down those that fail, while the engines share one `SharedSyncCheckpoints` so each version is written
once for all servers. Launched servers are stopped by `close()` / the context manager; attached ones keep running.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Callable, Sequence

import gin

from rstar_jax.model.config import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.rollout.engine import GenerationEngine
from rstar_jax.rollout.router import FailoverEngine
from rstar_jax.rollout.vllm_engine import VLLMServerEngine
from rstar_jax.rollout.vllm_server import VLLMServer, launch_servers
from rstar_jax.rollout.vllm_weight_sync import SharedSyncCheckpoints, SyncTiming


RouterFactory = Callable[[Sequence[GenerationEngine]], FailoverEngine]


class VLLMFleet:
    """Engines over vLLM servers, the router over them, and the servers this process started (stopped on close)."""

    def __init__(self, engines: Sequence[VLLMServerEngine], model_config: ModelConfig | None = None,
                 servers: Sequence[VLLMServer] = (), router: RouterFactory = FailoverEngine) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        self.engines = list(engines)
        self.model_config = model_config
        self.servers = list(servers)
        self.router = router(self.engines)

    @staticmethod
    def _engines(urls: Sequence[str], model_config: ModelConfig | None) -> list[VLLMServerEngine]:
        checkpoints = SharedSyncCheckpoints()
        return [VLLMServerEngine(url, model_config, checkpoints=checkpoints) for url in urls]

    @classmethod
    def attach(cls, urls: Sequence[str], model_config: ModelConfig | None = None,
               router: RouterFactory = FailoverEngine) -> VLLMFleet:
        """A fleet over servers already running at `urls` (they must run with this repo's worker extension and
        VLLM_SERVER_DEV_MODE=1 for weight sync), routed by `router` (a `FailoverEngine` class, e.g. `Balancer`)."""
        return cls(cls._engines(urls, model_config), model_config, router=router)

    @classmethod
    def launch(cls, model_dir: str | os.PathLike, num_servers: int, model_config: ModelConfig | None = None,
               router: RouterFactory = FailoverEngine, **start_options: Any) -> VLLMFleet:
        """Start `num_servers` servers on `model_dir` and wait until all are healthy (flags from gin:
        `server_command`, `server_env`; `start_options` such as extra_args go to `start_server`), routed by
        `router`."""
        servers = launch_servers(model_dir, num_servers, **start_options)
        return cls(cls._engines([server.url for server in servers], model_config), model_config, servers, router)

    async def update_weights(self, params: Params, version: int) -> SyncTiming:
        """Push `params` to every live server through `router` (one checkpoint written in the servers' dtype,
        reloaded by all servers concurrently, then deleted) and time it: gather and write as the checkpoint's writer
        measured them, load the rest of the wall time (with the servers' pause, reload, reset and resume).

        A server that cannot be reached is marked down and skipped from then on; AllEnginesDown (an
        EngineUnavailable) names every failure once none is left; RuntimeError when a reachable server failed to
        reload.
        """
        if self.model_config is None:
            raise ValueError("the fleet needs model_config to convert parameters for update_weights")
        start = time.perf_counter()
        await self.router.update_weights(params, version)
        seconds = time.perf_counter() - start
        checkpoints = self.engines[0].checkpoints
        written = checkpoints.last_gather_s + checkpoints.last_write_s
        return SyncTiming(megabytes=checkpoints.last_megabytes, gather_s=checkpoints.last_gather_s,
                          write_s=checkpoints.last_write_s, load_s=seconds - written, servers=len(self.router.live),
                          dtype=checkpoints.last_dtype)

    async def aclose(self) -> None:
        """Close the engines' HTTP sessions."""
        await asyncio.gather(*(engine.aclose() for engine in self.engines))

    def close(self) -> None:
        """Stop the servers this fleet launched (attached servers keep running)."""
        for server in self.servers:
            server.close()
        self.servers = []

    def __enter__(self) -> VLLMFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@gin.configurable
def make_fleet(model_dir: str | None = None, num_servers: int = 1, urls: Sequence[str] = (),
               model_config: ModelConfig | None = None) -> VLLMFleet:
    """The fleet a run is configured with: attach to `urls` when given, else launch `num_servers` on `model_dir`."""
    if urls and model_dir is not None:
        raise ValueError("give either urls (attach) or model_dir (launch), not both")
    if urls:
        return VLLMFleet.attach(urls, model_config)
    if model_dir is None:
        raise ValueError("make_fleet needs model_dir to launch servers, or urls to attach to")
    return VLLMFleet.launch(model_dir, num_servers, model_config)


async def measure_weight_sync(fleet: VLLMFleet, params: Params, repeats: int = 3,
                              first_version: int = 1) -> list[SyncTiming]:
    """Time `repeats` full syncs of `params` into every server of the fleet (issue 5 item 6: seconds per MB).

    Each timing's `seconds_per_mb` covers writing the checkpoint and all servers reloading it.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [await fleet.update_weights(params, first_version + index) for index in range(repeats)]
