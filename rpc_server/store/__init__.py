"""The worker's shard store: columns kept as immutable segments, indexed per task with numpy.

The store owns every shard a worker holds and the memory behind it: the task and per-field
index (`index`), the segments and the buffers they point into, with compaction (`segments`),
both kept consistent by puts and deletes (`shards`), appends that extend stored values
(`appends`), staged puts and their capacity
reservations (`stages`), shared-memory regions for same-host readers (`regions`), the columns
a fetch answers with (`columns`), its background sweepers (`sweeper`), and the `ShardStore`
facade (`shard_store`) whose lock makes each public method atomic. Puts, fetches and deletes
are array operations over those tables: no Python object is made per shard, and no loop runs
once per row, except over the runs of rows a scattered fetch touches. `stats()` reports live
bytes (what capacity counts) and held bytes (what the process holds). The store is on the
worker's data path: it imports neither torch nor aiohttp.

The names below are the store's public API, re-exported from the modules that define them.
"""

from rpc_server.errors import (
    AppendMismatchError,
    MissingShardsError,
    ReplacedShardsError,
    SharedMemoryUnavailable,
    StoreCapacityError,
    UnknownStageError,
)
from rpc_server.store.columns import GATHER_RUN_BYTES, MAX_MISSING_LISTED, MAX_SEND_RUNS
from rpc_server.store.records import PutReceipt, StoreStats, bundle_from_raw
from rpc_server.store.segments import COMPACT_MIN_BYTES
from rpc_server.store.shard_store import SHARE_ATTEMPTS, ShardStore
from rpc_server.store.sweeper import IdleSweeper

__all__ = [
    "COMPACT_MIN_BYTES",
    "AppendMismatchError",
    "GATHER_RUN_BYTES",
    "MAX_MISSING_LISTED",
    "MAX_SEND_RUNS",
    "SHARE_ATTEMPTS",
    "IdleSweeper",
    "MissingShardsError",
    "PutReceipt",
    "ReplacedShardsError",
    "ShardStore",
    "SharedMemoryUnavailable",
    "StoreCapacityError",
    "StoreStats",
    "UnknownStageError",
    "bundle_from_raw",
]
