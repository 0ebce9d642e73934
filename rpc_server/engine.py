"""Engine hosting: load `pkg.module:Factory`, run its public methods one at a time.

Methods run on one dedicated thread (GPU / NCCL code is rarely thread-safe),
while the data endpoints keep serving peers concurrently. Per-task results are
stored in this worker's own store and returned as a REMOTE batch.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distbatch import wire
from distbatch.batch.calls import decode_call, encode_value, loaded_batch_class
from distbatch.errors import WireFormatError
from distbatch.launch.flags import check_engine_kwargs, check_rank
from distbatch.transport.shm import SharedRegion
from distbatch.wire.bundle import Bundle
from distbatch.wire.json_values import check_json, find_non_json
from rpc_server.context import ServerState
from rpc_server.errors import (
    ApiError,
    BadArgumentsError,
    EngineCallFailed,
    EngineLoadError,
    SharedMemoryUnavailable,
    ShuttingDownError,
    StoreCapacityError,
    UnknownMethodError,
    UnstorableResultError,
)
from rpc_server.store.shard_store import PutReceipt, ShardStore

if TYPE_CHECKING:
    from distbatch.batch.memory import DistributedBatchMemory
    from distbatch.client.shard_client import ShardClient

# torch, the batch and the client are imported when a call first needs them, never at start: a
# worker whose engine answers JSON (a reward scorer, a coordinator) never loads torch (about 2 s
# of CPU and 200 MB), and while nothing in the process has imported torch, no value can be a
# tensor (`_is_tensor`).


@dataclass
class WorkerContext:
    """What an engine may use of the worker hosting it: passed as `context=` to an engine factory
    that takes a parameter of that name.

    `node`, `rank` and `world_size` are valid in the engine's constructor already, so an engine
    can set itself up there (pick its GPU, join a process group). `rank` is the worker's index
    in its group and `world_size` the group's size: `WorkerGroup.local` and `WorkerGroup.ray`
    give worker i rank i, `WorkerGroup.connect(addresses, engine=...)` the position of its
    address; a worker started by hand is rank 0 of 1 unless `--rank` / `--world-size` say
    otherwise. A group's `engine_kwargs=` (`--engine-kwargs` on the command line) arrive as
    the factory's keyword arguments, next to `context`. An engine module:

    ```py
    import torch

    from distbatch import DistributedBatchMemory
    from rpc_server.engine import WorkerContext


    class TrainEngine:
        def __init__(self, context: WorkerContext, model: str, lr: float = 1e-6) -> None:
            self.context = context  # its store and client serve the methods later
            self.device = torch.device("cuda", context.rank % torch.cuda.device_count())
            print(f"rank {context.rank} of {context.world_size} at {context.node} loads {model}")
            self.lr = lr

        def train_step(self, batch: DistributedBatchMemory) -> dict[str, float]:
            ...
    ```

    and the controller that starts two of them, worker i as rank i of 2:

    ```py
    from distbatch import WorkerGroup

    group = WorkerGroup.local(
        2, "my_pkg.engines:TrainEngine", engine_kwargs={"model": "Qwen/Qwen3-0.6B", "lr": 2e-6}
    )
    ```

    `engine_kwargs` must be JSON (str, int, float, bool, None, lists and string-keyed dicts of
    those; no NaN, tuples or tensors): groups refuse anything else before a worker starts.
    """

    store: ShardStore
    """The worker's own `ShardStore`: what its engine calls' results are stored in."""
    config: Any
    """The worker's `rpc_server.config.ServerConfig`: the flags it was started with (`engine`,
    `engine_kwargs`, `rank`, `world_size`, `max_bytes`, ...)."""

    @property
    def node(self) -> str:
        """This worker's `host:port`: the address its peers and the controller reach it at."""
        return str(self.config.node)

    @property
    def rank(self) -> int:
        """This worker's index in its group, from 0."""
        return int(self.config.rank)

    @property
    def world_size(self) -> int:
        """How many workers its group has."""
        return int(self.config.world_size)

    @property
    def client(self) -> ShardClient:
        """The worker's client, for gathering from peers (batch arguments use it already)."""
        from distbatch.client.default import default_client

        return default_client()


def load_engine(spec: str, context: WorkerContext, kwargs: Mapping[str, Any] | None = None) -> Any:
    """Import `pkg.module:Factory` and build the engine with `kwargs` (and `context=` when it takes one).

    `EngineLoadError` if it cannot be imported or does not take these keyword arguments; what
    the factory itself raises propagates.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EngineLoadError(f"engine spec {spec!r} must look like 'pkg.module:Factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EngineLoadError(f"cannot load engine {spec!r}: {exc}") from exc
    try:
        accepts_context = "context" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepts_context = False
    arguments = {**(kwargs or {}), **({"context": context} if accepts_context else {})}
    problem = _signature_problem(factory, [], arguments)
    if problem is not None:
        given = sorted(kwargs or {})
        takes = (
            f"does not take engine_kwargs {given}" if given else "needs arguments: pass them as engine_kwargs"
        )
        raise EngineLoadError(f"cannot build engine {spec!r}: {attr}{problem[0]} {takes} ({problem[1]})")
    return factory(**arguments)


def host_engine(
    store: ShardStore, config: Any, same_host_readers: Callable[[], bool] = lambda: False
) -> EngineHost:
    """Build the engine `config` names (`engine`, `engine_kwargs`, `rank`, `world_size`, and its
    `node`, which must be known by now) and the host that runs its methods. `same_host_readers`:
    whether the worker serves shared memory yet (its results then go into shared regions)."""
    context = WorkerContext(store, config)
    engine = load_engine(config.engine, context, config.engine_kwargs)
    return EngineHost(engine, context, same_host_readers=same_host_readers)


def start_requested_engine(current: ServerState, body: Any) -> dict[str, Any]:
    """`POST /v1/engine`: build the engine a body `{"engine", "kwargs", "rank", "world_size"}` asks
    for on a worker started without one but with `--accept-engine` (`WorkerGroup.connect(...,
    engine=)`); 403 without that flag, since it imports and calls the factory the body names.

    Asking again for the engine the worker hosts, with the same arguments, changes nothing (a
    controller that reconnects); asking for another is a 409. A factory that cannot be imported
    or called with these arguments is a 400, one that raises an `engine_error` with its traceback.
    """
    if not isinstance(body, dict) or not isinstance(body.get("engine"), str):
        raise ApiError(400, "bad_request", 'expected {"engine": "pkg.module:Factory", "kwargs": {...}, ...}')
    try:
        kwargs = check_engine_kwargs(body.get("kwargs") or {})
        rank, world_size = body.get("rank", 0), body.get("world_size", 1)
        check_rank(rank, world_size)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, "bad_request", str(exc)) from None
    asked = {"engine": body["engine"], "engine_kwargs": kwargs, "rank": rank, "world_size": world_size}
    config = current.config
    with current.engine_lock:
        hosted = {name: getattr(config, name) for name in asked}
        if current.engine is not None:
            if hosted != asked:
                message = (
                    f"this worker already hosts an engine, {hosted}, not {asked}: restart it to host another"
                )
                raise ApiError(409, "engine_exists", message)
            return {"engine": current.engine.name, "created": False, "node": config.node}
        if not config.accept_engine:  # it would import and call whatever the request names
            raise ApiError(
                403,
                "engine_not_accepted",
                "this worker builds no engine on request: start it with --accept-engine (and a "
                "DISTBATCH_TOKEN) to let a controller choose its engine, or with --engine",
            )
        for name, value in asked.items():
            setattr(config, name, value)
        try:
            current.engine = host_engine(current.store, config, current.serves_same_host_readers)
        except BaseException as exc:
            for name, value in hosted.items():  # as it was: no engine
                setattr(config, name, value)
            if isinstance(exc, EngineLoadError):
                raise ApiError(400, "engine_load_failed", str(exc)) from None
            raise EngineCallFailed(exc) from exc  # the factory's own failure: reported like a failed call
    return {"engine": current.engine.name, "created": True, "node": config.node}


def _signature_problem(fn: Any, args: list[Any], kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why `fn(*args, **kwargs)` would not bind, as (its bare signature, the TypeError's text); None
    if it binds, or if `fn` has no signature to check (some builtins: the call will tell)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        bare = signature.replace(  # `two(a, b=1)`: string annotations would read `a: 'int'`
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        return str(bare), str(exc)
    return None


def _check_arguments(name: str, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Refuse a call whose arguments do not fit `fn`'s signature (HTTP 400), before it is queued.

    Checked on the request thread, so a bad call is answered at once instead of after
    a long call ahead of it; a TypeError the engine raises itself stays an engine error.
    """
    problem = _signature_problem(fn, args, kwargs)
    if problem is not None:
        raise BadArgumentsError(
            f"engine method {name}{problem[0]} does not take these arguments: {problem[1]}"
        )


# What an engine method may return, for the messages that refuse anything else.
RESULT_KINDS = (
    "return a dict of per-task columns (a tensor or jagged nested tensor with one row, or a list "
    "with one entry, per task of the call's batch argument), a LOCAL batch "
    "(DistributedBatchMemory.from_dict(columns, task_ids=...)), or JSON (str, int, float, bool, "
    "None, lists and dicts of those)"
)


def _is_tensor(value: Any) -> bool:
    """A torch tensor (none can exist while nothing in the process has imported torch, or while
    another thread is still importing it and `torch.Tensor` is not defined yet)."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor is not None and isinstance(value, tensor)


def _is_array(value: Any) -> bool:
    """A torch tensor or a numpy array: a value with a first dimension that is not JSON."""
    return _is_tensor(value) or (type(value).__module__ == "numpy" and type(value).__name__ == "ndarray")


def _column_problems(result: Mapping[Any, Any], count: int) -> tuple[list[str], bool, bool]:
    """Why `result` is not `count`-entry columns ([] when it is).

    Also: whether a column's length is off, and whether anything other than a tensor
    the wire cannot carry is wrong (then the message says what may be returned).
    """
    problems: list[str] = []
    layout_problems = 0
    lengths_off = False
    for key, value in result.items():
        if not isinstance(key, str):
            problems.append(f"key {key!r} is not a field name")
        elif _is_tensor(value) and (problem := _column_problem(value)) is not None:
            problems.append(f"field {key!r}: {problem}")
            layout_problems += 1
        elif _is_array(value) and value.ndim == 0:
            problems.append(f"field {key!r} is a 0-d {type(value).__name__} (for a JSON number: .item())")
        elif _is_array(value) or isinstance(value, (list, tuple)):
            # size(0): a strided nested tensor has no .shape
            n = (value.size(0) if _is_tensor(value) else value.shape[0]) if _is_array(value) else len(value)
            if n != count:
                problems.append(f"field {key!r} has {n} entries")
                lengths_off = True
        else:
            problems.append(f"field {key!r} is a {type(value).__name__}, not a column")
    return problems, lengths_off, len(problems) > layout_problems


def _column_problem(tensor: Any) -> str | None:
    from distbatch.batch.ragged import column_problem  # torch is loaded: `tensor` is one

    return column_problem(tensor)


def _json_problem(value: Any) -> str | None:
    """Where and what in `value` JSON cannot carry (e.g. "result['loss'] is a Tensor"), or None."""
    try:
        check_json(value)
    except WireFormatError as exc:
        where, inner = find_non_json(value)
        if _is_array(inner) or not isinstance(inner, (dict, list, tuple)):
            return f"result{where} is a {type(inner).__name__}"
        return f"result{where}: {exc}"
    return None


def _storable_result(result: Any, input_batch: DistributedBatchMemory | None) -> Any:
    """The engine's return value as something `encode_value` sends: a batch or JSON.

    A dict whose every value has one entry per task of the batch argument becomes a
    LOCAL batch under those task ids (an EMPTY batch for a zero-task chunk); any other
    dict must be JSON. Anything else raises `UnstorableResultError` saying what to return.
    """
    batch_class = loaded_batch_class()
    if batch_class is not None and isinstance(result, batch_class):
        return result
    if input_batch is not None and isinstance(result, Mapping) and result:
        count = len(input_batch)
        problems, lengths_off, shape_off = _column_problems(result, count)
        if not problems:
            return type(input_batch).from_dict(dict(result), task_ids=input_batch.task_ids)
        json_problem = _json_problem(result)
        if json_problem is None:
            return result  # plain JSON that happens to be a dict of lists (e.g. metrics)
        detail = "; ".join(problems)
        if lengths_off:
            detail += f", but the input batch has {count} tasks and a column needs one entry per task"
        if not any(_is_array(v) and v.ndim for v in result.values()):  # maybe meant as JSON
            detail += f"; as JSON, {json_problem} (.item() / .tolist() it)"
        raise UnstorableResultError(f"{detail}. To fix, {RESULT_KINDS}" if shape_off else detail, ValueError)
    json_problem = _json_problem(result)
    if json_problem is None:
        return result
    if _is_array(result):
        shape = list(result.shape)
        raise UnstorableResultError(
            f"a bare {type(result).__name__} of shape {shape} has no field name to be stored under. "
            f"To fix, {RESULT_KINDS}"
        )
    if not isinstance(result, (Mapping, list, tuple)):
        raise UnstorableResultError(f"it is neither a batch nor JSON. To fix, {RESULT_KINDS}")
    detail = f"{json_problem}, which JSON cannot carry (.item() / .tolist() it)"
    if input_batch is None and isinstance(result, Mapping):
        detail += (
            "; per-task columns are stored under the task ids of the call's batch argument, and this "
            "call has no batch argument: to store tensors, return a LOCAL batch "
            "(DistributedBatchMemory.from_dict(columns, task_ids=...))"
        )
    raise UnstorableResultError(detail)


def _result_error(name: str, result: Any, exc: Exception) -> Exception:
    """The error an engine call reports when its result could not be stored or sent."""
    kind = type(result).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    what = f"engine method {name!r} returned {article} {kind} that could not be stored or sent"
    if isinstance(exc, UnstorableResultError):
        return exc.kind(f"{what}: {exc}")
    error = (ValueError if isinstance(exc, ValueError) else TypeError)(f"{what}: {exc}")
    error.__cause__ = exc  # shows in the remote traceback
    return error


MAX_FINISHED_CALLS = 1024  # finished calls whose stored shards are kept for a late abandon
FINISHED_CALL_TTL = 15.0  # seconds they are kept: the abandon for a lost reply follows within 5 s
MAX_ABANDONED_CALLS = 4096  # abandoned call ids remembered (the notice may beat its call)


@dataclass(slots=True)
class _ActiveCall:
    """A queued or running call with an id: its future, so that an abandon cancels it while it
    is queued, and the puts it made so far (see `ShardStore.delete_put`)."""

    future: Future[dict[str, Any]]
    stored: list[PutReceipt] = field(default_factory=list)


class EngineHost:
    """Owns the engine object and its single execution thread, and tracks calls by call id.

    A client that gives up on a call (its deadline passed, a sibling failed, its caller was
    interrupted) abandons it by id: a queued call is then not run (its request is answered at
    once), a running one stores nothing, and a finished one (whose reply was lost) has what it
    stored deleted. What a call stored is kept as the shard objects, not bare keys, so a late
    abandon never deletes a later call's shards under the same keys; since that also holds their
    bytes after a clear, finished calls are forgotten after `finished_ttl` seconds.
    """

    def __init__(
        self,
        engine: Any,
        context: WorkerContext,
        finished_ttl: float = FINISHED_CALL_TTL,
        same_host_readers: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self.context = context
        self.same_host_readers = same_host_readers  # whether the worker serves shared memory yet
        self.name = type(engine).__name__
        self.finished_ttl = finished_ttl
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._calls_lock = threading.Lock()
        self._active: dict[str, _ActiveCall] = {}  # queued or running
        self._abandoned: OrderedDict[str, None] = OrderedDict()
        # call id -> (time.monotonic() it finished, the puts it made), oldest first.
        self._finished: OrderedDict[str, tuple[float, list[PutReceipt]]] = OrderedDict()
        self._sweeper: threading.Thread | None = None  # runs while `_finished` holds calls
        self._closed = threading.Event()
        self._engine_thread = threading.local()  # `.call_id`: the call the engine thread runs

    def method(self, name: str) -> Any:
        if not name.isidentifier() or name.startswith("_"):
            raise UnknownMethodError(f"{name!r} is not a public engine method")
        fn = getattr(self.engine, name, None)
        if fn is None or not callable(fn):
            raise UnknownMethodError(f"engine {self.name} has no method {name!r}")
        return fn

    def call(self, name: str, body: Any, call_id: str | None = None) -> dict[str, Any]:
        """Run `name` on the engine thread; returns the tagged result for the reply.

        `call_id` (from the client) lets the call be abandoned; see `abandon`.
        """
        fn = self.method(name)
        # Batch arguments use the process's client (`context.client`) when they gather; passing
        # none leaves them to find it then, so a JSON-only call never imports the client.
        args, kwargs = decode_call(body)
        _check_arguments(name, fn, args, kwargs)
        if call_id is None:
            return self._result(self._submit(self._invoke, fn, args, kwargs), None)
        with self._calls_lock:
            if call_id in self._abandoned:
                raise _abandoned_error(call_id, "was abandoned before it started; not run")
            if call_id in self._active or call_id in self._finished:
                raise ApiError(409, "duplicate_call_id", f"call id {call_id!r} was already used")
            # Submitted under the lock, so the engine thread finds the call registered.
            future = self._submit(self._run_call, call_id, fn, args, kwargs)
            active = self._active[call_id] = _ActiveCall(future)
        completed = False
        try:
            result = self._result(active.future, call_id)
            completed = True
            return result
        finally:
            with self._calls_lock:
                del self._active[call_id]
                if completed and active.stored:  # kept, in case the reply is lost and the client abandons
                    now = time.monotonic()
                    self._finished[call_id] = (now, active.stored)
                    self._forget_finished(now)
                    self._start_sweeper()

    def _submit(self, fn: Any, *args: Any) -> Future[dict[str, Any]]:
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError:  # the executor is shut down: answer 503, not an unhandled 500
            raise ShuttingDownError("the worker is shutting down; the engine call was not run") from None

    def _result(self, future: Future[dict[str, Any]], call_id: str | None) -> dict[str, Any]:
        """Wait for a call; a cancelled one was abandoned while queued, or the worker is shutting down."""
        try:
            return future.result()
        except CancelledError:
            with self._calls_lock:
                abandoned = call_id is not None and call_id in self._abandoned
            if abandoned:
                raise _abandoned_error(str(call_id), "was abandoned while queued; not run") from None
            raise ShuttingDownError("the worker is shutting down; the queued call was not run") from None

    def _run_call(self, call_id: str, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """On the engine thread: skip an abandoned call; drop what a failed or abandoned one stored."""
        with self._calls_lock:
            if call_id in self._abandoned:
                raise _abandoned_error(call_id, "was abandoned while queued; not run")
        self._engine_thread.call_id = call_id
        try:
            result = self._invoke(fn, args, kwargs)
        except BaseException:
            self._drop_stored(call_id)  # nobody gets a handle to what a failed call stored
            raise
        finally:
            self._engine_thread.call_id = None
        with self._calls_lock:
            if call_id in self._abandoned:
                raise _abandoned_error(call_id, "was abandoned while running; its result was not kept")
        return result

    def _drop_stored(self, call_id: str) -> None:
        with self._calls_lock:
            active = self._active.get(call_id)
            if active is not None and active.stored:
                self._delete_puts(active.stored)
                active.stored = []

    def _delete_puts(self, receipts: list[PutReceipt]) -> tuple[int, int]:
        count = freed = 0
        for receipt in receipts:
            c, b = self.context.store.delete_put(receipt)
            count, freed = count + c, freed + b
        return count, freed

    def _put_for_call(self, bundle: Bundle, region: SharedRegion | None = None) -> int:
        """Store a call's result (in `region`, when it lies in one), unless the call was
        abandoned; remember the put. Returns the put's generation (0 when nothing was stored)."""
        size = None if region is None else region.size
        call_id = getattr(self._engine_thread, "call_id", None)
        if call_id is None:
            return self.context.store.put(bundle, size, region).generation
        with self._calls_lock:
            if call_id in self._abandoned:
                return 0  # `_run_call` reports the abandonment once the engine's code returns
            receipt = self.context.store.put(bundle, size, region)
            self._active[call_id].stored.append(receipt)
        return receipt.generation

    def abandon(self, call_ids: list[str]) -> dict[str, int]:
        """Drop these calls' results: not run if queued, not kept if running, deleted if finished.

        Unknown ids are remembered (bounded), since the notice may arrive before its call.
        """
        calls = deleted = freed = 0
        with self._calls_lock:
            self._forget_finished(time.monotonic())
            for call_id in call_ids:
                stored: list[PutReceipt] | None = None
                if call_id in self._finished:
                    stored = self._finished.pop(call_id)[1]
                elif (active := self._active.get(call_id)) is not None:
                    active.future.cancel()  # if still queued: never runs, and its request answers now
                    stored, active.stored = active.stored, []
                if stored is not None:
                    calls += 1
                if stored:
                    count, nbytes = self._delete_puts(stored)
                    deleted, freed = deleted + count, freed + nbytes
                self._abandoned[call_id] = None
                self._abandoned.move_to_end(call_id)
            while len(self._abandoned) > MAX_ABANDONED_CALLS:
                self._abandoned.popitem(last=False)
        return {"calls": calls, "deleted": deleted, "bytes_freed": freed}

    def _forget_finished(self, now: float) -> None:
        """Forget finished calls older than `finished_ttl` or past `MAX_FINISHED_CALLS` (lock held)."""
        finished = self._finished
        while finished and (
            len(finished) > MAX_FINISHED_CALLS or now - next(iter(finished.values()))[0] > self.finished_ttl
        ):
            finished.popitem(last=False)

    def _start_sweeper(self) -> None:
        """Start the sweeper unless it runs (caller holds the lock, and just recorded a call)."""
        if self._sweeper is None and not self._closed.is_set():
            self._sweeper = threading.Thread(target=self._sweep_finished, name="finished-calls", daemon=True)
            self._sweeper.start()

    def _sweep_finished(self) -> None:
        """Forget expired finished calls every `finished_ttl / 4` s (10 at most), so an idle worker
        does not hold their shards' bytes; exit once none are left."""
        interval = min(max(self.finished_ttl / 4, 0.05), 10.0)
        while not self._closed.wait(interval):
            with self._calls_lock:
                self._forget_finished(time.monotonic())
                if not self._finished:
                    self._sweeper = None
                    return
        with self._calls_lock:
            self._sweeper = None

    def _invoke(self, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit too: an engine's failure never takes the worker down
            raise EngineCallFailed(exc) from exc
        name = getattr(fn, "__name__", "?")
        batch_class = loaded_batch_class()
        inputs = [a for a in [*args, *kwargs.values()] if batch_class and isinstance(a, batch_class)]
        try:
            storable = _storable_result(result, inputs[0] if inputs else None)
            batch_class = loaded_batch_class()  # the engine's code may have loaded it
            if batch_class is not None and isinstance(storable, batch_class):
                from distbatch.batch.states import BatchStatus

                if storable.status is BatchStatus.LOCAL:
                    storable = self.store_local(storable)
            return encode_value(storable)
        except StoreCapacityError as exc:  # 507, as for a put: the store is full, not the engine wrong
            message = f"engine method {name!r} ran, but its result was not stored: {exc}"
            raise StoreCapacityError(message) from exc
        except Exception as exc:  # the result is the engine's doing, so report it as the engine's error
            raise EngineCallFailed(_result_error(name, result, exc)) from exc

    def store_local(self, batch: DistributedBatchMemory) -> DistributedBatchMemory:
        """Keep a LOCAL batch's columns in this worker's store (one copy per column); return the
        REMOTE view.

        Once a client on this host reads through shared memory, the copy goes into a sealed
        region (gathering writes from the engine's tensors), which same-host readers map as it
        is; otherwise into the store's own memory, whence a same-host reader's first read would
        copy it into a region again."""
        if self.same_host_readers():
            bundle, meta = batch.export_bundle(self.context.node)  # not copied: the region is the copy
            if self.context.store.shared_room(bundle.nbytes()):
                try:
                    region = SharedRegion.from_parts(wire.build_bundle(bundle))
                    generation = self._put_for_call(wire.parse_bundle(region.array.data), region)
                except (OSError, SharedMemoryUnavailable):
                    pass  # the kernel refused a region, or others filled the budget: below
                else:
                    return type(batch).from_meta(meta.stored_by(generation), self.context.client)
        bundle, meta = batch.export_bundle(self.context.node, copy=True)
        generation = self._put_for_call(bundle)
        return type(batch).from_meta(meta.stored_by(generation), self.context.client)

    def shutdown(self) -> None:
        """Take no more calls: queued ones are cancelled (their requests answer 503), a running one ends."""
        self._closed.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._calls_lock:
            self._finished.clear()


def _abandoned_error(call_id: str, what: str) -> ApiError:
    return ApiError(409, "call_abandoned", f"engine call {call_id} {what}")
