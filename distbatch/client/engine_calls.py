"""Engine calls on workers: sent at once, watched for liveness, abandoned when they fail.

A call is one `POST /v1/call/<method>` that the worker may hold open for a whole training
step, so it is never retried once sent (it may have run) and waits in its own connection
budget. While calls run, each worker's `/health` is probed from a separate session; the first
failure (a call's, or a worker that stopped answering) ends the batch at once, and the calls
that gave no result are abandoned on their workers (best effort), so nothing stays stored
that nobody holds a handle to.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from distbatch.client.loop import Runtime
from distbatch.client.transport import HttpTransport
from distbatch.errors import (
    AuthError,
    CallTimeoutError,
    CapacityError,
    EngineError,
    InvalidArgumentError,
    RequestError,
    WorkerUnavailableError,
)
from distbatch.protocol import CALL_ID_HEADER

DEFAULT_LIVENESS_TIMEOUT = 30.0
"""Seconds a worker may leave `/health` unanswered during an engine call before the call fails."""
_PROBE_INTERVAL_MAX = 5.0  # seconds between liveness probes (less for a short liveness_timeout)
_PROBE_TIMEOUT_MAX = 10.0  # one probe's own limit, so a stale connection is not waited on for long
_ABANDON_TIMEOUT = 5.0  # one abandon notice's whole budget, retries included
_ABANDON_WAIT = 0.5  # how long a failing call waits for its abandon notices before raising
# Answers after which the worker holds nothing of an engine call (it refused it or rolled it back).
_KEPT_NOTHING = (EngineError, RequestError, AuthError, CapacityError)

EncodedCall = tuple[str, str, bytes]
"""`(node, method, body)`: one engine call, its arguments encoded (see `distbatch.batch.calls`)."""


def check_liveness_timeout(value: float | None) -> float | None:
    """A liveness timeout: None (no probes) or a positive number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(
            f"liveness_timeout must be a positive number of seconds or None, got {value!r}"
        )
    return float(value)


def _failure(task: asyncio.Future[Any]) -> BaseException | None:
    """A done task's exception; None if it succeeded or was cancelled."""
    return None if task.cancelled() else task.exception()


async def _first_failure(
    tasks: list[asyncio.Task[Any]],
    node_of: Mapping[asyncio.Task[Any], str],
    watched: Mapping[str, asyncio.Task[Any]],
) -> BaseException | None:
    """Wait for the calls until they all succeed (None) or one call or one node's liveness
    watcher fails (that error). A worker that dies, or stops answering its probes, is reported
    at once, not after the others' (maybe long) calls end."""
    left: dict[str, int] = {}  # per node, its calls not done yet
    for node in node_of.values():
        left[node] = left.get(node, 0) + 1
    pending: set[asyncio.Task[Any]] = {*tasks, *watched.values()}
    error: BaseException | None = None
    while error is None and not all(t.done() for t in tasks):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        error = next((e for t in tasks if t in done and (e := _failure(t)) is not None), None)
        for task in done:
            if task in node_of:
                left[node_of[task]] -= 1
        for node, watcher in watched.items():
            if left[node] == 0:  # its calls are over: whether it still answers does not matter
                watcher.cancel()
                pending.discard(watcher)
            elif error is None and watcher in done:
                error = _failure(watcher)
    return error


class EngineCalls:
    """Runs batches of encoded engine calls through one transport."""

    def __init__(self, transport: HttpTransport) -> None:
        self.transport = transport

    async def call_many(
        self, calls: Sequence[EncodedCall], timeout: float | None, liveness_timeout: float | None
    ) -> list[Any]:
        """The calls' replies in order, or the first failure, with `partial_results` (see
        `ShardClient.call_many`)."""
        runtime = self.transport.runtimes.get()
        call_ids = [uuid.uuid4().hex for _ in calls]
        tasks = [
            asyncio.ensure_future(self._call(node, method, body, timeout, call_id))
            for (node, method, body), call_id in zip(calls, call_ids)
        ]
        node_of = {task: node for (node, _, _), task in zip(calls, tasks)}
        watched: dict[str, asyncio.Task[Any]] = {}  # per node, its liveness watcher
        if liveness_timeout is not None:
            for node, method, _ in calls:
                if node not in watched:
                    watched[node] = asyncio.ensure_future(
                        self._watch(runtime, node, method, liveness_timeout)
                    )
        try:
            error = await _first_failure(tasks, node_of, watched)
        finally:
            # Also when our caller gave up (cancelled, interrupted): the calls still running are
            # abandoned, so their workers store nothing nobody holds a handle to.
            notices = await self._settle(runtime, calls, call_ids, tasks, list(watched.values()))
        if error is None:
            return [t.result() for t in tasks]
        if notices:
            await asyncio.wait(notices, timeout=_ABANDON_WAIT)
        error.partial_results = [  # type: ignore[attr-defined]
            t.result() if not t.cancelled() and t.exception() is None else None for t in tasks
        ]
        raise error

    async def _call(self, node: str, method: str, body: bytes, timeout: float | None, call_id: str) -> Any:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await self.transport.request(
                node,
                "POST",
                f"/v1/call/{method}",
                body=body,
                timeout=timeout,
                idempotent=False,
                waits=True,
                extra_headers={CALL_ID_HEADER: call_id},
            )
        except WorkerUnavailableError:
            if timeout is not None and loop.time() - started >= timeout:
                raise CallTimeoutError(node, method, timeout) from None  # its deadline, not its worker
            raise

    async def _probe(self, runtime: Runtime, node: str, timeout: float) -> bool:
        """One `GET /health` on the probe session, never retried: did the worker answer at all?"""
        try:
            async with runtime.probe_session().get(
                f"http://{node}/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                await response.read()
                return True
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _watch(self, runtime: Runtime, node: str, method: str, liveness_timeout: float) -> None:
        """Probe `node` every few seconds until cancelled; raise once it has not answered for
        `liveness_timeout` seconds. The worker serves `/health` on other threads than its
        engine, so a long engine call on a live worker is never cut short."""
        loop = asyncio.get_running_loop()
        interval = min(_PROBE_INTERVAL_MAX, liveness_timeout / 4)
        answered = loop.time()
        while True:
            await asyncio.sleep(interval)
            remaining = answered + liveness_timeout - loop.time()
            if remaining > 0 and await self._probe(runtime, node, min(remaining, _PROBE_TIMEOUT_MAX)):
                answered = loop.time()
            elif loop.time() - answered >= liveness_timeout:
                raise WorkerUnavailableError(
                    node,
                    f"stopped answering: no reply to GET /health for {liveness_timeout:g} s while "
                    f"engine call {method!r} was in flight (liveness_timeout)",
                )

    async def _abandon(self, runtime: Runtime, node: str, call_ids: list[str]) -> None:
        """Tell `node` to drop these calls' results; best effort (a dead worker holds none)."""
        with contextlib.suppress(Exception):
            await self.transport.request(
                node,
                "POST",
                "/v1/calls/abandon",
                json_body={"call_ids": call_ids},
                timeout=_ABANDON_TIMEOUT,
                runtime=runtime,
            )

    async def _settle(
        self,
        runtime: Runtime,
        calls: Sequence[EncodedCall],
        call_ids: list[str],
        tasks: list[asyncio.Task[Any]],
        watchers: list[asyncio.Task[Any]],
    ) -> list[asyncio.Task[Any]]:
        """Stop what still runs and send abandon notices for every call that gave no result.

        A call the worker refused or reported failed (4xx, an engine error) needs none: the
        worker kept nothing of it. Any other outcome (no answer, a 5xx, an unreadable reply,
        a cancelled call) may have left a result there.
        """
        for task in (*tasks, *watchers):
            task.cancel()
        await asyncio.gather(*tasks, *watchers, return_exceptions=True)
        unanswered: dict[str, list[str]] = {}
        for (node, _, _), call_id, task in zip(calls, call_ids, tasks):
            if task.cancelled() or (
                task.exception() is not None and not isinstance(task.exception(), _KEPT_NOTHING)
            ):
                unanswered.setdefault(node, []).append(call_id)
        return [runtime.spawn(self._abandon(runtime, node, ids)) for node, ids in unanswered.items()]
