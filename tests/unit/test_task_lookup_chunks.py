"""How `ShardClient.task_fields` splits a lookup of many task ids into `GET /v1/tasks?ids=`
requests: every id once, in order, each request's query within its bound."""

from __future__ import annotations

from distbatch.client.shard_client import TASKS_QUERY_CHARS, _query_chunks


def test_ids_go_in_order_in_runs_that_fit_one_query() -> None:
    ids = [f"t{i}" * (1 + i % 40) for i in range(3_000)]
    chunks = list(_query_chunks(ids))
    assert [task_id for chunk in chunks for task_id in chunk] == ids
    assert len(chunks) > 1
    assert all(len(",".join(chunk)) <= TASKS_QUERY_CHARS for chunk in chunks)
    # Each run is as long as fits: the next id would have passed the bound.
    assert all(len(",".join([*chunk, nxt[0]])) > TASKS_QUERY_CHARS for chunk, nxt in zip(chunks, chunks[1:]))


def test_an_id_longer_than_the_bound_goes_alone() -> None:
    huge = "h" * (TASKS_QUERY_CHARS + 10)
    assert list(_query_chunks(["a", huge, "b"])) == [["a"], [huge], ["b"]]
    assert list(_query_chunks([])) == []
