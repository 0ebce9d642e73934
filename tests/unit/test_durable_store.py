"""A durable store (`ShardStore` with a `DurableLog`), in process: what it held comes back after
a restart on the same directory, and what a crash leaves half written never does.

The model-based test is the store's own (`test_store.StoreModel`: puts, replacements, appends,
shared values, deletes of every kind, fetches against a dict model) with one more step: restart,
which closes the log, reads it back and replays it into a fresh store; every later step and
check then runs against the recovered store.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from safetensors import safe_open
from test_store import StoreModel, decoded, u8

from distbatch.ids import ShardKey
from rpc_server.errors import DurableLogError
from rpc_server.store import ShardStore
from rpc_server.store.durable import DROPPED_DIR, LOG_DIR, RECORD_KEY, DurableLog, read_log


def durable_store(directory: Path, sync: bool = False) -> tuple[ShardStore, int]:
    """A store on `directory`'s log, with what the log holds replayed; (store, records replayed)."""
    recovered = read_log(directory)
    store = ShardStore(log=DurableLog(directory, next_seq=recovered.last_seq + 1), sync=sync)
    puts, deletes = store.recover(recovered.records)
    return store, puts + deletes


def restarted(store: ShardStore, directory: Path) -> ShardStore:
    store.close()  # writes what the log still holds, as a clean shutdown does
    return durable_store(directory)[0]


class DurableStoreModel(StoreModel):
    """`StoreModel` on a durable store that restarts now and then."""

    def __init__(self) -> None:
        super().__init__()
        self.store.close()
        self._tmp = tempfile.TemporaryDirectory()
        self.directory = Path(self._tmp.name)
        self.store, _ = durable_store(self.directory)
        self.restarts = 0
        self.fresh_from = 0  # receipts of puts before a restart name segments the old store had

    @rule()
    def restart(self) -> None:
        self.store = restarted(self.store, self.directory)
        self.restarts += 1
        self.fresh_from = self.puts_done

    @precondition(lambda self: bool(self.values))
    @rule(data=st.data())
    def delete_put(self, data: st.DataObject) -> None:
        fresh = [(n, r) for n, r in self.receipts if n > self.fresh_from]
        if not fresh:
            return
        number, receipt = data.draw(st.sampled_from(fresh))
        keys = [k for k, owner in self.owner.items() if owner == number]
        self._forget(keys, self.store.delete_put(receipt))

    def teardown(self) -> None:
        # Once more from the disk: the last steps' records too.
        self.store = restarted(self.store, self.directory)
        super().teardown()
        self._tmp.cleanup()


DurableStoreModel.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_durable_store_against_a_dict_model = DurableStoreModel.TestCase


def _put_some(store: ShardStore) -> None:
    store.put({("a", "x"): u8(b"alpha"), ("b", "x"): u8(b"beta"), ("a", "meta"): {"k": [1, 2]}})
    store.stage("s", {("c", "x"): u8(b"gamma")}, part="p0")
    store.stage("s", {("d", "x"): u8(b"delta")}, part="p1")
    store.commit("s")
    store.delete_keys([ShardKey("b", "x")])


def test_a_restart_brings_back_values_and_generations(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path)
    _put_some(store)
    before = store.fetch(["a", "c", "d"], ["x"])
    generations = store._shards.index.generations("x", store._shards.index.rows.lookup(["a", "c", "d"]))
    store.close()
    again, replayed = durable_store(tmp_path)
    assert replayed == 3  # a put, a commit of two parts, a delete
    assert decoded(again.fetch(["a", "c", "d"], ["x"])) == decoded(before)
    assert decoded(again.fetch(["a"], ["meta"])) == decoded(store.fetch(["a"], ["meta"]))
    assert len(again) == 4  # b's x was deleted, and stays so
    rows = again._shards.index.rows.lookup(["a", "c", "d"])
    assert again._shards.index.generations("x", rows).tolist() == generations.tolist()
    later = again.put({("e", "x"): u8(b"new")})
    assert later.generation > max(generations.tolist())  # never a generation an old handle names
    again.close()


def test_a_record_is_a_safetensors_file_a_person_can_open(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path, sync=True)
    store.put({("a", "x"): u8(b"alpha"), ("b", "x"): u8(b"beta")})
    store.close()
    (path,) = sorted((tmp_path / LOG_DIR).iterdir())
    with safe_open(str(path), framework="numpy") as f:
        assert bytes(f.get_tensor("x")) == b"alphabeta"
        info = json.loads(f.metadata()[RECORD_KEY])
    assert info["kind"] == "put" and info["seq"] == 1 and info["generation"] > 0


def test_with_sync_a_put_returns_once_its_record_is_on_disk(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path, sync=True)
    store.put({("a", "x"): u8(b"alpha")})
    stats = store.durable_stats()
    assert stats is not None and stats.durable_seq == 1 and stats.pending_records == 0
    # Read by someone else while the store still runs: the put is there.
    assert [r.kind for r in read_log(tmp_path).records] == ["put"]
    store.close()


def test_what_a_crash_leaves_half_written_is_set_aside_not_served(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path, sync=True)
    for i in range(4):
        store.put({(f"t{i}", "x"): u8(bytes([i]) * 100)})
    store.close()
    log = tmp_path / LOG_DIR
    files = sorted(log.iterdir())
    # A torn last write (a hidden temporary file), and damage in the third record's data: the
    # third record and everything after it go (the fourth might build on the third).
    (log / f".{files[-1].name}.tmp").write_bytes(files[-1].read_bytes()[:50])
    damaged = bytearray(files[2].read_bytes())
    damaged[-1] ^= 0xFF
    files[2].write_bytes(damaged)
    again, replayed = durable_store(tmp_path)
    assert replayed == 2
    assert sorted(t for t, _ in (k for k in _keys(again))) == ["t0", "t1"]
    assert sorted(p.name for p in (tmp_path / DROPPED_DIR).iterdir()) == sorted(
        [files[2].name, files[3].name, f".{files[-1].name}.tmp"]
    )
    # The next record does not reuse a dropped record's number.
    again.put({("t9", "x"): u8(b"z")})
    again.close()
    assert [r.seq for r in read_log(tmp_path).records] == [1, 2, 5]


def test_a_commit_missing_a_part_is_dropped_whole(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path, sync=True)
    store.stage("s", {("a", "x"): u8(b"one")}, part="p0")
    store.stage("s", {("b", "x"): u8(b"two")}, part="p1")
    store.commit("s")
    store.close()
    parts = sorted((tmp_path / LOG_DIR).iterdir())
    assert len(parts) == 2
    parts[1].unlink()
    again, replayed = durable_store(tmp_path)
    assert replayed == 0 and len(again) == 0
    again.close()


def test_a_log_that_cannot_write_refuses_changes_and_says_why(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path, sync=True)
    store.put({("a", "x"): u8(b"kept")})
    log = tmp_path / LOG_DIR
    log.rename(tmp_path / "moved")
    log.write_bytes(b"")  # the next record cannot be written (as on a full or failing disk)
    with pytest.raises(DurableLogError, match="could not be written"):
        store.put({("b", "x"): u8(b"applied, not durable")})
    with pytest.raises(DurableLogError, match="cannot write"):
        store.put({("c", "x"): u8(b"refused")})
    stats = store.durable_stats()
    assert stats is not None and stats.failed is not None and "NotADirectoryError" in stats.failed
    assert decoded(store.fetch(["a"], ["x"])) == {("a", "x"): ("U8", (4,), b"kept")}
    assert len(store) == 2  # the refused put changed nothing
    store.close()


def _keys(store: ShardStore) -> list[tuple[str, str]]:
    page, _ = store.list_tasks(limit=100)
    return [(t, f) for t, fields in page for f in fields]


def test_lag_is_reported_and_bounded(tmp_path: Path) -> None:
    store = ShardStore(log=DurableLog(tmp_path, max_lag_bytes=1))
    for i in range(20):
        store.put({(f"t{i}", "x"): u8(np.full(1000, i, dtype=np.uint8).tobytes())})
        stats = store.durable_stats()
        assert stats is not None and stats.pending_bytes <= 1000 + 1  # each put waited for room
    store.close()
    stats = store.durable_stats()
    assert stats is not None and stats.pending_records == 0 and stats.written_records == 20


def test_one_worker_a_directory(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path)
    with pytest.raises(DurableLogError, match="another worker"):
        DurableLog(tmp_path)
    store.close()
    DurableLog(tmp_path).close()  # free once the first closed
