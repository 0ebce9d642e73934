"""distbatch: a distributed batch memory for single-controller RL post-training.

The controller holds metadata; tensors stay on the workers that produced them
and are gathered straight from those workers, lazily, over HTTP.

Layers, bottom up (each imports only those below it; `docs/guide/architecture.md` draws them):
`errors`, `ids`, `protocol`, `auth` and small helpers; `wire` (the bytes); `transport`
(same-host regions, recycled receive buffers) and `serving` (the HTTP server the worker,
`rpc_server`, and the controller's HTTP face share); `client` (moving bytes to and from
workers); `batch` (the batch object, its metadata, its balancing and engine-call envelopes);
`samplers`; `controller`; `launch` (workers and groups); `dataloader`, `cli`,
`transferqueue` (TransferQueue's storage backend) and `areal` (AReaL's RTensor backend) on top.
"""

from typing import TYPE_CHECKING

from distbatch.errors import (
    AuthError,
    BatchStatusError,
    CallTimeoutError,
    CapacityError,
    ClearError,
    ClearInProgressError,
    DistBatchError,
    EngineError,
    InvalidArgumentError,
    InvalidIdError,
    MetaFormatError,
    NodeError,
    ProtocolError,
    RequestError,
    SchemaConflictError,
    ServerBindError,
    ServerError,
    ShardElsewhereError,
    ShardNotFoundError,
    ShardsReplacedError,
    UnknownFieldError,
    UnknownPartitionError,
    WireFormatError,
    WorkerUnavailableError,
)
from distbatch.ids import ShardKey, ShardRef

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see: the real classes (at run time, `_LAZY`)
    from distbatch.batch.memory import DistributedBatchMemory
    from distbatch.batch.meta import BatchMeta, FieldMeta
    from distbatch.batch.states import BatchStatus
    from distbatch.client.default import default_client, set_default_client
    from distbatch.client.results import DeleteResult, PutResult
    from distbatch.client.shard_client import ShardClient
    from distbatch.controller.api import ControllerAPI
    from distbatch.controller.core import Controller
    from distbatch.controller.remote import RemoteController
    from distbatch.controller.results import ForgottenNode
    from distbatch.controller.server import serve_controller
    from distbatch.dataloader import StreamingDataLoader, StreamingDataset
    from distbatch.launch.group import WorkerGroup

# Imported on first use: these pull in torch or aiohttp, which the worker's data path never needs.
# Each name maps to the module that defines it; tests/integration/test_public_api.py checks this table
# against the `if TYPE_CHECKING:` imports above, so the two cannot drift apart.
_LAZY = {
    "BatchStatus": "distbatch.batch.states",
    "DistributedBatchMemory": "distbatch.batch.memory",
    "BatchMeta": "distbatch.batch.meta",
    "FieldMeta": "distbatch.batch.meta",
    "DeleteResult": "distbatch.client.results",
    "PutResult": "distbatch.client.results",
    "ShardClient": "distbatch.client.shard_client",
    "default_client": "distbatch.client.default",
    "set_default_client": "distbatch.client.default",
    "Controller": "distbatch.controller.core",
    "ControllerAPI": "distbatch.controller.api",
    "RemoteController": "distbatch.controller.remote",
    "ForgottenNode": "distbatch.controller.results",
    "serve_controller": "distbatch.controller.server",
    "StreamingDataLoader": "distbatch.dataloader",
    "StreamingDataset": "distbatch.dataloader",
    "WorkerGroup": "distbatch.launch.group",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distbatch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "AuthError",
    "BatchMeta",
    "BatchStatus",
    "BatchStatusError",
    "CallTimeoutError",
    "CapacityError",
    "ClearError",
    "ClearInProgressError",
    "Controller",
    "ControllerAPI",
    "DeleteResult",
    "DistBatchError",
    "DistributedBatchMemory",
    "EngineError",
    "FieldMeta",
    "ForgottenNode",
    "InvalidArgumentError",
    "InvalidIdError",
    "MetaFormatError",
    "NodeError",
    "ProtocolError",
    "PutResult",
    "RemoteController",
    "RequestError",
    "SchemaConflictError",
    "ServerBindError",
    "ServerError",
    "ShardClient",
    "ShardKey",
    "ShardElsewhereError",
    "ShardNotFoundError",
    "ShardsReplacedError",
    "ShardRef",
    "StreamingDataLoader",
    "StreamingDataset",
    "UnknownFieldError",
    "UnknownPartitionError",
    "WireFormatError",
    "WorkerGroup",
    "WorkerUnavailableError",
    "default_client",
    "serve_controller",
    "set_default_client",
]
