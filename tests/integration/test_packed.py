"""`packed(field)`, the async batch methods and `WorkerGroup.acall*`, with real workers on loopback.

Two module-scoped workers host `engines_for_tests:make_echo_engine`; every test pushes its
own tasks (fresh ids) and clears them. `packed` is checked against `torch.cat` of the
per-task values for LOCAL batches and for REMOTE ones held by one node, by two nodes, and
by two nodes interleaved task by task (the gather then reorders rows).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import torch
from batch_support import place
from engines_for_tests import ENGINES_ENV

from distbatch import DistributedBatchMemory, EngineError, ShardClient, WorkerGroup, wire
from distbatch.batch import BatchStatus
from distbatch.errors import ShardNotFoundError

DBM = DistributedBatchMemory
ENV = ENGINES_ENV


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def group(echo_pair: WorkerGroup) -> WorkerGroup:
    return echo_pair


def fetch_requests(node: str) -> int:
    """`POST /v1/shards/fetch` requests the worker has served so far (its own counter)."""
    with urllib.request.urlopen(f"http://{node}/metrics", timeout=10) as response:
        text = response.read().decode()
    prefix = 'distbatch_requests_total{endpoint="/v1/shards/fetch"'
    return int(sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(prefix)))


# --------------------------------------------------------------------------- data


def ragged(n: int, dtype: torch.dtype = torch.int32, lengths: list[int] | None = None) -> list[torch.Tensor]:
    lengths = lengths or [(3 * i + 1) % 7 for i in range(n)]  # 1, 4, 0, 3, 6, 2, 5, 1...
    g = torch.Generator().manual_seed(n)
    return [(torch.randn(length, generator=g) * 100).to(dtype) for length in lengths]


LAYOUTS: dict[str, Callable[[int], Any]] = {
    "ragged_int32": lambda n: ragged(n),
    "ragged_bf16": lambda n: ragged(n, torch.bfloat16),
    "ragged_tail": lambda n: [torch.randn(length, 3) for length in [(i * 5) % 4 for i in range(n)]],
    "stacked": lambda n: torch.arange(n * 4, dtype=torch.float32).reshape(n, 4),
    "stacked_3d_bf16": lambda n: torch.randn(n, 2, 3).to(torch.bfloat16),
    "scalars": lambda n: torch.arange(n, dtype=torch.int64) * 7,  # one 0-d value per task
    "empty_rows": lambda n: [torch.zeros(0, dtype=torch.int64) for _ in range(n)],
}


def per_task(column: Any) -> list[torch.Tensor]:
    return list(column.unbind(0)) if isinstance(column, torch.Tensor) else list(column)


def reference(values: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """`torch.cat` of the per-task values (a 0-d value is one row) and the N+1 offsets."""
    rows = [v.reshape(1) if v.dim() == 0 else v for v in values]
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + row.shape[0])
    return torch.cat(rows), offsets


def assert_packed(result: tuple[torch.Tensor, torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    packed, cu = result
    expected, offsets = reference(values)
    assert packed.dtype == expected.dtype
    assert packed.shape == expected.shape
    assert torch.equal(packed, expected)
    assert cu.dtype == torch.int32
    assert cu.shape == (len(values) + 1,)
    assert cu.tolist() == offsets
    return packed


# --------------------------------------------------------------------------- packed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_local(layout: str) -> None:
    n = 7
    column = LAYOUTS[layout](n)
    batch = DBM.from_dict({"f": column})
    values = per_task(column)
    assert_packed(batch.packed("f"), values)
    assert_packed(batch.packed("f", device="cpu"), values)
    # the batch itself is unchanged
    after = batch["f"]
    for got, want in zip(per_task(after), values):
        assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["one_node", "two_nodes", "interleaved"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_remote(
    layout: str, how: str, group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    n = 7
    local = DBM.from_dict({"f": LAYOUTS[layout](n), "other": [f"o{i}" for i in range(n)]})
    values = per_task(local["f"])
    batch = place(local, how, group.nodes, module_client, pushed)
    before = [fetch_requests(node) for node in group.nodes]
    packed = assert_packed(batch.packed("f"), values)
    middle = [fetch_requests(node) for node in group.nodes]
    assert sum(middle) > sum(before)  # it gathered
    # `batch[field]` now answers from what `packed` gathered: same values, no new request
    column = batch["f"]
    assert [fetch_requests(node) for node in group.nodes] == middle
    for got, want in zip(per_task(column), values):
        assert got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(column, list):  # ragged: per-task views (of the gathered buffers), not copies
        assert all(v._is_view() for v in column)
    assert packed.numel() == sum(v.numel() for v in values)
    # and packing again (now from the cache), or onto a device, gives the same
    assert_packed(batch.packed("f"), values)
    assert_packed(batch.packed("f", device="cpu"), values)
    assert "other" in batch and batch["other"] == [f"o{i}" for i in range(n)]


@pytest.mark.parametrize("how", ["one_node", "two_nodes"])
def test_packed_remote_builds_no_per_task_views(
    how: str,
    group: WorkerGroup,
    module_client: ShardClient,
    pushed: list[DBM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`packed` on a REMOTE ragged batch never splits the gathered column into per-task tensors
    (torch's split/unbind are watched); `batch[field]` splits it later, once, on demand."""
    n = 300
    local = DBM.from_dict({"f": [torch.arange(i % 7, dtype=torch.int32) for i in range(n)]})
    values = per_task(local["f"])
    batch = place(local, how, group.nodes, module_client, pushed)
    calls: list[str] = []
    for name in ("split", "unbind"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1]
        )
        original_fn = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, _o=original_fn, _n=name, **k: (calls.append(_n), _o(*a, **k))[1]
        )
    assert_packed(batch.packed("f"), values)
    assert_packed(batch.packed("f"), values)
    assert calls == []
    column = batch["f"]
    assert calls and len(column) == n
    for got, want in zip(column, values):
        assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["two_nodes", "interleaved"])
def test_packed_remote_in_a_shuffled_order(
    how: str, group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    n = 8
    local = DBM.from_dict({"f": ragged(n, torch.bfloat16), "s": torch.arange(n, dtype=torch.float32)})
    batch = place(local, how, group.nodes, module_client, pushed)
    order = [5, 0, 7, 2, 3, 6, 1, 4]
    shuffled = batch[order]
    assert shuffled.status is BatchStatus.REMOTE
    values = per_task(local["f"])
    assert_packed(shuffled.packed("f"), [values[i] for i in order])
    assert_packed(shuffled.packed("s"), [local["s"][i] for i in order])
    # sub-batches of the interleaved batch pack alone
    assert_packed(batch[1:6:2].packed("f"), values[1:6:2])


@pytest.mark.parametrize("how", ["one_node", "interleaved"])
def test_ragged_field_with_trailing_dims_gathers_then_packs(
    how: str, group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    """Per-token vectors (`[len_i, H]`): indexing the REMOTE field gives each task's tensor, and
    `packed` afterwards (from the cache) is their concatenation."""
    column = [torch.randn(length, 3) for length in (2, 0, 1, 4)]
    batch = place(DBM.from_dict({"h": column}), how, group.nodes, module_client, pushed)
    got = batch["h"]
    assert isinstance(got, list) and len(got) == len(column)
    for row, want in zip(got, column):
        assert row.shape == want.shape and torch.equal(row, want)
    assert_packed(batch.packed("h"), column)


def test_packed_zero_length_rows(group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]) -> None:
    lengths = [3, 0, 2, 0, 0, 5, 0]
    column = ragged(len(lengths), torch.float32, lengths)
    local = DBM.from_dict({"f": column, "none": [torch.zeros(0, 2) for _ in lengths]})
    for batch in (local, place(local, "interleaved", group.nodes, module_client, pushed)):
        packed = assert_packed(batch.packed("f"), column)
        assert packed.shape == (10,)
        empty, cu = batch.packed("none")
        assert empty.shape == (0, 2) and cu.tolist() == [0] * (len(lengths) + 1)


def test_packed_keeps_bf16(group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]) -> None:
    column = ragged(5, torch.bfloat16)
    local = DBM.from_dict({"f": column})
    for batch in (local, place(local, "two_nodes", group.nodes, module_client, pushed)):
        packed, _ = batch.packed("f")
        assert packed.dtype == torch.bfloat16
        assert_packed((packed, _), column)


def test_packed_refuses_json_and_mixed_ranks(
    group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    local = DBM.from_dict(
        {
            "text": [f"t{i}" for i in range(4)],
            "mixed_rank": [torch.zeros(3), torch.zeros(2, 2), torch.zeros(1), torch.zeros(0)],
            "scalar_and_vector": [torch.tensor(1.0), torch.zeros(2), torch.tensor(2.0), torch.zeros(1)],
            "mixed_tail": [torch.zeros(3, 2), torch.zeros(3, 4), torch.zeros(1, 2), torch.zeros(1, 2)],
        }
    )
    for batch in (local, place(local, "interleaved", group.nodes, module_client, pushed)):
        with pytest.raises(ValueError, match="JSON"):
            batch.packed("text")
        for field in ("mixed_rank", "scalar_and_vector", "mixed_tail"):
            with pytest.raises(ValueError, match=field):
                batch.packed(field)
        with pytest.raises(KeyError):
            batch.packed("absent")


def test_engine_result_built_from_packed_values_round_trips(
    group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    """An engine packs a batch it was given (from both workers), returns per-task views of the packed
    values as a LOCAL batch: stored on its worker, back as a REMOTE batch with the same values."""
    n = 9
    lengths = [4, 0, 7, 1, 1, 3, 0, 2, 5]
    column = ragged(n, torch.bfloat16, lengths)
    local = DBM.from_dict({"x": column})
    batch = place(local, "interleaved", group.nodes, module_client, pushed)
    chunks = batch.chunk(2)
    results = group.call("repack", chunks, field="x")
    pushed.extend(results)
    start = 0
    for worker, (chunk, result) in enumerate(zip(chunks, results)):
        assert result.status is BatchStatus.REMOTE
        assert result.task_ids == chunk.task_ids
        assert result.meta is not None and result.meta.nodes == [group.nodes[worker]]
        size = len(chunk)
        got = result.to_local()
        assert got["length"].tolist() == lengths[start : start + size]
        for row, want in zip(per_task(got["rows"]), column[start : start + size]):
            assert row.dtype == torch.bfloat16 and torch.equal(row, want)
        assert_packed(result.packed("rows"), column[start : start + size])
        start += size
    combined = DBM.concat(results)
    assert_packed(combined.packed("rows"), column)


# --------------------------------------------------------------------------- async batch methods


def test_afetch_and_ato_local_match_the_sync_calls(
    group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    n = 6
    local = DBM.from_dict(
        {
            "ids": ragged(n),
            "h": torch.randn(n, 3).to(torch.bfloat16),
            "label": [{"i": i} for i in range(n)],
        }
    )
    remote = place(local, "interleaved", group.nodes, module_client, pushed)
    meta = remote.meta
    assert meta is not None

    async def main() -> tuple[DBM, DBM, DBM]:
        one = DBM.from_meta(meta, module_client)
        two = DBM.from_meta(meta, module_client)
        returned = await one.afetch(["ids"])
        assert returned is one
        await two.afetch()  # every field
        as_local = await DBM.from_meta(meta, module_client).ato_local()
        return one, two, as_local

    one, two, as_local = asyncio.run(main())
    before = [fetch_requests(node) for node in group.nodes]
    ids = one["ids"]  # cached by afetch: no request
    everything = two.to_local()  # all cached: no request
    assert [fetch_requests(node) for node in group.nodes] == before
    sync = DBM.from_meta(meta, module_client).to_local()
    for got, want in zip(per_task(ids), per_task(sync["ids"])):
        assert torch.equal(got, want)
    for batch in (everything, as_local):
        assert batch.status is BatchStatus.LOCAL
        assert batch.task_ids == sync.task_ids and batch.fields == sync.fields
        for name in sync.fields:
            got, want = batch[name], sync[name]
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want)
            elif want and isinstance(want[0], torch.Tensor):
                assert all(torch.equal(a, b) for a, b in zip(got, want))
            else:
                assert got == want
    assert torch.equal(sync["h"], local["h"])
    # one["ids"] answered from memory, then the rest gathers as usual
    assert one["label"] == [{"i": i} for i in range(n)]
    with pytest.raises(KeyError):
        asyncio.run(DBM.from_meta(meta, module_client).afetch(["absent"]))


def test_async_methods_on_local_and_empty_batches() -> None:
    local = DBM.from_dict({"x": torch.arange(3)})

    async def main() -> tuple[Any, ...]:
        return (await local.afetch(), await local.ato_local(), await local.aclear(), await DBM().aclear())

    fetched, as_local, cleared, cleared_empty = asyncio.run(main())
    assert fetched is local and as_local is local
    assert cleared == 0 and cleared_empty == 0


def test_aclear_deletes_every_shard(group: WorkerGroup, module_client: ShardClient) -> None:
    def holdings() -> list[tuple[int, int, int]]:
        return [(s["shards"], s["tasks"], s["bytes"]) for s in group.stats()]

    before = holdings()
    n = 8
    local = DBM.from_dict({"ids": ragged(n), "r": torch.randn(n), "tag": [f"x{i}" for i in range(n)]})
    parts = [local[[i]].to_remote(group.nodes[i % 2], module_client) for i in range(n)]
    batch = DBM.concat(parts)
    during = holdings()
    assert [d[0] - b[0] for d, b in zip(during, before)] == [n // 2 * 3, n // 2 * 3]
    assert [d[1] - b[1] for d, b in zip(during, before)] == [n // 2, n // 2]

    meta = batch.meta  # a handle from before the clear (the batch itself is EMPTY after it)

    async def main() -> tuple[int, int]:
        first = await batch.aclear()
        return first, await batch.aclear()

    first, second = asyncio.run(main())
    assert first == n * 3
    assert second == 0  # idempotent
    assert holdings() == before
    with pytest.raises(ShardNotFoundError):  # the shards are gone
        DBM.from_meta(meta, module_client)["ids"]  # type: ignore[arg-type]


# --------------------------------------------------------------------------- async group calls


def test_acall_all_and_acall_on_match_the_sync_calls(group: WorkerGroup) -> None:
    sync_all = group.call_all("echo", 5, key="v")
    sync_on = [group.call_on(i, "whoami") for i in range(len(group))]
    sync_by_node = group.call_on(group.nodes[1], "echo", [1, 2])

    async def main() -> tuple[Any, ...]:
        return (
            await group.acall_all("echo", 5, key="v"),
            [await group.acall_on(i, "whoami") for i in range(len(group))],
            await group.acall_on(group.nodes[1], "echo", [1, 2]),
        )

    async_all, async_on, async_by_node = asyncio.run(main())
    assert async_all == sync_all
    assert [{"node": r["node"], "pid": r["pid"]} for r in async_on] == [
        {"node": r["node"], "pid": r["pid"]} for r in sync_on
    ]
    assert [r["node"] for r in async_on] == group.nodes
    assert async_by_node == sync_by_node == {"node": group.nodes[1], "value": [1, 2], "kwargs": {}}


def test_acall_matches_call_with_batches(
    group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    n = 6
    local = DBM.from_dict({"x": torch.arange(n, dtype=torch.float32) + 1})
    batch = place(local, "interleaved", group.nodes, module_client, pushed)
    chunks = batch.chunk(2)
    sync_results = group.call("columns", chunks, scale=3.0)
    sync_local = [r.to_local() for r in sync_results]
    sync_nodes = [r.meta.nodes for r in sync_results]
    # the async call stores the same ids and fields: clear these first (a handle whose shards a
    # later put replaced may no longer clear them), then compare what came back
    for r in sync_results:
        r.clear()

    async def main() -> list[Any]:
        return await group.acall("columns", chunks, scale=3.0)

    async_results = asyncio.run(main())
    pushed.extend(async_results)
    assert [r.meta.nodes for r in async_results] == sync_nodes
    for got_remote, want in zip(async_results, sync_local):
        got = got_remote.to_local()
        assert got.task_ids == want.task_ids and got.fields == want.fields
        assert torch.equal(got["y"], want["y"])
        assert got["tag"] == want["tag"]
        assert all(torch.equal(a, b) for a, b in zip(per_task(got["ragged"]), per_task(want["ragged"])))
    assert torch.equal(DBM.concat(async_results)["y"], local["x"] * 3.0)

    with pytest.raises(EngineError, match="boom"):
        group.call_all("fail", "boom")
    with pytest.raises(EngineError, match="boom"):
        asyncio.run(group.acall_all("fail", "boom"))
    with pytest.raises(EngineError, match="bang"):
        asyncio.run(group.acall_on(0, "fail", message="bang"))
    with pytest.raises(ValueError):
        asyncio.run(group.acall("columns", chunks[:1]))


def test_split_views_travel_as_one_view_and_the_store_copies_them() -> None:
    """A list of `split` views of one tensor is packed without a copy on its way out (one view
    of the base), and with one copy when a store will keep it (`copy=True`)."""
    base = torch.arange(10, dtype=torch.int64)
    views = list(base.split([1, 2, 3, 4]))
    column = wire.list_column("x", views, ["a", "b", "c", "d"])
    shared = wire.column_tensor(column)
    assert torch.equal(shared, base) and shared.data_ptr() == base.data_ptr()
    kept = wire.column_tensor(wire.list_column("x", views, ["a", "b", "c", "d"], copy=True))
    assert torch.equal(kept, base) and kept.data_ptr() != base.data_ptr()
    # Not end to end (a gap, a reordering): joined with one cat, values in task order.
    for picked in ([views[0], views[2]], [views[1], views[0]]):
        joined = wire.column_tensor(wire.list_column("x", picked, ["a", "b"]))
        assert torch.equal(joined, torch.cat(picked)) and joined.data_ptr() != base.data_ptr()


def test_stored_split_views_do_not_alias_the_engines_tensor(
    group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    """An engine returns views of a tensor it keeps, then writes to that tensor: what the worker
    stored is unchanged (the store copied the column once)."""
    batch = DBM.from_dict({"x": torch.zeros(4)}).to_remote(group.nodes[0], module_client)
    pushed.append(batch)
    result = group.call_on(0, "split_views", batch)
    pushed.append(result)
    assert group.call_on(0, "scribble") is True
    fresh = DBM.from_meta(result.meta, module_client)
    values, cu = fresh.packed("views")
    assert cu.tolist() == [0, 1, 3, 6, 10]
    assert torch.equal(values, torch.arange(10, dtype=torch.int32))
