"""One body per verb: a sync method and its ``a``-prefixed async twin come from one function.

A verb is written once, as a method that checks its arguments and returns the coroutine that
does the work. The checks run in the caller's thread, so a mistake raises there, before anything
is sent; encoding a batch happens there too, never on the shared event-loop thread. Then::

    def _put(self, node: str, shards: Mapping[Any, Any]) -> Coroutine[Any, Any, PutResult]:
        \"\"\"Store `shards` on `node`; all or nothing.\"\"\"
        return self._store(validate_node(node), encode(shards))

    put = blocking(_put)  # runs the coroutine on the client's loop thread and waits
    aput = awaiting(_put)  # awaits it from any event loop, without blocking that loop

The owner says which loop runs its coroutines with a `loop_runner` property: a `ShardClient`
is its own; a worker group uses its client's. Type checkers see both twins with the verb's
exact parameters; the API reference shows them as methods (docs/griffe_twins.py).

A verb some of whose steps must run in the caller's thread (a batch's: it takes its own lock
around the client's work, which must never be taken on the client's loop thread) is written
instead as an ``async def`` body that takes a `Twin` and sends each waiting step through it:
`twin.call(blocking_fn, awaitable_fn, ...)` for a pair of client methods, `twin.offload(fn, ...)`
for work that blocks. The awaitable form awaits the body with `AWAITED`; the blocking form runs
it with ``run_blocking(body(BLOCKING))``, where no step ever suspends, so the coroutine finishes
in one step with no event loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from distbatch.errors import StateError

P = ParamSpec("P")
R = TypeVar("R")


class LoopRunner(Protocol):
    """Runs coroutines on its own event-loop thread."""

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run `coro` on the loop thread and wait for its result (from any thread)."""
        ...

    async def arun(self, coro: Coroutine[Any, Any, R]) -> R:
        """Await `coro`, run on the loop thread, from any event loop."""
        ...


class HasLoopRunner(Protocol):
    """An object whose verbs run on a `LoopRunner`."""

    @property
    def loop_runner(self) -> LoopRunner: ...


Owner = TypeVar("Owner", bound=HasLoopRunner)


def blocking(
    verb: Callable[Concatenate[Owner, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Owner, P], R]:
    """The sync twin of `verb`: its coroutine run on the owner's loop thread, waited for."""

    @functools.wraps(verb)
    def method(self: Owner, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.loop_runner.run(verb(self, *args, **kwargs))

    return method


def awaiting(
    verb: Callable[Concatenate[Owner, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Owner, P], Coroutine[Any, Any, R]]:
    """The async twin of `verb`: its coroutine awaited from any event loop."""

    @functools.wraps(verb)
    async def method(self: Owner, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self.loop_runner.arun(verb(self, *args, **kwargs))

    return method


async def first_result(results: Coroutine[Any, Any, list[R]]) -> R:
    """The first item of what `results` returns (a verb on one target built from one on many)."""
    return (await results)[0]


async def done(value: R) -> R:
    """A coroutine that has nothing to do (a verb whose arguments leave no work)."""
    return value


@dataclass(frozen=True)
class Twin:
    """Which form of a verb is running: `blocking` (the caller's thread waits) or awaited."""

    blocking: bool

    async def call(
        self,
        blocking_fn: Callable[P, R],
        awaitable_fn: Callable[P, Awaitable[R]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """One step with a blocking and an awaitable implementation (same arguments): this form's."""
        if self.blocking:
            return blocking_fn(*args, **kwargs)
        return await awaitable_fn(*args, **kwargs)

    async def offload(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)`, which may block: in this thread when blocking, else in a worker
        thread, so the caller's event loop goes on."""
        if self.blocking:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)


BLOCKING = Twin(blocking=True)
AWAITED = Twin(blocking=False)


def run_blocking(body: Coroutine[Any, Any, R]) -> R:
    """The result of a twin body started with `BLOCKING`, run to its end in this thread."""
    try:
        body.send(None)
    except StopIteration as done:
        return done.value
    body.close()
    raise StateError("a twin body suspended under BLOCKING: it awaited something other than its Twin")
