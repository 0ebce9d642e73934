"""distbatch: a distributed batch memory for single-controller RL post-training.

The controller holds metadata; tensors stay on the workers that produced them
and are gathered straight from those workers, lazily, over HTTP.
"""

from distbatch.client import DeleteResult, PutResult, ShardClient, ShardRef
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

__version__ = "0.1.0"

__all__ = [
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
