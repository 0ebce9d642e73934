"""Same-host shared memory: gathers and puts through sealed memfds handed over a Unix socket.

Real workers on loopback; the client decides per node, so the same calls take the shared path
here and HTTP where a test turns it off, and both must give the same data.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from distbatch import CapacityError, DistributedBatchMemory, ShardClient, wire
from distbatch.client.same_host import RegionResolver
from distbatch.errors import WireFormatError
from distbatch.launch import WorkerProcess
from distbatch.transport.shm import (
    ENV_HOST_ID,
    ENV_SWITCH,
    SharedRegion,
    abstract_address,
    close_all,
    host_id,
    json_payload,
    recv_message,
    send_message,
    split_payload,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")

MIB = 1 << 20
NO_TOKEN = {"DISTBATCH_TOKEN": ""}


@pytest.fixture(autouse=True)
def no_shm_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite runs with `DISTBATCH_SHM=0` (conftest); here the path is on, for this process
    and the workers it starts, and no host id is faked."""
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.delenv(ENV_HOST_ID, raising=False)


@pytest.fixture
def tokenless_client(no_shm_override: None) -> Iterator[ShardClient]:
    """A client with no token, the same-host path on (this file's workers run without one)."""
    with ShardClient(token="") as c:
        yield c


@pytest.fixture
def plain_worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return start_worker(env=NO_TOKEN)


def batch_shards(
    n: int, prefix: str = "t", width: int = 1024, seed: int = 0
) -> dict[tuple[str, str], object]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, width, generator=gen)
    lengths = torch.randint(1, 300, (n,), generator=gen)
    shards: dict[tuple[str, str], object] = {}
    for i in range(n):
        task = f"{prefix}{i}"
        shards[(task, "dense")] = dense[i]
        shards[(task, "tokens")] = torch.randint(0, 50_000, (int(lengths[i]),), generator=gen)
        shards[(task, "reward")] = float(i) / 3
    return shards


def memfd_mappings() -> set[str]:
    """This process's mappings of memfds (one line each: address range and name)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[0] for line in maps if "memfd:distbatch" in line}


def mapping_of(address: int) -> str:
    """The /proc/self/maps path of the mapping holding `address` ('' for anonymous)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return " ".join(parts[5:])
    raise AssertionError("address not mapped")


def worker_memfds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:distbatch" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                count += 1
        except OSError:
            pass
    return count


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def shm_info(tokenless_client: ShardClient, node: str) -> dict:
    return tokenless_client.request_json(node, "GET", "/v1/shm")


def raw_connect(info: dict) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(abstract_address(info["socket"]))
    return sock


def raw_request(sock: socket.socket, header: dict, fds: list[int] = ()) -> tuple[dict, memoryview, list[int]]:
    send_message(sock, json_payload(header), fds)
    payload, got = recv_message(sock, 1 << 30, 1 << 16)
    answer, rest = split_payload(payload)
    return answer, rest, got


def hello(sock: socket.socket, secret: str, token: str | None = None) -> dict:
    header = {"op": "hello", "secret": secret}
    if token is not None:
        header["token"] = token
    answer, _, fds = raw_request(sock, header)
    close_all(fds)
    return answer


# --------------------------------------------------------------------------- gathers


def test_same_host_gather_gives_what_http_gives(
    tokenless_client: ShardClient, plain_worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = batch_shards(200)
    tokenless_client.put(plain_worker.node, shards)
    before = tokenless_client.traffic()
    fetched = tokenless_client.fetch([(plain_worker.node, *key) for key in shards])
    used = tokenless_client.traffic() - before
    assert used.same_host_requests >= 1 and used.same_host_bytes > 200 * 1024 * 4
    assert used.bytes_received < 10_000  # no shard bytes came over HTTP
    monkeypatch.setenv(ENV_SWITCH, "0")
    before = tokenless_client.traffic()
    over_http = tokenless_client.fetch([(plain_worker.node, *key) for key in shards])
    used = tokenless_client.traffic() - before
    assert used.same_host_requests == 0 and used.bytes_received > 200 * 1024 * 4
    for key, a, b, want in zip(shards, fetched, over_http, shards.values()):
        if isinstance(want, torch.Tensor):
            assert torch.equal(a, want) and torch.equal(b, want), key
        else:
            assert a == b == want


def test_a_column_in_one_run_is_a_view_of_the_shared_region(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    shards = batch_shards(64)
    tokenless_client.put(plain_worker.node, shards)
    ids = [f"t{i}" for i in range(64)]
    (bundle,) = tokenless_client.fetch_products([(plain_worker.node, ids, ["dense", "tokens"])])
    dense = wire.column_tensor(bundle.columns["dense"])
    assert "memfd:distbatch" in mapping_of(dense.data_ptr())  # no copy: the worker's own pages
    expected = torch.stack([shards[(t, "dense")] for t in ids])
    assert torch.equal(dense.reshape(64, -1), expected)


def test_scattered_rows_are_gathered_into_one_private_buffer(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    shards = batch_shards(100)
    tokenless_client.put(plain_worker.node, dict(list(shards.items())[: 3 * 50]))  # tasks 0..49
    tokenless_client.put(
        plain_worker.node, dict(list(shards.items())[3 * 50 :])
    )  # tasks 50..99: another region
    ids = [f"t{i}" for i in (97, 3, 51, 0, 99, 10, 60)]
    (bundle,) = tokenless_client.fetch_products([(plain_worker.node, ids, ["tokens", "dense", "reward"])])
    tokens = wire.decode_column(bundle.columns["tokens"])
    dense = wire.column_tensor(bundle.columns["dense"])
    assert "memfd" not in mapping_of(dense.data_ptr())  # several runs: one copy into our memory
    for i, task in enumerate(ids):
        assert torch.equal(tokens[i], shards[(task, "tokens")])
        assert torch.equal(dense.reshape(len(ids), -1)[i], shards[(task, "dense")])
    assert wire.decode_column(bundle.columns["reward"]) == [shards[(t, "reward")] for t in ids]


def test_writing_a_gathered_tensor_changes_only_the_readers_copy(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    shards = batch_shards(32)
    tokenless_client.put(plain_worker.node, shards)
    first = tokenless_client.fetch([(plain_worker.node, "t0", "dense")])[0]
    first.fill_(7.0)  # in place, on a copy-on-write view of the region
    again = tokenless_client.fetch([(plain_worker.node, "t0", "dense")])[0]
    assert torch.equal(again, shards[("t0", "dense")])


def test_remote_batch_columns_and_packed_take_the_same_host_path(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    from distbatch.client import set_default_client

    lengths = [5, 300, 17, 1, 64]
    local = DistributedBatchMemory.from_dict(
        {
            "input_ids": [torch.arange(n) for n in lengths],
            "logprobs": torch.randn(5, 2048),
            "uid": ["a", "b", "c", "d", "e"],
        }
    )
    set_default_client(tokenless_client)
    try:
        remote = local.to_remote(plain_worker.node)
        before = tokenless_client.traffic()
        values, cu = remote.packed("input_ids")
        assert torch.equal(values, torch.cat([torch.arange(n) for n in lengths]))
        assert cu.tolist() == [0, *np.cumsum(lengths).tolist()]
        assert torch.equal(remote["logprobs"], local["logprobs"])
        assert remote.to_local()["uid"] == ["a", "b", "c", "d", "e"]
        assert (tokenless_client.traffic() - before).same_host_requests >= 3
    finally:
        set_default_client(None)


def test_a_big_column_from_one_worker_is_one_request_and_no_copy(
    no_shm_override: None, plain_worker: WorkerProcess
) -> None:
    """HTTP splits gathers at `max_bytes_per_request`; a same-host answer is references, so a
    batch gathers the whole column in one request, and it stays one run: a view, no join."""
    from distbatch.client import set_default_client

    with ShardClient(token="", max_bytes_per_request=MIB) as c:
        values = torch.randn(64, 16_384)  # 4 MiB
        set_default_client(c)
        try:
            remote = DistributedBatchMemory.from_dict({"x": values}).to_remote(plain_worker.node)
            before = c.traffic()
            column = DistributedBatchMemory.from_meta(remote.meta, c)["x"]
            assert (c.traffic() - before).same_host_requests == 1
            assert torch.equal(column, values)
            assert "memfd:distbatch" in mapping_of(column.data_ptr())
        finally:
            set_default_client(None)


def test_data_put_over_http_moves_into_a_region_once(
    tokenless_client: ShardClient, plain_worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = batch_shards(50)
    monkeypatch.setenv(ENV_SWITCH, "0")
    tokenless_client.put(plain_worker.node, shards)
    assert tokenless_client.stats(plain_worker.node)["shared_regions"] == 0
    monkeypatch.delenv(ENV_SWITCH)
    keys = [(plain_worker.node, t, f) for t, f in shards if f == "dense"]
    for _ in range(3):
        got = tokenless_client.fetch(keys)
        assert all(torch.equal(g, shards[k[1:]]) for g, k in zip(got, keys))
    stats = tokenless_client.stats(plain_worker.node)
    assert stats["shared_regions"] == 1  # moved once, then shared as it is
    tensor_bytes = sum(v.nbytes for v in shards.values() if isinstance(v, torch.Tensor))
    assert tensor_bytes <= stats["shared_bytes"] < tensor_bytes + 64 * 2  # both tensor fields, aligned


def test_an_engines_result_goes_straight_into_a_region_once_a_reader_is_on_the_host(
    tokenless_client: ShardClient,
) -> None:
    """Before any same-host client, an engine's result is kept in the store's own memory (moved
    into a region by the first same-host read); once one has connected, the result is written
    into a region as it is stored, and the reads that follow make no other."""
    from engines_for_tests import ECHO, ENGINES_ENV

    from distbatch import WorkerGroup

    group = WorkerGroup.local(1, ECHO, env={**NO_TOKEN, **ENGINES_ENV}, client=tokenless_client)
    n = 20_000  # 80 KB of "z": over the size answered inline
    want = [i * 10.0 for i in range(n)]
    try:
        node = group.nodes[0]
        first = group.call_on(0, "make_batch", n, prefix="before")
        assert tokenless_client.stats(node)["shared_regions"] == 0
        column = DistributedBatchMemory.from_meta(first.meta, tokenless_client)["z"]
        assert column.tolist() == want
        assert tokenless_client.stats(node)["shared_regions"] == 1  # the first read moved it
        second = group.call_on(0, "make_batch", n, prefix="after")
        assert tokenless_client.stats(node)["shared_regions"] == 2  # stored in a region at once
        for _ in range(2):
            got = DistributedBatchMemory.from_meta(second.meta, tokenless_client).get_data()
            assert got["z"].tolist() == want and got["name"][3] == "after/3"
        assert tokenless_client.stats(node)["shared_regions"] == 2  # reading made no copy
        first.clear()
        second.clear()
        assert tokenless_client.stats(node)["shared_regions"] == 0
    finally:
        group.shutdown()


# --------------------------------------------------------------------------- puts


def test_same_host_put_is_stored_without_a_copy_and_reads_back(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    shards = batch_shards(80)
    before = tokenless_client.traffic()
    result = tokenless_client.put(plain_worker.node, shards)
    used = tokenless_client.traffic() - before
    assert result.stored == len(shards)
    assert used.same_host_requests == 1 and used.bytes_sent == 0  # the body never went over HTTP
    stats = tokenless_client.stats(plain_worker.node)
    assert stats["shared_regions"] == 1 and stats["shared_bytes"] >= stats["bytes"] - 80 * 40
    got = tokenless_client.fetch([(plain_worker.node, *k) for k in shards])
    for value, want in zip(got, shards.values()):
        assert torch.equal(value, want) if isinstance(want, torch.Tensor) else value == want


ZERO_SIZE_SHAPES = [(0,), (3, 0), (0, 2, 5), (2, 0, 5), (2, 5, 0)]


def zero_size_shards(prefix: str) -> dict[tuple[str, str], object]:
    """Zero in every position of the shape, in every kind of column: fixed-shape columns of
    zero-size rows, ragged columns mixing empty and big rows (big enough for a shared region),
    scalars, and dtypes whose rows are not bytes (bf16, bool)."""
    shards: dict[tuple[str, str], object] = {}
    for i in range(4):
        task = f"{prefix}{i}"
        for k, shape in enumerate(ZERO_SIZE_SHAPES):
            for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int8):
                shards[(task, f"z{k}.{str(dtype)[6:]}")] = torch.zeros(shape, dtype=dtype)
        shards[(task, "ragged")] = torch.arange(300_000) if i % 2 else torch.zeros(0, dtype=torch.int64)
        # One field, two dtypes (a column per dtype): the field is big enough to be shared, and
        # its bool layer, all zero-size rows, is a shared column of no runs at all.
        shards[(task, "mixed")] = torch.ones(300_000) if i % 2 else torch.zeros((2, 0), dtype=torch.bool)
        shards[(task, "scalar")] = torch.tensor(float(i))
        shards[(task, "text")] = "" if i % 2 else "é✓"
    return shards


@pytest.mark.parametrize("put_over", ["same host", "HTTP"])
def test_zero_size_parts_of_any_shape_take_the_same_host_path(
    tokenless_client: ShardClient, plain_worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch, put_over: str
) -> None:
    """A batch with an empty field (an empty response, a task with no image) stays on the fast
    path both ways: no request falls back to HTTP (the suite runs with DISTBATCH_SHM_STRICT=1,
    so one that did would raise here too)."""
    shards = zero_size_shards("z")
    before = tokenless_client.traffic()
    if put_over == "HTTP":
        monkeypatch.setenv(ENV_SWITCH, "0")
    assert tokenless_client.put(plain_worker.node, shards).stored == len(shards)
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    # Every row; then only the empty rows of a column that lives in a shared region (an answer
    # whose region column has no run at all).
    empty_rows = [key for key in shards if key[1] == "ragged" and not shards[key].numel()]
    for keys in (list(shards), empty_rows):
        got = tokenless_client.fetch([(plain_worker.node, *key) for key in keys])
        for key, value in zip(keys, got):
            want = shards[key]
            if isinstance(want, torch.Tensor):
                assert (value.dtype, value.shape) == (want.dtype, want.shape), key
                assert torch.equal(value, want), key
            else:
                assert value == want, key
    used = tokenless_client.traffic() - before
    assert used.same_host_fallbacks == 0
    assert used.same_host_requests == (3 if put_over == "same host" else 2)


def test_same_host_put_over_capacity_is_507_and_stores_nothing(
    tokenless_client: ShardClient, start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker("--max-bytes", str(MIB), env=NO_TOKEN)
    tokenless_client.put(worker.node, {("keep", "x"): torch.ones(1000)})
    with pytest.raises(CapacityError):
        tokenless_client.put(worker.node, {(f"t{i}", "x"): torch.ones(100_000) for i in range(4)})
    stats = tokenless_client.stats(worker.node)
    assert stats["shards"] == 1 and stats["shared_regions"] == 1
    assert tokenless_client.traffic().same_host_requests >= 2


def test_a_put_split_by_the_task_bound_is_staged_and_committed_at_once(
    no_shm_override: None, plain_worker: WorkerProcess
) -> None:
    with ShardClient(token="", max_keys_per_request=30) as small_requests:
        shards = batch_shards(100)
        result = small_requests.put(plain_worker.node, shards)
        assert result.stored == 300
        assert small_requests.traffic().same_host_requests >= 4  # parts over shared memory
        stats = small_requests.stats(plain_worker.node)
        assert stats["shards"] == 300 and stats["shared_regions"] >= 4
        got = small_requests.fetch([(plain_worker.node, "t99", "tokens")])[0]
        assert torch.equal(got, shards[("t99", "tokens")])


# --------------------------------------------------------------------------- lifetimes


def test_a_view_outlives_the_delete_and_its_memory_goes_with_the_last_view(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    shards = batch_shards(64, width=4096)
    tokenless_client.put(plain_worker.node, shards)
    (bundle,) = tokenless_client.fetch_products(
        [(plain_worker.node, [f"t{i}" for i in range(64)], ["dense"])]
    )
    dense = wire.column_tensor(bundle.columns["dense"])
    del bundle
    assert memfd_mappings()
    tokenless_client.delete(plain_worker.node, task_ids=[f"t{i}" for i in range(64)])
    stats = tokenless_client.stats(plain_worker.node)
    assert stats["shards"] == 0 and stats["shared_regions"] == 0 and stats["shared_bytes"] == 0
    assert worker_memfds(plain_worker.pid) == 0  # the worker let go: only our mapping holds it
    expected = torch.stack([shards[(f"t{i}", "dense")] for i in range(64)])
    assert torch.equal(dense.reshape(64, -1), expected)  # still valid: no SIGBUS, same bytes
    del dense
    gc.collect()
    assert not memfd_mappings()  # the last view went: unmapped, the memory is back


def test_rss_and_shared_memory_stay_flat_over_many_cycles(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    """Long (15-60 s): a thousand same-host put and fetch cycles, because a leak of a region or
    of memory per cycle shows only over many of them."""
    shards = batch_shards(16, width=4096)  # ~300 KiB a cycle
    keys = [(plain_worker.node, *k) for k in shards]
    ids = [f"t{i}" for i in range(16)]
    samples = []
    for cycle in range(1000):
        tokenless_client.put(plain_worker.node, shards)
        got = tokenless_client.fetch(keys)
        assert torch.equal(got[0], shards[keys[0][1:]])
        del got
        tokenless_client.delete(plain_worker.node, task_ids=ids)
        if cycle in (199, 999):
            gc.collect()
            samples.append((rss_bytes(os.getpid()), rss_bytes(plain_worker.pid)))
            assert worker_memfds(plain_worker.pid) == 0
            assert not memfd_mappings()
    (client_200, worker_200), (client_1000, worker_1000) = samples
    assert client_1000 - client_200 < 16 * MIB
    assert worker_1000 - worker_200 < 16 * MIB
    assert tokenless_client.traffic().same_host_requests >= 2000


# --------------------------------------------------------------------------- safety


def test_the_handshake_needs_the_secret(tokenless_client: ShardClient, plain_worker: WorkerProcess) -> None:
    info = shm_info(tokenless_client, plain_worker.node)
    assert (
        len(info["socket"]) >= 32
        and info["socket"] != shm_info(tokenless_client, plain_worker.node)["secret"]
    )
    with raw_connect(info) as sock:
        answer = hello(sock, "0" * 64)
        assert answer["status"] == 401
        with pytest.raises((EOFError, ConnectionError)):  # the worker hangs up
            raw_request(sock, {"op": "fetch", "task_ids": ["t0"], "fields": ["dense"]})
    with raw_connect(info) as sock:  # a request before the hello is no hello
        answer, _, _ = raw_request(sock, {"op": "fetch", "task_ids": ["t0"], "fields": ["dense"]})
        assert answer["status"] == 401


def test_with_a_token_the_same_host_path_needs_it_too(
    no_shm_override: None, start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker(env={"DISTBATCH_TOKEN": "sesame"})
    with ShardClient(token="wrong") as stranger:
        with pytest.raises(Exception, match="401|unauthorized|token"):
            stranger.request_json(worker.node, "GET", "/v1/shm")
    with ShardClient(token="sesame") as member:
        info = shm_info(member, worker.node)
        with raw_connect(info) as sock:
            assert hello(sock, info["secret"])["status"] == 401  # the secret alone is not enough
        with raw_connect(info) as sock:
            assert hello(sock, info["secret"], "sesame")["ok"] is True
        member.put(worker.node, {("t0", "x"): torch.arange(10)})
        assert torch.equal(member.fetch([(worker.node, "t0", "x")])[0], torch.arange(10))
        assert member.traffic().same_host_requests == 2


def test_an_unsealed_region_is_refused_and_nothing_is_stored(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    info = shm_info(tokenless_client, plain_worker.node)
    parts = wire.encode_bundle({("t0", "x"): torch.arange(100)})
    fd = os.memfd_create("distbatch-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.writev(fd, [memoryview(p).cast("B") for p in parts])
        with raw_connect(info) as sock:
            assert hello(sock, info["secret"])["ok"] is True
            answer, _, _ = raw_request(sock, {"op": "put"}, [fd])
            assert answer["status"] == 400 and answer["error"] == "bad_region"
            answer, _, _ = raw_request(sock, {"op": "put"}, [])  # no descriptor at all
            assert answer["status"] == 400
    finally:
        os.close(fd)
    assert tokenless_client.stats(plain_worker.node)["shards"] == 0


def test_readers_get_regions_they_cannot_change(
    tokenless_client: ShardClient, plain_worker: WorkerProcess
) -> None:
    tokenless_client.put(
        plain_worker.node, {(f"t{i}", "x"): torch.full((50_000,), float(i)) for i in range(4)}
    )
    info = shm_info(tokenless_client, plain_worker.node)
    with raw_connect(info) as sock:
        assert hello(sock, info["secret"])["ok"] is True
        answer, _, fds = raw_request(
            sock, {"op": "fetch", "task_ids": ["t0", "t1", "t2", "t3"], "fields": ["x"]}
        )
    try:
        assert answer["status"] == 200 and len(fds) == 1
        fd = fds[0]
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1)
    finally:
        close_all(fds)
    got = tokenless_client.fetch([(plain_worker.node, "t2", "x")])[0]
    assert torch.equal(got, torch.full((50_000,), 2.0))


def test_a_forged_run_or_a_reference_over_http_is_refused() -> None:
    region = SharedRegion.from_parts([bytes(range(256)) * 16])
    resolver = RegionResolver([region.array], lambda n: bytearray(n))
    assert bytes(resolver(np.array([[0, 16, 32]]), 32)[0]) == bytes(range(16, 48))
    with pytest.raises(WireFormatError, match="past the end"):
        resolver(np.array([[0, 4000, 200]]), 200)
    with pytest.raises(WireFormatError, match="region"):
        resolver(np.array([[1, 0, 8]]), 8)
    column = wire.RawColumn("U8", wire.RowShapes.uniform(1, (32,)), (), 32, runs=np.array([[0, 0, 32]]))
    container = wire.join_parts(wire.build_bundle(wire.Bundle(["t0"], {"x": column})))
    with pytest.raises(WireFormatError, match="same-host"):
        wire.parse_bundle(container)  # what an HTTP answer carrying references would get
    parsed = wire.parse_bundle(container, resolver)
    assert bytes(parsed.columns["x"].parts[0]) == bytes(range(32))


# --------------------------------------------------------------------------- fallbacks


def test_shm_off_in_the_client_means_http_with_one_log_line(
    plain_worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    lines = http_round_trips(plain_worker.node, caplog)
    assert len(lines) == 1 and "DISTBATCH_SHM=0" in lines[0]


def http_round_trips(node: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Three puts and gathers that must all go over HTTP; the "not used" log lines they caused."""
    caplog.set_level(logging.INFO, logger="distbatch")
    with ShardClient(token="") as c:
        for _ in range(3):
            c.put(node, {("t0", "x"): torch.arange(100_000)})
            assert torch.equal(c.fetch([(node, "t0", "x")])[0], torch.arange(100_000))
        assert c.traffic().same_host_requests == 0
    return [r.getMessage() for r in caplog.records if "shared memory not used" in r.getMessage()]


@pytest.mark.parametrize(
    ("worker_env", "reason"),
    [({ENV_SWITCH: "0"}, "worker: DISTBATCH_SHM=0"), ({ENV_HOST_ID: "another-machine"}, "another host")],
)
def test_a_worker_without_the_path_or_on_another_host_means_http(
    no_shm_override: None,
    start_worker: Callable[..., WorkerProcess],
    caplog: pytest.LogCaptureFixture,
    worker_env: dict[str, str],
    reason: str,
) -> None:
    worker = start_worker(env={**NO_TOKEN, **worker_env})
    lines = http_round_trips(worker.node, caplog)
    assert len(lines) == 1 and reason in lines[0] and worker.node in lines[0]


def test_over_the_workers_shared_bound_puts_and_gathers_use_http(
    tokenless_client: ShardClient,
    start_worker: Callable[..., WorkerProcess],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    lenient_same_host: None,
) -> None:
    # What a container with a small /dev/shm would impose, as a bound the worker enforces.
    worker = start_worker("--shm-max-bytes", str(MIB), env=NO_TOKEN)
    caplog.set_level(logging.WARNING, logger="distbatch")
    big = {(f"t{i}", "x"): torch.full((200_000,), float(i)) for i in range(4)}  # 3.2 MB
    assert tokenless_client.put(worker.node, big).stored == 4
    assert tokenless_client.stats(worker.node)["shared_regions"] == 0  # went over HTTP
    got = tokenless_client.fetch([(worker.node, "t3", "x"), (worker.node, "t0", "x")])
    assert torch.equal(got[0], big[("t3", "x")]) and torch.equal(got[1], big[("t0", "x")])
    small = {("s0", "y"): torch.arange(1000)}
    tokenless_client.put(worker.node, small)  # fits: shared
    assert tokenless_client.stats(worker.node)["shared_regions"] == 1
    lines = [r.getMessage() for r in caplog.records if "shm-max-bytes" in r.getMessage()]
    assert len(lines) == 1  # once per node and kind of reason, however many requests fell back


def test_a_region_the_kernel_refuses_means_http_for_that_gather(
    tokenless_client: ShardClient,
    start_worker: Callable[..., WorkerProcess],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    lenient_same_host: None,
) -> None:
    """What a full tmpfs or a memory limit does to a worker making a region, forced here by a
    1 MiB file-size limit on the worker (memfd writes count; Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (MIB, hard))  # the worker inherits it
    try:
        worker = start_worker(env=NO_TOKEN)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    big = {(f"t{i}", "x"): torch.full((200_000,), float(i)) for i in range(4)}  # 3.2 MB
    monkeypatch.setenv(ENV_SWITCH, "0")
    tokenless_client.put(worker.node, big)  # over HTTP: the worker must make a region to share it
    monkeypatch.delenv(ENV_SWITCH)
    caplog.set_level(logging.WARNING, logger="distbatch")
    for _ in range(2):
        got = tokenless_client.fetch([(worker.node, "t2", "x"), (worker.node, "t1", "x")])
        assert torch.equal(got[0], big[("t2", "x")]) and torch.equal(got[1], big[("t1", "x")])
    assert tokenless_client.stats(worker.node)["shared_regions"] == 0
    lines = [r.getMessage() for r in caplog.records if "refused a shared region" in r.getMessage()]
    assert len(lines) == 1 and "this request used HTTP" in lines[0]


def test_same_host_means_same_boot_and_same_network_namespace(no_shm_override: None) -> None:
    """Processes of one boot in different network namespaces (pods on one node, the simulated
    hosts of `simcluster`) cannot reach each other's abstract socket: their host ids differ, so
    a client never tries the path there (and logs no failed handshake); a process in our own
    namespace shares ours."""
    code = "from distbatch.transport.shm import host_id; print(host_id())"
    ours = host_id()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert ours.startswith(boot + "/net:[")
    sibling = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert sibling.stdout.strip() == ours
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare command to make a network namespace")
    other = subprocess.run(
        [unshare, "--net", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    if other.returncode != 0:
        pytest.skip(f"this machine does not allow a new network namespace: {other.stderr.strip()[-200:]}")
    theirs = other.stdout.strip()
    assert theirs.startswith(boot + "/net:[") and theirs != ours
