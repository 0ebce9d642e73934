"""How puts and gathers travel to a node: one `ShardPath` interface, over HTTP or shared memory.

The client puts and gathers through a `ShardPath` and never asks how the bytes travel.
`HttpShardPath` sends container bodies over HTTP (a put over the request bounds as staged
parts committed at once). `SameHostShardPath` hands them over through shared memory to
workers on this host (`distbatch.client.same_host`: blocking requests, run in threads here),
and uses its HTTP path for every other worker and for any request the same-host path cannot
take: same calls, same answers, same errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from distbatch import wire
from distbatch.client.planning import product_body, split_bundle
from distbatch.client.responses import error_from_response
from distbatch.client.results import PutResult
from distbatch.client.same_host import SameHostChannel, SameHostPaths
from distbatch.client.transport import HttpTransport
from distbatch.errors import (
    CapacityError,
    NodeError,
    RequestError,
    SameHostAnswerError,
    SameHostFallback,
    ShardNotFoundError,
    ShmError,
    WireFormatError,
    WorkerUnavailableError,
)

T = TypeVar("T")

Progress = Callable[[int], None]
"""Called with each answer's byte count as it lands."""

# A gather request to a same-host worker names at most this many bytes (effectively no bound).
MAX_SAME_HOST_REQUEST_BYTES = 1 << 62

_CHANNEL_BROKE = (OSError, EOFError, ShmError)
"""What a same-host request whose connection failed raises (HTTP then carries it)."""


async def _failures_until_unreachable(requests: list[Awaitable[Any]]) -> list[BaseException]:
    """Run `requests` concurrently; what they raised (nothing: all succeeded). Once one finds the
    worker unreachable (`WorkerUnavailableError`: stopped, or its link down), the others are
    cancelled: those still queued for a connection slot would each wait out their own timeouts
    on the same silent worker, for a put that fails anyway."""
    tasks = [asyncio.ensure_future(request) for request in requests]
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(not t.cancelled() and isinstance(t.exception(), WorkerUnavailableError) for t in done):
                break
    finally:
        for task in tasks:
            task.cancel()  # a no-op for those done
    await asyncio.wait(tasks)
    return [error for t in tasks if not t.cancelled() and (error := t.exception()) is not None]


async def _ignoring(errors: type[BaseException], work: Awaitable[Any]) -> None:
    """Await `work`, ignoring `errors` (best-effort work in the background)."""
    with contextlib.suppress(errors):
        await work


class ShardPath(Protocol):
    """How puts and gathers reach a node."""

    async def put(self, node: str, bundle: wire.Bundle) -> PutResult:
        """Store `bundle` on `node`, all or nothing."""
        ...

    async def fetch(
        self,
        node: str,
        task_ids: list[str],
        fields: list[str],
        progress: Progress | None,
        generations: list[int] | None = None,
    ) -> wire.Bundle:
        """The product `task_ids` x `fields` from `node` in one answer, as the worker sent it
        (refused where a later put replaced the values `generations` names)."""
        ...

    def request_bytes_bound(self, node: str) -> int:
        """How many shard bytes one gather request to `node` should ask for."""
        ...


class HttpShardPath:
    """Puts and gathers over HTTP, each request under `max_bytes` and `max_tasks`."""

    def __init__(self, transport: HttpTransport, max_bytes: int, max_tasks: int) -> None:
        self.transport = transport
        self.max_bytes = max_bytes
        self.max_tasks = max_tasks

    def request_bytes_bound(self, node: str) -> int:
        return self.max_bytes

    async def put(self, node: str, bundle: wire.Bundle) -> PutResult:
        bundles = split_bundle(bundle, self.max_bytes, self.max_tasks)
        if len(bundles) == 1:
            reply = await self.transport.request(
                node, "PUT", "/v1/shards", body=wire.build_bundle(bundles[0])
            )
            return PutResult(reply["stored"], reply["bytes"], reply.get("generation", 0))
        # Several requests: stage them, then commit once, so the call stores all or nothing
        # and never touches existing shards before it succeeds. Each part has a name, so a
        # retried request replaces its first attempt instead of adding to it.
        stage = uuid.uuid4().hex
        failures = await _failures_until_unreachable(
            [
                self.transport.request(
                    node, "PUT", f"/v1/shards?stage={stage}&part=p{i}", body=wire.build_bundle(part)
                )
                for i, part in enumerate(bundles)
            ]
        )
        if failures:
            unreachable = [f for f in failures if isinstance(f, WorkerUnavailableError)]
            await self.abort_stage(node, stage, unreachable=bool(unreachable))
            raise (unreachable or failures)[0]  # the reason the others were stopped, if it was one
        return await self.commit_stage(node, stage)

    async def abort_stage(self, node: str, stage: str, *, unreachable: bool = False) -> None:
        """Drop a staged put's parts; a failure here is ignored: the stage expires on the worker,
        and the failure that made us abort is what matters. To a worker that just went
        unanswered (`unreachable`: stopped, or its link down) the abort goes in the background,
        within the client's timeout: the put fails now, not after the abort's own wait."""
        runtime = self.transport.runtimes.get()
        notice = self.transport.request(
            node, "POST", "/v1/shards/abort", json_body={"stage": stage}, runtime=runtime
        )
        if unreachable:
            runtime.spawn(_ignoring(NodeError, notice))
            return
        with contextlib.suppress(NodeError):
            await notice

    async def commit_stage(self, node: str, stage: str) -> PutResult:
        """Store every part of a staged put at once. A commit the worker refuses (a stale
        append, a shared value with no source, no room) leaves the stage: it is aborted here,
        so its reservation does not hold capacity until it expires."""
        try:
            body = {"stage": stage}
            reply = await self.transport.request(node, "POST", "/v1/shards/commit", json_body=body)
        except (RequestError, ShardNotFoundError, CapacityError):
            await self.abort_stage(node, stage)
            raise
        return PutResult(reply["stored"], reply["bytes"], reply.get("generation", 0))

    async def fetch(
        self,
        node: str,
        task_ids: list[str],
        fields: list[str],
        progress: Progress | None,
        generations: list[int] | None = None,
    ) -> wire.Bundle:
        body = await self.transport.request(
            node,
            "POST",
            "/v1/shards/fetch",
            json_body=product_body(task_ids, fields, generations),
            binary_response=True,
        )
        if progress is not None:
            progress(len(body))
        try:
            return wire.parse_bundle(body, asked=task_ids)
        except WireFormatError as exc:
            raise WireFormatError(f"{node}: bad response container: {exc}") from None


class SameHostShardPath:
    """Shared memory to workers on this host (decided once per node), HTTP to the others."""

    def __init__(self, http: HttpShardPath) -> None:
        self.http = http
        self.transport = http.transport

    @property
    def paths(self) -> SameHostPaths:
        """This process's same-host channels (kept by the runtime, so a forked child has its own)."""
        return self.transport.runtimes.get().same_host

    def request_bytes_bound(self, node: str) -> int:
        """The HTTP bound, or none for a worker already known to be on this host, whose answer
        is a few references into shared memory however many bytes they name."""
        if isinstance(self.paths.decided(node), SameHostChannel):
            return MAX_SAME_HOST_REQUEST_BYTES
        return self.http.request_bytes_bound(node)

    async def channel(self, node: str) -> SameHostChannel | None:
        """The shared-memory channel to `node` if it is on this host, deciding once per node
        (a `GET /v1/shm` and a Unix-socket handshake); None means HTTP. A worker that does not
        answer is not decided about: the HTTP request that follows reports it."""
        paths = self.paths
        decided = paths.decided(node)
        if decided is None:
            lock = self.transport.runtimes.get().handshakes.setdefault(node, asyncio.Lock())
            async with lock:
                decided = paths.decided(node)
                if decided is None:
                    try:
                        info = await self.transport.request(node, "GET", "/v1/shm")
                    except RequestError as exc:
                        if exc.status != 404:
                            return None
                        info = None
                    except NodeError:
                        return None
                    decided = await asyncio.to_thread(paths.open, node, info)
        return decided if isinstance(decided, SameHostChannel) else None

    async def put(self, node: str, bundle: wire.Bundle) -> PutResult:
        channel = await self.channel(node)
        if channel is not None:
            try:
                return await self._put(node, channel, bundle)
            except SameHostFallback as exc:
                self._fell_back(node, str(exc))
            except _CHANNEL_BROKE as exc:
                self._broke(node, exc)
        return await self.http.put(node, bundle)

    async def _put(self, node: str, channel: SameHostChannel, bundle: wire.Bundle) -> PutResult:
        """A put handed over as sealed memfds: one request unless the task bound splits it
        (then staged parts, committed over HTTP, as the HTTP path does)."""
        bundles = split_bundle(bundle, None, self.http.max_tasks)
        stage = uuid.uuid4().hex if len(bundles) > 1 else None
        try:
            answers = []
            for i, part in enumerate(bundles):
                parts = wire.build_bundle(part)
                answers.append(await self._call(node, self.paths.put, channel, parts, stage, f"p{i}"))
                self.transport.traffic.same_host_sent += wire.parts_size(parts)
        except BaseException:
            if stage is not None:
                await self.http.abort_stage(node, stage)
            raise
        if stage is None:
            return PutResult(answers[0]["stored"], answers[0]["bytes"], answers[0].get("generation", 0))
        return await self.http.commit_stage(node, stage)

    async def fetch(
        self,
        node: str,
        task_ids: list[str],
        fields: list[str],
        progress: Progress | None,
        generations: list[int] | None = None,
    ) -> wire.Bundle:
        channel = await self.channel(node)
        if channel is not None:
            try:
                bundle = await self._call(node, self.paths.fetch, channel, task_ids, fields, generations)
            except SameHostFallback as exc:
                self._fell_back(node, str(exc))
            except WireFormatError as exc:
                raise WireFormatError(f"{node}: bad same-host answer: {exc}") from None
            except _CHANNEL_BROKE as exc:
                self._broke(node, exc)
            else:
                received = sum(c.nbytes for c in bundle.columns.values())
                self.transport.traffic.same_host_received += received
                if progress is not None:
                    progress(received)
                return bundle
        return await self.http.fetch(node, task_ids, fields, progress, generations)

    def _fell_back(self, node: str, reason: str) -> None:
        """The worker could not share this request's answer: said once (an error under strict
        mode, which sends nothing over HTTP), counted, sent over HTTP."""
        self.paths.fell_back(node, reason)
        self.transport.traffic.same_host_fallbacks += 1

    def _broke(self, node: str, exc: BaseException) -> None:
        """A same-host request broke: forget the channel (HTTP carries this request), unless the
        worker simply did not answer within the client's timeout, which HTTP would not mend."""
        self.paths.forget(node, f"the same-host connection failed: {type(exc).__name__}: {exc}")
        if isinstance(exc, TimeoutError):
            timeout = self.transport.policy.timeout
            raise WorkerUnavailableError(node, f"no same-host answer within {timeout:g} s") from None
        self.transport.traffic.same_host_fallbacks += 1  # only a request HTTP then carries

    async def _call(self, node: str, method: Callable[..., T], *args: Any) -> T:
        """Run a blocking same-host request in a thread under the node's connection slot; an
        error answer becomes the `NodeError` HTTP would have raised."""
        runtime = self.transport.runtimes.get()
        entered = False
        try:
            async with runtime.slot(node, False, self.transport.policy.timeout):
                entered = True
                self.transport.traffic.same_host_requests += 1
                return await asyncio.to_thread(method, *args)
        except SameHostAnswerError as exc:
            raise error_from_response(node, exc.status, exc.body) from None
        except TimeoutError:
            if entered:
                raise  # the socket's own timeout: the caller falls back to HTTP
            raise WorkerUnavailableError(
                node, "no connection slot freed within the client's timeout"
            ) from None
