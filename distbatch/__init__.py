"""distbatch: a distributed batch memory for single-controller RL post-training.

The controller holds metadata; tensors stay on the workers that produced them
and are gathered straight from those workers, lazily, over HTTP.
"""

from distbatch.errors import (
    AuthError,
    BatchStatusError,
    CapacityError,
    ClearError,
    DistBatchError,
    EngineError,
    InvalidArgumentError,
    InvalidIdError,
    NodeError,
    ProtocolError,
    RequestError,
    ServerError,
    ShardNotFoundError,
    UnknownFieldError,
    UnknownPartitionError,
    WireFormatError,
    WorkerUnavailableError,
)
from distbatch.ids import ShardKey

__version__ = "0.1.0"

# Imported on first use: these pull in torch or aiohttp, which the worker's data path never needs.
_LAZY = {
    "DeleteResult": "distbatch.client",
    "PutResult": "distbatch.client",
    "ShardClient": "distbatch.client",
    "ShardRef": "distbatch.client",
    "default_client": "distbatch.client",
    "set_default_client": "distbatch.client",
    "BatchStatus": "distbatch.batch",
    "DistributedBatchMemory": "distbatch.batch",
    "BatchMeta": "distbatch.batch.meta",
    "FieldMeta": "distbatch.batch.meta",
    "MetaFormatError": "distbatch.batch.meta",
    "WorkerGroup": "distbatch.launch.group",
    "Controller": "distbatch.controller",
    "ClearInProgressError": "distbatch.controller",
    "SchemaConflictError": "distbatch.controller",
    "RemoteController": "distbatch.controller.http",
    "serve_controller": "distbatch.controller.http",
    "StreamingDataset": "distbatch.dataloader",
    "StreamingDataLoader": "distbatch.dataloader",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distbatch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "BatchMeta",
    "BatchStatus",
    "DistributedBatchMemory",
    "FieldMeta",
    "MetaFormatError",
    "default_client",
    "set_default_client",
    "AuthError",
    "EngineError",
    "WorkerGroup",
    "Controller",
    "ClearError",
    "ClearInProgressError",
    "SchemaConflictError",
    "RemoteController",
    "serve_controller",
    "StreamingDataLoader",
    "StreamingDataset",
    "BatchStatusError",
    "CapacityError",
    "DeleteResult",
    "DistBatchError",
    "InvalidArgumentError",
    "InvalidIdError",
    "NodeError",
    "ProtocolError",
    "PutResult",
    "RequestError",
    "ServerError",
    "ShardClient",
    "ShardKey",
    "ShardNotFoundError",
    "ShardRef",
    "UnknownFieldError",
    "UnknownPartitionError",
    "WireFormatError",
    "WorkerUnavailableError",
]
