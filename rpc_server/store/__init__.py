"""The worker's shard store: columns kept as immutable segments, indexed per task with numpy.

`ShardStore` (`shard_store`) is what the routes and the engine host call: puts (plain and
staged), fetches (bytes or shared-memory runs), deletes, eviction and statistics, under one
lock. Its pieces: `segments` (a put's field as rows over its body buffer, the per-field index,
a staged put's record), `columns` (building a fetch's response columns from segments without a
loop per row) and `sweeper` (the background thread that evicts idle tasks). Imports numpy and
distbatch's wire, ids and shm; never torch or aiohttp (tests/unit/test_layout.py checks).
"""

from rpc_server.errors import (
    MissingShardsError,
    SharedMemoryUnavailable,
    StoreCapacityError,
    UnknownStageError,
)
from rpc_server.store.shard_store import (
    COMPACT_MIN_BYTES,
    MAX_MISSING_LISTED,
    PutReceipt,
    ShardStore,
    StoreStats,
    bundle_from_raw,
)
from rpc_server.store.sweeper import IdleSweeper

__all__ = [
    "COMPACT_MIN_BYTES",
    "MAX_MISSING_LISTED",
    "IdleSweeper",
    "MissingShardsError",
    "PutReceipt",
    "ShardStore",
    "SharedMemoryUnavailable",
    "StoreCapacityError",
    "StoreStats",
    "UnknownStageError",
    "bundle_from_raw",
]
