"""Live weight sync into running vLLM servers (issue 5 item 2; DESIGN "Scale-out": weights pushed after every update).

The learner writes its parameters once as an HF checkpoint folder (safetensors shards, on tmpfs by default), then for
each server: POST /pause (in-flight requests finish on the old weights, new ones wait), POST /collective_rpc into
the worker extension (`vllm_worker_extension`), which reloads the folder in place, POST /reset_prefix_cache (cached
KV was computed by the old weights), POST /resume. Servers are never restarted.

The folder is written in the dtype the servers run (issue 22 item 4), which each server reports (`server_dtype`):
vLLM casts whatever it loads to that dtype, so float32 files for a bfloat16 server would double the bytes written
and read for nothing, and bfloat16 files for a float32 server would lose precision. The cast happens on the learner's
devices before anything is copied to the host (`save_hf`'s `dtype`).
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

from rstar_jax.files import atomic_path
from rstar_jax.model.config import DTYPES, ModelConfig
from rstar_jax.model.hf_io import save_hf
from rstar_jax.model.lm import Params
from rstar_jax.rollout.engine import EngineUnavailable
from rstar_jax.rollout.vllm_worker_extension import LOAD_WEIGHTS_METHOD, SERVED_DTYPE_METHOD

PAUSE_MODES = ("wait", "keep", "abort")
_SHM = Path("/dev/shm")


@dataclasses.dataclass(frozen=True)
class SyncCheckpoint:
    """A written weight-sync checkpoint: its folder of safetensors shards, how many bytes of tensors it holds, their
    dtype, and the seconds spent waiting for the devices (cast, transpose, copy to host) and writing the files."""

    path: Path
    nbytes: int
    dtype: str
    gather_s: float = 0.0
    write_s: float = 0.0

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
                          shard_size_mb: float = 1024, dtype: str | None = None) -> SyncCheckpoint:
    """Write `params` as an HF checkpoint in `dtype` (default: the config's param_dtype; a server's `server_dtype`
    for a sync) in a fresh folder that appears atomically (written, then renamed). `save_hf` casts on the devices and
    streams each tensor into shards of at most `shard_size_mb` MiB, so the host holds a few tensors at a time."""
    folder = Path(directory) if directory is not None else default_sync_dir()
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or config.param_dtype
    final = folder / f"rstar-weights-{os.getpid()}-v{version}-{dtype}"
    shutil.rmtree(final, ignore_errors=True)  # a stale folder of the same version
    with atomic_path(final) as temporary:
        saved = save_hf((config, params), temporary, shard_size_mb=shard_size_mb, dtype=dtype)
    return SyncCheckpoint(final, saved.nbytes, dtype, saved.gather_s, saved.write_s)


@dataclasses.dataclass
class _Written:
    task: asyncio.Future
    users: int = 0


class SharedSyncCheckpoints:
    """Writes each weight version once for all the servers that load it (DESIGN "Scale-out": one write, every
    server reads it), and deletes it when the last of them is done.

    The engines of one fleet share one of these: each engine's `update_weights` enters `use(...)` for the version
    and its server's dtype; the first to enter writes the checkpoint (in a thread, off the event loop), the others
    wait for that same write (servers of another dtype get their own). A server that is down never enters, so it
    cannot hold the folder up. `last_*` describe the latest write: its MB, dtype, and seconds spent waiting for the
    devices (`last_gather_s`) and writing files (`last_write_s`, what remains of the write's wall time).
    """

    def __init__(self) -> None:
        self._written: dict[tuple[int, str], _Written] = {}
        self.last_gather_s = 0.0
        self.last_write_s = 0.0
        self.last_megabytes = 0.0
        self.last_dtype: str | None = None

    def _write(self, config: ModelConfig, params: Params, version: int, dtype: str | None = None) -> SyncCheckpoint:
        started = time.perf_counter()
        checkpoint = write_sync_checkpoint(config, params, version, dtype=dtype)
        self.last_gather_s = checkpoint.gather_s
        self.last_write_s = time.perf_counter() - started - checkpoint.gather_s
        self.last_megabytes, self.last_dtype = checkpoint.megabytes, checkpoint.dtype
        return checkpoint

    @contextlib.asynccontextmanager
    async def use(self, config: ModelConfig, params: Params, version: int,
                  dtype: str | None = None) -> AsyncIterator[SyncCheckpoint]:
        """The written checkpoint of `version` in `dtype` (default: the config's param_dtype; written now if no other
        user has started it) while inside."""
        key = (version, dtype or config.param_dtype)
        entry = self._written.get(key)
        if entry is None:
            entry = self._written[key] = _Written(asyncio.ensure_future(
                asyncio.to_thread(self._write, config, params, version, dtype)))
        entry.users += 1
        try:
            yield await asyncio.shield(entry.task)
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._written[key]
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


async def server_dtype(session: aiohttp.ClientSession, base_url: str, timeout_s: float | None = 60.0) -> str:
    """The dtype the server at `base_url` holds its weights in ("bfloat16", "float16" or "float32"), as its worker
    reports it: vLLM's `--dtype` after its own resolution ("auto": the start folder's config.json dtype, float32
    downcast to the platform's 16-bit type), so extra flags, attached servers and platform fallbacks all count."""
    reply = await _post(session, f"{base_url}/collective_rpc", {"method": SERVED_DTYPE_METHOD}, timeout_s=timeout_s)
    dtype = reply["results"][0]
    if dtype not in DTYPES:
        raise RuntimeError(f"{base_url} serves its weights in {dtype!r}; a weight sync can write {tuple(DTYPES)}")
    return dtype


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
    """One measured weight sync: waiting for the devices (cast, transpose, copy to host), writing the checkpoint,
    reloading it on all servers (with the pause, prefix-cache reset and resume), and the throughput figures.
    `megabytes` are the bytes written (in `dtype`, the servers' dtype)."""

    megabytes: float
    gather_s: float
    write_s: float
    load_s: float
    servers: int
    dtype: str | None = None

    @property
    def seconds(self) -> float:
        """Gather, write and load: what one learner update costs in wall time."""
        return self.gather_s + self.write_s + self.load_s

    @property
    def seconds_per_mb(self) -> float:
        """Wall seconds per MB written (the benchmark's figure)."""
        return self.seconds / self.megabytes

    @property
    def gigabytes_per_s(self) -> float:
        """GB (10^9 bytes) written and loaded per wall second, end to end."""
        return self.megabytes / 1e3 / self.seconds
