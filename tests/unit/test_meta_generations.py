"""Put generations in batch metadata: carried by every slice, concat and union, and through JSON
in its compact forms (one per node, runs, a batch-wide default with per-field overrides); bad
forms are a `MetaFormatError`. The store's side: a stale read or delete is refused and changes
nothing, while a put of other fields leaves the older values' generation alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from distbatch.batch.meta import BatchMeta, FieldMeta
from distbatch.errors import MetaFormatError
from distbatch.wire.container import RawTensor
from distbatch.wire.shapes import RowShapes
from rpc_server.errors import ReplacedShardsError
from rpc_server.store import ShardStore


def meta(gens: dict[str, list[int] | None], nodes: list[int]) -> BatchMeta:
    n = len(nodes)
    fields = {
        name: FieldMeta("F32", np.asarray(nodes), RowShapes.uniform(n, (2,)), False, g)
        for name, g in gens.items()
    }
    return BatchMeta([f"t{i}" for i in range(n)], ["a:1", "b:2"], fields)


def roundtrip(m: BatchMeta) -> BatchMeta:
    return BatchMeta.from_json(m.to_json())


def test_one_generation_per_node_is_said_once_for_the_batch() -> None:
    m = meta({"x": [7, 7, 9, 9], "y": [7, 7, 9, 9]}, [0, 0, 1, 1])
    data = json.loads(m.to_json())
    assert data["generations"] == [7, 9]
    assert all("generations" not in f for f in data["fields"].values())
    back = roundtrip(m)
    assert back == m and back.fields["y"].generations.tolist() == [7, 7, 9, 9]


def test_fields_of_other_puts_and_mixed_runs_say_their_own() -> None:
    m = meta(
        {"x": [7, 7, 9, 9], "y": [7, 7, 9, 9], "adv": [11, 11, 12, 12], "mix": [7, 8, 9, 9]}, [0, 0, 1, 1]
    )
    m.fields["none"] = FieldMeta(None, np.asarray([0, 0, 1, 1]), RowShapes.uniform(4, ()))
    data = json.loads(m.to_json())
    assert data["generations"] == [7, 9]
    assert data["fields"]["adv"]["generations"] == [11, 12]
    assert data["fields"]["mix"]["generations"] == {"runs": [7, 1, 8, 1, 9, 2]}
    assert data["fields"]["none"]["generations"] is None
    back = roundtrip(m)
    assert back == m
    assert back.fields["none"].generations is None


def test_slices_concats_and_unions_keep_each_tasks_generation() -> None:
    m = meta({"x": [1, 2, 3, 4]}, [0, 0, 1, 1])
    assert m.take([3, 0]).fields["x"].generations.tolist() == [4, 1]
    both = BatchMeta.concat([m.take([0]), m.take([2])])
    assert both.fields["x"].generations.tolist() == [1, 3]
    unknown = meta({"x": None}, [0, 1])
    mixed = BatchMeta.concat([unknown, m.take([1])])
    assert mixed.fields["x"].generations.tolist() == [0, 0, 2]
    other = meta({"y": [5, 5, 6, 6]}, [0, 0, 1, 1])
    merged = BatchMeta.merge(m.task_ids, [(m, None), (other, None)], ["x", "y"])
    assert merged.fields["y"].generations.tolist() == [5, 5, 6, 6]
    # A product's tasks have one generation per field set: fields of other puts are fetched apart.
    products = merged.plan(["x", "y"])
    assert sorted(names for _, names in products["a:1"]) == [["x"], ["y"]]


@pytest.mark.parametrize(
    "generations",
    [[1], [1, 2, 3], [-1, 2], [1 << 53, 1], ["1", 2], {"runs": [1, 3]}, {"runs": [1, 0, 2, 4]}, {"x": 1}, 5],
    ids=["few", "many", "negative", "too-big", "string", "short-runs", "empty-run", "unknown-form", "scalar"],
)
def test_bad_generations_are_a_meta_format_error(generations: object) -> None:
    data = json.loads(meta({"x": [1, 1, 2, 2]}, [0, 0, 1, 1]).to_json())
    data["fields"]["x"]["generations"] = generations
    with pytest.raises(MetaFormatError, match="generation"):
        BatchMeta.from_dict(data)


def u8(payload: bytes) -> RawTensor:
    return RawTensor("U8", (len(payload),), payload)


def test_the_store_refuses_stale_reads_and_deletes_and_keeps_other_fields_generation() -> None:
    store = ShardStore()
    first = store.put({("a", "f"): u8(b"one"), ("b", "f"): u8(b"one")}).generation
    extra = store.put({("a", "g"): u8(b"more")}).generation  # another field: f keeps its generation
    assert extra == first + 1
    both = np.asarray([first, first])
    assert store.fetch(["a", "b"], ["f"], both).shard_count() == 2
    second = store.put({("a", "f"): u8(b"two")}).generation  # replaces a/f only
    with pytest.raises(ReplacedShardsError, match=r"1 shard\(s\) were replaced.*a/f") as caught:
        store.fetch(["a", "b"], ["f"], both)
    assert caught.value.replaced == [("a", "f", second, first)]
    with pytest.raises(ReplacedShardsError, match="nothing was deleted"):
        store.delete_product(["a", "b"], ["f"], both)
    assert store.stats().shards == 3  # the refused delete changed nothing
    assert store.fetch(["a"], ["g"], np.asarray([extra])).shard_count() == 1
    assert store.fetch(["a"], ["f"], np.asarray([0])).shard_count() == 1  # 0: not checked
    assert store.delete_product(["b"], ["f"], np.asarray([first])) == (1, 3)
    with pytest.raises(ReplacedShardsError):  # g was stored by another put than `second`
        store.delete_product(["a"], ["f", "g"], np.asarray([second]))
    assert store.delete_product(["a"], ["f"], np.asarray([second])) == (1, 3)
