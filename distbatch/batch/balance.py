"""Sequence-length balancing: Karmarkar–Karp largest differencing over k partitions.

Used by `DistributedBatchMemory.chunk_balanced` and the seqlen-balanced sampler.
Every function validates its input and raises `ValueError` (never `assert`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np

from distbatch.errors import InvalidArgumentError

# Up to this many items, Karmarkar-Karp runs as is; past it (its per-merge Python work grows
# to seconds at 10^5 items) a vectorised snake split refined by swaps takes over.
EXACT_MAX_ITEMS = 4096


class _State:
    """k partial partitions (sums and members), kept sorted heaviest first.

    The order is verl's and TransferQueue's, so the merge sequence, and with it
    the result before refinement, is the same as theirs: partitions by sum,
    then member count, then member list, all descending. Empty partitions come
    last, so a merge fills them before stacking two items together (every
    partition ends non-empty whenever there are at least k items).
    """

    __slots__ = ("sums", "members")

    def __init__(self, sums: list[int], members: list[list[int]]) -> None:
        order = sorted(range(len(sums)), key=lambda i: (sums[i], len(members[i]), members[i]), reverse=True)
        self.sums = [sums[i] for i in order]
        self.members = [members[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def __lt__(self, other: _State) -> bool:
        """Heap order: the widest spread pops first, then the heavier top partition."""
        if self.spread != other.spread:
            return self.spread > other.spread
        mine = (self.sums[0], len(self.members[0]), self.members[0])
        theirs = (other.sums[0], len(other.members[0]), other.members[0])
        return mine > theirs

    def merge(self, other: _State) -> _State:
        # Pair the heaviest partitions of one with the lightest of the other.
        k = len(self.sums)
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        members = [self.members[i] + other.members[k - 1 - i] for i in range(k)]
        return _State(sums, members)


def _check_lengths(seqlen_list: Sequence[int], k_partitions: int) -> list[int]:
    if not isinstance(k_partitions, int) or isinstance(k_partitions, bool) or k_partitions < 1:
        raise InvalidArgumentError(f"k_partitions must be a positive int, got {k_partitions!r}")
    lengths = list(seqlen_list)
    for value in lengths:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgumentError(f"sequence lengths must be non-negative ints, got {value!r}")
    return lengths


def karmarkar_karp(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split item indexes into `k_partitions` lists with near-equal length sums.

    With `equal_size` every partition gets the same number of items (the item
    count must then be divisible by k). Each returned list is sorted.

    The Karmarkar-Karp pass merges in the same order as verl's and
    TransferQueue's; `refine_by_swaps` then narrows the gap further where it
    can, so the spread (heaviest minus lightest sum) is never wider than theirs.
    """
    lengths = _check_lengths(seqlen_list, k_partitions)
    k = k_partitions
    if equal_size and len(lengths) % k:
        raise InvalidArgumentError(f"{len(lengths)} items cannot be split into {k} equal-size partitions")
    return refine_by_swaps(karmarkar_karp_merges(lengths, k, equal_size), lengths, keep_counts=equal_size)


def karmarkar_karp_merges(lengths: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """The Karmarkar-Karp merges alone (verl's and TransferQueue's order), members unsorted."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    heap: list[_State] = []
    if equal_size:
        for start in range(0, len(order), k):
            chunk = order[start : start + k]
            heap.append(_State([lengths[i] for i in chunk], [[i] for i in chunk]))
    else:
        for i in order:
            heap.append(_State([lengths[i]] + [0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        heapq.heappush(heap, a.merge(b))
    return heap[0].members


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Balanced partitions of item indexes; every partition non-empty when possible.

    Like `karmarkar_karp`, plus a check that the result covers each index once.
    Raises `ValueError` when there are fewer items than partitions.
    """
    lengths = _check_lengths(seqlen_list, k_partitions)
    if len(lengths) < k_partitions:
        raise InvalidArgumentError(f"{len(lengths)} items cannot fill {k_partitions} partitions")
    partitions = karmarkar_karp(lengths, k_partitions, equal_size)
    seen = sorted(i for p in partitions for i in p)
    if seen != list(range(len(lengths))) or any(not p for p in partitions):
        raise InvalidArgumentError("balancing produced an invalid partition")  # a bug, not user error
    return partitions


def balanced_group_partitions(group_lengths: Sequence[int], k_partitions: int) -> list[list[int]]:
    """Partition groups into k parts whose counts differ by at most one, lengths balanced.

    When the count is not divisible by k, zero-length placeholders fill the
    remainder for an equal-size split and are dropped afterwards.
    """
    if len(group_lengths) > EXACT_MAX_ITEMS:
        return _balanced_many(group_lengths, k_partitions)
    lengths = _check_lengths(group_lengths, k_partitions)
    padding = -len(lengths) % k_partitions
    # Placeholders go first (indexes 0..padding-1): they then sort ahead of any real
    # zero-length group into the first k-item chunk, whose items all land in
    # different partitions, so no partition receives two of them.
    padded = [0] * padding + lengths
    # No swaps yet: they could pair placeholders.
    parts = karmarkar_karp_merges(padded, k_partitions, equal_size=True)
    real = [[i - padding for i in part if i >= padding] for part in parts]
    return refine_by_swaps(real, lengths)


def refine_by_swaps(
    partitions: list[list[int]],
    lengths: Sequence[int],
    max_rounds: int | None = None,
    *,
    keep_counts: bool = True,
) -> list[list[int]]:
    """Improve a partition by exchanging items between the heaviest and lightest parts.

    Karmarkar–Karp is a fine start but can leave a sizeable gap on heavy-tailed
    lengths with k > 2. Each step swaps one item of the heaviest part for one
    of the lightest (or, unless `keep_counts`, moves one item across, never
    emptying a part), and only when that strictly narrows their gap. Both new
    sums then lie between the old two, so the overall spread never widens.
    Returns new sorted lists; the input is not modified.
    """
    parts = [list(p) for p in partitions]
    if len(parts) < 2:
        return [sorted(p) for p in parts]
    sums = [sum(lengths[i] for i in p) for p in parts]
    rounds = max_rounds if max_rounds is not None else 4 * sum(len(p) for p in parts) + 16
    for _ in range(rounds):
        heavy = max(range(len(parts)), key=lambda j: sums[j])
        light = min(range(len(parts)), key=lambda j: sums[j])
        gap = sums[heavy] - sums[light]
        if gap <= 0:
            break
        # Swapping a (heavy) with b (light) changes the pair's gap to |gap - 2*(la - lb)|;
        # the best b for each a is the one with lb closest to la - gap/2.
        light_sorted = sorted(parts[light], key=lambda i: lengths[i])
        light_lengths = [lengths[i] for i in light_sorted]
        best: tuple[int, int, int | None] | None = None
        for a in parts[heavy]:
            if not keep_counts and len(parts[heavy]) > 1 and 0 < lengths[a] < gap:
                new_gap = abs(gap - 2 * lengths[a])  # move a alone
                if best is None or new_gap < best[0]:
                    best = (new_gap, a, None)
            target = lengths[a] - gap / 2
            pos = bisect.bisect_left(light_lengths, target)
            for q in (pos - 1, pos):
                if 0 <= q < len(light_sorted):
                    diff = lengths[a] - light_lengths[q]
                    new_gap = abs(gap - 2 * diff)
                    if 0 < diff < gap and (best is None or new_gap < best[0]):
                        best = (new_gap, a, light_sorted[q])
        if best is None:
            break
        _, a, b = best
        parts[heavy].remove(a)
        parts[light].append(a)
        delta = lengths[a]
        if b is not None:
            parts[light].remove(b)
            parts[heavy].append(b)
            delta -= lengths[b]
        sums[heavy] -= delta
        sums[light] += delta
    return [sorted(p) for p in parts]


def _balanced_many(group_lengths: Sequence[int], k: int) -> list[list[int]]:
    """`balanced_group_partitions` for many items, on numpy: counts differ by at most one.

    Items sorted by length (largest first) are dealt in a snake (0..k-1, k-1..0, ...), which
    leaves each partition within about one item's length of the others; then the heaviest
    and lightest partitions swap the pair of items that best closes their gap, while that
    helps. With thousands of small items the result is as even as Karmarkar-Karp's.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidArgumentError(f"k_partitions must be a positive int, got {k!r}")
    lengths = np.asarray(group_lengths)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (len(lengths) and lengths.min() < 0):
        _check_lengths(list(group_lengths), k)  # says which value is wrong
        raise InvalidArgumentError("sequence lengths must be non-negative ints")
    lengths = lengths.astype(np.int64)
    n = len(lengths)
    order = np.argsort(-lengths, kind="stable")
    position = np.arange(n)
    column = position % k
    owner = np.empty(n, dtype=np.int64)
    owner[order] = np.where((position // k) % 2 == 0, column, k - 1 - column)
    _refine_vectorised(owner, lengths, k, rounds=4 * k)
    return [np.flatnonzero(owner == p).tolist() for p in range(k)]


def _refine_vectorised(owner: np.ndarray, lengths: np.ndarray, k: int, rounds: int) -> None:
    """Swap single items between the heaviest and the lightest partition while that narrows
    their gap (counts stay the same); `owner` is updated in place."""
    sums = np.bincount(owner, weights=lengths, minlength=k).astype(np.int64)
    for _ in range(rounds):
        heavy, light = int(sums.argmax()), int(sums.argmin())
        gap = int(sums[heavy] - sums[light])
        if gap <= 0:
            return
        in_heavy, in_light = np.flatnonzero(owner == heavy), np.flatnonzero(owner == light)
        if not len(in_heavy) or not len(in_light):
            return  # an empty partition (more partitions than items): no swap keeps the counts
        light_order = np.argsort(lengths[in_light], kind="stable")
        light_sorted = lengths[in_light][light_order]
        heavy_lengths = lengths[in_heavy]
        # Swapping a (heavy) for b (light) leaves a gap of |gap - 2 (a - b)|: best b is near a - gap/2.
        near = np.searchsorted(light_sorted, heavy_lengths - gap / 2)
        best = (gap, -1, -1)
        for candidate in (
            np.clip(near - 1, 0, len(light_sorted) - 1),
            np.clip(near, 0, len(light_sorted) - 1),
        ):
            new_gaps = np.abs(gap - 2 * (heavy_lengths - light_sorted[candidate]))
            i = int(new_gaps.argmin())
            if new_gaps[i] < best[0]:
                best = (int(new_gaps[i]), i, int(candidate[i]))
        if best[1] < 0:
            return
        a, b = in_heavy[best[1]], in_light[light_order[best[2]]]
        owner[a], owner[b] = light, heavy
        moved = int(lengths[a] - lengths[b])
        sums[heavy] -= moved
        sums[light] += moved
