"""The client's event-loop thread and what lives on it: sessions, connection slots, cleanup.

Every coroutine a `ShardClient` runs runs on one private loop thread (`LoopThread`), so its
sync methods behave the same from plain code, from a thread whose own loop is running and from
inside a Flask handler. `Runtime` is that thread with the aiohttp sessions, the connection
slots and the same-host channels living on it; `ProcessRuntime` makes one per process, lazily,
and a new one after a fork (the parent's loop thread does not exist in the child).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from distbatch.client.same_host import SameHostPaths
from distbatch.errors import StateError
from distbatch.protocol import CLIENT_KEEPALIVE_SECONDS

T = TypeVar("T")

CLOSED_IN_FLIGHT = "ShardClient was closed while this call was in flight"
_CLEANUP_GRACE = 1.0  # how long closing a client lets pending abandon notices finish


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
            raise StateError(
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
                    raise StateError(CLOSED_IN_FLIGHT)
        except BaseException:
            future.cancel()  # KeyboardInterrupt and the like: stop the work, free its connections
            raise
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise StateError(CLOSED_IN_FLIGHT) from None

    async def await_from(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro`, run on this loop, from any event loop (this one included)."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller is being cancelled
            raise StateError(CLOSED_IN_FLIGHT) from None

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


def _session(**connector: Any) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ttl_dns_cache=300, **connector), auto_decompress=False, trust_env=False
    )


class Runtime:
    """The loop thread, the sessions living on it and the connection slots.

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
        self.max_connections = max_connections
        self.max_connections_per_node = max_connections_per_node
        self.data_slots = asyncio.Semaphore(max_connections)
        self.waiting_slots = asyncio.Semaphore(max_connections)
        self.node_slots: dict[str, asyncio.Semaphore] = {}
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        # One same-host handshake per node at a time (`SameHostShardPath.channel`).
        self.handshakes: dict[str, asyncio.Lock] = {}
        # Best-effort cleanup (abandon notices) that outlives the call that started it.
        self.background: set[asyncio.Task[Any]] = set()

    def session(self) -> aiohttp.ClientSession:
        """The session data requests share (kept-alive connections)."""
        if self._session is None:
            # The slots bound connections (per node and in total); the connector's own limit is
            # only a backstop for both budgets together. Connections are reused for less time
            # than the server keeps them idle, so no request goes out on one it is closing.
            self._session = _session(
                limit=2 * self.max_connections, limit_per_host=0, keepalive_timeout=CLIENT_KEEPALIVE_SECONDS
            )
        return self._session

    def fresh_session(self) -> aiohttp.ClientSession:
        """A session whose every request opens its own connection, for requests that are not
        retried (engine calls): a server may close an idle kept-alive connection (its thread
        wanted elsewhere) just as a request goes out on it, which only a retry could mend."""
        if self._fresh_session is None:
            self._fresh_session = _session(limit=0, force_close=True)
        return self._fresh_session

    def probe_session(self) -> aiohttp.ClientSession:
        """Liveness probes' own session: never a slot a data request needs, never queued behind them."""
        if self._probe_session is None:
            self._probe_session = _session(limit=0)
        return self._probe_session

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
            sessions = [self._session, self._probe_session, self._fresh_session]
            self.loop_thread.stop(sessions, self.background)


class ProcessRuntime:
    """This process's `Runtime`, made on first use and again after a fork or a `close()`.

    Holds nothing of the client it serves, so a client nobody holds any more is freed at once
    (and its runtime closed by the client's finalizer).
    """

    def __init__(self, make: Callable[[], Runtime]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._runtime: Runtime | None = None
        # A forked child keeps its parent's runtime alive, untouched: freed here, the loop's and
        # aiohttp's finalizers would unregister the parent's sockets from the epoll instance
        # both processes share, and the parent's next request would never see its answer.
        self._inherited: list[Runtime] = []

    def get(self) -> Runtime:
        with self._lock:
            runtime = self._runtime
            if runtime is None or runtime.loop_thread.pid != os.getpid():
                if runtime is not None:
                    self._inherited.append(runtime)
                runtime = self._runtime = self._make()
            return runtime

    def close(self) -> None:
        """Stop the loop thread and close the sessions (a forked child's copy: nothing to stop)."""
        with self._lock:
            runtime, self._runtime = self._runtime, None
            if runtime is not None and runtime.loop_thread.pid != os.getpid():
                self._inherited.append(runtime)  # the parent's: kept, never touched (see above)
                runtime = None
        if runtime is not None:
            runtime.close()
