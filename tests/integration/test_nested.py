"""Jagged nested tensors (`torch.nested`, `layout=torch.jagged`) in and out of a batch.

TransferQueue hands every non-scalar field out as a jagged nested tensor, and its users write
code for that. A batch takes one wherever it takes a column (`from_dict`, `batch[f] = nt`, an
engine's result) as a ragged field whose tasks are `nt.unbind()`, using `nt.values()` as the
packed tensor (no copy); `batch.nested(f)` gives one back over `packed(f)`'s values, again
without a copy. Checked LOCAL, through real workers (the module's two echo workers), from an
engine, and against TransferQueue's own packing where it is installed.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from batch_support import place

from distbatch import BatchStatus, DistributedBatchMemory, ShardClient, WorkerGroup

DBM = DistributedBatchMemory
LENGTHS = [3, 0, 5, 1, 4]


def rows(
    dtype: torch.dtype = torch.float32, tail: tuple[int, ...] = (), lengths: list[int] = LENGTHS
) -> list[Any]:
    g = torch.Generator().manual_seed(len(lengths) + len(tail))
    return [(torch.randn(n, *tail, generator=g) * 100).to(dtype) for n in lengths]


def jagged(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(values, layout=torch.jagged)


def assert_nested(nt: torch.Tensor, values: list[torch.Tensor]) -> None:
    """`nt` is a jagged nested tensor whose tasks are `values` (dtype, shapes, data, int64 offsets)."""
    assert nt.is_nested and nt.layout == torch.jagged and nt.size(0) == len(values)
    assert nt.dtype == values[0].dtype and nt.offsets().dtype == torch.int64
    lengths = [v.shape[0] for v in values]
    assert torch.diff(nt.offsets()).tolist() == lengths
    got = nt.unbind()
    assert len(got) == len(values)
    for row, want in zip(got, values):
        assert row.shape == want.shape and torch.equal(row, want)


def assert_column(column: Any, values: list[torch.Tensor]) -> None:
    assert isinstance(column, list) and len(column) == len(values)
    for row, want in zip(column, values):
        assert row.dtype == want.dtype and row.shape == want.shape and torch.equal(row, want)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def group(echo_pair: WorkerGroup) -> WorkerGroup:
    return echo_pair


# --------------------------------------------------------------------------- nested in


@pytest.mark.parametrize("tail", [(), (3,), (2, 2)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_from_dict_nested_is_a_ragged_field_over_its_values(
    dtype: torch.dtype, tail: tuple[int, ...]
) -> None:
    values = rows(dtype, tail)
    nt = jagged(values)
    batch = DBM.from_dict({"x": nt, "r": torch.arange(len(values))})
    assert batch.status is BatchStatus.LOCAL and len(batch) == len(values)
    assert_column(batch["x"], list(nt.unbind()))
    packed, cu = batch.packed("x")
    assert packed.dtype == dtype and packed.shape == nt.values().shape
    assert packed.data_ptr() == nt.values().data_ptr()  # the nested tensor's own values: no copy
    assert cu.dtype == torch.int32 and cu.tolist() == nt.offsets().tolist()
    assert batch.lengths("x") == LENGTHS
    meta = batch.schema_meta().fields["x"]
    assert (
        meta.ragged
        and meta.dtype == {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}[dtype]
    )
    assert_nested(batch.nested("x"), values)


def test_a_nested_field_of_equal_lengths_stays_ragged() -> None:
    nt = jagged([torch.ones(2), torch.zeros(2)])
    batch = DBM.from_dict({"x": nt})
    assert isinstance(batch["x"], list) and batch.schema_meta().fields["x"].ragged
    assert isinstance(batch[1:]["x"], list)


def test_setitem_takes_a_nested_tensor() -> None:
    batch = DBM.from_dict({"r": torch.arange(len(LENGTHS))})
    values = rows(torch.bfloat16, (3,))
    batch["x"] = jagged(values)
    assert_column(batch["x"], values)
    with pytest.raises(ValueError, match="2 entries for 5 tasks"):
        batch["y"] = jagged(values[:2])


def test_nested_with_holes_or_offsets_past_zero() -> None:
    """`torch.nested.narrow` leaves offsets with per-task lengths (holes between tasks); a nested
    tensor may start past its values' first row. Either way the tasks are what `unbind` says."""
    dense = torch.arange(24.0).reshape(4, 6)
    narrowed = torch.nested.narrow(
        dense, 1, torch.tensor([1, 0, 3, 2]), torch.tensor([2, 6, 0, 3]), layout=torch.jagged
    )
    batch = DBM.from_dict({"x": narrowed})
    want = [
        torch.tensor([1.0, 2.0]),
        torch.arange(6.0, 12.0),
        torch.zeros(0),
        torch.tensor([20.0, 21.0, 22.0]),
    ]
    assert_column(batch["x"], want)
    assert batch.packed("x")[1].tolist() == [0, 2, 8, 8, 11]
    late = torch.nested.nested_tensor_from_jagged(torch.arange(10.0), torch.tensor([2, 5, 9]))
    assert_column(DBM.from_dict({"x": late})["x"], [torch.tensor([2.0, 3.0, 4.0]), torch.arange(5.0, 9.0)])


def test_slices_and_chunks_keep_the_values_packed() -> None:
    nt = jagged(rows())
    batch = DBM.from_dict({"x": nt})
    base = nt.values()
    first, second = batch.chunk(2)
    values, cu = second.packed("x")
    assert values.data_ptr() == base[LENGTHS[0] + LENGTHS[1] + LENGTHS[2] :].data_ptr()  # a view, no copy
    assert cu.tolist() == [0, 1, 5]
    assert_nested(first.nested("x"), rows()[:3])
    picked = batch[[4, 0]]  # not a run of tasks: packed joins them
    assert_column(picked["x"], [rows()[4], rows()[0]])
    assert_nested(picked.nested("x"), [rows()[4], rows()[0]])


def test_pickle_carries_the_packed_values_once() -> None:
    values = rows(torch.bfloat16, (3,), [50] * 200)
    batch = DBM.from_dict({"x": jagged(values)})
    data = pickle.dumps(batch[2:5])
    assert len(data) < 3 * 50 * 3 * 2 + 8000  # the three tasks' bytes, not all 200 tasks' 60 kB
    again = pickle.loads(data)
    assert_column(again["x"], values[2:5])
    packed, _ = again.packed("x")
    assert packed.data_ptr() == again.packed("x")[0].data_ptr()  # still one packed tensor


def test_zero_task_nested_makes_an_empty_batch_that_keeps_the_field() -> None:
    empty = torch.nested.nested_tensor_from_jagged(
        torch.zeros(0, 3, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64)
    )
    batch = DBM.from_dict({"x": empty})
    assert batch.status is BatchStatus.EMPTY and batch.fields == ["x"]
    assert batch["x"] == []
    nt = batch.nested("x")
    assert nt.is_nested and nt.size(0) == 0 and nt.dtype == torch.bfloat16 and nt.values().shape == (0, 3)
    assert nt.unbind() == ()
    values, cu = batch.packed("x")
    assert values.shape == (0, 3) and cu.tolist() == [0]
    # an empty slice of any batch keeps the field's dtype and trailing dims too
    sliced = DBM.from_dict({"x": jagged(rows(torch.bfloat16, (3,)))})[:0]
    assert sliced.status is BatchStatus.EMPTY
    assert sliced.nested("x").values().shape == (0, 3) and sliced.nested("x").dtype == torch.bfloat16


# --------------------------------------------------------------------------- nested out


def test_nested_of_a_list_field_and_of_a_fixed_shape_field() -> None:
    values = rows(torch.int32)
    assert_nested(DBM.from_dict({"ids": values}).nested("ids"), values)
    fixed = DBM.from_dict({"pad": torch.arange(24, dtype=torch.int64).reshape(3, 4, 2)})
    nt = fixed.nested("pad")
    assert_nested(nt, list(torch.arange(24, dtype=torch.int64).reshape(3, 4, 2).unbind()))
    packed, _ = fixed.packed("pad")
    assert nt.values().data_ptr() == packed.data_ptr()  # a stacked column packs as a view: shared


def test_nested_round_trips_through_a_batch_without_copies() -> None:
    values = rows(torch.bfloat16)
    nt = DBM.from_dict({"x": values}).nested("x", device="cpu")  # a list column: one `cat`
    assert_nested(nt, values)
    again = DBM.from_dict({"x": nt}).nested("x")  # then neither way copies the values
    assert again.values().data_ptr() == nt.values().data_ptr()
    assert torch.equal(again.offsets(), nt.offsets())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nested_on_a_gpu() -> None:
    values = rows(torch.bfloat16, (3,))
    on_gpu = DBM.from_dict({"x": jagged(values).to("cuda")})  # a column of GPU views
    nt = on_gpu.nested("x")
    assert nt.is_cuda and nt.offsets().is_cuda and nt.values().data_ptr() == on_gpu.packed("x")[0].data_ptr()
    assert_nested(nt.cpu(), values)
    moved = DBM.from_dict({"x": values}).nested("x", device="cuda")
    assert moved.is_cuda and moved.offsets().is_cuda
    assert_nested(moved.cpu(), values)
    bundle, _ = on_gpu.export_bundle("127.0.0.1:1")  # the wire copies GPU values to the host
    assert bundle.columns["x"].dtype == "BF16"


def test_nested_refuses_what_it_cannot_represent() -> None:
    batch = DBM.from_dict(
        {
            "text": ["a", "b"],
            "score": torch.tensor([1.0, 2.0]),
            "mixed_tail": [torch.zeros(2, 3), torch.zeros(2, 4)],
            "mixed_rank": [torch.zeros(2), torch.zeros(2, 2)],
        }
    )
    with pytest.raises(ValueError, match="JSON values; nested"):
        batch.nested("text")
    with pytest.raises(ValueError, match="one scalar per task"):
        batch.nested("score")
    for field in ("mixed_tail", "mixed_rank"):
        with pytest.raises(ValueError, match=field):
            batch.nested(field)
    with pytest.raises(KeyError):
        batch.nested("absent")
    with pytest.raises(ValueError, match="one scalar per task"):
        batch[:0].nested("score")  # the same answer over zero tasks


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's prototype notice for strided nested tensors
def test_strided_nested_tensors_are_columns_over_their_buffer() -> None:
    """`torch.nested.nested_tensor(rows)` (strided, the default layout, as TransferQueue's README
    and tests build them): tasks sharing their trailing dims are a ragged column over the nested
    tensor's own buffer (no copy, no tensor per task built from Python)."""
    values = rows(torch.bfloat16, (3,))
    strided = torch.nested.nested_tensor(values)
    assert strided.layout == torch.strided
    batch = DBM.from_dict({"x": strided})
    assert [t.tolist() for t in batch["x"]] == [t.tolist() for t in values]
    assert batch.packed("x")[0].data_ptr() == strided.values().data_ptr()  # its buffer, not a copy
    assert_nested(batch.nested("x"), values)
    # Not contiguous (a transpose of each task): copied once into order, then the same.
    turned = torch.nested.nested_tensor([v.t().contiguous() for v in values]).transpose(1, 2)
    assert not turned.is_contiguous()
    assert [t.tolist() for t in DBM.from_dict({"x": turned})["x"]] == [t.tolist() for t in values]
    batch = DBM.from_dict({"r": torch.arange(5)})
    batch["x"] = strided
    assert_nested(batch.nested("x"), values)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_ragged_in_any_dimension_are_columns_of_their_tasks(layout: torch.layout) -> None:
    """Tasks that differ beyond their first dimension (a strided nested tensor, or a jagged one
    ragged in dim 2) are a ragged column of the tasks themselves, as TransferQueue stores them."""
    tasks = [torch.arange(6).view(2, 3), torch.arange(8).view(2, 4), torch.arange(2).view(2, 1)]
    nested = torch.nested.nested_tensor(tasks, layout=layout)
    if layout == torch.jagged:
        assert nested._ragged_idx == 2
    batch = DBM.from_dict({"x": nested, "r": torch.arange(3)})
    assert [t.tolist() for t in batch["x"]] == [t.tolist() for t in tasks]
    with pytest.raises(ValueError, match="differ in rank or trailing dimensions"):
        batch.nested("x")  # a jagged nested tensor is ragged in one dimension: index the field


def test_a_nested_tensor_of_a_dtype_the_wire_cannot_carry_is_refused() -> None:
    chalf = jagged([torch.zeros(2, dtype=torch.complex32), torch.zeros(3, dtype=torch.complex32)])
    with pytest.raises(ValueError, match=r"field 'x': a torch.complex32 tensor cannot be stored"):
        DBM.from_dict({"x": chalf})
    batch = DBM.from_dict({"r": torch.arange(2)})
    with pytest.raises(ValueError, match="complex32"):
        batch["x"] = chalf
    assert batch.fields == ["r"]


# --------------------------------------------------------------------------- through workers


@pytest.mark.parametrize("how", ["one_node", "two_nodes", "interleaved"])
def test_nested_column_round_trips_through_workers(
    how: str, group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    values = rows(torch.bfloat16, (3,))
    batch = place(DBM.from_dict({"x": jagged(values)}), how, group.nodes, module_client, pushed)
    meta = batch.meta
    assert meta is not None and meta.fields["x"].ragged and meta.fields["x"].dtype == "BF16"
    nt = batch.nested("x")  # gathers the field, as packed() does
    assert_nested(nt, values)
    assert_column(batch["x"], values)  # answered from what nested() gathered
    assert_nested(batch[1:4].nested("x"), values[1:4])
    local = batch.to_local()
    assert_column(local["x"], values)
    assert_nested(local.nested("x"), values)


def test_nested_of_a_field_one_node_holds_shares_the_gathered_buffer(
    group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    values = rows(torch.float32, (2,))
    batch = place(DBM.from_dict({"x": jagged(values)}), "one_node", group.nodes, module_client, pushed)
    packed, _ = batch.packed("x")
    nt = batch.nested("x")
    assert nt.values().data_ptr() == packed.data_ptr()  # packed copies nothing here, nor does nested
    split = batch["x"]  # now split into per-task views of that buffer: packing still copies nothing
    assert_column(split, values)
    assert batch.packed("x")[0].data_ptr() == packed.data_ptr()
    local = batch.to_local()
    assert local.nested("x").values().data_ptr() == packed.data_ptr()


@pytest.mark.parametrize("how", ["two_nodes", "interleaved"])
def test_nested_of_a_field_two_nodes_hold_shares_only_what_arrived_as_one_tensor(
    how: str, group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    """What the guide says of sharing. Each node holding a run of the tasks (as `concat` of
    per-node batches makes it): a buffer per node arrives, used as it is, so `packed` (and
    `nested`, which copies nothing of its own) joins them into a new tensor on every call.
    Tasks interleaved across nodes are put in order once, when gathered, into one tensor, then
    shared. A batch over one node's tasks of the same shards shares that node's buffer."""
    values = rows(torch.float32, (2,))
    batch = place(DBM.from_dict({"x": jagged(values)}), how, group.nodes, module_client, pushed)
    nt = batch.nested("x")
    assert_nested(nt, values)
    packed, _ = batch.packed("x")
    assert torch.equal(packed, nt.values())
    shared = how == "interleaved"
    assert (packed.data_ptr() == nt.values().data_ptr()) is shared
    assert (batch.nested("x").values().data_ptr() == nt.values().data_ptr()) is shared
    meta = batch.meta
    assert meta is not None
    first = meta.nodes.index(group.nodes[0])
    on_first = [int(i) for i in np.flatnonzero(meta.fields["x"].nodes == first)]
    one = DBM.from_meta(batch[on_first].meta)  # nothing gathered yet: one response from one node
    own = one.nested("x")
    assert_nested(own, [values[i] for i in on_first])
    assert one.packed("x")[0].data_ptr() == own.values().data_ptr()


def test_engine_returns_nested_columns(
    group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    """An engine reads its chunk as a nested tensor (gathered from both workers) and returns nested
    columns: stored on its worker as ragged fields, back as REMOTE batches; a zero-task chunk's
    nested result is an EMPTY batch that keeps the field, so concat just works."""
    values = rows(torch.bfloat16, (2,))
    batch = place(DBM.from_dict({"x": jagged(values)}), "interleaved", group.nodes, module_client, pushed)
    results = group.call("nested_result", batch.chunk(2), field="x")
    pushed.extend(results)
    for worker, result in enumerate(results):
        assert result.status is BatchStatus.REMOTE and result.meta is not None
        assert result.meta.nodes == [group.nodes[worker]]
        assert result.meta.fields["twice"].ragged and result.meta.fields["twice"].dtype == "BF16"
    both = DBM.concat(results)
    assert both.task_ids == batch.task_ids
    assert_nested(both.nested("twice"), [v * 2 for v in values])
    assert both["length"].tolist() == LENGTHS
    few = place(DBM.from_dict({"x": jagged(values[:1])}), "one_node", group.nodes, module_client, pushed)
    parts = group.call("nested_result", few.chunk(2), field="x")
    pushed.extend(parts)
    assert [p.status for p in parts] == [BatchStatus.REMOTE, BatchStatus.EMPTY]
    assert "twice" in parts[1] and parts[1].nested("twice").dtype == torch.bfloat16
    assert_nested(DBM.concat(parts).nested("twice"), [values[0] * 2])


@pytest.mark.parametrize("kind", ["strided", "dim2"])
def test_engine_nested_results_of_any_layout_are_stored(
    kind: str, group: WorkerGroup, module_client: ShardClient, pushed: list[DBM]
) -> None:
    values = rows()
    batch = place(DBM.from_dict({"x": jagged(values)}), "one_node", group.nodes, module_client, pushed)
    result = group.call_on(0, "nested_result", batch, field="x", kind=kind)
    pushed.append(result)
    assert [t.tolist() for t in result["other"]] == [v.unsqueeze(0).tolist() for v in values]


# --------------------------------------------------------------------------- TransferQueue's convention


def test_nested_matches_transferqueue_packing() -> None:
    """TransferQueue packs a field's per-sample tensors with `as_nested_tensor(..., layout=jagged)`
    (scalars: `torch.stack`); `nested()` gives the same tensor, and takes TransferQueue's back."""
    tq = pytest.importorskip("transfer_queue.storage.managers.simple_storage_manager")
    pack = tq.AsyncSimpleStorageManager._pack_field_values
    fields = {
        "ids": rows(torch.int32),
        "hidden": rows(torch.bfloat16, (4,)),
        "pad": list(torch.arange(30, dtype=torch.float32).reshape(5, 3, 2).unbind()),
    }
    batch = DBM.from_dict({**fields, "score": torch.arange(5.0)})
    for name, values in fields.items():
        theirs, ours = pack(values), batch.nested(name)
        assert theirs.layout == ours.layout == torch.jagged and theirs.dtype == ours.dtype
        assert theirs.dim() == ours.dim() and theirs.size(0) == ours.size(0)
        assert torch.equal(theirs.offsets(), ours.offsets())
        assert torch.equal(theirs.values(), ours.values())
        assert_column(DBM.from_dict({name: theirs})[name], values)
    assert torch.equal(pack(list(batch["score"].unbind())), batch["score"])  # scalars: a plain tensor
