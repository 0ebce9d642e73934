"""Samplers: which ready samples a consumer, and which data-parallel rank, gets next.

One module per sampler (`sequential`, `grpo`, `rank_aware`, `seqlen_balanced`) over `base`
(`BaseSampler`, its cache and checkpoint rows, the argument checks); every name is importable
from `distbatch.samplers` as before. A `sample` marked `@probe_safe` changes nothing when the
ready list is empty, so the controller may probe a batch size and config with it before data
arrives.

Samplers run inside the controller and see only per-partition sample indexes
(never data). The interface matches TransferQueue's, so a custom sampler
written for TransferQueue ports by changing its import:

- ``sample(ready_indexes, batch_size, *args, **kwargs) -> (sampled, consumed)``:
  ``sampled`` goes to the caller; ``consumed`` is marked consumed for the
  calling ``task_name`` and never offered to it again. Both are returned even
  when they are the same list.
- ``__call__`` delegates to ``sample``; ``clear_cache(partition_id)`` forgets
  every cached result of a partition (the controller calls it when a
  partition's tasks are cleared or its consumption is reset).

The controller calls ``sampler(ready, batch_size, partition_id=...,
task_name=..., partition=..., **sampling_config)``, where ``sampling_config``
is whatever the consumer passed (``dp_rank``, ``batch_index``...) and
``partition`` offers ``get_custom_meta(indexes)`` (TransferQueue's) and
``sample_lengths(indexes, field)``. As TransferQueue's controller does, it
calls a sampler only when ``ready`` holds ``batch_size`` indexes or
``has_cached_result`` says this rank's answer is cached; short of that it
calls ``check_call`` (our samplers check their arguments there, so a mistake
fails at once; a ported sampler without it is simply not called).

**Rank-aware caching.** TP/PP peers of one data-parallel rank each ask for
the same ``(dp_rank, batch_index)`` and must get the same samples, in any
order and while prefetching ahead. The first call for a key samples from
``ready_indexes`` and caches the result in ``_states[partition_id][task_name]
[dp_rank][batch_index] = (sampled, consumed)`` (TransferQueue's layout); later
calls return the cache even though those samples have left ``ready_indexes``.
(`RankAwareSampler` stores the bare ``sampled`` list when ``consumed`` is the
same, as TransferQueue's does; readers of ``_states`` accept both forms.)
The cache is bounded: at most ``max_cached_batches`` (default 4096) batch
indexes per ``(partition_id, task_name, dp_rank)``, oldest inserted evicted
first. A peer that falls more than that many batches behind its fastest
sibling therefore gets a fresh batch instead of its siblings' one. A cached
key asked again with another ``batch_size`` is refused
(`InvalidArgumentError`): a peer configured differently would otherwise get
its siblings' batch silently. (The batch size is not part of the checkpoint:
after a load, cached keys are served without that check.)

**Groups.** Group samplers treat the aligned block ``[k*n, (k+1)*n)`` as the
k-th group of ``n = n_samples_per_prompt`` samples. The controller gives each
put a contiguous block of indexes aligned to the put's size, so putting whole
groups (a multiple of n samples per put, the n responses of one prompt
adjacent) keeps every group on one aligned block. A put that is not a whole
number of groups breaks that alignment.

**Checkpoints.** ``state_dict()`` is JSON-safe (string keys, lists, ints)::

    {"version": 1, "config": {...ints...},
     "cache": [[partition_id, task_name, dp_rank, batch_index, sampled, consumed], ...]}

listed in insertion order, so a loaded sampler evicts exactly as the saved
one would have. ``load_state_dict`` validates everything before it changes
anything, and rejects a ``config`` (group size, dp size) other than its own.

**Errors.** Invalid input (a batch size, a sampling config, a checkpoint)
raises `InvalidArgumentError`, a `ValueError`; the controller's HTTP face
answers it with 400. Any other exception from a sampler is a bug (500).

Samplers are not thread-safe by themselves: the controller calls them under
its lock.
"""

from distbatch.batch.balance import get_seqlen_balanced_partitions, karmarkar_karp
from distbatch.samplers.base import (
    DEFAULT_MAX_CACHED_BATCHES,
    STATE_VERSION,
    BaseSampler,
    LengthSource,
    probe_safe,
)
from distbatch.samplers.grpo import GRPOGroupNSampler
from distbatch.samplers.rank_aware import RankAwareSampler
from distbatch.samplers.seqlen_balanced import SeqlenBalancedSampler
from distbatch.samplers.sequential import SequentialSampler

# The public path, as before the package: what reprs, pickles and error messages name.
for _public in (
    BaseSampler,
    GRPOGroupNSampler,
    LengthSource,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    probe_safe,
):
    _public.__module__ = __name__
del _public

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "LengthSource",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "DEFAULT_MAX_CACHED_BATCHES",
    "STATE_VERSION",
    "get_seqlen_balanced_partitions",
    "karmarkar_karp",
    "probe_safe",
]
