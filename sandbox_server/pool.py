"""The warm worker pool: one zygote per slot, a bounded queue in front, crashed zygotes replaced.

Issue 3, points 3 and 5. Requests wait in a bounded asyncio queue (a full queue is answered at once with a
retryable overload error, which is the backpressure); each slot's task takes one request at a time, sets the slot's
memory budget, sends the call to its zygote and answers with the zygote's result. A zygote that dies or stops
answering is killed, its in-flight call is answered with `killed`, and a fresh zygote takes the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from sandbox_server import framing
from sandbox_server.api import RunRequest, Status, ToolResult
from sandbox_server.cgroups import CgroupTree, SlotCgroups
from sandbox_server.config import SandboxConfig
from sandbox_server.zygote import ZygoteSettings

log = logging.getLogger(__name__)

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_START_TIMEOUT_S = 120.0
_ANSWER_GRACE_S = 10.0
_THREAD_VARS = (
    "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
    "BLIS_NUM_THREADS",
)  # fmt: skip


def zygote_environment() -> dict[str, str]:
    """The whole environment a zygote (and so every call) sees: no secrets, single-threaded math libraries."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    env.update({name: "1" for name in _THREAD_VARS})
    return env


def start_like_a_zygote(module: str, args: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start `python -m module args` the way every zygote starts: this interpreter, the package's parent folder,
    `zygote_environment`, no user site-packages (HOME=/tmp there, which anyone can write), so its sys.path is the
    zygote's (what the preflight probe must see)."""
    return subprocess.Popen(
        [sys.executable, "-s", "-m", module, *args],
        env=zygote_environment(),
        cwd=_PACKAGE_PARENT,
        stdin=subprocess.DEVNULL,
        **popen,
    )


class QueueFull(Exception):
    """The pool's queue is at its bound; the caller should retry later or elsewhere."""


class ZygoteStartError(RuntimeError):
    """A zygote could not isolate itself or preload its modules; the message carries its reason."""


@dataclasses.dataclass
class _Job:
    request: RunRequest
    future: asyncio.Future[ToolResult]
    enqueued: float


class Slot:
    """One zygote process and the cgroups it lives in."""

    def __init__(self, index: int, config: SandboxConfig, cgroups: SlotCgroups | None) -> None:
        self.index, self.config, self.cgroups = index, config, cgroups
        self.process: subprocess.Popen[bytes] | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.workdir = "/tmp"  # private to the slot's mount namespace
        if cgroups is None:  # unisolated: a host directory of its own, owned by the uid calls run as
            self.workdir = tempfile.mkdtemp(prefix=f"sandbox-slot{index}-")
            if os.geteuid() == 0:
                os.chown(self.workdir, config.uid_base + index, config.uid_base + index)

    async def start(self) -> None:
        """Spawn the zygote and wait until it has isolated itself and warmed up."""
        parent_end, child_end = socket.socketpair()
        if self.cgroups is not None:
            self.cgroups.set_max_processes(self.config.max_processes + 2)  # + launcher and zygote
        settings = ZygoteSettings(
            channel_fd=child_end.fileno(),
            uid=self.config.uid_base + self.index,
            isolate=self.cgroups is not None,
            cgroup_procs=[] if self.cgroups is None else self.cgroups.procs_files,
            memory_cgroup=None if self.cgroups is None else self.cgroups.memory_dir,
            tmpfs_size_mb=self.config.tmpfs_size_mb,
            preload_modules=list(self.config.preload_modules),
            max_processes=self.config.max_processes,
            max_open_files=self.config.max_open_files,
            max_file_size_mb=self.config.max_file_size_mb,
            output_cap_bytes=self.config.output_cap_bytes,
            workdir=self.workdir,
        )
        self.process = start_like_a_zygote(
            "sandbox_server.zygote", [json.dumps(dataclasses.asdict(settings))], pass_fds=[child_end.fileno()]
        )
        child_end.close()
        self.reader, self.writer = await asyncio.open_unix_connection(sock=parent_end)
        try:
            hello = await asyncio.wait_for(framing.read_message(self.reader), _START_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            await self.stop()
            raise ZygoteStartError(f"slot {self.index}: zygote exited or hung before it was ready") from exc
        if not hello.get("ready"):
            await self.stop()
            raise ZygoteStartError(f"slot {self.index}: {hello.get('fatal')}\n{hello.get('traceback', '')}")
        if self.cgroups is not None:
            self.cgroups.record_baseline()
            self.cgroups.memory_limit_bytes = -1

    @property
    def alive(self) -> bool:
        """Whether the zygote process is still running."""
        return self.process is not None and self.process.poll() is None

    async def execute(self, request: RunRequest, timeout_s: float, memory_mb: int) -> ToolResult:
        """Run one call on this slot's zygote; a lost zygote yields `killed` and is stopped for replacement."""
        assert self.reader is not None and self.writer is not None
        if self.cgroups is not None:
            self.cgroups.limit_call_memory(memory_mb)
        message = {"code": request.code, "stdin": request.stdin, "timeout_s": timeout_s, "memory_mb": memory_mb}
        try:
            self.writer.write(framing.encode_frame(message))
            await self.writer.drain()
            body = await asyncio.wait_for(framing.read_message(self.reader), timeout_s + _ANSWER_GRACE_S)
            return ToolResult.from_json(body)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError) as exc:
            log.warning("slot %d lost its zygote during a call (%r); replacing it", self.index, exc)
            await self.stop()
            return ToolResult.failure(Status.KILLED, "[sandbox] the worker running this call died; it was replaced")

    async def stop(self) -> None:
        """Kill the zygote (its namespace dies with it) and close the channel."""
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            await asyncio.get_running_loop().run_in_executor(None, self.process.wait)
        self.process = self.reader = self.writer = None


class WorkerPool:
    """Slots plus the bounded queue; `submit` never blocks and never drops a request it accepted."""

    def __init__(self, config: SandboxConfig, isolate: bool, on_done: Callable[[ToolResult, float], None]) -> None:
        self.config = config
        self.isolate = isolate
        self.on_done = on_done
        self.queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=config.max_queue)
        self.cgroup_tree: CgroupTree | None = None
        self.slots: list[Slot] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.in_flight = 0

    async def start(self) -> None:
        """Create cgroups and start every slot's zygote (a start failure aborts with the zygote's reason)."""
        if self.isolate:
            self.cgroup_tree = CgroupTree()
        self.slots = [
            Slot(i, self.config, None if self.cgroup_tree is None else self.cgroup_tree.slot(i))
            for i in range(self.config.workers)
        ]
        try:
            await asyncio.gather(*(slot.start() for slot in self.slots))
        except BaseException:
            await self._stop_slots()
            raise
        self.tasks = [asyncio.create_task(self._serve_slot(slot)) for slot in self.slots]

    def submit(self, request: RunRequest) -> asyncio.Future[ToolResult]:
        """Queue one request; raises QueueFull when the bound is reached."""
        future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait(_Job(request, future, time.monotonic()))
        except asyncio.QueueFull:
            raise QueueFull(f"sandbox queue is full ({self.config.max_queue} waiting calls)") from None
        return future

    async def submit_waiting(self, request: RunRequest) -> asyncio.Future[ToolResult]:
        """Queue one request, waiting for room (backpressure for batches larger than the free space)."""
        future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Job(request, future, time.monotonic()))
        return future

    def free_capacity(self) -> int:
        """How many more requests the queue accepts right now."""
        return self.config.max_queue - self.queue.qsize()

    async def _serve_slot(self, slot: Slot) -> None:
        while True:
            job = await self.queue.get()
            self.in_flight += 1
            try:
                if not slot.alive:
                    await self._restart(slot)
                timeout_s = job.request.timeout_s or self.config.default_timeout_s
                memory_mb = job.request.memory_mb or self.config.default_memory_mb
                result = await slot.execute(job.request, timeout_s, memory_mb)
            except asyncio.CancelledError:
                if not job.future.done():
                    job.future.set_result(ToolResult.failure(Status.KILLED, "[sandbox] server shut down mid-call"))
                raise
            except Exception as exc:  # noqa: BLE001 - a request must be answered whatever went wrong
                log.exception("slot %d failed a call", slot.index)
                result = ToolResult.failure(Status.KILLED, f"[sandbox] internal error: {exc}")
            finally:
                self.in_flight -= 1
                self.queue.task_done()
            if not job.future.done():
                job.future.set_result(result)
            self.on_done(result, time.monotonic() - job.enqueued)
            if not slot.alive:  # replace a lost zygote now, not when the next call arrives
                with contextlib.suppress(ZygoteStartError):
                    await self._restart(slot)

    async def _restart(self, slot: Slot) -> None:
        await slot.stop()
        for attempt in range(3):
            try:
                await slot.start()
                return
            except ZygoteStartError:
                log.exception("slot %d: restart attempt %d failed", slot.index, attempt + 1)
                await asyncio.sleep(1.0)
        raise ZygoteStartError(f"slot {slot.index} could not be restarted")

    async def drain(self, grace_s: float) -> None:
        """Wait up to `grace_s` for queued and running calls to finish; answer what is left with `killed`."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.queue.join(), grace_s)
        while not self.queue.empty():
            job = self.queue.get_nowait()
            self.queue.task_done()
            if not job.future.done():
                reason = "[sandbox] server shut down before the call ran"
                job.future.set_result(ToolResult.failure(Status.KILLED, reason))

    async def close(self) -> None:
        """Stop slot tasks and zygotes (answering any call still running), then remove the cgroups."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self._stop_slots()

    async def _stop_slots(self) -> None:
        await asyncio.gather(*(slot.stop() for slot in self.slots), return_exceptions=True)
        if self.cgroup_tree is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.cgroup_tree.remove)
        for slot in self.slots:
            if slot.cgroups is None:
                shutil.rmtree(slot.workdir, ignore_errors=True)
