"""`WorkerGroup`: start or connect to workers and call their engine methods.

The controller sends metadata only: batch arguments travel as their shard
metadata, and per-task results stay on the worker that produced them.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from distbatch.batch.calls import decode_value, encode_call
from distbatch.client.default import default_client
from distbatch.client.engine_calls import DEFAULT_LIVENESS_TIMEOUT, check_liveness_timeout
from distbatch.client.shard_client import ShardClient
from distbatch.errors import CallTimeoutError, InvalidArgumentError, WorkerUnavailableError
from distbatch.ids import validate_node
from distbatch.launch.flags import (
    GROUP_OPTIONS,
    LOCAL_GROUP_OPTIONS,
    check_engine_kwargs,
    check_launcher_flags,
    engine_kwargs_json,
)
from distbatch.launch.local import WorkerProcess, spawn_workers
from distbatch.twins import awaiting, blocking, first_result


class Stoppable(Protocol):
    """Whatever else a group started (e.g. Ray actors); `stop()` must be safe to call twice."""

    def stop(self) -> None: ...


def _stop_all(processes: list[WorkerProcess], stoppers: list[Stoppable]) -> None:
    for process in processes:
        process.terminate()  # all at once: each takes a moment to exit
    for process in processes:
        process.stop()
    for stopper in stoppers:
        stopper.stop()


def _engine_kwargs_flags(engine: str | None, engine_kwargs: Mapping[str, Any] | None) -> list[str]:
    """`--engine-kwargs JSON` for a group's workers ([] for none), checked before anything starts."""
    text = engine_kwargs_json(engine_kwargs)
    if text is not None and not engine:
        raise InvalidArgumentError(
            "engine_kwargs are the engine's constructor arguments: name the engine too"
        )
    return ["--engine-kwargs", text] if text else []


class WorkerGroup:
    """An ordered set of worker nodes; worker i receives chunk i.

    `call_timeout`: default deadline of one engine call in seconds (None: none, for long
    training steps). `liveness_timeout`: while a call runs, each worker's `/health` is
    probed; a worker that has not answered for this many seconds (stopped, dropped off the
    network) fails the call with `WorkerUnavailableError`. A long call on a live worker is
    never cut short by it. None disables the probes.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        *,
        processes: Sequence[WorkerProcess] = (),
        stoppers: Sequence[Stoppable] = (),
        client: ShardClient | None = None,
        call_timeout: float | None = None,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
    ) -> None:
        self.nodes = [validate_node(n) for n in nodes]
        if not self.nodes:
            raise InvalidArgumentError("a worker group needs at least one node")
        self.processes = list(processes)
        self.stoppers = list(stoppers)
        self.call_timeout = call_timeout
        self.liveness_timeout = check_liveness_timeout(liveness_timeout)
        self._client = client
        # How `local` started the workers (flags, environment, startup timeout): `restart` repeats it.
        self._respawn: tuple[list[str], Mapping[str, str] | Sequence[Mapping[str, str]] | None, float] | None
        self._respawn = None
        # Stops the processes (and stoppers) on shutdown(), on garbage collection and at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_all, self.processes, self.stoppers)

    @classmethod
    def local(
        cls,
        n: int,
        engine: str | None = None,
        *,
        engine_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        args: Sequence[str] = (),
        client: ShardClient | None = None,
        call_timeout: float | None = None,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
        startup_timeout: float = 60.0,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> WorkerGroup:
        """Spawn `n` `rpc_server` processes on loopback, hosting `engine` ('pkg.module:Factory').

        Worker i's engine is built as `Factory(**engine_kwargs, context=...)` (`context` if the
        factory takes it: a `WorkerContext` whose `rank` is i and `world_size` n). `engine_kwargs`
        must be JSON (checked before anything starts: `TypeError` / `ValueError` naming the key).
        `args` are other worker flags (`--max-bytes`, ...), also checked first; those the group
        sets itself are refused (`ValueError`): `--rank`, `--world-size`, `--engine-kwargs`, and
        `--port`, `--address-file`, `--exit-with-parent` (each worker listens on a free port).
        Workers import with this process's import path; whatever they print or log goes to
        `group.log_files`, all in `group.log_dir`: `log_dir` if given, else `$DISTBATCH_LOG_DIR`,
        else a new temporary directory, removed when the group stops cleanly and kept (and named
        in the error) when a worker failed; see `spawn_workers`.
        """
        engine_flags = _engine_kwargs_flags(engine, engine_kwargs)
        check_launcher_flags(args, {**LOCAL_GROUP_OPTIONS, **GROUP_OPTIONS})
        extra = [*args, *(["--engine", engine] if engine else []), *engine_flags]
        processes = spawn_workers(n, args=extra, env=env, startup_timeout=startup_timeout, log_dir=log_dir)
        group = cls(
            [p.node for p in processes],
            processes=processes,
            client=client,
            call_timeout=call_timeout,
            liveness_timeout=liveness_timeout,
        )
        group._respawn = (extra, env, startup_timeout)
        return group._ready_or_shut_down()

    def restart(self, worker: int | str) -> str:
        """Start a worker of this (local) group again, with its flags, rank and engine, on a new
        port, after stopping it if it still runs; its new address, which the group calls from
        now on. A worker started with `--data-dir` comes back holding every shard it had
        committed: point batch handles at it with `DistributedBatchMemory.moved(old, new)` and a
        controller with `Controller.move_node(old, new)`. Its engine is built afresh (an
        engine's own state, such as loaded weights, is not durable: load it again).
        `InvalidArgumentError` for a group not started by `WorkerGroup.local`."""
        if self._respawn is None:
            raise InvalidArgumentError("only the workers of a WorkerGroup.local group can be restarted")
        node = self._node(worker)
        rank = self.nodes.index(node)
        old = next(p for p in self.processes if p.node == node)
        args, env, startup_timeout = self._respawn
        if old.logs is not None:
            old.logs.started(None)  # the log directory stays while its worker is replaced
        try:
            old.stop()
            (new,) = spawn_workers(
                1,
                args=args,
                env=env if env is None or isinstance(env, Mapping) else [env[rank]],
                startup_timeout=startup_timeout,
                log_dir=old.logs,
                first_rank=rank,
                world_size=len(self.nodes),
            )
        finally:
            if old.logs is not None:
                old.logs.stopped(clean=True)
        self.processes[self.processes.index(old)] = new
        self.nodes[rank] = new.node
        self.client.health(new.node)
        return new.node

    @classmethod
    def ray(
        cls,
        n: int,
        engine: str | None = None,
        *,
        engine_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        placement: str = "spread",
        resources: Mapping[str, float] | None = None,
        node_ids: Sequence[str] | None = None,
        args: Sequence[str] = (),
        runtime_env: Mapping[str, Any] | None = None,
        client: ShardClient | None = None,
        call_timeout: float | None = None,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
        startup_timeout: float = 120.0,
    ) -> WorkerGroup:
        """Start `n` workers as Ray actors (one per placement-group bundle), hosting `engine`.

        `placement` is "spread" (over nodes where possible), "strict_spread" or "pack";
        `node_ids` (one Ray node ID per worker) pins workers to nodes instead, e.g. next to the
        trainer ranks that read them. `resources` are per worker, e.g. `{"GPU": 1}` or
        `{"CPU": 2}`. `args` are store flags as for `local` (`--max-bytes`, `--max-idle-seconds`);
        `runtime_env` is Ray's per-actor runtime environment (pip, env_vars, container, ...).
        `engine_kwargs`, ranks and world size as for `local` (worker i, in bundle order, is rank i).
        Calls and data go over HTTP exactly as for `local`; `shutdown()` kills the actors and
        frees the placement group.
        Calls `ray.init` with closed-machine defaults if Ray is not initialised yet.
        """
        engine_flags = _engine_kwargs_flags(engine, engine_kwargs)  # before Ray is imported
        try:
            from distbatch.launch.ray_actors import start_ray_workers
        except ImportError as exc:
            if exc.name is None or exc.name.split(".")[0] != "ray":
                raise
            raise ImportError("WorkerGroup.ray needs Ray: pip install distbatch[ray]") from exc
        workers = start_ray_workers(
            n,
            engine,
            engine_flags=engine_flags,
            env=env,
            placement=placement,
            resources=resources,
            node_ids=node_ids,
            args=args,
            runtime_env=runtime_env,
            startup_timeout=startup_timeout,
        )
        try:
            group = cls(
                workers.nodes,
                stoppers=[workers],
                client=client,
                call_timeout=call_timeout,
                liveness_timeout=liveness_timeout,
            )
        except BaseException:
            workers.stop()
            raise
        return group._ready_or_shut_down()

    @classmethod
    def connect(
        cls,
        addresses: Sequence[str],
        *,
        engine: str | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        client: ShardClient | None = None,
        call_timeout: float | None = None,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT,
        startup_timeout: float | None = 120.0,
    ) -> WorkerGroup:
        """A group over workers someone else started (Slurm, by hand, another launcher).

        With `engine`, each worker must have been started without `--engine` and with
        `--accept-engine` (a worker refuses, 403, to import what a request names unless told
        so): connect builds `engine` on every worker at once (as `local` does; `engine_kwargs`
        checked the same way first), worker i, the i-th address, as rank i of `len(addresses)`,
        and returns once all are built (each within `startup_timeout` seconds, None: no bound).
        A worker that already hosts this engine with these arguments and rank keeps it (a
        controller reconnecting); one hosting anything else is a `RequestError` (409), an
        engine that fails to build an `EngineError`. Without `engine`, the workers keep the
        engines they were started with, built with the rank, world size and keyword arguments
        their `--rank`, `--world-size` and `--engine-kwargs` gave them (so `engine_kwargs` is
        refused), whatever order the addresses come in. `shutdown()` leaves them running.
        """
        if engine is None and engine_kwargs is not None:
            raise InvalidArgumentError(
                "engine_kwargs reach an engine that connect builds: pass engine= too (a worker "
                "started with --engine built its engine at start, from its own --engine-kwargs)"
            )
        kwargs = check_engine_kwargs({} if engine_kwargs is None else engine_kwargs)
        group = cls(addresses, client=client, call_timeout=call_timeout, liveness_timeout=liveness_timeout)
        group.wait_ready()
        if engine is not None:
            group.client.run(group._start_engines(engine, kwargs, startup_timeout))
        return group

    async def _start_engines(self, engine: str, kwargs: dict[str, Any], timeout: float | None) -> None:
        """Build `engine` on every worker concurrently (ranks may wait for each other, as in a
        `torch.distributed` rendezvous); the first failure once every worker has answered."""
        world_size = len(self.nodes)
        replies = await asyncio.gather(
            *(
                self.client.arequest_json(
                    node,
                    "POST",
                    "/v1/engine",
                    {"engine": engine, "kwargs": kwargs, "rank": rank, "world_size": world_size},
                    timeout=timeout,
                    idempotent=False,
                )
                for rank, node in enumerate(self.nodes)
            ),
            return_exceptions=True,
        )
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply

    @property
    def log_files(self) -> list[Path]:
        """Each started worker's log file (its prints and logs), in worker order; [] for connect/ray."""
        return [p.log_file for p in self.processes if p.log_file is not None]

    @property
    def log_dir(self) -> Path | None:
        """The directory the started workers log into (None for connect/ray): see `local`."""
        return next((p.logs.path for p in self.processes if p.logs is not None), None)

    @property
    def client(self) -> ShardClient:
        return self._client or default_client()

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.nodes})"

    def _ready_or_shut_down(self) -> WorkerGroup:
        """Return self once every worker answers; stop what this group started if one does not
        (keeping their logs)."""
        try:
            self.wait_ready()
        except BaseException:
            for process in self.processes:
                if process.logs is not None:
                    process.logs.keep()
            self.shutdown()
            raise
        return self

    def wait_ready(self) -> None:
        """Check every worker answers `/health` (raises `WorkerUnavailableError` naming it)."""
        for node in self.nodes:
            self.client.health(node)

    def _node(self, worker: int | str) -> str:
        if isinstance(worker, int):
            return self.nodes[worker]
        node = validate_node(worker)
        if node not in self.nodes:
            raise InvalidArgumentError(f"{node} is not in this group")
        return node

    @property
    def loop_runner(self) -> ShardClient:
        """The client whose event-loop thread runs this group's calls."""
        return self.client

    def _calls(
        self, calls: list[tuple[str, str, bytes]], call_timeout: float | None
    ) -> Coroutine[Any, Any, list[Any]]:
        """The calls' coroutine, once the workers they go to are checked alive (in the caller)."""
        self._check_alive([node for node, _, _ in calls])
        return self._run_calls(calls, call_timeout)

    async def _run_calls(self, calls: list[tuple[str, str, bytes]], call_timeout: float | None) -> list[Any]:
        nodes = [node for node, _, _ in calls]
        try:
            replies = await self.client.acall_many(
                calls,
                timeout=self.call_timeout if call_timeout is None else call_timeout,
                liveness_timeout=self.liveness_timeout,
            )
        except Exception as exc:  # any error of a call carries the completed ones' replies
            # Asking Ray whether an actor died may block: not on the client's loop.
            dead = await asyncio.to_thread(self._dead_worker_error, nodes)
            raise self._call_error(exc, nodes, dead) from exc
        return [decode_value(reply["result"], self._client) for reply in replies]

    def _call_error(self, exc: Exception, nodes: list[str], dead: WorkerUnavailableError | None) -> Exception:
        """The error a failed group call raises: why a worker is gone if the launcher knows,
        carrying the completed calls' results (`partial_results`) as batches."""
        error: Exception = dead or exc if isinstance(exc, (WorkerUnavailableError, CallTimeoutError)) else exc
        partial = getattr(exc, "partial_results", None)
        if partial is not None:
            error.partial_results = [  # type: ignore[attr-defined]
                None if r is None else decode_value(r["result"], self._client) for r in partial
            ]
        return error

    def _dead_worker_error(self, nodes: list[str]) -> WorkerUnavailableError | None:
        try:
            self._check_alive(nodes)
            self._check_stoppers(nodes)
        except WorkerUnavailableError as exc:
            return exc
        return None

    def _check_alive(self, nodes: list[str]) -> None:
        for process in self.processes:
            if process.node in nodes and not process.alive():
                code = process.process.returncode
                log = f"; its log, kept: {process.log_file}" if process.log_file is not None else ""
                raise WorkerUnavailableError(process.node, f"worker process exited with code {code}{log}")

    def _check_stoppers(self, nodes: list[str]) -> None:
        """After a failed call: name a worker whose launcher (e.g. Ray) knows it is dead."""
        for stopper in self.stoppers:
            dead = getattr(stopper, "dead", None)
            if dead is None:
                continue
            for node in nodes:
                if node in getattr(stopper, "nodes", ()) and dead(node):
                    raise WorkerUnavailableError(node, "its Ray actor or worker process is dead")

    def _call_verb(
        self, method: str, chunks: Sequence[Any], *, call_timeout: float | None = None, **kwargs: Any
    ) -> Coroutine[Any, Any, list[Any]]:
        """Call `method(chunks[i], **kwargs)` on worker i, all concurrently; results in worker order.

        `call_timeout` overrides the group's deadline for this call; every other keyword
        (`timeout` too) goes to the engine method. If a worker fails, the error is raised at
        once and carries `partial_results` (per worker: the result if its call completed,
        else None; clear those batches if you do not use them); the calls still running
        are abandoned and their workers drop their results.
        """
        if len(chunks) != len(self.nodes):
            raise InvalidArgumentError(f"{len(chunks)} chunks for {len(self.nodes)} workers")
        calls = [(node, method, encode_call([chunk], kwargs)) for node, chunk in zip(self.nodes, chunks)]
        return self._calls(calls, call_timeout)

    call = blocking(_call_verb)
    acall = awaiting(_call_verb)

    def _call_all_verb(
        self, method: str, *args: Any, call_timeout: float | None = None, **kwargs: Any
    ) -> Coroutine[Any, Any, list[Any]]:
        """Call `method(*args, **kwargs)` on every worker concurrently; results in worker order.

        Errors and `call_timeout` as for `call`.
        """
        body = encode_call(args, kwargs)
        return self._calls([(node, method, body) for node in self.nodes], call_timeout)

    call_all = blocking(_call_all_verb)
    acall_all = awaiting(_call_all_verb)

    def _call_on_verb(
        self, worker: int | str, method: str, *args: Any, call_timeout: float | None = None, **kwargs: Any
    ) -> Coroutine[Any, Any, Any]:
        """Call `method(*args, **kwargs)` on one worker (by index or node); `call_timeout` as for `call`."""
        return first_result(
            self._calls([(self._node(worker), method, encode_call(args, kwargs))], call_timeout)
        )

    call_on = blocking(_call_on_verb)
    acall_on = awaiting(_call_on_verb)

    def stats(self) -> list[dict[str, Any]]:
        """Every worker's `/v1/stats`, in worker order."""
        return [self.client.stats(node) for node in self.nodes]

    def shutdown(self) -> None:
        """Stop the workers this group started (connected workers are left running)."""
        self._finalizer()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
