"""The HTTP front end: `/run`, `/run_batch`, `/health`, `/metrics` (issue 3, point 1).

Every request gets an answer with a JSON body: a bad request is `rejected` (HTTP 400) with the reason in stderr; a
full queue or a server shutting down is `rejected` with HTTP 503, which clients retry elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from sandbox_server.api import RequestError, Status, ToolResult, parse_batch_body, parse_run_request
from sandbox_server.config import SandboxConfig
from sandbox_server.metrics import ServerMetrics
from sandbox_server.pool import QueueFull, WorkerPool

MAX_BODY_BYTES = 64 * 1024 * 1024


class SandboxService:
    """The pool, its metrics and the accept/drain state shared by the handlers."""

    def __init__(self, config: SandboxConfig, isolate: bool) -> None:
        self.config = config
        self.isolate = isolate
        self.limits = config.request_limits()
        self.pool = WorkerPool(config, isolate, on_done=self._record)
        self.metrics = ServerMetrics(lambda: self.pool.queue.qsize(), lambda: self.pool.in_flight)
        self.accepting = False

    def _record(self, result: ToolResult, latency_s: float) -> None:
        self.metrics.record(result, latency_s)

    async def start(self) -> None:
        """Start every zygote, then accept calls."""
        await self.pool.start()
        self.accepting = True

    async def stop(self) -> None:
        """Graceful shutdown: refuse new calls, finish (or answer) queued ones, stop the zygotes."""
        self.accepting = False
        await self.pool.drain(self.config.shutdown_grace_s)
        await self.pool.close()

    def _rejected(self, reason: str, http_status: int) -> web.Response:
        self.metrics.count_rejected()
        return web.json_response(ToolResult.failure(Status.REJECTED, reason).to_json(), status=http_status)

    async def _read_json(self, request: web.Request) -> Any:
        try:
            return await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"request body exceeds {MAX_BODY_BYTES} bytes") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None

    async def handle_run(self, request: web.Request) -> web.Response:
        """POST /run {code, stdin?, timeout_s?, memory_mb?} -> ToolResult JSON."""
        self.metrics.requests.labels(endpoint="/run").inc()
        try:
            run_request = parse_run_request(await self._read_json(request), self.limits)
        except RequestError as exc:
            return self._rejected(str(exc), 400)
        if not self.accepting:
            return self._rejected("server is shutting down", 503)
        try:
            future = self.pool.submit(run_request)
        except QueueFull as exc:
            return self._rejected(str(exc), 503)
        return web.json_response((await future).to_json())

    async def handle_run_batch(self, request: web.Request) -> web.Response:
        """POST /run_batch {requests: [...]} -> {results: [...]} in order; invalid items come back `rejected`.

        A batch is refused (503) unless the queue has room for it, or is empty for one larger than the queue bound;
        an admitted batch then waits for room item by item.
        """
        self.metrics.requests.labels(endpoint="/run_batch").inc()
        try:
            bodies = parse_batch_body(await self._read_json(request))
        except RequestError as exc:
            return self._rejected(str(exc), 400)
        if not self.accepting:
            return self._rejected("server is shutting down", 503)
        parsed: list[Any] = []
        for index, body in enumerate(bodies):
            try:
                parsed.append(parse_run_request(body, self.limits))
            except RequestError as exc:
                self.metrics.count_rejected()
                parsed.append(ToolResult.failure(Status.REJECTED, f"request {index}: {exc}"))
        runnable = sum(1 for item in parsed if not isinstance(item, ToolResult))
        if min(runnable, self.config.max_queue) > self.pool.free_capacity():
            return self._rejected(f"sandbox queue cannot take {runnable} more calls now", 503)
        pending = [item if isinstance(item, ToolResult) else await self.pool.submit_waiting(item) for item in parsed]
        results = [item if isinstance(item, ToolResult) else await item for item in pending]
        return web.json_response({"results": [r.to_json() for r in results]})

    async def handle_health(self, _: web.Request) -> web.Response:
        """GET /health: 200 while accepting calls, 503 while starting or draining."""
        body = {
            "status": "ok" if self.accepting else "unavailable",
            "isolated": self.isolate,
            "workers": len(self.pool.slots),
            "workers_alive": sum(slot.alive for slot in self.pool.slots),
            "queue_depth": self.pool.queue.qsize(),
            "in_flight": self.pool.in_flight,
        }
        return web.json_response(body, status=200 if self.accepting else 503)

    async def handle_metrics(self, _: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format."""
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")


def build_app(service: SandboxService) -> web.Application:
    """The aiohttp application routing the four endpoints to `service`."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.add_routes(
        [
            web.post("/run", service.handle_run),
            web.post("/run_batch", service.handle_run_batch),
            web.get("/health", service.handle_health),
            web.get("/metrics", service.handle_metrics),
        ]
    )
    return app


async def serve(service: SandboxService, host: str, port: int, stop: asyncio.Event) -> None:
    """Start the pool, listen on host:port until `stop` is set, then shut down gracefully."""
    await service.start()
    runner = web.AppRunner(build_app(service), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    try:
        await stop.wait()
    finally:
        service.accepting = False
        await service.stop()
        await runner.cleanup()
