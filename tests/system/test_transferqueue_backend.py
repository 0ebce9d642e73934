"""distbatch as a TransferQueue storage backend, differential: the same program through
TransferQueue 0.1.11's public API, once with its SimpleStorage and once with `Distbatch`, must
see identical TensorDicts, lists and metadata; then what only Distbatch has (its options, its
workers' lifecycle, a worker that dies, registration in a Ray worker).

Real parts throughout: a local Ray cluster (TransferQueue's controller and storage units are Ray
actors, and so are the workers `tq.init` starts for Distbatch), real `rpc_server` workers, real
HTTP. `scripts/test` installs TransferQueue (the `tq` extra) and requires these tests to run.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ray_support import import_ray

from distbatch.launch.ray_actors import init_local_ray

ray = import_ray()
if os.environ.get("DISTBATCH_REQUIRE_TQ") == "1":
    tq = importlib.import_module("transfer_queue")
else:
    tq = pytest.importorskip("transfer_queue")
from tensordict import NonTensorStack, TensorDict  # noqa: E402

import distbatch.transferqueue as dtq  # noqa: E402  (after the skip)

BACKENDS = ("SimpleStorage", "Distbatch")
# TransferQueue's controller, its two storage units and our workers are actors: give them CPUs.
RAY_CPUS = 8
SETUP_HOOK = {"worker_process_setup_hook": "distbatch.transferqueue.register"}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    if ray.is_initialized():
        pytest.fail("ray was initialised before this module")
    # Every Ray worker of this job imports distbatch.transferqueue first (Ray's job-level setup
    # hook), as a verl job would set it: the backend is registered wherever TransferQueue runs.
    init_local_ray(num_cpus=RAY_CPUS, configure_logging=False, runtime_env=SETUP_HOOK)
    yield
    ray.shutdown()


def config(backend: str, **options: Any) -> dict[str, Any]:
    return {"backend": {"storage_backend": backend, backend: options}}


def rollout(n: int, seed: int) -> TensorDict:
    """A GRPO-shaped batch in TransferQueue's layout: ragged ids (jagged), bf16 logprobs of the
    same lengths, a dense mask, a scalar reward per sample, strings and dicts."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=gen).tolist()
    ids = [torch.randint(0, 1000, (k,), generator=gen) for k in lengths]
    return TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "logprobs": torch.nested.nested_tensor(
                [torch.randn(k, generator=gen).to(torch.bfloat16) for k in lengths], layout=torch.jagged
            ),
            "mask": torch.rand(n, 4, generator=gen) > 0.5,
            "reward": torch.rand(n, generator=gen),
            "prompt": NonTensorStack(*[f"prompt {i}" for i in range(n)]),
            "info": NonTensorStack(*[{"id": i, "tags": ["a", str(i)]} for i in range(n)]),
        },
        batch_size=[n],
    )


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
    return [("client get", got), ("client indexes", sorted(meta.global_indexes))]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[tuple[str, Any]]]:
    out = {}
    for backend in BACKENDS:
        tq.init(config(backend))
        try:
            out[backend] = program()
        finally:
            dtq.close()
    return out


def same(a: Any, b: Any) -> bool:
    """Equal as a TransferQueue user sees them: types, dtypes, layouts, values."""
    if isinstance(a, TensorDict):
        return (
            isinstance(b, TensorDict)
            and a.batch_size == b.batch_size
            and sorted(a.keys()) == sorted(b.keys())
            and all(same(a.get(k), b.get(k)) for k in a.keys())
        )
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.is_nested, a.dtype, a.layout) != (
            b.is_nested,
            b.dtype,
            b.layout,
        ):
            return False
        if a.is_nested:
            return torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, NonTensorStack):
        return isinstance(b, NonTensorStack) and a.tolist() == b.tolist()
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_every_call_answers_as_with_simple_storage(runs: dict[str, list[tuple[str, Any]]]) -> None:
    reference, ours = runs["SimpleStorage"], runs["Distbatch"]
    assert [label for label, _ in ours] == [label for label, _ in reference]
    differ = [label for (label, a), (_, b) in zip(reference, ours) if not same(a, b)]
    assert not differ, f"Distbatch answered differently from SimpleStorage at: {differ}"


def test_the_comparison_can_fail(runs: dict[str, list[tuple[str, Any]]]) -> None:
    """`same` tells layouts, dtypes and values apart (so the differential test means something)."""
    got = dict(runs["Distbatch"])["get all"]
    assert same(got, got)
    assert not same(got, got.exclude("reward"))
    changed = got.clone()
    changed.set("reward", got.get("reward") + 1)
    assert not same(got, changed)
    dense = torch.nested.nested_tensor([torch.ones(2), torch.ones(2)], layout=torch.jagged)
    assert not same(dense, torch.ones(2, 2))
    assert not same(got.get("logprobs"), got.get("logprobs").to(torch.float32))


def checkpoint_program(backend: str, directory: Path) -> list[tuple[str, Any]]:
    """Save a checkpoint, restart (a new `tq.init`: new workers at new addresses for Distbatch),
    load it: the keys, tags and data are back."""
    keys = [f"c{i}" for i in range(5)]
    tq.init(config(backend))
    try:
        tq.kv_batch_put(
            keys=keys, partition_id="ckpt", fields=rollout(5, 7), tags=[{"i": i} for i in range(5)]
        )
        advantage = TensorDict({"advantage": torch.arange(3.0)}, batch_size=[3])
        tq.kv_batch_put(keys=keys[:3], partition_id="ckpt", fields=advantage)
        before = tq.kv_batch_get(keys=keys, partition_id="ckpt")
        tq.save_checkpoint(directory)
    finally:
        dtq.close()
    tq.init(config(backend))
    try:
        tq.load_checkpoint(directory)
        after = tq.kv_batch_get(keys=keys, partition_id="ckpt")
        extra = tq.kv_batch_get(keys=keys[:3], partition_id="ckpt", select_fields=["advantage"])
        listed = tq.kv_list(partition_id="ckpt")
        tq.kv_clear(keys=keys, partition_id="ckpt")
    finally:
        dtq.close()
    assert same(before, after), backend
    return [("restored", after), ("restored later field", extra), ("restored list", listed)]


def test_checkpoints_round_trip_as_with_simple_storage(tmp_path: Path) -> None:
    answers = {backend: checkpoint_program(backend, tmp_path / backend) for backend in BACKENDS}
    differ = [
        label for (label, a), (_, b) in zip(answers["SimpleStorage"], answers["Distbatch"]) if not same(a, b)
    ]
    assert not differ, f"Distbatch answered differently from SimpleStorage at: {differ}"
    assert (tmp_path / "Distbatch" / "distbatch" / "index.json").exists()


# --------------------------------------------------------------------------- Distbatch only


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"workrs": 2}, r"unknown option\(s\) \['workrs'\]"),
        ({"workers": 0}, "at least 1"),
        ({"workers": "2"}, "must be int"),
        ({"same_host": "yes"}, "must be bool"),
        ({"capacity": "lots"}, "not a size"),
        ({"endpoints": "127.0.0.1:1"}, "must be a list"),
        ({"endpoints": ["not an address"]}, "node"),
        ({"timeout": 0}, "seconds > 0"),
        ({"fast_schema": 1}, "must be bool"),
    ],
)
def test_bad_options_fail_tq_init_before_any_worker_starts(options: dict[str, Any], message: str) -> None:
    before = _distbatch_actors()
    try:
        with pytest.raises(ValueError, match=message):
            tq.init(config("Distbatch", **options))
    finally:
        dtq.close()
    assert _distbatch_actors() == before


def _distbatch_actors() -> int:
    """Live distbatch worker actors in this Ray cluster (read from Ray's control store)."""
    from ray._private import state

    return sum(
        1
        for actor in state.actors().values()
        if actor.get("ActorClassName") == "_WorkerActor" and actor.get("State") == "ALIVE"
    )


@pytest.fixture
def distbatch_backend() -> Iterator[Callable[..., Any]]:
    """`tq.init` with Distbatch (options as given), closed after the test."""

    def init(**options: Any) -> Any:
        return tq.init(config("Distbatch", **options))

    try:
        yield init
    finally:
        dtq.close()


@pytest.mark.parametrize("fast", [True, False])
def test_the_fast_schema_is_in_place_while_the_backend_is(
    fast: bool, distbatch_backend: Callable[..., Any]
) -> None:
    import transfer_queue.metadata as tq_metadata

    from distbatch.transferqueue import fast_schema

    distbatch_backend(workers=1, fast_schema=fast)
    ragged = torch.nested.nested_tensor([torch.arange(3), torch.arange(2)], layout=torch.jagged)
    tq.kv_batch_put(keys=["x", "y"], partition_id="p", fields=TensorDict({"v": ragged}, batch_size=2))
    in_use = tq_metadata.extract_field_schema
    assert (in_use is fast_schema.extract_field_schema) is fast
    got = tq.kv_batch_get(keys=["x", "y"], partition_id="p")["v"]
    assert [t.tolist() for t in got.unbind()] == [[0, 1, 2], [0, 1]]
    dtq.close()
    assert tq_metadata.extract_field_schema is fast_schema.TQ_EXTRACT_FIELD_SCHEMA


def test_close_stops_the_workers_tq_init_started(distbatch_backend: Callable[..., Any]) -> None:
    conf = distbatch_backend(workers=2, capacity="64M")
    endpoints = list(conf.backend.Distbatch.endpoints)
    assert len(endpoints) == 2
    tq.kv_put(key="x", partition_id="p", fields={"v": torch.arange(3)})
    from distbatch import ShardClient, WorkerUnavailableError

    with ShardClient(timeout=5, retries=0) as client:
        assert sum(client.stats(node)["shards"] for node in endpoints) == 1
        assert {client.stats(node)["capacity"] for node in endpoints} == {64 << 20}
        assert dtq.close() == 2
        for node in endpoints:
            with pytest.raises(WorkerUnavailableError):
                client.health(node)
    assert dtq.close() == 0  # twice is fine


def test_a_worker_gone_mid_run_is_a_clear_error_and_nothing_half_stored(
    distbatch_backend: Callable[..., Any],
) -> None:
    from distbatch import NodeError

    conf = distbatch_backend(workers=1, timeout=5.0)
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=rollout(2, 3))
    dtq.STARTED.stop_all()  # the worker holding them is gone
    with pytest.raises(NodeError):
        tq.kv_batch_get(keys=["a", "b"], partition_id="p")
    with pytest.raises(NodeError):
        tq.kv_batch_put(keys=["c"], partition_id="p", fields=rollout(1, 4))
    # TransferQueue registered the key before the put failed (as with its own storage), but no
    # field of it was stored or announced: nothing half-stored to read.
    try:
        got = tq.kv_batch_get(keys=["c"], partition_id="p")
    except ValueError:
        got = None
    assert got is None or not list(got.keys())
    assert conf.backend.Distbatch.endpoints


def test_a_ray_worker_registers_with_the_setup_hook(distbatch_backend: Callable[..., Any]) -> None:
    """A Ray task in another process reaches the backend with no import of its own: the job's
    `worker_process_setup_hook` imported distbatch.transferqueue there, as verl's workers would."""
    distbatch_backend(workers=1)
    tq.kv_batch_put(keys=["r0", "r1"], partition_id="p", fields=rollout(2, 5))

    @ray.remote
    def read() -> tuple[int, list[int]]:
        import transfer_queue as remote_tq

        got = remote_tq.kv_batch_get(keys=["r0", "r1"], partition_id="p", select_fields=["input_ids"])
        return os.getpid(), got.get("input_ids").offsets().tolist()

    expected = tq.kv_batch_get(keys=["r0", "r1"], partition_id="p").get("input_ids").offsets().tolist()
    pid, offsets = ray.get(read.remote(), timeout=120)
    assert pid != os.getpid() and offsets == expected
