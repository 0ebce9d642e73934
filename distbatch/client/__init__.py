"""The client: puts, gathers and deletes shards on workers and calls their engines.

Owns every byte that leaves or reaches this process for a worker: `ShardClient` (the public
client and its private event-loop thread), the HTTP response reader that lands bodies in
place (`http_recv`) and the same-host shared-memory channel (`same_host`). May import
`distbatch.wire`, `distbatch.ids`, `distbatch.errors`, `distbatch.auth`, `distbatch.protocol`,
`distbatch.recv_pool` and `distbatch.shm`; never the batch, the controller or the launchers,
which build on them.
"""

from distbatch.client.shard_client import (
    DeleteResult,
    PutResult,
    ShardClient,
    Traffic,
    default_client,
    set_default_client,
)
from distbatch.ids import ShardRef

__all__ = [
    "DeleteResult",
    "PutResult",
    "ShardClient",
    "ShardRef",
    "Traffic",
    "default_client",
    "set_default_client",
]
