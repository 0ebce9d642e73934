"""Engine hosting: load `pkg.module:Factory`, run its public methods one at a time.

Methods run on one dedicated thread (GPU / NCCL code is rarely thread-safe),
while the data endpoints keep serving peers concurrently. Per-task results are
stored in this worker's own store and returned as a REMOTE batch.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from distbatch.batch import BatchStatus, DistributedBatchMemory
from distbatch.client import ShardClient, default_client
from distbatch.ids import validate_key
from distbatch.rpc import decode_call, encode_value
from distbatch.wire import RawTensor, value_to_wire
from rpc_server.errors import EngineCallFailed, EngineLoadError, UnknownMethodError
from rpc_server.store import ShardStore, StoredShard


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


def _is_columns(result: Any, count: int) -> bool:
    """A dict whose every value is one entry per input task (tensor dim 0 or list length)."""
    if not isinstance(result, Mapping) or not result or count == 0:
        return False
    for value in result.values():
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != count:
                return False
        elif not isinstance(value, (list, tuple)) or len(value) != count:
            return False
    return all(isinstance(k, str) for k in result)


class EngineHost:
    """Owns the engine object and its single execution thread."""

    def __init__(self, engine: Any, context: WorkerContext) -> None:
        self.engine = engine
        self.context = context
        self.name = type(engine).__name__
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def method(self, name: str) -> Any:
        if not name.isidentifier() or name.startswith("_"):
            raise UnknownMethodError(f"{name!r} is not a public engine method")
        fn = getattr(self.engine, name, None)
        if fn is None or not callable(fn):
            raise UnknownMethodError(f"engine {self.name} has no method {name!r}")
        return fn

    def call(self, name: str, body: Any) -> dict[str, Any]:
        """Run `name` on the engine thread; returns the tagged result for the reply."""
        fn = self.method(name)
        args, kwargs = decode_call(body, self.context.client)
        return self._executor.submit(self._invoke, fn, args, kwargs).result()

    def _invoke(self, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit too: an engine's failure never takes the worker down
            raise EngineCallFailed(exc) from exc
        try:
            inputs = [a for a in [*args, *kwargs.values()] if isinstance(a, DistributedBatchMemory)]
            input_batch = inputs[0] if inputs else None
            if input_batch is not None and _is_columns(result, len(input_batch)):
                result = DistributedBatchMemory.from_dict(result, task_ids=input_batch.task_ids)
            if isinstance(result, DistributedBatchMemory) and result.status is BatchStatus.LOCAL:
                result = self.store_local(result)
            return encode_value(result)
        except Exception as exc:  # the result is the engine's doing, so report it as the engine's error
            raise EngineCallFailed(
                TypeError(
                    f"engine returned {type(result).__name__} that could not be stored or sent "
                    f"(expected JSON, a batch, or a dict of per-task columns): {exc}"
                )
            ) from exc

    def store_local(self, batch: DistributedBatchMemory) -> DistributedBatchMemory:
        """Keep a LOCAL batch's shards in this worker's store; return the REMOTE view."""
        shards, meta = batch.export_shards(self.context.node)
        stored: dict[Any, StoredShard] = {}
        for key, value in shards.items():
            encoded = value_to_wire(value)
            if isinstance(encoded, RawTensor):
                stored[key] = StoredShard(encoded.dtype, encoded.shape, bytes(encoded.data))
            else:
                stored[key] = StoredShard(None, (), encoded.encode())
        self.context.store.put({validate_key(k): v for k, v in stored.items()})
        return DistributedBatchMemory.from_meta(meta, self.context.client)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
