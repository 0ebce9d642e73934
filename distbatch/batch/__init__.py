"""The batch: `DistributedBatchMemory` (LOCAL, REMOTE or EMPTY) and its metadata.

Owns what a batch is and how it is rearranged: the batch object (`memory`) and its columnar
metadata (`meta`: per field a dtype, per task a node and a shape). Slicing, chunking,
balancing, union and concat of a REMOTE batch move metadata only; reading a field gathers it
through `distbatch.client`. May import `distbatch.client`, `distbatch.wire`,
`distbatch.balance`, `distbatch.ids` and `distbatch.errors`; never the controller or the
launchers.
"""

from distbatch.batch.memory import BatchStatus, DistributedBatchMemory, new_task_ids
from distbatch.batch.meta import BatchMeta, FieldMeta

__all__ = ["BatchMeta", "BatchStatus", "DistributedBatchMemory", "FieldMeta", "new_task_ids"]
