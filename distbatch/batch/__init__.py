"""The batch: `DistributedBatchMemory` (LOCAL, REMOTE or EMPTY) and its metadata.

Owns what a batch is and how it is rearranged:

- `memory`: the batch object; checks arguments and asks its state;
- `states`: the batch's status as one object (`EmptyState`, `LocalState`, `RemoteState`):
  what each holds and how it answers reads, rearrangements, gathers and clears;
- `meta`: its columnar metadata (per field a dtype, per task a node and a shape);
- `columns`: a LOCAL batch's data (building, taking, concatenating, packing, pickling and
  exporting columns);
- `ragged`: ragged columns over one packed tensor (`RaggedViews`), and jagged nested tensors
  (`torch.nested`, `layout=torch.jagged`) in and out;
- `remote`: a REMOTE batch's state (metadata, client, cache of gathered fields) and its
  metadata-only rearrangements;
- `gather`: fetching fields through `distbatch.client` and putting the responses in task order;
- `ops`: which rows an index, a chunk, a balanced chunk or a union takes, for both statuses;
- `balance`: sequence-length balancing (Karmarkar–Karp), which `ops` and the samplers use;
- `calls`: engine-call envelopes, how arguments and results of an engine call travel (a batch
  as its metadata, never its data).

Slicing, chunking, balancing, union and concat of a REMOTE batch move metadata only; reading
a field gathers it. May import `distbatch.client`, `distbatch.wire`, `distbatch.ids`,
`distbatch.gc_pause`, `distbatch.twins` and `distbatch.errors`; never the controller or the
launchers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distbatch.batch.memory import DistributedBatchMemory, new_task_ids
    from distbatch.batch.meta import BatchMeta, FieldMeta
    from distbatch.batch.states import BatchStatus

# Imported on first use, so `distbatch.batch.balance` (which the samplers use) costs neither
# torch nor aiohttp.
_LAZY = {
    "BatchMeta": "distbatch.batch.meta",
    "BatchStatus": "distbatch.batch.states",
    "DistributedBatchMemory": "distbatch.batch.memory",
    "FieldMeta": "distbatch.batch.meta",
    "new_task_ids": "distbatch.batch.memory",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distbatch.batch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["BatchMeta", "BatchStatus", "DistributedBatchMemory", "FieldMeta", "new_task_ids"]
