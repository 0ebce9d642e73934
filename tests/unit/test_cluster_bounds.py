"""The cluster bench's link lower bound: which bytes cross which host's NIC when each receiver
gathers its chunk peer to peer (bench/cluster/job.py), from a batch's metadata alone."""

from __future__ import annotations

import numpy as np

from bench.cluster.job import busiest_link_bytes, bytes_by_host
from distbatch import DistributedBatchMemory
from distbatch.batch.meta import BatchMeta, FieldMeta
from distbatch.wire.shapes import RowShapes

# Nodes are only named here (nothing connects): port 0, hosts told apart by address.
A, B, C = "10.77.0.2:0", "10.77.0.3:0", "10.77.0.4:0"
A2 = "[10.77.0.2]:0"  # another worker's name on A's host (the bracketed form of its address)


def remote(nodes: list[str], where: list[int], lengths: list[int]) -> DistributedBatchMemory:
    """A REMOTE batch of one int32 ragged field (4 bytes per element) and one JSON field."""
    n = len(where)
    ids = FieldMeta("I32", np.array(where), RowShapes.from_list([(k,) for k in lengths]), True)
    text = FieldMeta(None, np.array(where), RowShapes.uniform(n, ()), False)
    meta = BatchMeta([f"t{i}" for i in range(n)], nodes, {"ids": ids, "text": text})
    return DistributedBatchMemory.from_meta(meta)


def test_bytes_by_host_counts_tensor_bytes_per_host_and_merges_workers_of_one_host() -> None:
    batch = remote([A, A2, B], [0, 1, 2, 2], [10, 5, 1, 2])
    assert bytes_by_host(batch) == {"10.77.0.2": 60, "10.77.0.3": 12}


def test_the_busiest_link_is_the_most_loaded_nic_each_way_and_local_bytes_cross_none() -> None:
    to_a = remote([A, B, C], [0, 1, 2], [100, 10, 20])  # 400 local, 40 from B, 80 from C
    to_b = remote([A, B, C], [0, 2], [50, 30])  # 200 from A, 120 from C
    links = busiest_link_bytes([to_a, to_b], [A2, B])
    # A receives 120, B receives 320; A sends 200, B sends 40, C sends 200.
    assert links == {"in": 320, "out": 200, "total": 840, "local": 400}
