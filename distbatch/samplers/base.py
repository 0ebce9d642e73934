"""What every sampler shares: `BaseSampler` (TransferQueue's interface, its cache of sampled
batches and its checkpoint rows), the argument checks, and `probe_safe`."""

from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from distbatch.checks import check_int
from distbatch.errors import InvalidArgumentError

logger = logging.getLogger("distbatch.samplers")

STATE_VERSION = 1
DEFAULT_MAX_CACHED_BATCHES = 4096

# (sampled, consumed) for one (partition_id, task_name, dp_rank, batch_index).
_Entry = tuple[list[int], list[int]]
_States = dict[str, dict[str, dict[int, dict[int, _Entry]]]]


# A `sample` marked so changes nothing when the ready list is empty: `check_call` probes it.
PROBE_SAFE = "_distbatch_probe_safe"
F = TypeVar("F", bound=Callable[..., Any])


def probe_safe(sample: F) -> F:
    """Mark a `sample` that changes nothing when called with an empty ready list, so
    `BaseSampler.check_call` may probe it with one (a subclass that overrides `sample` without
    this mark is not probed: its `sample` may have side effects)."""
    setattr(sample, PROBE_SAFE, True)
    return sample


class LengthSource(Protocol):
    """What the controller passes as ``partition=``: per-sample lengths from metadata."""

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]: ...


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


def _complete_groups(
    ready_indexes: Sequence[int], n: int, count: int, partition: Any = None
) -> list[int] | None:
    """Ids of the first `count` complete groups (all n members ready), or None if fewer exist.

    Group k is the aligned block [k*n, (k+1)*n); groups are taken in order of id, oldest policy
    version first where `partition` has versions (see `oldest_first`).
    """
    ready = set(ready_indexes)
    for i in ready:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise InvalidArgumentError(f"ready indexes must be non-negative ints, got {i!r}")
    members = Counter(i // n for i in ready)
    complete = sorted(g for g, c in members.items() if c == n)
    if len(complete) < count:
        return None
    if _keeps_versions(partition):
        return [i // n for i in oldest_first([g * n for g in complete], partition)[:count]]
    return complete[:count]


def _keeps_versions(partition: Any) -> bool:
    """Whether `partition` (a controller's) knows the policy version of some task."""
    has_versions = getattr(partition, "has_versions", None)
    return callable(has_versions) and bool(has_versions())


def oldest_first(indexes: Sequence[int], partition: Any) -> list[int]:
    """`indexes` in order of the policy version their tasks were put with, oldest first, then of
    index (tasks without a version last): what an asynchronous consumer takes first, so fewer
    tasks grow too old. Index order alone is not age: a cleared task's index is reused by a
    later put. Unchanged where `partition` keeps no versions."""
    if not _keeps_versions(partition):
        return list(indexes)
    version = partition.versions.item  # item by item: no numpy call that releases the GIL
    newest = sys.maxsize  # a task without a version (-1) sorts last

    def age(i: int) -> tuple[int, int]:
        v = version(i)
        return (newest if v < 0 else v, i)

    return sorted(indexes, key=age)


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
        if getattr(type(self).sample, PROBE_SAFE, False):
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


def _rows_from_transferqueue(states: Any) -> list[list[Any]]:
    """Cache rows (our checkpoint format) from TransferQueue's ``_states``, where an entry is
    ``(sampled, consumed)`` or the bare sampled list; InvalidArgumentError if it is anything else."""
    try:
        return list(_cache_rows(states))
    except (AttributeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"TransferQueue sampler state is not in its layout: {exc}") from None
