"""distbatch: a distributed batch memory for single-controller RL post-training.

The controller holds metadata; tensors stay on the workers that produced them
and are gathered straight from those workers, lazily, over HTTP.
"""

from distbatch.batch import BatchStatus, DistributedBatchMemory
from distbatch.client import (
    DeleteResult,
    PutResult,
    ShardClient,
    ShardRef,
    default_client,
    set_default_client,
)
from distbatch.errors import (
    AuthError,
    BatchStatusError,
    CapacityError,
    DistBatchError,
    InvalidIdError,
    NodeError,
    RequestError,
    ServerError,
    ShardNotFoundError,
    WireFormatError,
    WorkerUnavailableError,
)
from distbatch.ids import ShardKey
from distbatch.meta import BatchMeta, FieldMeta, MetaFormatError

__version__ = "0.1.0"

__all__ = [
    "BatchMeta",
    "BatchStatus",
    "DistributedBatchMemory",
    "FieldMeta",
    "MetaFormatError",
    "default_client",
    "set_default_client",
    "AuthError",
    "BatchStatusError",
    "CapacityError",
    "DeleteResult",
    "DistBatchError",
    "InvalidIdError",
    "NodeError",
    "PutResult",
    "RequestError",
    "ServerError",
    "ShardClient",
    "ShardKey",
    "ShardNotFoundError",
    "ShardRef",
    "WireFormatError",
    "WorkerUnavailableError",
]
