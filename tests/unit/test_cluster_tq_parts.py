"""The TransferQueue cluster bench's pure parts (bench/cluster/tq_peer.py): keys per chunk in the
order the chunk is assembled, a host pair's bytes without cutting the rows, NIC counters from
/proc/net/dev, TransferQueue's returned fields as packed numpy, addresses to hosts, and the
controller's repeats summarised. Neither Ray nor TransferQueue needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.cluster.ray_peer import piece_bytes, split_rows, take_ragged
from bench.cluster.tq_peer import (
    busiest,
    chunk_keys,
    markdown_table,
    nic_bytes,
    nic_delta,
    packed,
    placed_hosts,
    report,
    rows_bytes,
    summarise,
    task_key,
)

NET_DEV = """Inter-|   Receive                                |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier
    lo:    1200   10 0 0 0 0 0 0    1200   10 0 0 0 0 0 0
  eth0: 5000000 4000 0 0 0 0 0 0 7000000 5000 0 0 0 0 0 0
"""


def test_chunk_keys_follow_producer_order_then_the_rows() -> None:
    # Producer 0 has 4 tasks (global 0-3), producer 1 has 2 (global 4-5).
    local = split_rows([np.array([0, 1, 4]), np.array([2, 3, 5])], [4, 2])
    assert chunk_keys(7, local, 0) == [task_key(7, 0, 0), task_key(7, 0, 1), task_key(7, 1, 0)]
    assert chunk_keys(7, local, 1) == ["7-0-2", "7-0-3", "7-1-1"]
    assert len({task_key(s, p, r) for s in (-1, 0, 1) for p in range(3) for r in range(12)}) == 3 * 3 * 12


def test_rows_bytes_equals_the_bytes_of_the_rows_cut_out() -> None:
    offsets = np.array([0, 3, 4, 4, 10], dtype=np.int64)
    fields = {
        "input_ids": np.arange(10, dtype=np.int64),
        "logprobs": np.zeros(10, dtype=np.float32),
        "loss_mask": np.ones(10, dtype=np.int8),
        "advantages": np.zeros(4, dtype=np.float32),
    }
    for rows in (np.array([3, 0, 2]), np.array([1]), np.zeros(0, dtype=np.int64), np.arange(4)):
        piece: dict[str, np.ndarray] = {}
        for f in ("input_ids", "logprobs", "loss_mask"):
            piece[f], _ = take_ragged(fields[f], offsets, rows)
        piece["advantages"] = fields["advantages"][rows]
        assert rows_bytes(fields, offsets, rows) == piece_bytes(piece)


def test_nic_bytes_reads_one_interface_of_proc_net_dev() -> None:
    assert nic_bytes(NET_DEV) == {"received": 5_000_000, "sent": 7_000_000}
    assert nic_bytes(NET_DEV, "lo") == {"received": 1200, "sent": 1200}
    with pytest.raises(ValueError, match="eth1"):
        nic_bytes(NET_DEV, "eth1")
    before = [{"received": 1, "sent": 2}, {"received": 10, "sent": 20}]
    after = [{"received": 5, "sent": 2}, {"received": 40, "sent": 21}]
    moved = nic_delta(after, before)
    assert moved == [{"received": 4, "sent": 0}, {"received": 30, "sent": 1}]
    assert busiest(moved) == 30 and busiest([]) == 0


def test_packed_takes_transferqueues_nested_and_dense_fields() -> None:
    rows = [torch.arange(3), torch.arange(0), torch.arange(5) + 10]
    values, lengths = packed(torch.nested.as_nested_tensor(rows, layout=torch.jagged))
    assert values.tolist() == [0, 1, 2, 10, 11, 12, 13, 14] and lengths.tolist() == [3, 0, 5]
    # A view whose offsets do not start at 0 (a slice of a bigger buffer).
    base = torch.arange(10)
    view = torch.nested.nested_tensor_from_jagged(base, offsets=torch.tensor([2, 4, 7]))
    values, lengths = packed(view)
    assert values.tolist() == [2, 3, 4, 5, 6] and lengths.tolist() == [2, 3]
    values, lengths = packed(torch.tensor([0.5, -1.0], dtype=torch.float32))
    assert values.dtype == np.float32 and values.tolist() == [0.5, -1.0] and lengths.tolist() == [1, 1]


def test_placed_hosts_maps_cluster_addresses_to_hosts() -> None:
    assert placed_hosts(["10.77.0.1", "10.77.0.3", "10.77.0.2"]) == [0, 2, 1]
    with pytest.raises(ValueError, match="not a cluster address"):
        placed_hosts(["127.0.0.1"])


def _repeat(put: float, get: float, busiest_bytes: int, moved: int) -> dict[str, object]:
    link = {"in": busiest_bytes, "out": busiest_bytes // 2, "total": 4 * busiest_bytes, "local": 1}
    nic = [{"received": 10, "sent": 10}, {"received": moved, "sent": moved // 2}]
    return {"puts": [put, put / 2], "gets": [get / 2, get], "put_wall": put + 0.1, "get_wall": get + 0.1,
            "put_cpu": 0.5, "get_cpu": 0.25, "tasks": [2, 2], "bytes": [1, 1], "link": link,
            "put_moved": nic, "get_moved": nic, "keys_left": 0, "equal": True}  # fmt: skip


def test_summarise_takes_medians_of_the_slowest_put_and_get() -> None:
    repeats = [_repeat(1.0, 2.0, 100, 1000), _repeat(3.0, 1.0, 300, 3000), _repeat(2.0, 4.0, 200, 2000)]
    out = summarise(2, repeats, 800)
    assert out["tq_put_s"] == 2.0 and out["tq_get_s"] == 2.0
    assert out["tq_put_get_s"] == 4.0  # medians of 3, 4, 6 (per repeat), not the sum of medians
    assert out["busiest_link_bytes"] == 200 and out["bound_s"] == 2.0
    assert out["put_busiest_nic_bytes"] == 2000 and out["put_moved_s"] == 20.0
    assert out["equal"] is True and out["keys_left"] == 0
    out["distbatch_data_s"] = 2.0
    out["tq_get_over_distbatch_data"] = 1.0
    out["tq_put_get_over_distbatch_data"] = 2.0
    assert "2.00x" in report([out])[-1] and "50%/25%" in report([out])[-1]
    assert markdown_table([out]).splitlines()[-1].endswith("| 1.00× | 2.00× |")
