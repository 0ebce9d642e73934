"""The client: puts, gathers and deletes shards on workers and calls their engines.

Owns every byte that leaves or reaches this process for a worker. `ShardClient`
(`shard_client`) is the public facade; behind it, one module per concern: the event-loop
thread and its sessions (`loop`), one HTTP request with retries (`transport`), error answers
as exceptions (`responses`), the HTTP and same-host shard paths behind one interface
(`shard_paths`, with the shared-memory channel in `same_host` and the in-place HTTP reader in
`http_recv`), gathers (`fetches`), deletes (`deletes`), engine calls (`engine_calls`),
request planning shared with the batch (`planning`), result values (`results`) and the
process-wide client (`default`). May import `distbatch.wire`, `distbatch.ids`,
`distbatch.errors`, `distbatch.auth`, `distbatch.protocol`, `distbatch.transport` (`shm`,
`recv_pool`), `distbatch.serving.open_files` (the descriptor limit) and `distbatch.twins`;
never the batch, the controller or the launchers, which build on it.
"""

from distbatch.client.default import default_client, set_default_client
from distbatch.client.results import DeleteResult, PutResult, Traffic
from distbatch.client.shard_client import ShardClient
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
