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
is its own; a batch or a worker group uses its client's. Type checkers see both twins with the
verb's exact parameters; the API reference shows them as methods (docs/griffe_twins.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

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
