"""distbatch as a TransferQueue storage backend, differential: the same program through
TransferQueue 0.1.11's public API, once with its SimpleStorage and once with `Distbatch`, must
see identical TensorDicts, lists and metadata, checkpoints included. What only Distbatch has
(its options, its workers' lifecycle, a worker that dies, registration in a Ray worker) is in
test_transferqueue_backend_options.py.

Real parts throughout: a local Ray cluster (TransferQueue's controller and storage units are Ray
actors, and so are the workers `tq.init` starts for Distbatch), real `rpc_server` workers, real
HTTP. `scripts/test` installs TransferQueue (the `tq` extra) and requires these tests to run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tq_backend_support import BACKENDS, config, rollout, same, tq, tq_ray_cluster

import distbatch.transferqueue as dtq


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    yield from tq_ray_cluster()


def program() -> list[tuple[str, Any]]:
    """A sequence of TransferQueue calls as verl makes them; what each one returned."""
    seen: list[tuple[str, Any]] = []
    keys = [f"k{i}" for i in range(6)]
    meta = tq.kv_batch_put(
        keys=keys, partition_id="train", fields=rollout(6, 0), tags=[{"i": i} for i in range(6)]
    )
    seen.append(("put meta", (meta.keys, meta.tags, sorted(meta.fields))))
    seen.append(("get all", tq.kv_batch_get(keys=keys, partition_id="train")))
    seen.append(
        (
            "get some",
            tq.kv_batch_get(keys=["k4", "k1"], partition_id="train", select_fields=["input_ids", "prompt"]),
        )
    )
    seen.append(("get by meta", tq.kv_batch_get_by_meta(meta, select_fields=["logprobs", "reward"])))
    # A later stage adds a field to the same keys; then a field is put again with new values.
    tq.kv_batch_put(
        keys=keys, partition_id="train", fields=TensorDict({"advantage": torch.arange(6.0)}, batch_size=[6])
    )
    seen.append(
        (
            "added field",
            tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantage", "reward"]),
        )
    )
    tq.kv_batch_put(
        keys=keys[:2],
        partition_id="train",
        fields=TensorDict({"reward": torch.tensor([7.0, 8.0])}, batch_size=[2]),
    )
    seen.append(
        ("replaced field", tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["reward"]))
    )
    # One key at a time, with a tag only, then with fields.
    tq.kv_put(
        key="single",
        partition_id="eval",
        fields={"input_ids": torch.arange(5), "note": "hello"},
        tag={"t": 1},
    )
    seen.append(("single", tq.kv_batch_get(keys="single", partition_id="eval")))
    seen.append(("list", tq.kv_list()))
    tq.kv_clear(keys=["k1", "k3"], partition_id="train")
    seen.append(("list after clear", tq.kv_list(partition_id="train")))
    seen.append(("get after clear", tq.kv_batch_get(keys=["k0", "k2", "k5"], partition_id="train")))
    seen.extend(asyncio.run(async_program()))
    seen.extend(client_program())
    tq.kv_clear(keys=["k0", "k2", "k4", "k5"], partition_id="train")
    tq.kv_clear(keys="single", partition_id="eval")
    seen.append(("list at the end", tq.kv_list()))
    return seen


async def async_program() -> list[tuple[str, Any]]:
    keys = ["a0", "a1", "a2"]
    await tq.async_kv_batch_put(keys=keys, partition_id="async", fields=rollout(3, 1), tags=[{}, {}, {}])
    got = await tq.async_kv_batch_get(keys=keys, partition_id="async")
    await tq.async_kv_clear(keys=keys, partition_id="async")
    return [("async get", got), ("async list", await tq.async_kv_list(partition_id="async"))]


def client_program() -> list[tuple[str, Any]]:
    """The client's own put / get_meta / get_data, as verl's v1 trainer uses them."""
    client = tq.get_client()
    client.put(rollout(4, 2), partition_id="stream")
    meta = client.get_meta(["input_ids", "reward", "prompt"], 4, "stream", task_name="trainer")
    got = client.get_data(meta)
    client.clear_partition("stream")
    # What `put` hands back reads what was put (the backend's locations travel in it).
    put_meta = client.put(rollout(3, 5), partition_id="direct")
    direct = client.get_data(put_meta)
    client.clear_partition("direct")
    return [("client get", got), ("client indexes", sorted(meta.global_indexes)), ("get of put", direct)]


@dataclass
class Run:
    """One backend's session: the program's answers, then its checkpoint: what a get gave before
    saving, what the new session read back, and where it was saved."""

    answers: list[tuple[str, Any]]
    saved: Any
    restored: list[tuple[str, Any]]
    directory: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each backend once: the program, then a checkpoint saved at the end of that session and
    loaded in a new one (a new `tq.init`: new workers at new addresses for Distbatch). Two
    `tq.init`s a backend, each starting TransferQueue's actors and ours."""
    out = {}
    for backend in BACKENDS:
        directory = tmp_path_factory.mktemp(backend)
        tq.init(config(backend))
        try:
            answers = program()
            saved = save_checkpoint(directory)
        finally:
            dtq.close()
        tq.init(config(backend))
        try:
            restored = load_checkpoint(directory)
        finally:
            dtq.close()
        out[backend] = Run(answers, saved, restored, directory)
    return out


def test_every_call_answers_as_with_simple_storage(runs: dict[str, Run]) -> None:
    reference, ours = runs["SimpleStorage"].answers, runs["Distbatch"].answers
    assert [label for label, _ in ours] == [label for label, _ in reference]
    differ = [label for (label, a), (_, b) in zip(reference, ours) if not same(a, b)]
    assert not differ, f"Distbatch answered differently from SimpleStorage at: {differ}"


def test_the_comparison_can_fail(runs: dict[str, Run]) -> None:
    """`same` tells layouts, dtypes and values apart (so the differential test means something)."""
    got = dict(runs["Distbatch"].answers)["get all"]
    assert same(got, got)
    assert not same(got, got.exclude("reward"))
    changed = got.clone()
    changed.set("reward", got.get("reward") + 1)
    assert not same(got, changed)
    dense = torch.nested.nested_tensor([torch.ones(2), torch.ones(2)], layout=torch.jagged)
    assert not same(dense, torch.ones(2, 2))
    assert not same(got.get("logprobs"), got.get("logprobs").to(torch.float32))


CHECKPOINTED = [f"c{i}" for i in range(5)]


def save_checkpoint(directory: Path) -> Any:
    """Keys with tags and a field a later stage added, saved; what a get gave before saving."""
    tq.kv_batch_put(
        keys=CHECKPOINTED, partition_id="ckpt", fields=rollout(5, 7), tags=[{"i": i} for i in range(5)]
    )
    advantage = TensorDict({"advantage": torch.arange(3.0)}, batch_size=[3])
    tq.kv_batch_put(keys=CHECKPOINTED[:3], partition_id="ckpt", fields=advantage)
    before = tq.kv_batch_get(keys=CHECKPOINTED, partition_id="ckpt")
    tq.save_checkpoint(directory)
    return before


def load_checkpoint(directory: Path) -> list[tuple[str, Any]]:
    """In a new session: the checkpoint loaded, then what the keys, tags and data read back as."""
    tq.load_checkpoint(directory)
    after = tq.kv_batch_get(keys=CHECKPOINTED, partition_id="ckpt")
    extra = tq.kv_batch_get(keys=CHECKPOINTED[:3], partition_id="ckpt", select_fields=["advantage"])
    listed = tq.kv_list(partition_id="ckpt")
    tq.kv_clear(keys=CHECKPOINTED, partition_id="ckpt")
    return [("restored", after), ("restored later field", extra), ("restored list", listed)]


def test_checkpoints_round_trip_as_with_simple_storage(runs: dict[str, Run]) -> None:
    for backend, run in runs.items():
        assert same(run.saved, dict(run.restored)["restored"]), backend
    reference, ours = runs["SimpleStorage"].restored, runs["Distbatch"].restored
    differ = [label for (label, a), (_, b) in zip(reference, ours) if not same(a, b)]
    assert not differ, f"Distbatch answered differently from SimpleStorage at: {differ}"
    assert (runs["Distbatch"].directory / "distbatch" / "index.json").exists()
