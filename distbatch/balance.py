"""Sequence-length balancing: Karmarkar–Karp largest differencing over k partitions.

Used by `DistributedBatchMemory.chunk_balanced` and the seqlen-balanced sampler.
Every function validates its input and raises `ValueError` (never `assert`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence


class _State:
    """k partial partitions (sums and members), kept sorted by sum, largest first.

    Ties in sum put the partition with more members first, so empty partitions
    come last and a merge fills them before stacking two items together (every
    partition ends non-empty whenever there are at least k items).
    """

    __slots__ = ("sums", "members")

    def __init__(self, sums: list[int], members: list[list[int]]) -> None:
        order = sorted(range(len(sums)), key=lambda i: (-sums[i], -len(members[i]), members[i]))
        self.sums = [sums[i] for i in order]
        self.members = [members[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: _State) -> _State:
        # Pair the heaviest partitions of one with the lightest of the other.
        k = len(self.sums)
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        members = [self.members[i] + other.members[k - 1 - i] for i in range(k)]
        return _State(sums, members)


def _check_lengths(seqlen_list: Sequence[int], k_partitions: int) -> list[int]:
    if not isinstance(k_partitions, int) or isinstance(k_partitions, bool) or k_partitions < 1:
        raise ValueError(f"k_partitions must be a positive int, got {k_partitions!r}")
    lengths = list(seqlen_list)
    for value in lengths:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"sequence lengths must be non-negative ints, got {value!r}")
    return lengths


def karmarkar_karp(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split item indexes into `k_partitions` lists with near-equal length sums.

    With `equal_size` every partition gets the same number of items (the item
    count must then be divisible by k). Each returned list is sorted.
    """
    lengths = _check_lengths(seqlen_list, k_partitions)
    k = k_partitions
    if equal_size and len(lengths) % k:
        raise ValueError(f"{len(lengths)} items cannot be split into {k} equal-size partitions")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    states: list[_State] = []
    if equal_size:
        for start in range(0, len(order), k):
            chunk = order[start : start + k]
            states.append(_State([lengths[i] for i in chunk], [[i] for i in chunk]))
    else:
        for i in order:
            states.append(_State([lengths[i]] + [0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    if not states:
        return [[] for _ in range(k)]
    heap = [(-s.spread, n, s) for n, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, counter, merged))
        counter += 1
    return [sorted(m) for m in heap[0][2].members]


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Balanced partitions of item indexes; every partition non-empty when possible.

    Like `karmarkar_karp`, plus a check that the result covers each index once.
    Raises `ValueError` when there are fewer items than partitions.
    """
    lengths = _check_lengths(seqlen_list, k_partitions)
    if len(lengths) < k_partitions:
        raise ValueError(f"{len(lengths)} items cannot fill {k_partitions} partitions")
    partitions = karmarkar_karp(lengths, k_partitions, equal_size)
    seen = sorted(i for p in partitions for i in p)
    if seen != list(range(len(lengths))) or any(not p for p in partitions):
        raise ValueError("balancing produced an invalid partition")  # a bug, not user error
    return partitions


def balanced_group_partitions(group_lengths: Sequence[int], k_partitions: int) -> list[list[int]]:
    """Partition groups into k parts whose counts differ by at most one, lengths balanced.

    When the count is not divisible by k, zero-length placeholders fill the
    remainder for an equal-size split and are dropped afterwards.
    """
    lengths = _check_lengths(group_lengths, k_partitions)
    padding = -len(lengths) % k_partitions
    # Placeholders go first (indexes 0..padding-1): they then sort ahead of any real
    # zero-length group into the first k-item chunk, whose items all land in
    # different partitions, so no partition receives two of them.
    padded = [0] * padding + lengths
    parts = karmarkar_karp(padded, k_partitions, equal_size=True)
    real = [[i - padding for i in part if i >= padding] for part in parts]
    return refine_by_swaps(real, lengths)


def refine_by_swaps(
    partitions: list[list[int]], lengths: Sequence[int], max_rounds: int | None = None
) -> list[list[int]]:
    """Improve a partition by swapping one item between the heaviest and lightest parts.

    Karmarkar–Karp is a fine start but can leave a sizeable gap on heavy-tailed
    lengths with k > 2; each swap strictly narrows the heaviest/lightest gap
    and keeps every partition's item count, so the result is never worse.
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
        best: tuple[int, int, int] | None = None
        for a in parts[heavy]:
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
        parts[heavy][parts[heavy].index(a)] = b
        parts[light][parts[light].index(b)] = a
        delta = lengths[a] - lengths[b]
        sums[heavy] -= delta
        sums[light] += delta
    return [sorted(p) for p in parts]
