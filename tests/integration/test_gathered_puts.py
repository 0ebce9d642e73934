"""A ragged column's per-task tensors are put from where they lie (`wire.Pieces`, gathering writes).

Over HTTP and through a shared region, against real workers: exact bytes back, split into staged
requests, tensors that cannot travel as they lie (strided, negated views) taken the careful way,
and refusals that arrive while the body is still going out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import torch

from distbatch import DistributedBatchMemory, ShardClient, wire
from distbatch.errors import AuthError, CapacityError, RequestError, WorkerUnavailableError
from distbatch.launch import WorkerProcess
from distbatch.wire.tensors import SCATTER_MIN_TENSORS

NO_TOKEN_ENV = {"DISTBATCH_TOKEN": ""}


def _ragged(n: int, seed: int = 0, max_len: int = 300) -> dict[str, list[torch.Tensor]]:
    """Per-task tensors, each its own allocation, some of them empty."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (n,), generator=gen).tolist()
    return {
        "ids": [torch.randint(0, 50_000, (k,), generator=gen, dtype=torch.int32) for k in lengths],
        "lp": [torch.randn(k, generator=gen).to(torch.bfloat16) for k in lengths],
    }


def _assert_equal(got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]]) -> None:
    for field, values in want.items():
        assert len(got[field]) == len(values)
        for g, w in zip(got[field], values):
            assert g.dtype == w.dtype and torch.equal(g, w)


def test_a_ragged_column_is_exported_as_pieces_not_joined() -> None:
    columns = _ragged(SCATTER_MIN_TENSORS + 5)
    bundle, _ = DistributedBatchMemory.from_dict(columns).export_bundle("127.0.0.1:1")
    for field in columns:
        (part,) = bundle.columns[field].parts
        assert isinstance(part, wire.Pieces)
        assert part.nbytes == sum(v.nbytes for v in columns[field])
        want = b"".join(bytes(v.view(torch.uint8).numpy()) for v in columns[field])
        assert bytes(wire.byte_view(part)) == want
    few, _ = DistributedBatchMemory.from_dict(_ragged(SCATTER_MIN_TENSORS - 1)).export_bundle("127.0.0.1:1")
    assert not any(isinstance(p, wire.Pieces) for c in few.columns.values() for p in c.parts)
    copied, _ = DistributedBatchMemory.from_dict(columns).export_bundle("127.0.0.1:1", copy=True)
    assert not any(isinstance(p, wire.Pieces) for c in copied.columns.values() for p in c.parts)


@pytest.mark.parametrize("max_bytes", [None, 16 << 10], ids=["one-request", "staged"])
def test_a_ragged_put_over_http_round_trips_exactly(
    start_worker: Callable[..., WorkerProcess], max_bytes: int | None
) -> None:
    worker = start_worker(env=NO_TOKEN_ENV)
    columns = _ragged(400)
    options = {} if max_bytes is None else {"max_bytes_per_request": max_bytes}
    with ShardClient(**options) as client:
        remote = DistributedBatchMemory.from_dict(columns).to_remote(worker.node, client)
        sent = client.traffic()
        payload = sum(v.nbytes for values in columns.values() for v in values)
        assert sent.requests >= (1 if max_bytes is None else payload // max_bytes)
        assert sent.bytes_sent >= payload
        _assert_equal(DistributedBatchMemory.from_meta(remote.meta, client).get_data(), columns)
        remote.clear()


def test_a_ragged_put_through_shared_memory_round_trips_exactly(same_host: tuple[str, ShardClient]) -> None:
    node, client = same_host
    columns = _ragged(300, seed=1)
    remote = DistributedBatchMemory.from_dict(columns).to_remote(node, client)
    _assert_equal(DistributedBatchMemory.from_meta(remote.meta, client).get_data(), columns)
    remote.clear()


def test_tensors_that_do_not_hold_their_values_as_they_lie_are_joined_instead(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """A strided view's memory has gaps and a negated view's memory holds the values' negation:
    neither can be written out as it lies, so the column is joined (one `cat`) and still exact."""
    worker = start_worker(env=NO_TOKEN_ENV)
    base = [torch.arange(2 * k, dtype=torch.float32) for k in range(1, SCATTER_MIN_TENSORS + 9)]
    cases = {
        "strided": [t[::2] for t in base],
        "negated": [torch._neg_view(t) for t in base],
        "mixed": [t if i % 2 else t[::2] for i, t in enumerate(base)],
    }
    with ShardClient() as client:
        for name, values in cases.items():
            bundle, _ = DistributedBatchMemory.from_dict({name: values}).export_bundle(worker.node)
            assert not any(isinstance(p, wire.Pieces) for p in bundle.columns[name].parts), name
            remote = DistributedBatchMemory.from_dict({name: values}).to_remote(worker.node, client)
            got = DistributedBatchMemory.from_meta(remote.meta, client).get_data()[name]
            assert all(torch.equal(g, v.clone()) for g, v in zip(got, values)), name
            remote.clear()


@pytest.mark.parametrize("rows", [100, 20_000], ids=["whole-body-sent", "refused-mid-body"])
def test_a_refused_ragged_put_raises_the_workers_answer_and_stores_nothing(
    start_worker: Callable[..., WorkerProcess], rows: int
) -> None:
    """The worker refuses before it reads the body: over its request bound, its capacity, or
    with a wrong token. The client reports that answer (not a broken pipe), also when the
    refusal arrives while most of the body is still going out."""
    columns = _ragged(rows, seed=2, max_len=400)
    bounded = start_worker("--max-request-bytes", "4096", env=NO_TOKEN_ENV)
    full = start_worker("--max-bytes", "4096", env=NO_TOKEN_ENV)
    secured = start_worker(env={"DISTBATCH_TOKEN": "secret"})
    with ShardClient(retries=1, timeout=20) as client:
        with pytest.raises(RequestError) as info:
            DistributedBatchMemory.from_dict(columns).to_remote(bounded.node, client)
        assert info.value.status == 413
        with pytest.raises(CapacityError):
            DistributedBatchMemory.from_dict(columns).to_remote(full.node, client)
        assert client.stats(bounded.node)["shards"] == 0 and client.stats(full.node)["shards"] == 0
    with ShardClient(retries=1, timeout=20, token="wrong") as client:
        with pytest.raises(AuthError):
            DistributedBatchMemory.from_dict(columns).to_remote(secured.node, client)
    with ShardClient(retries=1, timeout=20, token="secret") as client:
        assert client.stats(secured.node)["shards"] == 0


def test_a_ragged_put_to_a_stopped_worker_fails_by_its_stall_timeout(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """A SIGSTOPped worker reads nothing: the gathered body stops going out once the kernel's
    buffers are full, and the put fails by the stall timeout, saying so; resumed, the worker
    holds nothing of it and takes the same put."""
    worker = start_worker(env=NO_TOKEN_ENV)
    columns = _ragged(6_000, seed=3, max_len=2_000)  # ~18 MB: more than the socket buffers hold
    stall = 1.0
    with ShardClient(timeout=30.0, stall_timeout=stall, retries=0) as client:
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(WorkerUnavailableError, match="stalled"):
                DistributedBatchMemory.from_dict(columns).to_remote(worker.node, client)
            assert time.monotonic() - started <= stall * 1.25 + 5.0
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert client.stats(worker.node)["shards"] == 0
        remote = DistributedBatchMemory.from_dict(columns).to_remote(worker.node, client)
        _assert_equal(DistributedBatchMemory.from_meta(remote.meta, client).get_data(), columns)
        remote.clear()
