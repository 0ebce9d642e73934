"""The TransferQueue backend's conversions, without Ray: the field schema a put announces equals
TransferQueue's own `extract_field_schema` (computed from offsets instead of one tensor per
sample), and gathered columns come back in TransferQueue's layout."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest
import torch

if os.environ.get("DISTBATCH_REQUIRE_TQ") == "1":
    importlib.import_module("transfer_queue")
else:
    pytest.importorskip("transfer_queue")
from tensordict import NonTensorStack, TensorDict  # noqa: E402
from transfer_queue.metadata import extract_field_schema  # noqa: E402

from distbatch.transferqueue.layout import columns_of, field_schema  # noqa: E402


def jagged(*lengths: int, tail: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.nested.nested_tensor(
        [torch.zeros(n, *tail, dtype=dtype) for n in lengths], layout=torch.jagged
    )


def strided(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.nested.nested_tensor`'s default layout, as TransferQueue's own tests build it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's prototype notice for this layout
        return torch.nested.nested_tensor([torch.zeros(*shape, dtype=dtype) for shape in shapes])


@pytest.mark.parametrize(
    "fields",
    [
        {"ids": jagged(3, 5, 1, dtype=torch.int64)},
        {"hidden": jagged(2, 4, 7, tail=(3,), dtype=torch.bfloat16)},
        {"reward": torch.rand(3)},
        {"mask": torch.ones(3, 4, dtype=torch.bool)},
        {"image": torch.zeros(3, 2, 2)},
        {"text": NonTensorStack("a", "b", "c")},
        {
            "holes": torch.nested.narrow(
                torch.arange(12.0).view(3, 4),
                1,
                torch.tensor([0, 1, 2]),
                torch.tensor([2, 1, 2]),
                layout=torch.jagged,
            )
        },
        {"strided": strided((3,), (5,), (1,), dtype=torch.int64)},
        {"strided-2d": strided((2, 3), (4, 3), (0, 3))},
        {"strided-any-dim": strided((2, 3), (1, 4), (2, 2), dtype=torch.bfloat16)},
        {"strided-same": strided((2, 2), (2, 2), (2, 2))},
        {"jagged-dim-2": jagged(2, 4, 1, tail=(3,)).transpose(1, 2)},
    ],
    ids=[
        "ragged", "ragged-2d-bf16", "scalar", "dense-bool", "dense-3d", "strings", "with-holes",
        "strided", "strided-2d", "strided-any-dim", "strided-same", "jagged-dim-2",
    ],  # fmt: skip
)
def test_the_announced_schema_is_transferqueues(fields: dict) -> None:
    data = TensorDict(fields, batch_size=[3])
    assert field_schema(data) == extract_field_schema(data)


def test_add_fields_records_the_same_schema_with_ours_installed() -> None:
    import transfer_queue.metadata as tq_metadata
    from transfer_queue.metadata import BatchMeta as TQBatchMeta

    from distbatch.transferqueue import fast_schema

    data = TensorDict(
        {"ids": jagged(3, 5, 1), "reward": torch.rand(3), "text": NonTensorStack("a", "b", "c")}, [3]
    )

    def recorded() -> dict:
        meta = TQBatchMeta(global_indexes=[0, 1, 2], partition_ids=["p"] * 3)
        return meta.add_fields(data).field_schema

    theirs = recorded()
    try:
        assert fast_schema.install() and not fast_schema.install()
        assert tq_metadata.extract_field_schema is fast_schema.extract_field_schema
        assert recorded() == theirs
    finally:
        assert fast_schema.uninstall() and not fast_schema.uninstall()
    assert tq_metadata.extract_field_schema is fast_schema.TQ_EXTRACT_FIELD_SCHEMA


def test_columns_keep_tensors_and_turn_other_values_into_lists() -> None:
    data = TensorDict({"ids": jagged(1, 2), "tag": NonTensorStack({"a": 1}, {"b": 2})}, batch_size=[2])
    columns, types = columns_of(data)
    assert types == {}
    assert columns["ids"].is_nested and columns["tag"] == [{"a": 1}, {"b": 2}]
