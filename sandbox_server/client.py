"""Asyncio client of the sandbox service, the `ToolExecutor` the agent loop uses (issue 3, point 6; SPEC 6).

Calls are gathered the way the paper's sender workers do: a batch leaves when it holds `batch_size` calls or when
the oldest call has waited `batch_wait_ms`. Batches go round-robin over several servers; a connection error, an
overloaded (503) or broken answer is retried on the next server with a short backoff; when every attempt fails, each
call of the batch gets an `unavailable` result. Nothing here raises for a failure of the tool side.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import aiohttp
import gin

from sandbox_server.api import RunRequest, Status, ToolResult


class _RetryableError(Exception):
    """An answer that says "try again, maybe elsewhere" (overload, shutdown, broken body)."""


@gin.configurable
class SandboxClient:
    """Batches and spreads calls over `urls`; use as `async with SandboxClient(urls) as client:`."""

    def __init__(
        self,
        urls: Sequence[str] = ("http://127.0.0.1:8080",),
        batch_size: int = 64,
        batch_wait_ms: float = 5.0,
        attempts: int = 3,
        retry_backoff_s: float = 0.25,
        request_timeout_s: float = 900.0,
        max_connections: int = 256,
    ) -> None:
        if isinstance(urls, str) or not urls:
            raise ValueError(f"urls must be a non-empty sequence of server URLs, got {urls!r}")
        if batch_size < 1 or attempts < 1 or batch_wait_ms < 0 or request_timeout_s <= 0 or max_connections < 1:
            raise ValueError(
                f"invalid client settings: {batch_size=} {attempts=} {batch_wait_ms=} {request_timeout_s=} "
                f"{max_connections=}"
            )
        self.urls = [url.rstrip("/") for url in urls]
        self.batch_size = batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.attempts = attempts
        self.retry_backoff_s = retry_backoff_s
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self._next_server = itertools.cycle(range(len(self.urls)))
        self._pending: list[tuple[RunRequest, asyncio.Future[ToolResult]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._senders: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def run(self, code: str, stdin: str = "", *, timeout_s: float | None = None) -> ToolResult:
        """Execute one snippet (SPEC section 2's tool); failures come back as a status, never as an exception."""
        return await self._enqueue(RunRequest(code=code, stdin=stdin, timeout_s=timeout_s))

    async def run_batch(self, requests: Sequence[RunRequest]) -> list[ToolResult]:
        """Execute many snippets; results in request order."""
        return list(await asyncio.gather(*(self._enqueue(request) for request in requests)))

    async def close(self) -> None:
        """Send what is pending, wait for every batch in flight, close the HTTP session."""
        self._flush()
        if self._senders:
            await asyncio.gather(*self._senders, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _enqueue(self, request: RunRequest) -> asyncio.Future[ToolResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ToolResult] = loop.create_future()
        self._pending.append((request, future))
        if len(self._pending) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.batch_wait_s, self._flush)
        return future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size :]
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            )
        return self._session

    async def _send(self, batch: list[tuple[RunRequest, asyncio.Future[ToolResult]]]) -> None:
        body = {"requests": [request.to_json() for request, _ in batch]}
        errors: list[str] = []
        for attempt in range(self.attempts):
            url = self.urls[next(self._next_server)]
            try:
                results = await self._post_batch(url, body, len(batch))
            except (aiohttp.ClientError, asyncio.TimeoutError, _RetryableError, ValueError) as exc:
                errors.append(f"{url}: {type(exc).__name__}: {exc}")
                if attempt + 1 < self.attempts:
                    await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
            return
        failure = ToolResult.failure(
            Status.UNAVAILABLE, f"[sandbox] no server answered after {self.attempts} attempts: " + "; ".join(errors)
        )
        for _, future in batch:
            if not future.done():
                future.set_result(failure)

    async def _post_batch(self, url: str, body: dict[str, Any], expected: int) -> list[ToolResult]:
        async with self._http().post(f"{url}/run_batch", json=body) as response:
            payload = await response.json(content_type=None)
        if response.status == 400 and isinstance(payload, dict) and payload.get("status") == Status.REJECTED:
            return [ToolResult.from_json(payload)] * expected  # the whole batch was refused as malformed
        if response.status != 200:
            reason = payload.get("stderr") if isinstance(payload, dict) else payload
            raise _RetryableError(f"HTTP {response.status}: {reason}")
        results = payload.get("results") if isinstance(payload, dict) else None
        if not isinstance(results, list) or len(results) != expected:
            raise _RetryableError(f"answer does not hold {expected} results")
        return [ToolResult.from_json(result) for result in results]
