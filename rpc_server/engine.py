"""Engine hosting: load `pkg.module:Factory`, run its public methods one at a time.

Methods run on one dedicated thread (GPU / NCCL code is rarely thread-safe),
while the data endpoints keep serving peers concurrently. Per-task results are
stored in this worker's own store and returned as a REMOTE batch.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from distbatch.batch.memory import BatchStatus, DistributedBatchMemory
from distbatch.batch.ragged import column_problem
from distbatch.calls import decode_call, encode_value
from distbatch.client.default import default_client
from distbatch.client.shard_client import ShardClient
from distbatch.errors import WireFormatError
from distbatch.wire.bundle import Bundle
from distbatch.wire.json_values import check_json, find_non_json
from rpc_server.errors import (
    ApiError,
    BadArgumentsError,
    EngineCallFailed,
    EngineLoadError,
    ShuttingDownError,
    StoreCapacityError,
    UnknownMethodError,
    UnstorableResultError,
)
from rpc_server.store.shard_store import PutReceipt, ShardStore


@dataclass
class WorkerContext:
    """What an engine may use of the worker hosting it (passed as `context=` if accepted)."""

    store: ShardStore
    config: Any

    @property
    def node(self) -> str:
        return self.config.node

    @property
    def client(self) -> ShardClient:
        return default_client()


def load_engine(spec: str, context: WorkerContext) -> Any:
    """Import `pkg.module:Factory` and build the engine (with `context=` when it takes one)."""
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
    return factory(context=context) if accepts_context else factory()


def _check_arguments(name: str, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Refuse a call whose arguments do not fit `fn`'s signature (HTTP 400), before it is queued.

    Checked on the request thread, so a bad call is answered at once instead of after
    a long call ahead of it; a TypeError the engine raises itself stays an engine error.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # nothing to introspect (some builtins): the call will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        bare = signature.replace(  # `two(a, b=1)`: string annotations would read `a: 'int'`
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        message = f"engine method {name}{bare} does not take these arguments: {exc}"
        raise BadArgumentsError(message) from None


# What an engine method may return, for the messages that refuse anything else.
RESULT_KINDS = (
    "return a dict of per-task columns (a tensor or jagged nested tensor with one row, or a list "
    "with one entry, per task of the call's batch argument), a LOCAL batch "
    "(DistributedBatchMemory.from_dict(columns, task_ids=...)), or JSON (str, int, float, bool, "
    "None, lists and dicts of those)"
)


def _is_array(value: Any) -> bool:
    """A torch tensor or a numpy array: a value with a first dimension that is not JSON."""
    return isinstance(value, torch.Tensor) or (
        type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"
    )


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
        elif isinstance(value, torch.Tensor) and (problem := column_problem(value)) is not None:
            problems.append(f"field {key!r}: {problem}")
            layout_problems += 1
        elif _is_array(value) and value.ndim == 0:
            problems.append(f"field {key!r} is a 0-d {type(value).__name__} (for a JSON number: .item())")
        elif _is_array(value) or isinstance(value, (list, tuple)):
            n = value.shape[0] if _is_array(value) else len(value)
            if n != count:
                problems.append(f"field {key!r} has {n} entries")
                lengths_off = True
        else:
            problems.append(f"field {key!r} is a {type(value).__name__}, not a column")
    return problems, lengths_off, len(problems) > layout_problems


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
    if isinstance(result, DistributedBatchMemory):
        return result
    if input_batch is not None and isinstance(result, Mapping) and result:
        count = len(input_batch)
        problems, lengths_off, shape_off = _column_problems(result, count)
        if not problems:
            return DistributedBatchMemory.from_dict(dict(result), task_ids=input_batch.task_ids)
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

    def __init__(self, engine: Any, context: WorkerContext, finished_ttl: float = FINISHED_CALL_TTL) -> None:
        self.engine = engine
        self.context = context
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
        args, kwargs = decode_call(body, self.context.client)
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

    def _put_for_call(self, bundle: Bundle) -> int:
        """Store a call's result, unless the call was abandoned; remember the put. Returns the
        put's generation (0 when nothing was stored)."""
        call_id = getattr(self._engine_thread, "call_id", None)
        if call_id is None:
            return self.context.store.put(bundle).generation
        with self._calls_lock:
            if call_id in self._abandoned:
                return 0  # `_run_call` reports the abandonment once the engine's code returns
            receipt = self.context.store.put(bundle)
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
        inputs = [a for a in [*args, *kwargs.values()] if isinstance(a, DistributedBatchMemory)]
        try:
            storable = _storable_result(result, inputs[0] if inputs else None)
            if isinstance(storable, DistributedBatchMemory) and storable.status is BatchStatus.LOCAL:
                storable = self.store_local(storable)
            return encode_value(storable)
        except StoreCapacityError as exc:  # 507, as for a put: the store is full, not the engine wrong
            message = f"engine method {name!r} ran, but its result was not stored: {exc}"
            raise StoreCapacityError(message) from exc
        except Exception as exc:  # the result is the engine's doing, so report it as the engine's error
            raise EngineCallFailed(_result_error(name, result, exc)) from exc

    def store_local(self, batch: DistributedBatchMemory) -> DistributedBatchMemory:
        """Keep a LOCAL batch's columns in this worker's store (one copy per column); return the
        REMOTE view."""
        bundle, meta = batch.export_bundle(self.context.node, copy=True)
        generation = self._put_for_call(bundle)
        return DistributedBatchMemory.from_meta(meta.stored_by(generation), self.context.client)

    def shutdown(self) -> None:
        """Take no more calls: queued ones are cancelled (their requests answer 503), a running one ends."""
        self._closed.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._calls_lock:
            self._finished.clear()


def _abandoned_error(call_id: str, what: str) -> ApiError:
    return ApiError(409, "call_abandoned", f"engine call {call_id} {what}")
