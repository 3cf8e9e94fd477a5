"""Live weight sync into running vLLM servers (issue 5 item 2; DESIGN "Scale-out": weights pushed after every update).

The learner writes its parameters once as an HF checkpoint folder (safetensors shards, on tmpfs by default), then for
each server: POST /pause (in-flight requests finish on the old weights, new ones wait), POST /collective_rpc into
the worker extension (`vllm_worker_extension`), which reloads the folder in place, POST /reset_prefix_cache (cached
KV was computed by the old weights), POST /resume. Servers are never restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import gin
import jax

from rstar_jax.model.config import ModelConfig
from rstar_jax.model.hf_io import save_hf
from rstar_jax.model.lm import Params
from rstar_jax.rollout.engine import EngineUnavailable
from rstar_jax.rollout.vllm_worker_extension import LOAD_WEIGHTS_METHOD

PAUSE_MODES = ("wait", "keep", "abort")
_SHM = Path("/dev/shm")


@dataclasses.dataclass(frozen=True)
class SyncCheckpoint:
    """A written weight-sync checkpoint: its folder of safetensors shards and how many bytes of tensors it holds."""

    path: Path
    nbytes: int

    @property
    def megabytes(self) -> float:
        """Tensor bytes in MB (10^6), the unit of the sync-speed measurement."""
        return self.nbytes / 1e6

    def remove(self) -> None:
        """Delete the folder once every server has loaded it."""
        shutil.rmtree(self.path, ignore_errors=True)


@gin.configurable
def default_sync_dir(sync_dir: str | None = None) -> Path:
    """Where weight-sync checkpoints go: `sync_dir` if set (it must be visible to every server, e.g. a shared mount),
    else /dev/shm (tmpfs) when present, else the system temp folder."""
    if sync_dir is not None:
        return Path(sync_dir)
    return _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) else Path(tempfile.gettempdir())


@gin.configurable
def write_sync_checkpoint(config: ModelConfig, params: Params, version: int, directory: str | os.PathLike | None = None,
                    shard_size_mb: float = 1024) -> SyncCheckpoint:
    """Write `params` as an HF checkpoint (save_hf: HF tensor names, shards of at most `shard_size_mb` MiB, so the
    host holds one shard at a time) in a fresh folder that appears atomically (written, then renamed)."""
    folder = Path(directory) if directory is not None else default_sync_dir()
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"rstar-weights-{os.getpid()}-v{version}"
    temporary = folder / f".{final.name}.tmp"
    for stale in (final, temporary):
        shutil.rmtree(stale, ignore_errors=True)
    save_hf((config, params), temporary, shard_size_mb=shard_size_mb)
    os.replace(temporary, final)
    return SyncCheckpoint(final, sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params)))


@dataclasses.dataclass
class _Written:
    task: asyncio.Future
    users: int = 0


class SharedSyncCheckpoints:
    """Writes each weight version once for all the servers that load it (DESIGN "Scale-out": one write, every
    server reads it), and deletes it when the last of them is done.

    The engines of one fleet share one of these: each engine's `update_weights` enters `use(...)` for the version
    it is given; the first to enter writes the checkpoint (in a thread, off the event loop), the others wait for
    that same write. A server that is down never enters, so it cannot hold the folder up.
    """

    def __init__(self) -> None:
        self._written: dict[int, _Written] = {}
        self.last_write_s = 0.0
        self.last_megabytes = 0.0

    def _write(self, config: ModelConfig, params: Params, version: int) -> SyncCheckpoint:
        started = time.perf_counter()
        checkpoint = write_sync_checkpoint(config, params, version)
        self.last_write_s, self.last_megabytes = time.perf_counter() - started, checkpoint.megabytes
        return checkpoint

    @contextlib.asynccontextmanager
    async def use(self, config: ModelConfig, params: Params, version: int) -> AsyncIterator[SyncCheckpoint]:
        """The written checkpoint of `version` (written now if no other user has started it) while inside."""
        entry = self._written.get(version)
        if entry is None:
            entry = self._written[version] = _Written(asyncio.ensure_future(
                asyncio.to_thread(self._write, config, params, version)))
        entry.users += 1
        try:
            yield await asyncio.shield(entry.task)
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._written[version]
                if entry.task.done() and not entry.task.cancelled() and entry.task.exception() is None:
                    entry.task.result().remove()


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
                timeout_s: float | None = None) -> Any:
    """POST JSON and return the decoded reply; a dead server raises EngineUnavailable, an error reply RuntimeError.

    Every sync step is idempotent (pause, reload the same file, reset, resume), so a request that fails on a pooled
    connection the server had already closed is sent once more on a fresh one (seen in a full local test run:
    "Can not write request body" on /pause after a long turn). The client's short keep-alive makes that rare; the
    retry is here and not in `VLLMServerEngine._request` because a sync step that fails can leave a server paused,
    while a failed generate is retried on another server by the router. A server that is really gone fails twice.
    """
    for attempt in (1, 2):
        try:
            async with session.post(url, json=body or {}, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                text = await response.text()
                if response.status != 200:
                    raise RuntimeError(f"POST {url} answered {response.status}: {text[:2000]}")
                return await response.json(content_type=None) if text else None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if attempt == 2:
                raise EngineUnavailable(f"POST {url} failed twice: {exc!r}") from exc
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise EngineUnavailable(f"POST {url} failed: {exc!r}") from exc


@gin.configurable
async def push_weights(session: aiohttp.ClientSession, base_url: str, path: str | os.PathLike,
                       pause_mode: str = "wait", timeout_s: float | None = 600.0) -> dict[str, Any]:
    """Make the server at `base_url` serve the weights in `path`: pause, reload, reset prefix cache, resume.

    `pause_mode` is vLLM's: "wait" lets in-flight requests finish on the old weights (every turn is generated by
    one policy); "keep" freezes them and recomputes their KV with the new weights (no drain wait, turns may span
    two versions); "abort" cancels them (their callers get EngineUnavailable). Returns the worker's report.
    The server is resumed even when the reload fails, and the failure is raised.
    """
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    await _post(session, f"{base_url}/pause?mode={pause_mode}", timeout_s=timeout_s)
    try:
        reply = await _post(session, f"{base_url}/collective_rpc",
                            {"method": LOAD_WEIGHTS_METHOD, "args": [str(path)]}, timeout_s=timeout_s)
        reset_running = "true" if pause_mode == "keep" else "false"
        reset = await _post(session, f"{base_url}/reset_prefix_cache?reset_running_requests={reset_running}",
                            timeout_s=timeout_s)
        if not reset or not reset.get("success"):
            raise RuntimeError(f"{base_url} refused to reset its prefix cache after the reload: {reset}")
    finally:
        await _post(session, f"{base_url}/resume", timeout_s=timeout_s)
    return reply["results"][0]


@dataclasses.dataclass(frozen=True)
class SyncTiming:
    """One measured weight sync: checkpoint write, reload on all servers, and the throughput figure."""

    megabytes: float
    write_s: float
    load_s: float
    servers: int

    @property
    def seconds(self) -> float:
        """Write plus load: what one learner update costs in wall time."""
        return self.write_s + self.load_s

    @property
    def seconds_per_mb(self) -> float:
        """Wall seconds per MB of weights (the benchmark's figure)."""
        return self.seconds / self.megabytes
