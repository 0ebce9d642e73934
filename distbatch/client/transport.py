"""One logical HTTP request to a worker: connection slots, retries, backoff and one deadline.

`HttpTransport.request` is the one way the client speaks HTTP: it builds the request (JSON, a
container body sent in slices, or nothing), takes a connection slot, lands data fetches'
bodies in their final buffer (`distbatch.client.http_recv`), counts the bytes (`Traffic`) and
turns error answers into exceptions (`distbatch.client.responses`), retrying what may be
retried. Puts, gathers, deletes, engine calls and plain JSON requests all go through it, so
they share one retry policy and one error mapping.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import aiohttp.payload

from distbatch import wire
from distbatch.client import http_recv
from distbatch.client.http_recv import StalledTransfer
from distbatch.client.loop import ProcessRuntime, Runtime
from distbatch.client.responses import error_from_response, json_reply, read_into_bytearray
from distbatch.client.results import Traffic
from distbatch.errors import AnsweredError, NodeError, ProtocolError, ServerError, WorkerUnavailableError

SEND_SLICE_BYTES = 4 << 20
MAX_RESPONSE_BYTES = 1 << 40  # a response announcing more than this is refused before allocating
_MAX_DOUBLINGS = 30  # the backoff's exponent is capped, so a worker busy for hours never overflows it

_UNANSWERED = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError, OSError)
"""What a request that got no answer raises (connection refused or lost, a timeout)."""

Body = bytes | list[wire.Part] | None


def unanswered_reason(exc: BaseException) -> str:
    """Why a request got no answer, in a few words: "connection refused", "timed out", "no route
    to host", "name or service not known" (DNS); else the exception's type and message, on one line."""
    if isinstance(exc, StalledTransfer):
        return f"stalled: no data for {exc.seconds:g} s"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        exc = exc.os_error
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno > 0:
        return os.strerror(exc.errno).lower()  # asyncio's own message names the address, not the errno
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()  # a resolver error (negative errno)
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class RequestPolicy:
    """How requests authenticate, how long they may take and how they are retried (see
    `ShardClient` for each)."""

    token: str | None
    timeout: float
    connect_timeout: float
    retries: int
    backoff: float
    backoff_max: float
    stall_timeout: float | None = None


@dataclass(frozen=True)
class _Outgoing:
    """What every try of one request sends, and the deadline they share."""

    node: str
    method: str
    path: str
    headers: dict[str, str]
    body: Body
    size: int
    binary_response: bool
    waits: bool
    deadline: float | None


def _is_busy(error: NodeError) -> bool:
    """503 `busy`: every worker thread was busy and nothing ran."""
    return isinstance(error, ServerError) and error.status == 503 and error.code == "busy"


class _Retries:
    """When one logical request tries again, and how long it pauses first."""

    def __init__(self, policy: RequestPolicy, idempotent: bool, deadline: float | None) -> None:
        self.policy = policy
        self.idempotent = idempotent
        self.deadline = deadline
        self.counted = 0  # retries that count against `policy.retries`
        self.waited = 0  # all retries, for the backoff

    def _may_retry(self, error: NodeError) -> bool:
        if isinstance(error, WorkerUnavailableError):
            return True
        return isinstance(error, ServerError) and self.idempotent

    async def pause_or_raise(self, error: NodeError) -> None:
        """Pause before the next try, or raise `error` when there is none. A busy worker ran
        nothing, so any request (an engine call too) waits for it until its deadline, without
        counting against `retries`."""
        busy = _is_busy(error)
        if not busy and not self._may_retry(error):
            raise error
        if not busy:
            self.counted += 1
        self.waited = min(self.waited + 1, _MAX_DOUBLINGS)
        policy = self.policy
        delay = min(policy.backoff * 2 ** (self.waited - 1), policy.backoff_max) * (0.5 + random.random() / 2)
        loop = asyncio.get_running_loop()
        if self.counted > policy.retries or (
            self.deadline is not None and loop.time() + delay >= self.deadline
        ):
            raise error
        await asyncio.sleep(delay)


async def _send_slices(parts: list[wire.Part]) -> AsyncIterator[memoryview]:
    """A body's parts in slices of a few MiB, sent as they are (never joined).

    aiohttp waits for the socket to drain after each slice; handing it one big buffer
    instead makes asyncio's transport copy its unsent tail again and again.
    """
    for part in parts:
        view = wire.byte_view(part)
        for start in range(0, view.nbytes, SEND_SLICE_BYTES):
            yield view[start : start + SEND_SLICE_BYTES]


class _WatchedUpload(aiohttp.payload.AsyncIterablePayload):
    """A container body sent in slices (`_send_slices`) that says how far it got, for the stall
    watchdog: a slice is a few MiB and the kernel queues more, so progress is read from the
    connection, not from the slices handed over."""

    def __init__(self, parts: list[wire.Part]) -> None:
        super().__init__(_send_slices(parts))  # type: ignore[arg-type]  # memoryviews are written as bytes
        self._writer: Any = None  # aiohttp's, once the body is being written
        self._acknowledged = 0
        self._written = False  # every slice handed to the connection
        self.delivered = False  # ... and every byte of it acknowledged by the worker

    async def write(self, writer: Any) -> None:
        self._writer = writer
        await super().write(writer)
        self._written = True

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        self._writer = writer
        await super().write_with_length(writer, content_length)
        self._written = True

    def acknowledged(self) -> int | None:
        """Bytes of the request (head and body) the worker has acknowledged so far: what left
        the event loop's buffer less what the kernel still holds unacknowledged. None before
        the body is written (the connection is being made, under the connect timeout)."""
        if self._writer is None:
            return None
        transport = getattr(self._writer, "transport", None)
        if transport is not None and not transport.is_closing():
            queued = transport.get_write_buffer_size()
            unacknowledged = http_recv.unacknowledged(transport)
            self._acknowledged = self._writer.output_size - queued - unacknowledged
            self.delivered = self._written and queued == 0 and unacknowledged == 0
        return self._acknowledged

    def cut(self) -> None:
        """Close the connection at once, with a reset: what the event loop and the kernel still
        queue is dropped, so an upload given up on never completes later (a link that comes back
        would otherwise deliver it, and the worker store a put its caller was told failed)."""
        transport = getattr(self._writer, "transport", None)
        if transport is not None:
            http_recv.reset(transport)


class HttpTransport:
    """Requests to workers (and to a controller) with one policy, one runtime and one traffic count.

    `allocate(nbytes)`: a writable buffer a fetched body lands in (the client's receive pool).
    """

    def __init__(
        self,
        policy: RequestPolicy,
        runtimes: ProcessRuntime,
        traffic: Traffic,
        allocate: Callable[[int], Any],
    ) -> None:
        self.policy = policy
        self.runtimes = runtimes
        self.traffic = traffic
        self.allocate = allocate

    def headers(self, content_type: str | None) -> dict[str, str]:
        headers = {}
        if content_type:
            headers["Content-Type"] = content_type
        if self.policy.token:
            headers["Authorization"] = f"Bearer {self.policy.token}"
        return headers

    async def request(
        self,
        node: str,
        method: str,
        path: str,
        *,
        body: Body = None,
        json_body: Any = None,
        binary_response: bool = False,
        timeout: float | None | object = ...,
        idempotent: bool = True,
        waits: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        runtime: Runtime | None = None,
        keep_alive: bool | None = None,
    ) -> Any:
        """One logical request with retries inside one deadline; returns JSON or a bytearray.

        `timeout` overrides the policy's (None: no deadline, for long engine calls; a dead
        worker still fails at once because its socket closes). A non-idempotent request is
        retried only when no connection was made or the worker answered 503 `busy` (it ran
        nothing). `waits`: the server may hold it open, so it takes a slot of the waiting
        budget, not the node's. `runtime`: the one to use (cleanup running while the client
        closes must not look it up). `keep_alive`: on a kept-alive connection (default: when
        idempotent; see `ShardClient.request_json`), else on a connection of its own.
        """
        limit = self.policy.timeout if timeout is ... else timeout
        deadline = None if limit is None else asyncio.get_running_loop().time() + float(limit)  # type: ignore[arg-type]
        body, headers, size = self._body(path, body, json_body, extra_headers)
        outgoing = _Outgoing(node, method, path, headers, body, size, binary_response, waits, deadline)
        runtime = runtime or self.runtimes.get()
        reuse = idempotent if keep_alive is None else keep_alive
        session = runtime.session() if reuse else runtime.fresh_session()
        retries = _Retries(self.policy, idempotent, deadline)
        while True:
            self.traffic.requests += 1
            self.traffic.bytes_sent += size
            try:
                return await self._attempt(runtime, session, outgoing)
            except AnsweredError as answered:
                error = answered.error
            except _UNANSWERED as exc:
                reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                if isinstance(exc, StalledTransfer):
                    reason = (
                        f"{exc} (the worker stopped, or its link is down; a slow transfer that "
                        "keeps moving is never cut: stall_timeout)"
                    )
                error = WorkerUnavailableError(node, f"{method} {path} failed: {reason}")
                error.reason = unanswered_reason(exc)
                if isinstance(exc, StalledTransfer):
                    raise error from None  # a retry would wait on the same silent link
                if not idempotent and not isinstance(exc, aiohttp.ClientConnectorError):
                    raise error from None  # it may have run: only a refused connection is retried
            await retries.pause_or_raise(error)

    def _body(
        self, path: str, body: Body, json_body: Any, extra_headers: Mapping[str, str] | None
    ) -> tuple[Body, dict[str, str], int]:
        """A request's body (JSON encoded once, for every attempt), its headers and its size."""
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode()
            headers = self.headers("application/json")
        else:
            content_type = "application/json" if path.startswith("/v1/call/") else wire.CONTENT_TYPE
            headers = self.headers(content_type if body is not None else None)
        if extra_headers:
            headers.update(extra_headers)
        size = 0 if body is None else len(body) if not isinstance(body, list) else wire.parts_size(body)
        if isinstance(body, list):
            headers["Content-Length"] = str(size)
        return body, headers, size

    async def _attempt(self, runtime: Runtime, session: aiohttp.ClientSession, request: _Outgoing) -> Any:
        """One try of a request: its answer (JSON, or a bytearray for `binary_response`), else
        `AnsweredError` carrying the error a worker's error status means."""
        loop = asyncio.get_running_loop()
        deadline = request.deadline
        remaining = None if deadline is None else deadline - loop.time()
        async with runtime.slot(request.node, request.waits, remaining):
            remaining = None if deadline is None else deadline - loop.time()  # after the slot
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            if request.binary_response and isinstance(request.body, bytes):
                async with asyncio.timeout(remaining):
                    return await self._fetch_into_buffer(request, request.body)
            if isinstance(request.body, list) and any(isinstance(p, wire.Pieces) for p in request.body):
                async with asyncio.timeout(remaining):
                    return await self._put_gathered(request, request.body)
            return await self._send(session, request, remaining)

    async def _fetch_into_buffer(self, request: _Outgoing, body: bytes) -> Any:
        """A data fetch: the body lands in its final buffer (see `http_recv`)."""
        host, _, port = request.node.rpartition(":")
        host = host[1:-1] if host.startswith("[") else host
        connect = asyncio.timeout(self.policy.connect_timeout)
        status, _, payload = await http_recv.request_into_buffer(
            host,
            int(port),
            request.method,
            request.path,
            request.headers,
            body,
            MAX_RESPONSE_BYTES,
            connect,
            self.allocate,
            self.policy.stall_timeout,
        )
        self.traffic.bytes_received += len(payload)
        if status < 400:
            return payload
        raise AnsweredError(error_from_response(request.node, status, bytes(payload)))

    async def _put_gathered(self, request: _Outgoing, parts: list[Any]) -> Any:
        """A body holding a ragged column's per-task tensors (`wire.Pieces`): written with
        gathering writes, on a connection of its own (see `http_recv.request_with_parts`)."""
        host, _, port = request.node.rpartition(":")
        host = host[1:-1] if host.startswith("[") else host
        status, headers, payload = await http_recv.request_with_parts(
            host,
            int(port),
            request.method,
            request.path,
            request.headers,
            parts,
            MAX_RESPONSE_BYTES,
            asyncio.timeout(self.policy.connect_timeout),
            self.policy.stall_timeout,
        )
        self.traffic.bytes_received += len(payload)
        if status >= 400:
            raise AnsweredError(error_from_response(request.node, status, bytes(payload)))
        try:
            return json.loads(payload)
        except (ValueError, RecursionError):
            raise ProtocolError(
                request.node,
                f"{request.method} {request.path} answered HTTP {status} with a body that is not JSON "
                f"({headers.get('content-type') or 'no Content-Type'}); is this address a distbatch worker?",
            ) from None

    async def _send(self, session: aiohttp.ClientSession, request: _Outgoing, remaining: float | None) -> Any:
        """One try through aiohttp: JSON replies, and binary ones of unknown size. A container
        body (a put) is watched for progress: `StalledTransfer` once nothing moved for the stall
        timeout, none of it acknowledged by the worker nor, once all of it was, an answer."""
        body = request.body
        stall_timeout = self.policy.stall_timeout
        if not isinstance(body, list):
            return await self._exchange(session, request, remaining, body)
        if stall_timeout is None:
            return await self._exchange(session, request, remaining, _send_slices(body))
        upload = _WatchedUpload(body)
        return await http_recv.until_upload_stalled(
            self._exchange(session, request, remaining, upload), upload, stall_timeout
        )

    async def _exchange(
        self, session: aiohttp.ClientSession, request: _Outgoing, remaining: float | None, data: Any
    ) -> Any:
        """Send `request` with `data` as its body and read the answer."""
        connect = (
            self.policy.connect_timeout if remaining is None else min(self.policy.connect_timeout, remaining)
        )
        async with session.request(
            request.method,
            f"http://{request.node}{request.path}",
            data=data,
            headers=request.headers,
            timeout=aiohttp.ClientTimeout(total=remaining, sock_connect=connect),
        ) as response:
            if response.status < 400 and request.binary_response:
                payload = await read_into_bytearray(response)
                self.traffic.bytes_received += len(payload)
                return payload
            raw = await response.read()
            self.traffic.bytes_received += len(raw)
            if response.status < 400:
                return json_reply(request.node, f"{request.method} {request.path}", response, raw)
            raise AnsweredError(error_from_response(request.node, response.status, raw))
