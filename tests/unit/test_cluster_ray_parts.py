"""The Ray cluster bench's pure parts (bench/cluster/ray_peer.py): cutting rows out of a packed ragged
column, mapping balanced chunks to each producer's rows, the busiest link from pair bytes, and
the controller's repeats summarised. No Ray needed."""

from __future__ import annotations

import numpy as np
import torch

from bench.cluster.ray_peer import link_bytes, split_rows, summarise, take_ragged
from distbatch import DistributedBatchMemory


def test_take_ragged_packs_the_chosen_rows_in_order() -> None:
    values = np.arange(10, dtype=np.int32)  # rows: [0 1 2] [3] [] [4 5 6 7 8 9]
    offsets = np.array([0, 3, 4, 4, 10])
    got, new_offsets = take_ragged(values, offsets, np.array([3, 0, 2]))
    assert got.tolist() == [4, 5, 6, 7, 8, 9, 0, 1, 2]
    assert new_offsets.tolist() == [0, 6, 9, 9]
    empty, empty_offsets = take_ragged(values, offsets, np.zeros(0, dtype=np.int64))
    assert empty.dtype == np.int32 and empty.size == 0 and empty_offsets.tolist() == [0]


def test_take_ragged_on_distbatch_packed_columns_gives_the_tasks_values() -> None:
    rng = np.random.default_rng(3)
    rows_values = [torch.randn(int(k), generator=torch.Generator().manual_seed(i)) for i, k in
                   enumerate(rng.integers(0, 9, 12))]  # fmt: skip
    values, offsets = DistributedBatchMemory.from_list([{"x": v} for v in rows_values]).packed("x")
    rows = np.array([1, 4, 5, 11])
    got, new_offsets = take_ragged(values.numpy(), offsets.numpy(), rows)
    assert np.array_equal(got, torch.cat([rows_values[r] for r in rows]).numpy())
    assert np.diff(new_offsets).tolist() == [len(rows_values[r]) for r in rows]


def test_split_rows_gives_each_producer_its_local_rows_per_consumer() -> None:
    # Producer 0 has 4 tasks (global 0-3), producer 1 has 2 (global 4-5).
    chunks = [np.array([0, 1, 4]), np.array([2, 3, 5])]
    local = split_rows(chunks, [4, 2])
    assert [[r.tolist() for r in per_consumer] for per_consumer in local] == [[[0, 1], [2, 3]], [[0], [1]]]


def test_link_bytes_counts_only_bytes_between_hosts() -> None:
    # pair[producer][consumer]; producer i and consumer i share host i.
    pair = [[400, 200, 0], [40, 0, 0], [80, 120, 0]]
    # Host 0 receives 120, host 1 receives 320; host 0 sends 200, host 1 sends 40, host 2 sends 200.
    assert link_bytes(pair) == {"in": 320, "out": 200, "total": 840, "local": 400}


def test_summarise_takes_medians_and_the_bound_of_the_busiest_link() -> None:
    def repeat(gets: list[float], busiest: int) -> dict[str, object]:
        link = {"in": busiest, "out": busiest // 2, "total": 4 * busiest, "local": busiest}
        return {"wall": max(gets) + 0.01, "cpu": 0.5, "gets": gets, "tasks": [2, 2], "objects": [2, 2],
                "bytes": [1, 1], "link": link}  # fmt: skip

    out = summarise(2, [repeat([1.0, 2.0], 100), repeat([3.0, 1.0], 300), repeat([0.5, 1.5], 200)], 800)
    assert out["ray_get_s"] == 2.0 and out["ray_get_seconds"] == [2.0, 3.0, 1.5]
    assert out["busiest_link_bytes"] == 200 and out["ray_bound_s"] == 2.0
    assert out["ray_get_over_bound"] == 1.0 and out["layout"] == "packed"
