"""Samplers: which ready samples a consumer, and which data-parallel rank, gets next.

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

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from distbatch.balance import balanced_group_partitions, get_seqlen_balanced_partitions, karmarkar_karp
from distbatch.checks import check_int
from distbatch.errors import InvalidArgumentError

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
]

logger = logging.getLogger(__name__)

STATE_VERSION = 1
DEFAULT_MAX_CACHED_BATCHES = 4096

# (sampled, consumed) for one (partition_id, task_name, dp_rank, batch_index).
_Entry = tuple[list[int], list[int]]
_States = dict[str, dict[str, dict[int, dict[int, _Entry]]]]


class LengthSource(Protocol):
    """What the controller passes as ``partition=``: per-sample lengths from metadata."""

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]: ...


# --------------------------------------------------------------------------- validation


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{name} must be a str, got {value!r}")
    return value


def _index_list(values: Any, name: str) -> list[int]:
    """A fresh list of non-negative ints (sample indexes), else ValueError."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidArgumentError(f"{name} must be a list of sample indexes, got {type(values).__name__}")
    return [check_int(v, name, 0) for v in values]


def _rank_key(dp_rank: Any, batch_index: Any) -> tuple[int, int] | None:
    """(dp_rank, batch_index) validated; None when both are absent."""
    if dp_rank is None and batch_index is None:
        return None
    if dp_rank is None or batch_index is None:
        raise InvalidArgumentError(
            f"dp_rank and batch_index go together, got dp_rank={dp_rank!r}, batch_index={batch_index!r}"
        )
    return check_int(dp_rank, "dp_rank", 0), check_int(batch_index, "batch_index", 0)


def _required_rank_key(dp_rank: Any, batch_index: Any, who: str) -> tuple[int, int]:
    key = _rank_key(dp_rank, batch_index)
    if key is None:
        raise InvalidArgumentError(f"{who} needs dp_rank and batch_index in the sampling config")
    return key


def _entry_lists(entry: Any) -> _Entry:
    """A cache entry as (sampled, consumed): ours are pairs; TransferQueue's RankAwareSampler (and
    a sampler ported from it) stores the sampled list alone, consumed being the same list."""
    if isinstance(entry, tuple) or (
        isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
    ):
        sampled, consumed = entry
        return list(sampled), list(consumed)
    return list(entry), list(entry)


def _cache_rows(states: Any) -> Iterator[list[Any]]:
    """``[partition_id, task_name, dp_rank, batch_index, sampled, consumed]`` per entry of a
    ``_states`` tree (ours or TransferQueue's), unchecked."""
    for partition_id, tasks in states.items():
        for task_name, ranks in tasks.items():
            for dp_rank, batches in ranks.items():
                for batch_index, entry in batches.items():
                    yield [partition_id, task_name, dp_rank, batch_index, *_entry_lists(entry)]


def _checked_row(row: Sequence[Any]) -> list[Any]:
    """A cache row with each item validated (the checkpoint's row format)."""
    return [
        _check_str(row[0], "partition_id"),
        _check_str(row[1], "task_name"),
        check_int(row[2], "dp_rank", 0),
        check_int(row[3], "batch_index", 0),
        _index_list(row[4], "sampled"),
        _index_list(row[5], "consumed"),
    ]


def _complete_groups(ready_indexes: Sequence[int], n: int, count: int) -> list[int] | None:
    """Ids of the first `count` complete groups (all n members ready), or None if fewer exist.

    Group k is the aligned block [k*n, (k+1)*n); groups are taken in order of id.
    """
    ready = set(ready_indexes)
    for i in ready:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise InvalidArgumentError(f"ready indexes must be non-negative ints, got {i!r}")
    members = Counter(i // n for i in ready)
    complete = sorted(g for g, c in members.items() if c == n)
    if len(complete) < count:
        return None
    return complete[:count]


# --------------------------------------------------------------------------- base


class BaseSampler(ABC):
    """Decides which ready samples a `get_meta` call returns and which it marks consumed.

    Subclasses implement `sample`. Rank-aware subclasses keep their per-rank
    cache in `_states` (see the module docstring), which `clear_cache`,
    `has_cached_result`, `state_dict` and `load_state_dict` all understand; a
    subclass that keeps other state overrides the last two.
    """

    max_cached_batches: int = DEFAULT_MAX_CACHED_BATCHES

    def __init__(self) -> None:
        self._states: _States = {}

    @abstractmethod
    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """Return (sampled, consumed) chosen from `ready_indexes`; ([], []) when there is not enough."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        """Same as `sample` (the controller calls samplers this way)."""
        return self.sample(*args, **kwargs)

    def clear_cache(self, partition_id: str) -> None:
        """Forget every cached result of the partition (its indexes may be reused next)."""
        self._states.pop(partition_id, None)
        sizes = self._batch_sizes()
        for key in [k for k in sizes if k[0] == partition_id]:
            del sizes[key]

    def forget_indexes(self, partition_id: str, indexes: Iterable[int]) -> None:
        """Drop cached results that hand out any of `indexes` (those tasks were cleared).

        Finer than `clear_cache`: portions that a rank has not fetched yet stay
        cached as long as none of their samples was cleared, so a partial clear
        never loses consumed-but-undelivered samples, while a cleared index that
        gets reused can never come back from a stale cache entry.
        """
        gone = set(indexes)
        sizes = self._batch_sizes()
        for task_name, ranks in self._states.get(partition_id, {}).items():
            for dp_rank, batches in ranks.items():
                for batch_index, entry in list(batches.items()):
                    sampled, consumed = _entry_lists(entry)
                    if gone.intersection(sampled):
                        del batches[batch_index]
                        sizes.pop((partition_id, task_name, dp_rank, batch_index), None)
                    elif gone.intersection(consumed):
                        # A sibling's cleared sample: never mark its index (maybe reused) consumed again.
                        batches[batch_index] = self._entry(sampled, [i for i in consumed if i not in gone])

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: Mapping[str, Any] | None = None
    ) -> bool:
        """True when a result for the config's ``dp_rank`` / ``batch_index`` is cached.

        Lets a polling controller answer a TP peer from the cache without
        checking whether enough samples are ready. Reads the config only and
        never raises: a missing or invalid key is simply not cached (`sample`
        is where a bad config is refused), as in TransferQueue.
        """
        config = sampling_config if isinstance(sampling_config, Mapping) else {}
        try:
            key = _rank_key(config.get("dp_rank"), config.get("batch_index"))
        except InvalidArgumentError:
            return False
        if key is None:
            return False
        ranks = self._states.get(partition_id, {}).get(task_name, {})
        batches = ranks.get(key[0]) if isinstance(ranks, Mapping) else None
        return isinstance(batches, Mapping) and key[1] in batches

    def check_call(self, batch_size: Any, **config: Any) -> None:
        """Refuse a call's arguments (`InvalidArgumentError`) without sampling anything.

        The controller calls this instead of `sample` while too few samples are
        ready, so a bad batch size or sampling config fails at once rather than
        once data arrives. Our samplers check by sampling from an empty ready list,
        which changes nothing; a subclass that overrides `sample` is not probed
        (its `sample` may have side effects), unless it overrides this too.
        """
        if type(self).sample in _SAMPLES_WITHOUT_SIDE_EFFECTS:
            self.sample([], batch_size, **config)

    # ---------------------------------------------------------------- the cache

    def _batch_sizes(self) -> dict[tuple[str, str, int, int], int]:
        """The batch size each cached key was sampled with (created on first use: a ported
        subclass may not call ``BaseSampler.__init__``)."""
        sizes = self.__dict__.get("_sizes")
        if sizes is None:
            sizes = self.__dict__["_sizes"] = {}
        return sizes

    def _cached(
        self, partition_id: str, task_name: str, dp_rank: int, batch_index: int, batch_size: int | None = None
    ) -> _Entry | None:
        """The cached result of a key (copies), or None; `InvalidArgumentError` if it was
        sampled with another `batch_size`."""
        entry = self._states.get(partition_id, {}).get(task_name, {}).get(dp_rank, {}).get(batch_index)
        if entry is None:
            return None
        if batch_size is not None:
            first = self._batch_sizes().get((partition_id, task_name, dp_rank, batch_index))
            if first is not None and first != batch_size:
                raise InvalidArgumentError(
                    f"dp_rank {dp_rank}, batch_index {batch_index} of task {task_name!r} in partition "
                    f"{partition_id!r} was sampled with batch_size {first}; asked again with {batch_size} "
                    "(every TP/PP peer of a rank must use the same batch size)"
                )
        return _entry_lists(entry)  # copies: callers may mutate what they get

    def _remember(
        self,
        partition_id: str,
        task_name: str,
        dp_rank: int,
        batch_index: int,
        sampled: Sequence[int],
        consumed: Sequence[int],
        batch_size: int | None = None,
    ) -> None:
        """Cache a result unless one is already there; evict the oldest beyond the bound."""
        batches = self._states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})
        if batch_index in batches:
            return
        batches[batch_index] = self._entry(sampled, consumed)
        sizes = self._batch_sizes()
        if batch_size is None:
            sizes.pop((partition_id, task_name, dp_rank, batch_index), None)
        else:
            sizes[(partition_id, task_name, dp_rank, batch_index)] = batch_size
        while len(batches) > self.max_cached_batches:
            oldest = next(iter(batches))
            del batches[oldest]
            sizes.pop((partition_id, task_name, dp_rank, oldest), None)

    def _entry(self, sampled: Sequence[int], consumed: Sequence[int]) -> Any:
        """What `_states` holds for one key: a (sampled, consumed) pair, as TransferQueue's group
        samplers keep it (`RankAwareSampler` keeps a bare list when the two agree, as theirs does)."""
        return list(sampled), list(consumed)

    # ---------------------------------------------------------------- checkpoint

    def _config(self) -> dict[str, int]:
        """Settings a checkpoint must agree with (group size, dp size); none by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe snapshot of the cache (see the module docstring for the format)."""
        try:
            cache = [_checked_row(row) for row in _cache_rows(self._states)]
        except (AttributeError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"{type(self).__name__}._states is not in the standard layout ({exc}); "
                "override state_dict() and load_state_dict()"
            ) from None
        return {"version": STATE_VERSION, "config": self._config(), "cache": cache}

    def _parse_state(self, state: Mapping[str, Any]) -> _States:
        """Validate a `state_dict` and build the `_states` it describes, changing nothing."""
        state = self._checked_header(state)
        raw = state.get("cache", [])
        if not isinstance(raw, list):
            raise InvalidArgumentError("sampler state 'cache' must be a list")
        states: _States = {}
        for row in raw:
            if not isinstance(row, (list, tuple)) or len(row) != 6:
                raise InvalidArgumentError(f"sampler cache rows have 6 items, got {row!r}")
            partition_id, task_name, dp_rank, batch_index, sampled, consumed = _checked_row(row)
            batches = states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})
            if batch_index in batches:
                raise InvalidArgumentError(f"sampler state lists {row[:4]} twice")
            batches[batch_index] = self._entry(sampled, consumed)
        self._trim(states)
        return states

    def _checked_header(self, state: Any) -> Mapping[str, Any]:
        """A state's keys, version and config checked (TransferQueue's layout converted first)."""
        if not isinstance(state, Mapping):
            raise InvalidArgumentError(f"sampler state must be a mapping, got {type(state).__name__}")
        if "_states" in state:  # TransferQueue's save_checkpoint(): {"_states": ..., "_balanced_cache": ...}
            state = {"cache": _rows_from_transferqueue(state["_states"])}
        unknown = sorted(set(state) - {"version", "config", "cache", "inner"})
        if unknown:
            raise InvalidArgumentError(f"sampler state has unknown keys {unknown}")
        if state and "cache" not in state:
            raise InvalidArgumentError("sampler state has no 'cache' (an empty mapping empties the cache)")
        version = state.get("version", STATE_VERSION)
        if version != STATE_VERSION:
            raise InvalidArgumentError(f"sampler state version {version!r} is not {STATE_VERSION}")
        config = state.get("config")
        if config is not None and (not isinstance(config, Mapping) or dict(config) != self._config()):
            raise InvalidArgumentError(
                f"sampler state was saved with config {config!r}; this sampler has {self._config()}"
            )
        return state

    def _trim(self, states: _States) -> None:
        """Keep at most `max_cached_batches` per rank, the newest (a checkpoint may hold more)."""
        for tasks in states.values():
            for ranks in tasks.values():
                for batches in ranks.values():
                    while len(batches) > self.max_cached_batches:
                        del batches[next(iter(batches))]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the cache with a `state_dict` (an empty mapping empties it); ValueError if invalid."""
        self._states = self._parse_state(state)
        self._batch_sizes().clear()

    def save_checkpoint(self) -> dict[str, Any]:
        """TransferQueue's name for `state_dict` (the controller checkpoints through `state_dict`,
        so a sampler with extra state overrides that pair)."""
        return self.state_dict()

    def load_checkpoint(self, state: Mapping[str, Any]) -> None:
        """TransferQueue's name for `load_state_dict`."""
        self.load_state_dict(state)


def _check_bound(max_cached_batches: Any) -> int:
    return check_int(max_cached_batches, "max_cached_batches", 1)


# --------------------------------------------------------------------------- samplers


class SequentialSampler(BaseSampler):
    """The first `batch_size` ready indexes, in the order given; nothing cached.

    As in TransferQueue, fewer than `batch_size` ready means all of them: the
    controller only asks once at least `batch_size` are ready (see the module
    docstring), so this matters to direct callers only.
    """

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """(the first batch_size ready indexes, the same); batch_size 0 gives ([], [])."""
        batch_size = check_int(batch_size, "batch_size", 0)
        sampled = _index_list(ready_indexes[:batch_size], "ready_indexes")
        return sampled, list(sampled)


class GRPOGroupNSampler(BaseSampler):
    """Whole GRPO groups only: the n responses of a prompt are sampled together or not at all.

    Group k is the aligned block ``[k*n, (k+1)*n)`` (see the module docstring);
    it is complete when all n indexes are ready. A call takes the first
    ``batch_size // n`` complete groups by index, or nothing. With ``dp_rank``
    and ``batch_index`` in the sampling config the result is cached per rank
    (like `RankAwareSampler`); without them nothing is cached.
    """

    def __init__(
        self, n_samples_per_prompt: int = 1, *, max_cached_batches: int = DEFAULT_MAX_CACHED_BATCHES
    ) -> None:
        super().__init__()
        self.n_samples_per_prompt = check_int(n_samples_per_prompt, "n_samples_per_prompt", 1)
        self.max_cached_batches = _check_bound(max_cached_batches)

    def _config(self) -> dict[str, int]:
        return {"n_samples_per_prompt": self.n_samples_per_prompt}

    def _check_n(self, n_samples_per_prompt: Any) -> int:
        """A per-call n (TransferQueue's older API passed it in the config) must match ours."""
        n = self.n_samples_per_prompt
        if (
            n_samples_per_prompt is not None
            and check_int(n_samples_per_prompt, "n_samples_per_prompt", 1) != n
        ):
            raise InvalidArgumentError(
                f"n_samples_per_prompt={n_samples_per_prompt!r} but this sampler was built with {n}"
            )
        return n

    def _select(self, ready_indexes: Sequence[int], n_groups: int) -> list[int] | None:
        """Sample indexes of the first `n_groups` complete groups, or None."""
        n = self.n_samples_per_prompt
        groups = _complete_groups(ready_indexes, n, n_groups)
        if groups is None:
            return None
        return [g * n + j for g in groups for j in range(n)]

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        dp_rank: int | None = None,
        batch_index: int | None = None,
        n_samples_per_prompt: int | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """`batch_size // n` complete groups (batch_size must be a multiple of n), or ([], [])."""
        batch_size = check_int(batch_size, "batch_size", 0)
        n = self._check_n(n_samples_per_prompt)
        if batch_size % n:
            raise InvalidArgumentError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})"
            )
        if batch_size == 0:
            return [], []
        partition_id = _check_str(partition_id, "partition_id")
        task_name = _check_str(task_name, "task_name")
        key = _rank_key(dp_rank, batch_index)
        if key is not None:
            cached = self._cached(partition_id, task_name, *key, batch_size)
            if cached is not None:
                return cached
        sampled = self._select(ready_indexes, batch_size // n)
        if sampled is None:
            return [], []
        if key is not None:
            self._remember(partition_id, task_name, *key, sampled, sampled, batch_size)
        return sampled, list(sampled)


class RankAwareSampler(BaseSampler):
    """Same ``(partition_id, task_name, dp_rank, batch_index)`` -> same samples, for every TP/PP peer.

    The first call for a key lets the wrapped sampler (default
    `SequentialSampler`) choose from ``ready_indexes`` and caches its answer;
    later calls return the cached answer even after those samples have left
    ``ready_indexes``. Different dp ranks get disjoint samples because the
    first call reports them consumed. The wrapped sampler is called without
    ``dp_rank`` / ``batch_index``: it only selects, caching is done here.

    As in TransferQueue, a first call that cannot fill ``batch_size`` (an
    answer shorter than that) returns ``([], [])`` and caches nothing, and
    positional order is theirs: ``sample(ready, batch_size, dp_rank,
    batch_index, task_name, partition_id)``.
    """

    def __init__(
        self, sampler: BaseSampler | None = None, *, max_cached_batches: int = DEFAULT_MAX_CACHED_BATCHES
    ) -> None:
        super().__init__()
        if sampler is None:
            sampler = SequentialSampler()
        if not isinstance(sampler, BaseSampler):
            raise InvalidArgumentError(f"sampler must be a BaseSampler, got {type(sampler).__name__}")
        if isinstance(sampler, (RankAwareSampler, SeqlenBalancedSampler)):
            raise InvalidArgumentError(f"{type(sampler).__name__} is rank-aware already; use it directly")
        self.sampler = sampler
        self.max_cached_batches = _check_bound(max_cached_batches)

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        dp_rank: int | None = None,
        batch_index: int | None = None,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """The cached result for this rank and batch index, else a fresh full one (then cached)."""
        batch_size = check_int(batch_size, "batch_size", 0)
        key = _required_rank_key(dp_rank, batch_index, type(self).__name__)
        if batch_size == 0:
            return [], []
        partition_id = _check_str(partition_id, "partition_id")
        task_name = _check_str(task_name, "task_name")
        cached = self._cached(partition_id, task_name, *key, batch_size)
        if cached is not None:
            return cached
        if not ready_indexes:
            return [], []  # nothing to choose from: the wrapped sampler is not asked
        sampled, consumed = self.sampler.sample(
            ready_indexes, batch_size, partition_id=partition_id, task_name=task_name, **kwargs
        )
        if len(sampled) < batch_size:
            return [], []
        sampled = _index_list(sampled, "sampled")
        consumed = _index_list(consumed, "consumed")
        self._remember(partition_id, task_name, *key, sampled, consumed, batch_size)
        return sampled, consumed

    def check_call(self, batch_size: Any, **config: Any) -> None:
        """Check this sampler's arguments, then the wrapped sampler's (without the rank keys)."""
        super().check_call(batch_size, **config)
        inner = {k: v for k, v in config.items() if k not in ("dp_rank", "batch_index")}
        self.sampler.check_call(batch_size, **inner)

    def _entry(self, sampled: Sequence[int], consumed: Sequence[int]) -> Any:
        # TransferQueue's layout: the sampled list itself when nothing else is consumed.
        if list(sampled) == list(consumed):
            return list(sampled)
        return list(sampled), list(consumed)

    def clear_cache(self, partition_id: str) -> None:
        """Forget this partition here and in the wrapped sampler."""
        super().clear_cache(partition_id)
        self.sampler.clear_cache(partition_id)

    def forget_indexes(self, partition_id: str, indexes: Iterable[int]) -> None:
        """Drop cached results holding any of `indexes`, here and in the wrapped sampler."""
        gone = list(indexes)
        super().forget_indexes(partition_id, gone)
        self.sampler.forget_indexes(partition_id, gone)

    def state_dict(self) -> dict[str, Any]:
        """The cache plus the wrapped sampler's state under ``"inner"``."""
        state = super().state_dict()
        state["inner"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the cache and the wrapped sampler's state; nothing changes if either is invalid."""
        states = self._parse_state(state)
        self.sampler.load_state_dict(state.get("inner", {}))
        self._states = states
        self._batch_sizes().clear()


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Whole groups for all dp ranks at once, split so every rank gets about the same token count.

    On the first call for ``(partition_id, task_name, batch_index)``, from
    whichever rank comes first, it takes ``batch_size * dp_size`` samples as
    complete groups and splits the groups over the ranks with Karmarkar–Karp
    (`balanced_group_partitions`) on per-group total length: every rank's
    portion holds ``batch_size // n`` groups. Every rank's portion is cached, and the
    first caller reports **all** selected samples consumed at once, so no
    sample can land in two batches. Later calls (other ranks, TP peers)
    return their cached portion with ``consumed`` equal to it.

    Lengths, first found wins:

    1. a ``lengths`` mapping of index to length in the sampling config
       (standalone use; every selected index must be in it);
    2. per-sample ``custom_meta`` ``total_lengths`` from
       ``partition.get_custom_meta(indexes)``, TransferQueue's way (a sample
       without one counts as length 1, as there);
    3. ``partition.sample_lengths(indexes, length_field)``: the first dimension
       of ``length_field`` as stored (our controller's partitions offer it);
    4. none of these: an equal split by count, with a warning. Without a
       partition, rank r gets the r-th run of ``batch_size`` selected samples;
       with one, every sample weighs 1 in the balancing. Both are what
       TransferQueue does (it warns only in the first case).

    ``batch_size`` is the per-rank size and must be a multiple of
    ``n_samples_per_prompt`` (whole groups per rank): anything else is an
    `InvalidArgumentError`, since a rank would otherwise get more or fewer
    tasks than it asked for. ``batch_size=0`` gives ``([], [])``. All ranks'
    entries of a batch index are inserted (and so evicted) together.
    """

    def __init__(
        self,
        n_samples_per_prompt: int = 1,
        dp_size: int = 1,
        length_field: str = "input_ids",
        *,
        max_cached_batches: int = DEFAULT_MAX_CACHED_BATCHES,
    ) -> None:
        super().__init__(n_samples_per_prompt, max_cached_batches=max_cached_batches)
        self.dp_size = check_int(dp_size, "dp_size", 1)
        self.length_field = _check_str(length_field, "length_field")

    def _config(self) -> dict[str, int]:
        return {"n_samples_per_prompt": self.n_samples_per_prompt, "dp_size": self.dp_size}

    def _lengths(self, indexes: list[int], partition: Any, lengths: Any) -> list[int] | None:
        """Per-sample lengths of `indexes` (see the class docstring for the order), or None."""
        if lengths is not None:
            if not isinstance(lengths, Mapping):
                raise InvalidArgumentError(
                    f"lengths must be a mapping of sample index to length, got {type(lengths)}"
                )
            missing = [i for i in indexes if i not in lengths]
            if missing:
                raise InvalidArgumentError(f"lengths has no entry for sample indexes {missing[:5]}")
            return [check_int(lengths[i], "sample length", 0) for i in indexes]
        if partition is None:
            self._no_lengths("no partition", "no partition= was given")
            return None
        get_custom_meta = getattr(partition, "get_custom_meta", None)
        if callable(get_custom_meta):
            meta = get_custom_meta(indexes) or {}
            found = [(meta.get(i) or {}).get("total_lengths") for i in indexes]
            if any(v is not None for v in found):
                return [1 if v is None else check_int(v, "total_lengths", 0) for v in found]
        sample_lengths = getattr(partition, "sample_lengths", None)
        if not callable(sample_lengths):
            self._no_lengths("no lengths", "no sample has custom_meta total_lengths")
            return [1] * len(indexes)
        try:
            values = list(sample_lengths(indexes, self.length_field))
        except InvalidArgumentError as exc:
            self._no_lengths("no lengths", f"no sample has custom_meta total_lengths, and {exc}")
            return [1] * len(indexes)
        if len(values) != len(indexes):
            raise InvalidArgumentError(
                f"sample_lengths gave {len(values)} lengths for {len(indexes)} indexes"
            )
        return [check_int(v, "sample length", 0) for v in values]

    def _no_lengths(self, kind: str, why: str) -> None:
        """Log that this batch is split by count: a warning the first time for each kind of
        reason, then at debug level (a training loop would repeat it every step)."""
        warned = self.__dict__.setdefault("_warned", set())
        level = logging.DEBUG if kind in warned else logging.WARNING
        warned.add(kind)
        logger.log(level, "SeqlenBalancedSampler: %s; splitting by count, without balancing lengths", why)

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        dp_rank: int | None = None,
        batch_index: int | None = None,
        n_samples_per_prompt: int | None = None,
        partition: LengthSource | None = None,
        lengths: Mapping[int, int] | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """This rank's balanced portion of batch `batch_index`; consumed = the whole batch on first call."""
        batch_size = check_int(batch_size, "batch_size", 0)
        n = self._check_n(n_samples_per_prompt)
        total = batch_size * self.dp_size
        if batch_size % n:
            # Not whole groups per rank: n=4, dp=2, batch_size=6 would serve 8 and 4 tasks.
            raise InvalidArgumentError(
                f"batch_size ({batch_size}, per rank) must be a multiple of n_samples_per_prompt ({n}): "
                "every rank gets whole groups"
            )
        partition_id = _check_str(partition_id, "partition_id")
        task_name = _check_str(task_name, "task_name")
        rank, index = _required_rank_key(dp_rank, batch_index, type(self).__name__)
        if rank >= self.dp_size:
            raise InvalidArgumentError(f"dp_rank {rank} is not in [0, {self.dp_size})")
        if batch_size == 0:
            return [], []
        cached = self._cached(partition_id, task_name, rank, index, batch_size)
        if cached is not None:
            return cached
        selected = self._select(ready_indexes, total // n)
        if selected is None:
            return [], []
        per_sample = self._lengths(selected, partition, lengths)
        if per_sample is None:  # no partition: contiguous runs, as TransferQueue
            portions = [selected[r * batch_size : (r + 1) * batch_size] for r in range(self.dp_size)]
        else:
            group_lengths = [sum(per_sample[g * n : (g + 1) * n]) for g in range(total // n)]
            parts = balanced_group_partitions(group_lengths, self.dp_size)
            portions = [[selected[g * n + j] for g in part for j in range(n)] for part in parts]
        for r, portion in enumerate(portions):
            self._remember(partition_id, task_name, r, index, portion, portion, batch_size)
        return list(portions[rank]), list(selected)


# `check_call` probes these with an empty ready list: they then change nothing.
_SAMPLES_WITHOUT_SIDE_EFFECTS = frozenset(
    cls.sample for cls in (SequentialSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler)
)


def _rows_from_transferqueue(states: Any) -> list[list[Any]]:
    """Cache rows (our checkpoint format) from TransferQueue's ``_states``, where an entry is
    ``(sampled, consumed)`` or the bare sampled list; InvalidArgumentError if it is anything else."""
    try:
        return list(_cache_rows(states))
    except (AttributeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"TransferQueue sampler state is not in its layout: {exc}") from None
