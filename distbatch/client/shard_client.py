"""`ShardClient`: the public client that puts, gathers and deletes shards and calls engines.

A facade over the client's parts, each in its own module: the event-loop thread and its
sessions (`loop`), one HTTP request with retries (`transport`), the HTTP and same-host shard
paths (`shard_paths`), gathers (`fetches`), deletes (`deletes`), engine calls
(`engine_calls`) and request planning (`planning`). Each verb is written once: its checks run
in the caller, its work on the client's loop, and `distbatch.twins` makes the sync method and
its `a*` twin from that one body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

import numpy as np

from distbatch import wire
from distbatch.auth import token_from_env
from distbatch.client.deletes import Deleter, Outcomes, check_delete_args
from distbatch.client.engine_calls import DEFAULT_LIVENESS_TIMEOUT, EngineCalls, check_liveness_timeout
from distbatch.client.fetches import Gatherer
from distbatch.client.loop import ProcessRuntime, Runtime
from distbatch.client.planning import Product, ProductRequest, check_product_plan, check_products, plan_refs
from distbatch.client.results import DeleteResult, PutResult, Traffic
from distbatch.client.same_host import SameHostPaths
from distbatch.client.shard_paths import HttpShardPath, SameHostShardPath
from distbatch.client.transport import HttpTransport, RequestPolicy
from distbatch.errors import InvalidArgumentError
from distbatch.ids import ShardRef, validate_id, validate_key, validate_node
from distbatch.transport.recv_pool import RecvPool, default_max_idle_bytes
from distbatch.twins import awaiting, blocking, done, first_result

# A gather or put with no byte moving for this long has stalled (the liveness timeout's default).
DEFAULT_STALL_TIMEOUT = 30.0

T = TypeVar("T")

Progress = Callable[[int], None]


def _make_runtime(
    max_connections: int, max_connections_per_node: int, token: str | None, timeout: float, pool: RecvPool
) -> Runtime:
    # The pool's own method, not the client's: the runtime must not keep the client alive.
    same_host = SameHostPaths(token, timeout, pool.take)
    return Runtime(max_connections, max_connections_per_node, same_host)


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
        recv_pool_bytes: idle receive buffers kept for reuse (see `distbatch.transport.recv_pool`),
            so a gather writes into memory that is already mapped in; default
            `DISTBATCH_RECV_POOL_BYTES` or 256 MiB; 0 turns reuse off.
        same_host: False keeps this client on HTTP even to workers on its host.
        stall_timeout: a gather that receives no byte for this many seconds, or a put whose
            upload the worker acknowledges no byte of (nor answers, once it has all of it), fails
            at once with `WorkerUnavailableError` saying it stalled (a worker stopped, or a link
            that went down without a reset), not retried; progress resets it, so a slow transfer
            is judged by whether it moves, never by how long it takes. A put stalled on the way
            out has its connection reset, so nothing of it reaches the worker if the link comes
            back (one the worker had acknowledged whole but never answered may have been stored:
            its error says so); a put in staged parts stops its other parts and drops the parts
            staged (in the background, within `timeout`; else the worker's `--stage-ttl` does).
            None: only `timeout` bounds them.

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
        same_host: bool = True,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        if min(max_connections, max_connections_per_node, max_keys_per_request, max_bytes_per_request) < 1:
            raise InvalidArgumentError("connection and request limits must be >= 1")
        if timeout <= 0 or connect_timeout <= 0 or retries < 0:
            raise InvalidArgumentError("timeouts must be > 0 and retries >= 0")
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
        self._traffic = Traffic()
        self._runtimes = ProcessRuntime(
            functools.partial(
                _make_runtime, max_connections, max_connections_per_node, self.token, timeout, self._recv_pool
            )
        )
        weakref.finalize(self, self._runtimes.close)  # a client dropped unclosed stops its thread
        if stall_timeout is not None and not stall_timeout > 0:
            raise InvalidArgumentError("stall_timeout must be > 0 or None")
        self.stall_timeout = stall_timeout
        policy = RequestPolicy(
            self.token, timeout, connect_timeout, retries, backoff, backoff_max, stall_timeout
        )
        self._transport = HttpTransport(policy, self._runtimes, self._traffic, self._recv_pool.take)
        http = HttpShardPath(self._transport, max_bytes_per_request, max_keys_per_request)
        self._path: HttpShardPath | SameHostShardPath = SameHostShardPath(http) if same_host else http
        self._gather = Gatherer(self._path, max_bytes_per_request, max_keys_per_request)
        self._deletes = Deleter(self._transport, max_keys_per_request)
        self._engine_calls = EngineCalls(self._transport)

    def close(self) -> None:
        """Close the sessions and stop the loop thread; the client restarts them if used again.
        Idle receive buffers are unmapped (tensors still using one keep it)."""
        self._recv_pool.clear()
        self._runtimes.close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_bytes_bound(self, node: str) -> int:
        """How many shard bytes one gather request to `node` should ask for: the HTTP bound
        (`max_bytes_per_request`), or none for a worker already known to be on this host, whose
        answer is a few references into shared memory however many bytes they name."""
        return self._path.request_bytes_bound(node)

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
        return self._runtimes.get().loop_thread.submit(coro)

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro`, run on this client's event-loop thread, from any event loop."""
        return await self._runtimes.get().loop_thread.await_from(coro)

    # Each verb below checks its arguments and returns the coroutine that does the work;
    # `blocking` / `awaiting` make the public sync method and its `a*` twin from it.

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
        return self._engine_calls.call_many(checked, timeout, check_liveness_timeout(liveness_timeout))

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
        """POST an encoded engine call (see `distbatch.batch.calls`) and return the decoded JSON reply."""
        calls = self._call_many_verb([(node, method, body)], timeout, liveness_timeout=liveness_timeout)
        return first_result(calls)

    call_raw = blocking(_call_raw_verb)
    acall_raw = awaiting(_call_raw_verb)

    def _put_verb(self, node: str, shards: Mapping[Any, Any]) -> Coroutine[Any, Any, PutResult]:
        """Store `{(task_id, field): tensor | JSON value}` on `node`; all or nothing."""
        return self._path.put(validate_node(node), wire.bundle_from_shards(shards))

    put = blocking(_put_verb)
    aput = awaiting(_put_verb)

    def _put_bundle_verb(self, node: str, bundle: wire.Bundle) -> Coroutine[Any, Any, PutResult]:
        """Store a bundle (task ids plus one column per field) on `node`; all or nothing.

        The columnar path: no object per shard. Bundles over the request bounds travel as
        several requests of consecutive tasks, staged and committed at once.
        """
        return self._path.put(validate_node(node), bundle)

    put_bundle = blocking(_put_bundle_verb)
    aput_bundle = awaiting(_put_bundle_verb)

    def _put_bundles_verb(
        self, puts: Sequence[tuple[str, wire.Bundle]]
    ) -> Coroutine[Any, Any, list[PutResult]]:
        """Each `(node, bundle)` put, all at once; their results in order. Each put is all or
        nothing on its node; if one fails, the first failure is raised once every put is done
        (the others may have stored)."""
        checked = [(validate_node(node), bundle) for node, bundle in puts]
        return self._put_each(checked)

    async def _put_each(self, puts: list[tuple[str, wire.Bundle]]) -> list[PutResult]:
        results = await asyncio.gather(*(self._path.put(n, b) for n, b in puts), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]  # no exceptions left

    put_bundles = blocking(_put_bundles_verb)
    aput_bundles = awaiting(_put_bundles_verb)

    def _fetch_products_verb(
        self,
        requests: Iterable[ProductRequest],
        *,
        progress: Progress | None = None,
    ) -> Coroutine[Any, Any, list[wire.Bundle]]:
        """Fetch `(node, task_ids, fields)` products concurrently; one bundle per request, in order.
        A request may carry per-task generations as a fourth element (a batch's gather does):
        values a later put replaced are then refused with `ShardsReplacedError`.

        The columnar path: each response is one buffer, and each field in it one entry
        (decode with `wire.decode_column` / `wire.column_tensor`). `ShardNotFoundError`
        names every missing key. `progress(nbytes)` is called as each response lands.
        """
        checked = check_products(requests)
        return self._gather.products(checked, progress) if checked else done([])

    fetch_products = blocking(_fetch_products_verb)
    afetch_products = awaiting(_fetch_products_verb)

    def _fetch_planned_verb(
        self, products: list[Product], *, progress: Progress | None = None
    ) -> Coroutine[Any, Any, list[wire.Bundle]]:
        """`fetch_products` of a batch's own gather plan: its ids come from the batch's metadata,
        checked when it was made, so they are not checked again (50k ids cost ~25 ms)."""
        return self._gather.products(products, progress) if products else done([])

    _fetch_planned = blocking(_fetch_planned_verb)
    _afetch_planned = awaiting(_fetch_planned_verb)

    def _fetch_verb(
        self, refs: Iterable[ShardRef | tuple], *, progress: Progress | None = None
    ) -> Coroutine[Any, Any, list[Any]]:
        """Gather single shards, given as `(node, task_id, field[, nbytes])`, in the order asked.

        The per-shard API (one value per shard); batches gather columns with
        `fetch_products`. Nodes are fetched concurrently. Raises `ShardNotFoundError`
        naming every missing key. `progress(nbytes)` is called (on the client's thread) as each
        response lands.
        """
        order, per_node = plan_refs(refs)
        return self._gather.keys(order, per_node, progress) if order else done([])

    fetch = blocking(_fetch_verb)
    afetch = awaiting(_fetch_verb)

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
        task_ids, keys, fields = check_delete_args(task_ids, keys, fields)
        return self._deletes.delete(node, task_ids=task_ids, keys=keys, fields=fields)

    delete = blocking(_delete_verb)
    adelete = awaiting(_delete_verb)

    def _delete_many_verb(
        self, keys_by_node: Mapping[str, Iterable[Any]]
    ) -> Coroutine[Any, Any, DeleteResult]:
        """Delete exactly the given keys on several nodes concurrently; returns the summed result."""
        return self._deletes.keys_all(_key_plan(keys_by_node))

    delete_many = blocking(_delete_many_verb)
    adelete_many = awaiting(_delete_many_verb)

    def delete_each(self, keys_by_node: Mapping[str, Iterable[Any]]) -> Outcomes:
        """Like `delete_many`, but reports each node's outcome instead of raising the first error.

        For cleanup that must say which nodes could not be cleared (a worker
        that is down) while still clearing the others.
        """
        return self.run(self._deletes.keys_each(_key_plan(keys_by_node)))

    def _delete_products_each_verb(
        self, plan: Mapping[str, Iterable[tuple[Sequence[str], Sequence[str]] | tuple[Any, ...]]]
    ) -> Coroutine[Any, Any, Outcomes]:
        """Delete `(task_ids, fields)` products per node, nodes concurrently; each node's outcome.

        The columnar delete: a request names tasks and fields, never one key per shard. A
        product may carry per-task generations as a third element (a batch's clear does): values
        a later put replaced are then refused (`ShardsReplacedError`) and nothing is deleted there.
        """
        return self._deletes.products_each(check_product_plan(plan))

    delete_products_each = blocking(_delete_products_each_verb)
    adelete_products_each = awaiting(_delete_products_each_verb)

    def _request_json_verb(
        self,
        node: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None | object = ...,
        idempotent: bool = True,
        waits: bool = False,
        keep_alive: bool | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """A JSON request to any distbatch HTTP service (worker or controller), with this
        client's session, token, retries and error mapping.

        `waits=True` for a request the server may hold open (a long poll): it takes a connection
        slot of the waiting budget, so waiters never hold up puts and fetches to the same node.
        `keep_alive`: whether it may go out on a kept-alive connection (default: only when
        idempotent, since a server may close one just as the request leaves, and only a re-send
        mends that); True for a request that is not retried here but that the caller safely
        sends again itself (`RemoteController.get_meta`, deduplicated by its request id).
        """
        if not path.startswith("/"):
            raise InvalidArgumentError("path must start with '/'")
        return self._transport.request(
            validate_node(node),
            method,
            path,
            json_body=body,
            timeout=timeout,
            idempotent=idempotent,
            waits=waits,
            keep_alive=keep_alive,
        )

    request_json = blocking(_request_json_verb)
    arequest_json = awaiting(_request_json_verb)

    def list_tasks(self, node: str, after: str | None = None, limit: int = 1000) -> dict[str, Any]:
        """One page of the tasks `node` holds, in id order after `after`: `{"tasks": [[task_id,
        [fields]], ...], "next": the id to pass as `after` for the next page (None at the end),
        "total": tasks held}`."""
        query = f"?limit={int(limit)}"
        if after is not None:  # quoted: an id may hold a '+', which a query reads as a space
            query += f"&after={quote(validate_id(after, 'after'))}"
        return self.request_json(validate_node(node), "GET", f"/v1/tasks{query}")

    async def _task_fields_verb(
        self, node: str, task_ids: Sequence[str]
    ) -> tuple[dict[str, list[str]], list[str]]:
        """The fields `node` holds of each of `task_ids`, and the ids it does not hold at all: what
        `distbatch show` describes, `distbatch clear --tasks` checks, and the TransferQueue
        backend asks after a failed put (as many ids a request as fit a few KB of query)."""
        node = validate_node(node)
        ids = wire.validate_id_list(list(dict.fromkeys(task_ids)))
        held: dict[str, list[str]] = {}
        missing: list[str] = []
        for chunk in _query_chunks([quote(task_id) for task_id in ids]):
            answer = await self._transport.request(node, "GET", f"/v1/tasks?ids={','.join(chunk)}")
            held.update((task, fields) for task, fields in answer["tasks"])
            missing += answer["missing"]
        return held, missing

    task_fields = blocking(_task_fields_verb)
    atask_fields = awaiting(_task_fields_verb)

    def _stats_verb(self, node: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """The node's store statistics (shards, tasks, bytes, capacity, free)."""
        return self._transport.request(validate_node(node), "GET", "/v1/stats")

    stats = blocking(_stats_verb)
    astats = awaiting(_stats_verb)

    def _health_verb(self, node: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """The node's `/health` answer; `WorkerUnavailableError` if it does not answer."""
        return self._transport.request(validate_node(node), "GET", "/health")

    health = blocking(_health_verb)
    ahealth = awaiting(_health_verb)


TASKS_QUERY_CHARS = 4096  # the ids of one `GET /v1/tasks?ids=` lookup, quoted and joined


def _query_chunks(quoted: list[str]) -> Iterator[list[str]]:
    """`quoted` ids in runs that fit one lookup: at most `TASKS_QUERY_CHARS` characters joined
    (one id always goes, however long: ids are bounded); so never more than the server's page
    limit either."""
    chunk: list[str] = []
    size = 0
    for task_id in quoted:
        if chunk and size + len(task_id) + 1 > TASKS_QUERY_CHARS:
            yield chunk
            chunk, size = [], 0
        chunk.append(task_id)
        size += len(task_id) + 1
    if chunk:
        yield chunk


def _key_plan(keys_by_node: Mapping[str, Iterable[Any]]) -> dict[str, list[Any]]:
    """Each node's keys, node and keys checked."""
    return {validate_node(n): [validate_key(k) for k in ks] for n, ks in keys_by_node.items()}
