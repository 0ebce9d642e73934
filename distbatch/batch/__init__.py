"""The batch: `DistributedBatchMemory` (LOCAL, REMOTE or EMPTY) and its metadata.

Owns what a batch is and how it is rearranged:

- `memory`: the batch object; checks arguments, picks the LOCAL or REMOTE path, and says
  what a gather asks the workers for;
- `meta`: its columnar metadata (per field a dtype, per task a node and a shape);
- `columns`: a LOCAL batch's data (building, taking, concatenating, packing, pickling and
  exporting columns);
- `ragged`: ragged columns over one packed tensor (`RaggedViews`), and jagged nested tensors
  (`torch.nested`, `layout=torch.jagged`) in and out;
- `remote`: a REMOTE batch's state (metadata, client, cache of gathered fields) and its
  metadata-only rearrangements;
- `gather`: fetching fields through `distbatch.client` and putting the responses in task order;
- `ops`: which rows an index, a chunk, a balanced chunk or a union takes, for both statuses.

Slicing, chunking, balancing, union and concat of a REMOTE batch move metadata only; reading
a field gathers it. May import `distbatch.client`, `distbatch.wire`, `distbatch.balance`,
`distbatch.ids`, `distbatch.gc_pause`, `distbatch.twins` and `distbatch.errors`; never the
controller or the launchers.
"""

from distbatch.batch.memory import BatchStatus, DistributedBatchMemory, new_task_ids
from distbatch.batch.meta import BatchMeta, FieldMeta

__all__ = ["BatchMeta", "BatchStatus", "DistributedBatchMemory", "FieldMeta", "new_task_ids"]
