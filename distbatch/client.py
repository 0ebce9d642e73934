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
import json
import os
import random
import re
import threading
import uuid
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import aiohttp

from distbatch import wire
from distbatch.auth import token_from_env
from distbatch.errors import (
    AuthError,
    CapacityError,
    EngineError,
    InvalidIdError,
    NodeError,
    RequestError,
    ServerError,
    ShardNotFoundError,
    WireFormatError,
    WorkerUnavailableError,
)
from distbatch.ids import ShardKey, validate_id, validate_key

T = TypeVar("T")

_CLOSED_IN_FLIGHT = "ShardClient was closed while this call was in flight"

_NODE_PATTERN = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}")


def validate_node(node: Any) -> str:
    """Return `node` as `host:port` (an `http://` prefix is dropped) or raise `ValueError`."""
    if isinstance(node, str) and node.startswith("http://"):
        node = node[len("http://") :].rstrip("/")
    if not isinstance(node, str) or _NODE_PATTERN.fullmatch(node) is None:
        raise ValueError(f"invalid node address {node!r}: expected 'host:port'")
    return node


class ShardRef(NamedTuple):
    """Where one shard lives; `nbytes` (if known) lets the client bound response sizes."""

    node: str
    task_id: str
    field: str
    nbytes: int | None = None


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


class _LoopThread:
    """An event loop running on a daemon thread, owned by one client in one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="distbatch-client", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(
                "sync ShardClient methods cannot run on the client's own loop; await the a* variant"
            )
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.CancelledError:
                raise RuntimeError(_CLOSED_IN_FLIGHT) from None
            except TimeoutError:
                if future.done():
                    raise  # the call itself raised TimeoutError
                if not self.thread.is_alive():  # the loop stopped under us: never wait forever
                    future.cancel()
                    raise RuntimeError(_CLOSED_IN_FLIGHT) from None

    async def _shutdown(self, session: aiohttp.ClientSession | None) -> None:
        # Cancel calls still in flight so that whoever waits on them is released.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if session is not None:
            await session.close()

    def stop(self, session: aiohttp.ClientSession | None) -> None:
        if not self.loop.is_closed() and self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(session), self.loop).result(timeout=5)
            except TimeoutError:
                pass  # stop the loop regardless; waiters notice the thread is gone
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class Traffic:
    """HTTP body bytes and requests this client moved (its view of the network)."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def total(self) -> int:
        return self.bytes_sent + self.bytes_received

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.requests - other.requests,
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
        )


class _Runtime:
    """The loop thread, the one session living on it and the connection slots; replaced after a fork.

    Data requests (puts, fetches, deletes, stats) take a slot of their node and one of the
    total; requests the server may hold open (engine calls, long-polling `get_meta`) take
    a slot of their own budget instead, so a crowd of waiters never takes the connections a
    put or a fetch needs, and a long training step never holds up data to its worker.
    """

    def __init__(self, max_connections: int, max_connections_per_node: int) -> None:
        self.loop_thread = _LoopThread()
        self.session: aiohttp.ClientSession | None = None
        self.max_connections_per_node = max_connections_per_node
        self.data_slots = asyncio.Semaphore(max_connections)
        self.waiting_slots = asyncio.Semaphore(max_connections)
        self.node_slots: dict[str, asyncio.Semaphore] = {}

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
            self.loop_thread.stop(self.session)


class ShardClient:
    """Puts, gathers and deletes shards on worker nodes over HTTP.

    Args:
        token: bearer token; defaults to `DISTBATCH_TOKEN` from the environment.
        timeout: seconds a whole call may take against one node, retries included.
        connect_timeout: seconds to establish one connection.
        max_connections / max_connections_per_node: connection pool bounds.
        max_keys_per_request / max_bytes_per_request: how requests are split.
        retries: extra attempts after a connection error, timeout or 5xx.
        backoff / backoff_max: exponential backoff between attempts, in seconds.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        max_connections: int = 64,
        max_connections_per_node: int = 8,
        max_keys_per_request: int = 8192,
        max_bytes_per_request: int = 64 << 20,
        retries: int = 3,
        backoff: float = 0.05,
        backoff_max: float = 2.0,
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
                runtime = self._runtime = _Runtime(self.max_connections, self.max_connections_per_node)
                self._finalizer = weakref.finalize(self, runtime.close)
            return runtime

    def close(self) -> None:
        """Close the session and stop the loop thread; the client restarts them if used again."""
        with self._runtime_lock:
            if self._finalizer is not None:
                self._finalizer()
            self._runtime = None
            self._finalizer = None

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def traffic(self) -> Traffic:
        """A snapshot of the bytes and requests this client has moved so far."""
        t = self._traffic
        return Traffic(t.requests, t.bytes_sent, t.bytes_received)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._get_runtime().loop_thread.submit(coro)

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
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
            connector = aiohttp.TCPConnector(
                limit=2 * self.max_connections, limit_per_host=0, ttl_dns_cache=300
            )
            runtime.session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=False
            )
        return runtime.session

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
        body: bytes | None = None,
        json_body: Any = None,
        binary_response: bool = False,
        timeout: float | None | object = ...,
        idempotent: bool = True,
        waits: bool = False,
    ) -> Any:
        """One logical request with retries inside one deadline; returns JSON or a bytearray.

        `timeout` overrides the client's (None: no deadline, for long engine
        calls; a dead worker still fails at once because its socket closes).
        A non-idempotent request is retried only when no connection was made.
        `waits`: the server may hold it open, so it takes a slot of the waiting budget, not the node's.
        """
        loop = asyncio.get_running_loop()
        limit = self.timeout if timeout is ... else timeout
        deadline = None if limit is None else loop.time() + float(limit)  # type: ignore[arg-type]
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode()
            headers = self._headers("application/json")
        else:
            content_type = "application/json" if path.startswith("/v1/call/") else wire.CONTENT_TYPE
            headers = self._headers(content_type if body is not None else None)
        url = f"http://{node}{path}"
        runtime = self._get_runtime()
        session = self._session(runtime)
        attempt = 0
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            self._traffic.requests += 1
            self._traffic.bytes_sent += len(body or b"")
            try:
                async with runtime.slot(node, waits, remaining):
                    remaining = None if deadline is None else deadline - loop.time()  # after the slot
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError
                    connect = (
                        self.connect_timeout if remaining is None else min(self.connect_timeout, remaining)
                    )
                    client_timeout = aiohttp.ClientTimeout(total=remaining, sock_connect=connect)
                    async with session.request(
                        method, url, data=body, headers=headers, timeout=client_timeout
                    ) as response:
                        if response.status < 400:
                            payload = (
                                await _read_into_bytearray(response)
                                if binary_response
                                else await response.read()
                            )
                            self._traffic.bytes_received += len(payload)
                            return payload if binary_response else json.loads(payload)
                        raw = await response.read()
                        self._traffic.bytes_received += len(raw)
                        error = _error_from_response(node, response.status, raw)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                error = WorkerUnavailableError(node, f"{method} {path} failed: {reason}")
                if not idempotent and not isinstance(exc, aiohttp.ClientConnectorError):
                    raise error from None
            if not isinstance(error, (WorkerUnavailableError, ServerError)) or (
                not idempotent and isinstance(error, ServerError)
            ):
                raise error
            attempt += 1
            delay = min(self.backoff * 2 ** (attempt - 1), self.backoff_max) * (0.5 + random.random() / 2)
            if attempt > self.retries or (deadline is not None and loop.time() + delay >= deadline):
                raise error
            await asyncio.sleep(delay)

    # ------------------------------------------------------------------ engine calls

    async def _call(self, node: str, method: str, body: bytes, timeout: float | None) -> Any:
        return await self._request(
            node,
            "POST",
            f"/v1/call/{method}",
            body=body,
            json_body=None,
            timeout=timeout,
            idempotent=False,
            waits=True,
        )

    async def _call_many(self, calls: Sequence[tuple[str, str, bytes]], timeout: float | None) -> list[Any]:
        tasks = [
            asyncio.ensure_future(self._call(node, method, body, timeout)) for node, method, body in calls
        ]
        # A worker that dies is reported at once, not after the others' (maybe long) calls end;
        # the other requests are abandoned (their engines finish on their own).
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and t.exception() is not None]
        if failed:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise failed[0].exception()  # type: ignore[misc]
        return [t.result() for t in tasks]

    def call_many(self, calls: Sequence[tuple[str, str, bytes]], timeout: float | None = None) -> list[Any]:
        """Run encoded engine calls `(node, method, body)` concurrently; replies in order.

        The first failure is raised as soon as it happens (a dead worker does not
        wait for the other workers' calls); the other calls are abandoned.
        """
        checked = [(validate_node(n), m, b) for n, m, b in calls]
        return self._run(self._call_many(checked, timeout))

    def call_raw(self, node: str, method: str, body: bytes, timeout: float | None = None) -> Any:
        """POST an encoded engine call (see `distbatch.rpc`) and return the decoded JSON reply."""
        return self._run(self._call(validate_node(node), method, body, timeout))

    async def acall_raw(self, node: str, method: str, body: bytes, timeout: float | None = None) -> Any:
        return await self._on_loop(self._call(validate_node(node), method, body, timeout))

    # ------------------------------------------------------------------ put

    def _encode_put(self, shards: Mapping[Any, Any]) -> list[tuple[list[ShardKey], bytes]]:
        """Validate and encode every shard, split into bounded request bodies."""
        tensors, json_texts = wire.split_values(shards)
        requests: list[tuple[list[ShardKey], bytes]] = []
        batch_t: dict[ShardKey, wire.RawTensor] = {}
        batch_j: dict[ShardKey, str] = {}
        size = 0

        def flush() -> None:
            nonlocal batch_t, batch_j, size
            if batch_t or batch_j:
                body = wire.join_parts(wire.build_container(batch_t, batch_j))
                requests.append(([*batch_t, *batch_j], body))
            batch_t, batch_j, size = {}, {}, 0

        items: list[tuple[ShardKey, wire.RawTensor | str]] = [*tensors.items(), *json_texts.items()]
        for key, value in items:
            nbytes = value.nbytes if isinstance(value, wire.RawTensor) else len(value)
            if (batch_t or batch_j) and (
                len(batch_t) + len(batch_j) >= self.max_keys_per_request
                or size + nbytes > self.max_bytes_per_request
            ):
                flush()
            if isinstance(value, wire.RawTensor):
                batch_t[key] = value
            else:
                batch_j[key] = value
            size += nbytes
        flush()
        return requests

    async def _put_encoded(self, node: str, requests: list[tuple[list[ShardKey], bytes]]) -> PutResult:
        if len(requests) == 1:
            reply = await self._request(node, "PUT", "/v1/shards", body=requests[0][1])
            return PutResult(reply["stored"], reply["bytes"])
        # Several requests: stage them, then commit once, so the call stores all
        # or nothing and never touches existing shards before it succeeds.
        stage = uuid.uuid4().hex
        results = await asyncio.gather(
            *(self._request(node, "PUT", f"/v1/shards?stage={stage}", body=body) for _, body in requests),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            try:
                await self._request(node, "POST", "/v1/shards/abort", json_body={"stage": stage})
            except NodeError:
                pass  # the stage expires on the worker; the original failure is what matters
            raise failures[0]
        reply = await self._request(node, "POST", "/v1/shards/commit", json_body={"stage": stage})
        return PutResult(reply["stored"], reply["bytes"])

    def put(self, node: str, shards: Mapping[Any, Any]) -> PutResult:
        """Store `{(task_id, field): tensor | JSON value}` on `node`; all or nothing."""
        node = validate_node(node)
        requests = self._encode_put(shards)
        return self._run(self._put_encoded(node, requests))

    async def aput(self, node: str, shards: Mapping[Any, Any]) -> PutResult:
        node = validate_node(node)
        requests = self._encode_put(shards)
        return await self._on_loop(self._put_encoded(node, requests))

    # ------------------------------------------------------------------ fetch

    def _plan_fetch(
        self, refs: Iterable[Any]
    ) -> tuple[list[tuple[str, ShardKey]], list[tuple[str, list[ShardKey]]]]:
        order: list[tuple[str, ShardKey]] = []
        per_node: dict[str, dict[ShardKey, int]] = defaultdict(dict)
        nodes: dict[str, str] = {}  # validate each distinct node once, not once per shard
        valid_ids: set[str] = set()  # likewise task ids and fields (a task has several fields)
        for ref in refs:
            if type(ref) is not ShardRef:
                ref = ShardRef(*ref)
            node = nodes.get(ref.node) if isinstance(ref.node, str) else None
            if node is None:
                node = nodes[ref.node] = validate_node(ref.node)
            task_id, field = ref.task_id, ref.field
            if type(task_id) is str and type(field) is str and task_id in valid_ids and field in valid_ids:
                key = ShardKey(task_id, field)
            else:
                key = validate_key((task_id, field))
                valid_ids.add(task_id)
                valid_ids.add(field)
            order.append((node, key))
            per_node[node][key] = ref.nbytes or 0
        requests: list[tuple[str, list[ShardKey]]] = []
        for node, sizes in per_node.items():
            batch: list[ShardKey] = []
            size = 0
            for key, nbytes in sizes.items():
                if batch and (
                    len(batch) >= self.max_keys_per_request or size + nbytes > self.max_bytes_per_request
                ):
                    requests.append((node, batch))
                    batch, size = [], 0
                batch.append(key)
                size += nbytes
            requests.append((node, batch))
        return order, requests

    async def _fetch_one(
        self, node: str, keys: list[ShardKey], progress: Callable[[int], None] | None = None
    ) -> dict[ShardKey, Any]:
        body = await self._request(
            node, "POST", "/v1/shards/fetch", json_body={"keys": keys}, binary_response=True
        )
        if progress is not None:
            progress(len(body))
        try:
            values = wire.decode_bundle(body)
        except WireFormatError as exc:
            raise WireFormatError(f"{node}: bad response container: {exc}") from None
        if len(values) != len(keys) or any(k not in values for k in keys):
            raise WireFormatError(f"{node}: response does not hold the shards asked for")
        return values

    async def _fetch(
        self,
        order: list[tuple[str, ShardKey]],
        requests: list[tuple[str, list[ShardKey]]],
        progress: Callable[[int], None] | None = None,
    ) -> list[Any]:
        results = await asyncio.gather(
            *(self._fetch_one(node, keys, progress) for node, keys in requests), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise _merge_errors(errors)
        found: dict[tuple[str, ShardKey], Any] = {}
        for (node, _), values in zip(requests, results):
            for key, value in values.items():
                found[(node, key)] = value
        return [found[item] for item in order]

    def fetch(
        self, refs: Iterable[ShardRef | tuple], *, progress: Callable[[int], None] | None = None
    ) -> list[Any]:
        """Gather shards, given as `(node, task_id, field[, nbytes])`, in the order asked.

        Keys are grouped per node into bounded requests; nodes are fetched
        concurrently. Raises `ShardNotFoundError` naming every missing key.
        `progress(nbytes)` is called (on the client's thread) as each response lands.
        """
        order, requests = self._plan_fetch(refs)
        if not order:
            return []
        return self._run(self._fetch(order, requests, progress))

    async def afetch(self, refs: Iterable[ShardRef | tuple]) -> list[Any]:
        order, requests = self._plan_fetch(refs)
        if not order:
            return []
        return await self._on_loop(self._fetch(order, requests))

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
            step = max(1, self.max_keys_per_request // max(len(fields or ()), 1))
            bodies: list[dict[str, Any]] = [
                {"task_ids": list(task_ids[i : i + step]), **({"fields": list(fields)} if fields else {})}
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

    def delete(
        self,
        node: str,
        *,
        task_ids: Iterable[str] | None = None,
        keys: Iterable[Any] | None = None,
        fields: Iterable[str] | None = None,
    ) -> DeleteResult:
        """Delete on `node`: all fields of `task_ids` (only `fields` of them, if given), or `keys`.

        Idempotent: deleting what is not there counts zero.
        """
        node = validate_node(node)
        task_ids, keys, fields = self._check_delete_args(task_ids, keys, fields)
        return self._run(self._delete(node, task_ids=task_ids, keys=keys, fields=fields))

    async def adelete(
        self,
        node: str,
        *,
        task_ids: Iterable[str] | None = None,
        keys: Iterable[Any] | None = None,
        fields: Iterable[str] | None = None,
    ) -> DeleteResult:
        node = validate_node(node)
        task_ids, keys, fields = self._check_delete_args(task_ids, keys, fields)
        return await self._on_loop(self._delete(node, task_ids=task_ids, keys=keys, fields=fields))

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
        results = await asyncio.gather(
            *(self._delete_keys_compact(node, keys) for node, keys in keys_by_node.items()),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise _merge_errors(errors)
        total = DeleteResult(0, 0)
        for result in results:
            total += result
        return total

    def delete_many(self, keys_by_node: Mapping[str, Iterable[Any]]) -> DeleteResult:
        """Delete exactly the given keys on several nodes concurrently; returns the summed result."""
        plan = {validate_node(n): [validate_key(k) for k in ks] for n, ks in keys_by_node.items()}
        return self._run(self._delete_many(plan))

    async def adelete_many(self, keys_by_node: Mapping[str, Iterable[Any]]) -> DeleteResult:
        plan = {validate_node(n): [validate_key(k) for k in ks] for n, ks in keys_by_node.items()}
        return await self._on_loop(self._delete_many(plan))

    async def _delete_each(
        self, keys_by_node: dict[str, list[ShardKey]]
    ) -> dict[str, DeleteResult | NodeError]:
        nodes = list(keys_by_node)
        results = await asyncio.gather(
            *(self._delete_keys_compact(node, keys_by_node[node]) for node in nodes), return_exceptions=True
        )
        out: dict[str, DeleteResult | NodeError] = {}
        for node, result in zip(nodes, results):
            if isinstance(result, NodeError) or isinstance(result, DeleteResult):
                out[node] = result
            else:
                raise result  # not a node's answer: a bug or a cancellation
        return out

    def delete_each(self, keys_by_node: Mapping[str, Iterable[Any]]) -> dict[str, DeleteResult | NodeError]:
        """Like `delete_many`, but reports each node's outcome instead of raising the first error.

        For cleanup that must say which nodes could not be cleared (a worker
        that is down) while still clearing the others.
        """
        plan = {validate_node(n): [validate_key(k) for k in ks] for n, ks in keys_by_node.items()}
        return self._run(self._delete_each(plan))

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
        return self._run(
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

    def stats(self, node: str) -> dict[str, Any]:
        """The node's store statistics (shards, tasks, bytes, capacity, free)."""
        return self._run(self._request(validate_node(node), "GET", "/v1/stats"))

    async def astats(self, node: str) -> dict[str, Any]:
        return await self._on_loop(self._request(validate_node(node), "GET", "/v1/stats"))

    def health(self, node: str) -> dict[str, Any]:
        """The node's `/health` answer; `WorkerUnavailableError` if it does not answer."""
        return self._run(self._request(validate_node(node), "GET", "/health"))

    async def ahealth(self, node: str) -> dict[str, Any]:
        return await self._on_loop(self._request(validate_node(node), "GET", "/health"))


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
