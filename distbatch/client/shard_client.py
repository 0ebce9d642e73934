"""`ShardClient`: the aiohttp client that puts, gathers and deletes shards on workers.

One client owns one aiohttp session on one private event-loop thread. Sync
methods submit work to that loop and wait, so they behave the same from plain
code, from a thread whose own event loop is running, and from inside a Flask
handler; the `a*` variants await the same work from any event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import threading
import uuid
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import aiohttp
import numpy as np

from distbatch import wire
from distbatch.auth import token_from_env
from distbatch.client import http_recv
from distbatch.client.same_host import SameHostChannel, SameHostPaths
from distbatch.errors import (
    AnsweredError,
    AuthError,
    CapacityError,
    EngineError,
    InvalidIdError,
    NodeError,
    ProtocolError,
    RequestError,
    SameHostAnswerError,
    SameHostFallback,
    ServerError,
    ShardNotFoundError,
    ShmError,
    WireFormatError,
    WorkerUnavailableError,
)
from distbatch.ids import ShardKey, ShardRef, validate_id, validate_key, validate_node
from distbatch.protocol import CALL_ID_HEADER, CLIENT_KEEPALIVE_SECONDS
from distbatch.recv_pool import RecvPool, default_max_idle_bytes
from distbatch.twins import awaiting, blocking, done, first_result

T = TypeVar("T")

# A gather request to a same-host worker names at most this many bytes (effectively no bound).
MAX_SAME_HOST_REQUEST_BYTES = 1 << 62

_CLOSED_IN_FLIGHT = "ShardClient was closed while this call was in flight"

DEFAULT_LIVENESS_TIMEOUT = 30.0
"""Seconds a worker may leave `/health` unanswered during an engine call before the call fails."""
_PROBE_INTERVAL_MAX = 5.0  # seconds between liveness probes (less for a short liveness_timeout)
_PROBE_TIMEOUT_MAX = 10.0  # one probe's own limit, so a stale connection is not waited on for long
_ABANDON_TIMEOUT = 5.0  # one abandon notice's whole budget, retries included
_ABANDON_WAIT = 0.5  # how long a failing call waits for its abandon notices before raising
_CLEANUP_GRACE = 1.0  # how long closing a client lets pending abandon notices finish
# Answers after which the worker holds nothing of an engine call (it refused it or rolled it back).
_KEPT_NOTHING = (EngineError, RequestError, AuthError, CapacityError)


@dataclass(frozen=True)
class PutResult:
    stored: int
    bytes: int


@dataclass(frozen=True)
class DeleteResult:
    deleted: int
    bytes_freed: int

    def __add__(self, other: DeleteResult) -> DeleteResult:
        return DeleteResult(self.deleted + other.deleted, self.bytes_freed + other.bytes_freed)


class LoopThread:
    """An event loop running on a daemon thread, owned by one client in one process.

    `wait_interval`: how often a waiting sync caller checks that the loop thread still runs.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.wait_interval = 1.0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="distbatch-client", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for it; its own result or exception, always.

        If the waiting thread is interrupted (KeyboardInterrupt, any BaseException), the
        coroutine is cancelled so it does not run on, holding connections (an engine call is
        abandoned on its worker).
        """
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(
                "sync ShardClient methods cannot run on the client's own loop; await the a* variant"
            )
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            # Wait without `future.result(timeout)`: its TimeoutError could not be told apart
            # from the call's own, and a call finishing right after the wait gave up was lost.
            while not future.done():
                concurrent.futures.wait([future], timeout=self.wait_interval)
                if not future.done() and not self.thread.is_alive():  # the loop stopped under us
                    future.cancel()
                    raise RuntimeError(_CLOSED_IN_FLIGHT)
        except BaseException:
            future.cancel()  # KeyboardInterrupt and the like: stop the work, free its connections
            raise
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise RuntimeError(_CLOSED_IN_FLIGHT) from None

    async def _shutdown(
        self, sessions: Sequence[aiohttp.ClientSession | None], background: set[asyncio.Task[Any]]
    ) -> None:
        # Cancel calls still in flight so that whoever waits on them is released; the cleanup
        # they leave behind (abandon notices to workers) gets a moment before it is cut off.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t not in background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if background:
            await asyncio.wait(set(background), timeout=_CLEANUP_GRACE)
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        for session in sessions:
            if session is not None:
                await session.close()

    def stop(
        self,
        sessions: Sequence[aiohttp.ClientSession | None] = (),
        background: set[asyncio.Task[Any]] | None = None,
    ) -> None:
        if not self.loop.is_closed() and self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(
                    self._shutdown(sessions, background or set()), self.loop
                ).result(timeout=5)
            except TimeoutError:
                pass  # stop the loop regardless; waiters notice the thread is gone
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class Traffic:
    """HTTP body bytes and requests this client moved (its view of the network), and the
    requests and bytes that took the same-host path instead (shared memory, no socket copy)."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    same_host_requests: int = 0
    same_host_sent: int = 0
    same_host_received: int = 0

    @property
    def total(self) -> int:
        return self.bytes_sent + self.bytes_received

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.requests - other.requests,
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
            self.same_host_requests - other.same_host_requests,
            self.same_host_sent - other.same_host_sent,
            self.same_host_received - other.same_host_received,
        )

    @property
    def same_host_bytes(self) -> int:
        return self.same_host_sent + self.same_host_received


class _Runtime:
    """The loop thread, the one session living on it and the connection slots; replaced after a fork.

    Data requests (puts, fetches, deletes, stats) take a slot of their node and one of the
    total; requests the server may hold open (engine calls, long-polling `get_meta`) take
    a slot of their own budget instead, so a crowd of waiters never takes the connections a
    put or a fetch needs, and a long training step never holds up data to its worker.
    """

    def __init__(self, max_connections: int, max_connections_per_node: int, same_host: SameHostPaths) -> None:
        self.loop_thread = LoopThread()
        # This process's same-host channels: a forked child gets a runtime, so channels, of its
        # own (the parent's Unix connections, and locks it may have held, are not the child's).
        self.same_host = same_host
        self.session: aiohttp.ClientSession | None = None
        self.max_connections_per_node = max_connections_per_node
        self.data_slots = asyncio.Semaphore(max_connections)
        self.waiting_slots = asyncio.Semaphore(max_connections)
        self.node_slots: dict[str, asyncio.Semaphore] = {}
        # Liveness probes get a session (and connections) of their own: never a slot a data
        # request needs, never queued behind them.
        self.probe_session: aiohttp.ClientSession | None = None
        self.fresh_session: aiohttp.ClientSession | None = None
        # One same-host handshake per node at a time (`ShardClient._same_host_channel`).
        self.handshakes: dict[str, asyncio.Lock] = {}
        # Best-effort cleanup (abandon notices) that outlives the call that started it.
        self.background: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` on the loop, detached from the caller (must be called on the loop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    @contextlib.asynccontextmanager
    async def slot(self, node: str, waits: bool, timeout: float | None) -> AsyncIterator[None]:
        """Hold a connection slot for one request to `node`; TimeoutError if none frees in `timeout`."""
        if waits:
            semaphores = [self.waiting_slots]
        else:
            per_node = self.node_slots.get(node)
            if per_node is None:
                per_node = self.node_slots[node] = asyncio.Semaphore(self.max_connections_per_node)
            semaphores = [per_node, self.data_slots]  # the node's first: never sit on a total slot
        held: list[asyncio.Semaphore] = []
        try:
            async with asyncio.timeout(timeout):
                for semaphore in semaphores:
                    await semaphore.acquire()
                    held.append(semaphore)
            yield
        finally:
            for semaphore in reversed(held):
                semaphore.release()

    def close(self) -> None:
        if self.loop_thread.pid == os.getpid():
            self.same_host.close()
            self.loop_thread.stop([self.session, self.probe_session, self.fresh_session], self.background)


class _Attempt(NamedTuple):
    """What every try of one request sends, and the deadline they share."""

    node: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | list[wire.Buffer] | None
    binary_response: bool
    waits: bool
    deadline: float | None


class ShardClient:
    """Puts, gathers and deletes shards on worker nodes over HTTP.

    Args:
        token: bearer token; defaults to `DISTBATCH_TOKEN` from the environment.
        timeout: seconds a whole call may take against one node, retries included.
        connect_timeout: seconds to establish one connection.
        max_connections: connections open at once, over all nodes.
        max_connections_per_node: connections open at once to one node.
        max_keys_per_request: shards one HTTP request names at most (a gather is split past it).
        max_bytes_per_request: bytes one HTTP request carries at most (a gather is split past it).
        retries: extra attempts after a connection error, timeout or 5xx.
        backoff: the first pause between attempts, in seconds; it doubles each time.
        backoff_max: the longest pause between attempts, in seconds.
        recv_pool_bytes: idle receive buffers kept for reuse (see `distbatch.recv_pool`), so a
            gather writes into memory that is already mapped in; default
            `DISTBATCH_RECV_POOL_BYTES` or 256 MiB; 0 turns reuse off.

    Workers on this host are reached through shared memory instead of HTTP when they allow it
    (`distbatch.client.same_host`; `DISTBATCH_SHM=0` turns that off): same calls, same errors.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        max_connections: int = 64,
        max_connections_per_node: int = 8,
        max_keys_per_request: int = 100_000,
        max_bytes_per_request: int = 64 << 20,
        retries: int = 3,
        backoff: float = 0.05,
        backoff_max: float = 2.0,
        recv_pool_bytes: int | None = None,
    ) -> None:
        if min(max_connections, max_connections_per_node, max_keys_per_request, max_bytes_per_request) < 1:
            raise ValueError("connection and request limits must be >= 1")
        if timeout <= 0 or connect_timeout <= 0 or retries < 0:
            raise ValueError("timeouts must be > 0 and retries >= 0")
        self.token = token if token is not None else token_from_env()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.max_connections_per_node = max_connections_per_node
        self.max_keys_per_request = max_keys_per_request
        self.max_bytes_per_request = max_bytes_per_request
        self.retries = retries
        self.backoff = backoff
        self.backoff_max = backoff_max
        self._recv_pool = RecvPool(default_max_idle_bytes() if recv_pool_bytes is None else recv_pool_bytes)
        self._runtime_lock = threading.Lock()
        self._runtime: _Runtime | None = None
        self._traffic = Traffic()
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ lifecycle

    def _get_runtime(self) -> _Runtime:
        with self._runtime_lock:
            runtime = self._runtime
            if runtime is None or runtime.loop_thread.pid != os.getpid():
                # After a fork the parent's loop thread does not exist here: start afresh.
                # The pool's own method, not this client's: the runtime must not keep the client alive.
                same_host = SameHostPaths(self.token, self.timeout, self._recv_pool.take)
                runtime = self._runtime = _Runtime(
                    self.max_connections, self.max_connections_per_node, same_host
                )
                self._finalizer = weakref.finalize(self, runtime.close)
            return runtime

    def close(self) -> None:
        """Close the session and stop the loop thread; the client restarts them if used again.
        Idle receive buffers are unmapped (tensors still using one keep it)."""
        self._recv_pool.clear()
        with self._runtime_lock:
            if self._finalizer is not None:
                self._finalizer()
            self._runtime = None
            self._finalizer = None

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _same_host(self) -> SameHostPaths:
        """This process's same-host channels (kept by the runtime, so a forked child has its own)."""
        return self._get_runtime().same_host

    def request_bytes_bound(self, node: str) -> int:
        """How many shard bytes one gather request to `node` should ask for: the HTTP bound
        (`max_bytes_per_request`), or none for a worker already known to be on this host, whose
        answer is a few references into shared memory however many bytes they name."""
        if isinstance(self._same_host.decided(node), SameHostChannel):
            return MAX_SAME_HOST_REQUEST_BYTES
        return self.max_bytes_per_request

    def receive_buffer(self, nbytes: int) -> bytearray | np.ndarray:
        """A writable buffer of `nbytes` from this client's recycled receive buffers: memory
        already mapped in, so filling it costs no page faults; it returns to the pool when the
        last view of it goes. What gathered columns are joined into."""
        return self._recv_pool.take(nbytes)

    def traffic(self) -> Traffic:
        """A snapshot of the bytes and requests this client has moved so far."""
        return dataclasses.replace(self._traffic)

    @property
    def loop_runner(self) -> ShardClient:
        """This client: its verbs' coroutines run on its own event-loop thread."""
        return self

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on this client's event-loop thread and wait for its result.

        Works from plain code, from a thread whose own event loop is running, and from inside
        a Flask handler: the coroutine never runs on the caller's loop.
        """
        return self._get_runtime().loop_thread.submit(coro)

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro`, run on this client's event-loop thread, from any event loop."""
        loop = self._get_runtime().loop_thread.loop
        if asyncio.get_running_loop() is loop:
            return await coro
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller is being cancelled
            raise RuntimeError(_CLOSED_IN_FLIGHT) from None

    def _session(self, runtime: _Runtime) -> aiohttp.ClientSession:
        if runtime.session is None:
            # The runtime's slots bound connections (per node and in total); the connector's own
            # limit is only a backstop for both budgets together.
            # Connections are reused for less time than the server keeps them idle, so no request
            # goes out on a connection the server is closing for idleness.
            connector = aiohttp.TCPConnector(
                limit=2 * self.max_connections,
                limit_per_host=0,
                ttl_dns_cache=300,
                keepalive_timeout=CLIENT_KEEPALIVE_SECONDS,
            )
            runtime.session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=False
            )
        return runtime.session

    def _fresh_session(self, runtime: _Runtime) -> aiohttp.ClientSession:
        """A session whose every request opens its own connection, for requests that are not
        retried (engine calls): a server may close an idle kept-alive connection (its thread
        wanted elsewhere) just as a request goes out on it, which only a retry could mend."""
        if runtime.fresh_session is None:
            runtime.fresh_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True, ttl_dns_cache=300),
                auto_decompress=False,
                trust_env=False,
            )
        return runtime.fresh_session

    # ------------------------------------------------------------------ transport

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {}
        if content_type:
            headers["Content-Type"] = content_type
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def _request(
        self,
        node: str,
        method: str,
        path: str,
        *,
        body: bytes | list[wire.Buffer] | None = None,
        json_body: Any = None,
        binary_response: bool = False,
        timeout: float | None | object = ...,
        idempotent: bool = True,
        waits: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        runtime: _Runtime | None = None,
    ) -> Any:
        """One logical request with retries inside one deadline; returns JSON or a bytearray.

        `timeout` overrides the client's (None: no deadline, for long engine
        calls; a dead worker still fails at once because its socket closes).
        A non-idempotent request is retried only when no connection was made or
        the worker answered 503 `busy` (it ran nothing).
        `waits`: the server may hold it open, so it takes a slot of the waiting budget, not the node's.
        `runtime`: the one to use (cleanup running while the client closes must not look it up).
        """
        loop = asyncio.get_running_loop()
        limit = self.timeout if timeout is ... else timeout
        deadline = None if limit is None else loop.time() + float(limit)  # type: ignore[arg-type]
        body, headers, size = self._request_body(path, body, json_body, extra_headers)
        runtime = runtime or self._get_runtime()
        session = self._session(runtime) if idempotent else self._fresh_session(runtime)
        request = _Attempt(node, method, path, headers, body, binary_response, waits, deadline)
        attempt = waited = 0  # attempts that count against `retries`; all retries (for the backoff)
        while True:
            self._traffic.requests += 1
            self._traffic.bytes_sent += size
            try:
                return await self._attempt(runtime, session, request)
            except AnsweredError as answered:
                error = answered.error
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError, OSError) as exc:
                reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                error = WorkerUnavailableError(node, f"{method} {path} failed: {reason}")
                if not idempotent and not isinstance(exc, aiohttp.ClientConnectorError):
                    raise error from None
            # 503 `busy`: every worker thread was busy and nothing ran, so any request (an engine
            # call too) is retried until its deadline, without counting against `retries`.
            busy = isinstance(error, ServerError) and error.status == 503 and error.code == "busy"
            if not busy and (
                not isinstance(error, (WorkerUnavailableError, ServerError))
                or (not idempotent and isinstance(error, ServerError))
            ):
                raise error
            if not busy:
                attempt += 1
            waited = min(waited + 1, 30)  # capped, so a worker busy for hours never overflows the delay
            delay = min(self.backoff * 2 ** (waited - 1), self.backoff_max) * (0.5 + random.random() / 2)
            if attempt > self.retries or (deadline is not None and loop.time() + delay >= deadline):
                raise error
            await asyncio.sleep(delay)

    def _request_body(
        self,
        path: str,
        body: bytes | list[wire.Buffer] | None,
        json_body: Any,
        extra_headers: Mapping[str, str] | None,
    ) -> tuple[bytes | list[wire.Buffer] | None, dict[str, str], int]:
        """A request's body (JSON encoded once, for every attempt), its headers and its size."""
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode()
            headers = self._headers("application/json")
        else:
            content_type = "application/json" if path.startswith("/v1/call/") else wire.CONTENT_TYPE
            headers = self._headers(content_type if body is not None else None)
        if extra_headers:
            headers.update(extra_headers)
        size = 0 if body is None else len(body) if not isinstance(body, list) else wire.parts_size(body)
        if isinstance(body, list):
            headers["Content-Length"] = str(size)
        return body, headers, size

    async def _attempt(self, runtime: _Runtime, session: aiohttp.ClientSession, request: _Attempt) -> Any:
        """One try of a request: its answer (JSON, or a bytearray for `binary_response`), else
        `AnsweredError` carrying the error a worker's error status means."""
        loop = asyncio.get_running_loop()
        node, deadline = request.node, request.deadline
        remaining = None if deadline is None else deadline - loop.time()
        async with runtime.slot(node, request.waits, remaining):
            remaining = None if deadline is None else deadline - loop.time()  # after the slot
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            if request.binary_response and isinstance(request.body, bytes):
                # Data fetches: the body lands in its final buffer (see `http_recv`).
                async with asyncio.timeout(remaining):
                    status, raw = await self._fetch_into_buffer(
                        node, request.method, request.path, request.headers, request.body
                    )
                self._traffic.bytes_received += len(raw)
                if status < 400:
                    return raw
                raise AnsweredError(_error_from_response(node, status, bytes(raw)))
            connect = self.connect_timeout if remaining is None else min(self.connect_timeout, remaining)
            client_timeout = aiohttp.ClientTimeout(total=remaining, sock_connect=connect)
            body = request.body
            data = _send_slices(body) if isinstance(body, list) else body
            async with session.request(
                request.method, f"http://{node}{request.path}", data=data, headers=request.headers,
                timeout=client_timeout,
            ) as response:
                if response.status < 400:
                    if request.binary_response:
                        payload = await _read_into_bytearray(response)
                        self._traffic.bytes_received += len(payload)
                        return payload
                    reply = await response.read()
                    self._traffic.bytes_received += len(reply)
                    return _json_reply(node, f"{request.method} {request.path}", response, reply)
                raw = await response.read()
                self._traffic.bytes_received += len(raw)
                raise AnsweredError(_error_from_response(node, response.status, raw))

    async def _fetch_into_buffer(
        self, node: str, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, Any]:
        host, _, port = node.rpartition(":")
        host = host[1:-1] if host.startswith("[") else host
        connect = asyncio.timeout(self.connect_timeout)
        status, _, payload = await http_recv.request_into_buffer(
            host, int(port), method, path, headers, body, MAX_RESPONSE_BYTES, connect, self._recv_pool.take
        )
        return status, payload

    # ------------------------------------------------------------------ engine calls

    async def _call(self, node: str, method: str, body: bytes, timeout: float | None, call_id: str) -> Any:
        return await self._request(
            node,
            "POST",
            f"/v1/call/{method}",
            body=body,
            json_body=None,
            timeout=timeout,
            idempotent=False,
            waits=True,
            extra_headers={CALL_ID_HEADER: call_id},
        )

    def _probe_session(self, runtime: _Runtime) -> aiohttp.ClientSession:
        if runtime.probe_session is None:
            runtime.probe_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                auto_decompress=False,
                trust_env=False,
            )
        return runtime.probe_session

    async def _probe(self, runtime: _Runtime, node: str, timeout: float) -> bool:
        """One `GET /health` on the probe session, never retried: did the worker answer at all?"""
        try:
            async with self._probe_session(runtime).get(
                f"http://{node}/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                await response.read()
                return True
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _watch(self, runtime: _Runtime, node: str, method: str, liveness_timeout: float) -> None:
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

    async def _abandon(self, runtime: _Runtime, node: str, call_ids: list[str]) -> None:
        """Tell `node` to drop these calls' results; best effort (a dead worker holds none)."""
        with contextlib.suppress(Exception):
            await self._request(
                node,
                "POST",
                "/v1/calls/abandon",
                json_body={"call_ids": call_ids},
                timeout=_ABANDON_TIMEOUT,
                runtime=runtime,
            )

    async def _settle(
        self,
        runtime: _Runtime,
        calls: Sequence[tuple[str, str, bytes]],
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

    async def _call_many(
        self,
        calls: Sequence[tuple[str, str, bytes]],
        timeout: float | None,
        liveness_timeout: float | None,
    ) -> list[Any]:
        runtime = self._get_runtime()
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
                    watch = self._watch(runtime, node, method, liveness_timeout)
                    watched[node] = asyncio.ensure_future(watch)
        watchers = list(watched.values())
        try:
            error = await _first_failure(tasks, node_of, watched)
        finally:
            # Also when our caller gave up (cancelled, interrupted): the calls still running are
            # abandoned, so their workers store nothing nobody holds a handle to.
            notices = await self._settle(runtime, calls, call_ids, tasks, watchers)
        if error is None:
            return [t.result() for t in tasks]
        if notices:
            await asyncio.wait(notices, timeout=_ABANDON_WAIT)
        error.partial_results = [  # type: ignore[attr-defined]
            t.result() if not t.cancelled() and t.exception() is None else None for t in tasks
        ]
        raise error

    def _call_many_verb(
        self,
        calls: Sequence[tuple[str, str, bytes]],
        timeout: float | None = None,
        *,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
    ) -> Coroutine[Any, Any, list[Any]]:
        """Run encoded engine calls `(node, method, body)` concurrently; replies in order.

        The first failure is raised as soon as it happens (a dead worker does not wait for
        the other workers' calls). The raised error's `partial_results` holds, in call order,
        the reply of every call that completed (None for the others): the caller owns what
        those stored. The calls still running are abandoned: each worker is told (best effort)
        to drop their results. `timeout`: a deadline per call (None: none). Until its own calls
        end, each worker's `/health` is probed; one that has not answered for `liveness_timeout`
        seconds fails the call with `WorkerUnavailableError` (None: no probes).
        """
        checked = [(validate_node(n), m, b) for n, m, b in calls]
        return self._call_many(checked, timeout, check_liveness_timeout(liveness_timeout))

    call_many = blocking(_call_many_verb)
    acall_many = awaiting(_call_many_verb)

    def _call_raw_verb(
        self,
        node: str,
        method: str,
        body: bytes,
        timeout: float | None = None,
        *,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
    ) -> Coroutine[Any, Any, Any]:
        """POST an encoded engine call (see `distbatch.calls`) and return the decoded JSON reply."""
        calls = self._call_many_verb([(node, method, body)], timeout, liveness_timeout=liveness_timeout)
        return first_result(calls)

    call_raw = blocking(_call_raw_verb)
    acall_raw = awaiting(_call_raw_verb)

    # ------------------------------------------------------------------ put

    def _split_bundle(self, bundle: wire.Bundle, by_bytes: bool = True) -> list[wire.Bundle]:
        """Cut a bundle into bundles of consecutive tasks, each under the request bounds (the
        task bound only, with `by_bytes` False: a same-host put has no body to bound)."""
        n = len(bundle.task_ids)
        if n <= 1:
            return [bundle]
        if by_bytes:
            per_task = np.zeros(n, dtype=np.int64)
            for column in bundle.columns.values():
                if column.rows is None:
                    per_task += column.row_nbytes()
                else:
                    np.add.at(per_task, column.rows, column.row_nbytes())
            cuts = cut_points(per_task, self.max_bytes_per_request, self.max_keys_per_request)
        else:
            cuts = [*range(0, n, self.max_keys_per_request), n]
        if len(cuts) == 2:
            return [bundle]
        return [_slice_bundle(bundle, a, b) for a, b in zip(cuts, cuts[1:])]

    async def _put_bundles(self, node: str, bundles: list[wire.Bundle]) -> PutResult:
        if len(bundles) == 1:
            reply = await self._request(node, "PUT", "/v1/shards", body=wire.build_bundle(bundles[0]))
            return PutResult(reply["stored"], reply["bytes"])
        # Several requests: stage them, then commit once, so the call stores all
        # or nothing and never touches existing shards before it succeeds. Each part has a
        # name, so a retried request replaces its first attempt instead of adding to it.
        stage = uuid.uuid4().hex
        results = await asyncio.gather(
            *(
                self._request(node, "PUT", f"/v1/shards?stage={stage}&part=p{i}", body=wire.build_bundle(b))
                for i, b in enumerate(bundles)
            ),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self._abort_stage(node, stage)
            raise failures[0]
        return await self._commit_stage(node, stage)

    async def _abort_stage(self, node: str, stage: str) -> None:
        """Drop a staged put's parts; a failure here is ignored: the stage expires on the worker,
        and the failure that made us abort is what matters."""
        with contextlib.suppress(NodeError):
            await self._request(node, "POST", "/v1/shards/abort", json_body={"stage": stage})

    async def _commit_stage(self, node: str, stage: str) -> PutResult:
        """Store every part of a staged put at once."""
        reply = await self._request(node, "POST", "/v1/shards/commit", json_body={"stage": stage})
        return PutResult(reply["stored"], reply["bytes"])

    async def _put(self, node: str, bundle: wire.Bundle) -> PutResult:
        """Store a bundle on `node`: through shared memory when it is on this host, else HTTP."""
        channel = await self._same_host_channel(node)
        if channel is not None:
            try:
                return await self._put_same_host(node, channel, bundle)
            except SameHostFallback as exc:
                self._same_host.fell_back(node, str(exc))
            except (OSError, EOFError, ShmError) as exc:
                self._same_host_failed(node, exc)
        return await self._put_bundles(node, self._split_bundle(bundle))

    def _same_host_failed(self, node: str, exc: BaseException) -> None:
        """A same-host request broke: forget the channel (HTTP carries this request), unless the
        worker simply did not answer within the client's timeout, which HTTP would not mend."""
        self._same_host.forget(node, f"the same-host connection failed: {type(exc).__name__}: {exc}")
        if isinstance(exc, TimeoutError):
            raise WorkerUnavailableError(node, f"no same-host answer within {self.timeout:g} s") from None

    async def _put_same_host(self, node: str, channel: SameHostChannel, bundle: wire.Bundle) -> PutResult:
        """A put handed over as sealed memfds: one request unless the task bound splits it
        (then staged parts, committed over HTTP, as `_put_bundles` does)."""
        bundles = self._split_bundle(bundle, by_bytes=False)
        stage = uuid.uuid4().hex if len(bundles) > 1 else None
        try:
            answers = []
            for i, part in enumerate(bundles):
                parts = wire.build_bundle(part)
                answers.append(
                    await self._same_host_call(node, self._same_host.put, channel, parts, stage, f"p{i}")
                )
                self._traffic.same_host_sent += wire.parts_size(parts)
        except BaseException:
            if stage is not None:
                await self._abort_stage(node, stage)
            raise
        if stage is None:
            return PutResult(answers[0]["stored"], answers[0]["bytes"])
        return await self._commit_stage(node, stage)

    def _put_verb(self, node: str, shards: Mapping[Any, Any]) -> Coroutine[Any, Any, PutResult]:
        """Store `{(task_id, field): tensor | JSON value}` on `node`; all or nothing."""
        return self._put(validate_node(node), wire.bundle_from_shards(shards))

    put = blocking(_put_verb)
    aput = awaiting(_put_verb)

    def _put_bundle_verb(self, node: str, bundle: wire.Bundle) -> Coroutine[Any, Any, PutResult]:
        """Store a bundle (task ids plus one column per field) on `node`; all or nothing.

        The columnar path: no object per shard. Bundles over the request bounds travel as
        several requests of consecutive tasks, staged and committed at once.
        """
        return self._put(validate_node(node), bundle)

    put_bundle = blocking(_put_bundle_verb)
    aput_bundle = awaiting(_put_bundle_verb)

    # ------------------------------------------------------------------ same host

    async def _same_host_channel(self, node: str) -> SameHostChannel | None:
        """The shared-memory channel to `node` if it is on this host, deciding once per node
        (a `GET /v1/shm` and a Unix-socket handshake); None means HTTP. A worker that does not
        answer is not decided about: the HTTP request that follows reports it."""
        decided = self._same_host.decided(node)
        if decided is None:
            runtime = self._get_runtime()
            lock = runtime.handshakes.setdefault(node, asyncio.Lock())
            async with lock:
                decided = self._same_host.decided(node)
                if decided is None:
                    try:
                        info = await self._request(node, "GET", "/v1/shm")
                    except RequestError as exc:
                        if exc.status != 404:
                            return None
                        info = None
                    except NodeError:
                        return None
                    decided = await asyncio.to_thread(self._same_host.open, node, info)
        return decided if isinstance(decided, SameHostChannel) else None

    async def _same_host_call(self, node: str, method: Callable[..., T], *args: Any) -> T:
        """Run a blocking same-host request in a thread under the node's connection slot; an
        error answer becomes the `NodeError` HTTP would have raised."""
        runtime = self._get_runtime()
        entered = False
        try:
            async with runtime.slot(node, False, self.timeout):
                entered = True
                self._traffic.same_host_requests += 1
                return await asyncio.to_thread(method, *args)
        except SameHostAnswerError as exc:
            raise _error_from_response(node, exc.status, exc.body) from None
        except TimeoutError:
            if entered:
                raise  # the socket's own timeout: the caller falls back to HTTP
            raise WorkerUnavailableError(
                node, "no connection slot freed within the client's timeout"
            ) from None

    # ------------------------------------------------------------------ fetch

    async def _fetch_product(
        self,
        node: str,
        task_ids: list[str],
        fields: list[str],
        progress: Callable[[int], None] | None = None,
    ) -> wire.Bundle:
        """One product from `node` in one request, or in parts if the response would be too large.

        A worker refuses (413 `response_too_large`) a response over its
        `--max-response-bytes`; the tasks are then split into parts that should fit
        (halves at least) and fetched concurrently, recursively; a single task's fields
        over the limit raise `RequestError`.
        """
        try:
            bundle = await self._fetch_same_host(node, task_ids, fields)
            if bundle is None:
                body = await self._request(
                    node,
                    "POST",
                    "/v1/shards/fetch",
                    json_body={"task_ids": task_ids, "fields": fields},
                    binary_response=True,
                )
        except RequestError as exc:
            if exc.status != 413 or exc.code != "response_too_large":
                raise
            return await self._fetch_product_split(node, task_ids, fields, exc, progress)
        if bundle is None:
            if progress is not None:
                progress(len(body))
            try:
                bundle = wire.parse_bundle(body)
            except WireFormatError as exc:
                raise WireFormatError(f"{node}: bad response container: {exc}") from None
        else:
            received = sum(c.nbytes for c in bundle.columns.values())
            self._traffic.same_host_received += received
            if progress is not None:
                progress(received)
        if bundle.task_ids != task_ids or {wire.column_field(k) for k in bundle.columns} != set(fields):
            raise WireFormatError(f"{node}: response does not hold the shards asked for")
        return bundle

    async def _fetch_same_host(self, node: str, task_ids: list[str], fields: list[str]) -> wire.Bundle | None:
        """The product through shared memory, or None when it must go over HTTP."""
        channel = await self._same_host_channel(node)
        if channel is None:
            return None
        try:
            bundle = await self._same_host_call(node, self._same_host.fetch, channel, task_ids, fields)
        except SameHostFallback as exc:
            self._same_host.fell_back(node, str(exc))
            return None
        except WireFormatError as exc:
            raise WireFormatError(f"{node}: bad same-host answer: {exc}") from None
        except (OSError, EOFError, ShmError) as exc:
            self._same_host_failed(node, exc)
            return None
        return bundle  # its bytes are counted by `_fetch_product`

    async def _fetch_product_split(
        self,
        node: str,
        task_ids: list[str],
        fields: list[str],
        refused: RequestError,
        progress: Callable[[int], None] | None,
    ) -> wire.Bundle:
        limit, size = refused.payload.get("limit"), refused.payload.get("bytes")
        if len(task_ids) == 1:
            raise RequestError(
                node,
                413,
                refused.code,
                (
                    f"shard {task_ids[0]}/{fields[0]} alone is"
                    if len(fields) == 1
                    else f"task {task_ids[0]}'s fields {fields} together are"
                )
                + " over the worker's response limit"
                f" ({limit if limit is not None else 'unknown'} bytes); raise its --max-response-bytes",
                refused.payload,
            ) from None
        # Aim each part at half the limit (sizes vary and the header adds a little), so one
        # refusal usually costs one round of parts, not a cascade of halvings; halves at least.
        parts = 2
        if type(limit) is int and type(size) is int and limit > 1:
            parts = max(2, -(-size // (limit // 2)))
        parts = min(parts, len(task_ids))
        bounds = [i * len(task_ids) // parts for i in range(parts + 1)]
        results = await asyncio.gather(
            *(self._fetch_product(node, task_ids[a:b], fields, progress) for a, b in zip(bounds, bounds[1:])),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise _merge_errors(errors)
        return wire.concat_bundles(results)  # type: ignore[arg-type]

    async def _fetch_products(
        self,
        requests: Sequence[tuple[str, list[str], list[str]]],
        progress: Callable[[int], None] | None = None,
    ) -> list[wire.Bundle]:
        results = await asyncio.gather(
            *(self._fetch_product(node, ids, fields, progress) for node, ids, fields in requests),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise _merge_errors(errors)
        return results  # type: ignore[return-value]

    def _check_products(
        self, requests: Iterable[tuple[str, Sequence[str], Sequence[str]]]
    ) -> list[tuple[str, list[str], list[str]]]:
        return [
            (
                validate_node(node),
                wire.validate_id_list(list(ids)),
                wire.validate_id_list(list(fields), "field"),
            )
            for node, ids, fields in requests
        ]

    def _fetch_products_verb(
        self,
        requests: Iterable[tuple[str, Sequence[str], Sequence[str]]],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> Coroutine[Any, Any, list[wire.Bundle]]:
        """Fetch `(node, task_ids, fields)` products concurrently; one bundle per request, in order.

        The columnar path: each response is one buffer, and each field in it one entry
        (decode with `wire.decode_column` / `wire.column_tensor`). `ShardNotFoundError`
        names every missing key. `progress(nbytes)` is called as each response lands.
        """
        checked = self._check_products(requests)
        if not checked:
            return done([])
        return self._fetch_products(checked, progress)

    fetch_products = blocking(_fetch_products_verb)
    afetch_products = awaiting(_fetch_products_verb)

    def _plan_fetch(
        self, refs: Iterable[Any]
    ) -> tuple[list[tuple[str, ShardKey]], dict[str, dict[ShardKey, int]]]:
        order: list[tuple[str, ShardKey]] = []
        per_node: dict[str, dict[ShardKey, int]] = defaultdict(dict)
        nodes: dict[str, str] = {}  # validate each distinct node once, not once per shard
        for ref in refs:
            if type(ref) is not ShardRef:
                ref = ShardRef(*ref)
            node = nodes.get(ref.node) if isinstance(ref.node, str) else None
            if node is None:
                node = nodes[ref.node] = validate_node(ref.node)
            key = validate_key((ref.task_id, ref.field))
            order.append((node, key))
            per_node[node][key] = ref.nbytes or 0
        return order, dict(per_node)

    async def _fetch_keys(
        self, node: str, sizes: dict[ShardKey, int], progress: Callable[[int], None] | None = None
    ) -> dict[ShardKey, Any]:
        """Explicit keys from `node`, as a product per field set, split to the request bounds
        (by bytes too when the refs said how big their shards are)."""
        fields_of: dict[str, list[str]] = {}
        for task_id, field in sizes:
            fields_of.setdefault(task_id, []).append(field)
        by_fields: dict[tuple[str, ...], list[str]] = {}
        for task_id, task_fields in fields_of.items():
            by_fields.setdefault(tuple(dict.fromkeys(task_fields)), []).append(task_id)
        requests = []
        for fields, task_ids in by_fields.items():
            per_task = np.asarray(
                [sum(sizes[ShardKey(t, f)] for f in fields) for t in task_ids], dtype=np.int64
            )
            max_tasks = max(1, self.max_keys_per_request // len(fields))
            cuts = cut_points(per_task, self.max_bytes_per_request, max_tasks)
            requests += [(node, task_ids[a:b], list(fields)) for a, b in zip(cuts, cuts[1:])]
        out: dict[ShardKey, Any] = {}
        for bundle in await self._fetch_products(requests, progress):
            out.update(wire.bundle_to_shards(bundle))
        return out

    async def _fetch(
        self,
        order: list[tuple[str, ShardKey]],
        per_node: dict[str, dict[ShardKey, int]],
        progress: Callable[[int], None] | None = None,
    ) -> list[Any]:
        nodes = list(per_node)
        results = await asyncio.gather(
            *(self._fetch_keys(node, per_node[node], progress) for node in nodes), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise _merge_errors(errors)
        found = dict(zip(nodes, results))
        return [found[node][key] for node, key in order]  # type: ignore[index]

    def _fetch_verb(
        self, refs: Iterable[ShardRef | tuple], *, progress: Callable[[int], None] | None = None
    ) -> Coroutine[Any, Any, list[Any]]:
        """Gather single shards, given as `(node, task_id, field[, nbytes])`, in the order asked.

        The per-shard API (one value per shard); batches gather columns with
        `fetch_products`. Nodes are fetched concurrently. Raises `ShardNotFoundError`
        naming every missing key. `progress(nbytes)` is called (on the client's thread) as each
        response lands.
        """
        order, per_node = self._plan_fetch(refs)
        if not order:
            return done([])
        return self._fetch(order, per_node, progress)

    fetch = blocking(_fetch_verb)
    afetch = awaiting(_fetch_verb)

    # ------------------------------------------------------------------ delete

    async def _delete(
        self,
        node: str,
        *,
        task_ids: Sequence[str] | None = None,
        keys: Sequence[ShardKey] | None = None,
        fields: Sequence[str] | None = None,
    ) -> DeleteResult:
        if (task_ids is None) == (keys is None):
            raise ValueError("give exactly one of task_ids or keys")
        if task_ids is not None:
            step = self.max_keys_per_request  # a task count: the worker deletes a product at once
            bodies: list[dict[str, Any]] = [
                {
                    "task_ids": list(task_ids[i : i + step]),
                    **({"fields": list(fields)} if fields is not None else {}),
                }
                for i in range(0, len(task_ids), step)
            ]
        else:
            items = list(keys or ())
            step = self.max_keys_per_request
            bodies = [{"keys": items[i : i + step]} for i in range(0, len(items), step)]
        total = DeleteResult(0, 0)
        for body in bodies:
            reply = await self._request(node, "POST", "/v1/shards/delete", json_body=body)
            total += DeleteResult(reply["deleted"], reply["bytes_freed"])
        return total

    def _check_delete_args(
        self, task_ids: Iterable[str] | None, keys: Iterable[Any] | None, fields: Iterable[str] | None
    ) -> tuple[list[str] | None, list[ShardKey] | None, list[str] | None]:
        if (task_ids is None) == (keys is None):
            raise ValueError("give exactly one of task_ids or keys")
        if fields is not None and task_ids is None:
            raise ValueError("fields goes with task_ids")
        for name, ids in (("task_ids", task_ids), ("fields", fields)):
            if isinstance(ids, str):
                raise InvalidIdError(f"{name} must be a list of ids, not one string")
        checked_fields = None if fields is None else [validate_id(f, "field") for f in fields]
        if task_ids is not None:
            return [validate_id(t, "task_id") for t in task_ids], None, checked_fields
        return None, [validate_key(k) for k in keys or ()], None

    def _delete_verb(
        self,
        node: str,
        *,
        task_ids: Iterable[str] | None = None,
        keys: Iterable[Any] | None = None,
        fields: Iterable[str] | None = None,
    ) -> Coroutine[Any, Any, DeleteResult]:
        """Delete on `node`: all fields of `task_ids` (only `fields` of them, if given), or `keys`.

        Idempotent: deleting what is not there counts zero.
        """
        node = validate_node(node)
        task_ids, keys, fields = self._check_delete_args(task_ids, keys, fields)
        return self._delete(node, task_ids=task_ids, keys=keys, fields=fields)

    delete = blocking(_delete_verb)
    adelete = awaiting(_delete_verb)

    async def _delete_keys_compact(self, node: str, keys: list[ShardKey]) -> DeleteResult:
        """Delete exactly `keys`, sent as (task ids x fields) products: far smaller than key pairs."""
        fields_of: dict[str, list[str]] = {}
        for task_id, field in keys:
            fields_of.setdefault(task_id, []).append(field)
        groups: dict[tuple[str, ...], list[str]] = {}
        for task_id, task_fields in fields_of.items():
            groups.setdefault(tuple(sorted(set(task_fields))), []).append(task_id)
        total = DeleteResult(0, 0)
        for fields, task_ids in groups.items():
            total += await self._delete(node, task_ids=task_ids, fields=fields)
        return total

    async def _delete_many(self, keys_by_node: dict[str, list[ShardKey]]) -> DeleteResult:
        """`_delete_each`, summed; a node's failure is raised (all missing keys merged)."""
        total = DeleteResult(0, 0)
        errors: list[BaseException] = []
        for outcome in (await self._delete_each(keys_by_node)).values():
            if isinstance(outcome, DeleteResult):
                total += outcome
            else:
                errors.append(outcome)
        if errors:
            raise _merge_errors(errors)
        return total

    def _delete_many_verb(
        self, keys_by_node: Mapping[str, Iterable[Any]]
    ) -> Coroutine[Any, Any, DeleteResult]:
        """Delete exactly the given keys on several nodes concurrently; returns the summed result."""
        plan = {validate_node(n): [validate_key(k) for k in ks] for n, ks in keys_by_node.items()}
        return self._delete_many(plan)

    delete_many = blocking(_delete_many_verb)
    adelete_many = awaiting(_delete_many_verb)

    async def _delete_each(
        self, keys_by_node: dict[str, list[ShardKey]]
    ) -> dict[str, DeleteResult | NodeError]:
        return await _each_node(
            {node: self._delete_keys_compact(node, keys) for node, keys in keys_by_node.items()}
        )

    def delete_each(self, keys_by_node: Mapping[str, Iterable[Any]]) -> dict[str, DeleteResult | NodeError]:
        """Like `delete_many`, but reports each node's outcome instead of raising the first error.

        For cleanup that must say which nodes could not be cleared (a worker
        that is down) while still clearing the others.
        """
        plan = {validate_node(n): [validate_key(k) for k in ks] for n, ks in keys_by_node.items()}
        return self.run(self._delete_each(plan))

    async def _delete_products(self, node: str, products: list[tuple[list[str], list[str]]]) -> DeleteResult:
        total = DeleteResult(0, 0)
        for task_ids, fields in products:
            total += await self._delete(node, task_ids=task_ids, fields=fields)
        return total

    async def _delete_products_each(
        self, plan: dict[str, list[tuple[list[str], list[str]]]]
    ) -> dict[str, DeleteResult | NodeError]:
        return await _each_node(
            {node: self._delete_products(node, products) for node, products in plan.items()}
        )

    def _check_product_plan(
        self, plan: Mapping[str, Iterable[tuple[Sequence[str], Sequence[str]]]]
    ) -> dict[str, list[tuple[list[str], list[str]]]]:
        return {
            validate_node(node): [
                (wire.validate_id_list(list(ids)), wire.validate_id_list(list(fields), "field"))
                for ids, fields in products
            ]
            for node, products in plan.items()
        }

    def _delete_products_each_verb(
        self, plan: Mapping[str, Iterable[tuple[Sequence[str], Sequence[str]]]]
    ) -> Coroutine[Any, Any, dict[str, DeleteResult | NodeError]]:
        """Delete `(task_ids, fields)` products per node, nodes concurrently; each node's outcome.

        The columnar delete: a request names tasks and fields, never one key per shard.
        """
        return self._delete_products_each(self._check_product_plan(plan))

    delete_products_each = blocking(_delete_products_each_verb)
    adelete_products_each = awaiting(_delete_products_each_verb)

    # ------------------------------------------------------------------ plain JSON requests

    def request_json(
        self,
        node: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None | object = ...,
        idempotent: bool = True,
        waits: bool = False,
    ) -> Any:
        """A JSON request to any distbatch HTTP service (worker or controller), with this
        client's session, token, retries and error mapping.

        `waits=True` for a request the server may hold open (a long poll): it takes a connection
        slot of the waiting budget, so waiters never hold up puts and fetches to the same node.
        """
        if not path.startswith("/"):
            raise ValueError("path must start with '/'")
        return self.run(
            self._request(
                validate_node(node),
                method,
                path,
                json_body=body,
                timeout=timeout,
                idempotent=idempotent,
                waits=waits,
            )
        )

    # ------------------------------------------------------------------ info

    def list_tasks(self, node: str, after: str | None = None, limit: int = 1000) -> dict[str, Any]:
        """One page of the tasks `node` holds, in id order after `after`: `{"tasks": [[task_id,
        [fields]], ...], "next": the id to pass as `after` for the next page (None at the end),
        "total": tasks held}`."""
        query = f"?limit={int(limit)}" + ("" if after is None else f"&after={validate_id(after, 'after')}")
        return self.request_json(validate_node(node), "GET", f"/v1/tasks{query}")

    def _stats_verb(self, node: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """The node's store statistics (shards, tasks, bytes, capacity, free)."""
        return self._request(validate_node(node), "GET", "/v1/stats")

    stats = blocking(_stats_verb)
    astats = awaiting(_stats_verb)

    def _health_verb(self, node: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """The node's `/health` answer; `WorkerUnavailableError` if it does not answer."""
        return self._request(validate_node(node), "GET", "/health")

    health = blocking(_health_verb)
    ahealth = awaiting(_health_verb)

def check_liveness_timeout(value: float | None) -> float | None:
    """A liveness timeout: None (no probes) or a positive number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"liveness_timeout must be a positive number of seconds or None, got {value!r}")
    return float(value)


async def _read_into_bytearray(response: aiohttp.ClientResponse) -> bytearray:
    """Read the body into one writable buffer, so tensors can be decoded without a copy."""
    size = response.content_length
    if size is None:
        return bytearray(await response.read())
    buffer = bytearray(size)
    view = memoryview(buffer)
    position = 0
    async for chunk in response.content.iter_any():
        end = position + len(chunk)
        if end > size:
            raise aiohttp.ClientPayloadError("response longer than its Content-Length")
        view[position:end] = chunk
        position = end
    if position != size:
        raise aiohttp.ClientPayloadError(f"response ended after {position} of {size} bytes")
    return buffer


def _json_reply(node: str, request: str, response: aiohttp.ClientResponse, body: bytes) -> Any:
    """A success reply's JSON; a body that is not JSON means the peer is not a distbatch worker."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        kind = response.headers.get("Content-Type") or "no Content-Type"
        raise ProtocolError(
            node,
            f"{request} answered HTTP {response.status} with a body that is not JSON "
            f"({kind}, {len(body)} bytes: {bytes(body[:60])!r}); is this address a distbatch worker?",
        ) from None


def _error_from_response(node: str, status: int, body: bytes) -> NodeError:
    try:
        payload = json.loads(body)
        code, message = str(payload.get("error", "error")), str(payload.get("message", ""))
    except (ValueError, AttributeError):
        payload, code, message = {}, "error", body[:200].decode(errors="replace")
    if status == 401:
        return AuthError(node, message or "unauthorized")
    if status == 507:
        return CapacityError(node, message)
    if status == 404 and isinstance(payload.get("missing"), list):
        return ShardNotFoundError(node, [tuple(k) for k in payload["missing"]])
    if code == "engine_error":
        return EngineError(
            node, str(payload.get("exception", "Exception")), message, str(payload.get("traceback", ""))
        )
    if status >= 500:
        return ServerError(node, status, code, message)
    return RequestError(node, status, code, message, payload if isinstance(payload, dict) else {})


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


def _merge_errors(errors: list[BaseException]) -> BaseException:
    """One error for several failed requests: all missing keys together, else the first."""
    not_found = [e for e in errors if isinstance(e, ShardNotFoundError)]
    others = [e for e in errors if not isinstance(e, ShardNotFoundError)]
    if others:
        return others[0]
    if len(not_found) == 1:
        return not_found[0]
    nodes = sorted({e.node for e in not_found})
    merged = ShardNotFoundError(", ".join(nodes), [k for e in not_found for k in e.keys])
    merged.missing_by_node = {n: [k for e in not_found if e.node == n for k in e.keys] for n in nodes}
    return merged


class _DefaultClientHolder:
    """The per-process client that batches use unless given one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: ShardClient | None = None

    def get(self) -> ShardClient:
        with self._lock:
            if self._client is None:
                self._client = ShardClient()
            return self._client

    def set(self, client: ShardClient | None) -> None:
        with self._lock:
            self._client = client


_default_holder = _DefaultClientHolder()


def default_client() -> ShardClient:
    """The process-wide `ShardClient` batches use (created on first use, fork-safe)."""
    return _default_holder.get()


def set_default_client(client: ShardClient | None) -> None:
    """Replace the process-wide client (e.g. one with a token or other limits); None resets."""
    _default_holder.set(client)


def cut_points(per_task: np.ndarray, max_bytes: int, max_tasks: int) -> list[int]:
    """Task indexes cutting `per_task` bytes into runs under `max_bytes` and `max_tasks` each
    (a task over `max_bytes` alone gets a run of its own); first 0, last len(per_task)."""
    n = len(per_task)
    cuts = [0]
    totals = np.cumsum(per_task)
    while cuts[-1] < n:
        start = cuts[-1]
        base = int(totals[start - 1]) if start else 0
        end = int(np.searchsorted(totals, base + max_bytes, side="right"))
        cuts.append(min(max(end, start + 1), start + max_tasks, n))
    return cuts


def _slice_bundle(bundle: wire.Bundle, start: int, stop: int) -> wire.Bundle:
    """Tasks `start:stop` of a bundle (byte views, no copies)."""
    columns: dict[str, wire.RawColumn] = {}
    for name, column in bundle.columns.items():
        if column.rows is None:
            lo, hi, rows = start, stop, None
        else:
            lo, hi = (int(i) for i in np.searchsorted(column.rows, [start, stop]))
            if not np.all(np.diff(column.rows) > 0):
                raise ValueError("a partial column's rows must be ascending to be split")
            rows = column.rows[lo:hi] - start
        if hi == lo:
            continue
        columns[name] = wire.slice_column(column, lo, hi, rows)
    return wire.Bundle(bundle.task_ids[start:stop], columns)


SEND_SLICE_BYTES = 4 << 20


async def _send_slices(parts: list[wire.Buffer]) -> AsyncIterator[memoryview]:
    """A body's parts in slices of a few MiB, sent as they are (never joined).

    aiohttp waits for the socket to drain after each slice; handing it one big buffer
    instead makes asyncio's transport copy its unsent tail again and again.
    """
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, view.nbytes, SEND_SLICE_BYTES):
            yield view[start : start + SEND_SLICE_BYTES]


MAX_RESPONSE_BYTES = 1 << 40  # a response announcing more than this is refused before allocating


async def _each_node(
    deletes: dict[str, Coroutine[Any, Any, DeleteResult]],
) -> dict[str, DeleteResult | NodeError]:
    """Run one delete per node concurrently; each node's result or `NodeError`, by node."""
    nodes = list(deletes)
    results = await asyncio.gather(*deletes.values(), return_exceptions=True)
    out: dict[str, DeleteResult | NodeError] = {}
    for node, result in zip(nodes, results):
        if isinstance(result, (NodeError, DeleteResult)):
            out[node] = result
        else:
            raise result  # not a node's answer: a bug or a cancellation
    return out
