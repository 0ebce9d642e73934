"""A durable store (`ShardStore` with a `DurableLog`), in process: what it held comes back after
a restart on the same directory, and what a crash leaves half written never does.

The model-based test is the store's own (`test_store.StoreModel`: puts, replacements, appends,
shared values, deletes of every kind, fetches against a dict model) with one more step: restart,
which closes the log, reads it back and replays it into a fresh store; every later step and
check then runs against the recovered store.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from safetensors import safe_open
from test_store import StoreModel, appending, decoded, u8

from distbatch.ids import ShardKey
from distbatch.wire.bundle import Bundle, RawColumn
from distbatch.wire.shapes import RowShapes
from rpc_server.errors import DurableLogError, StoreCapacityError
from rpc_server.store import ShardStore, bundle_from_raw
from rpc_server.store.durable import DROPPED_DIR, LOG_DIR, RECORD_KEY, DurableLog, read_log
from rpc_server.store.shard_store import GENERATION_MARGIN


def durable_store(directory: Path, sync: bool = False) -> tuple[ShardStore, int]:
    """A store on `directory`'s log, with what the log holds replayed; (store, records replayed)."""
    log = DurableLog(directory)
    store = ShardStore(log=log, sync=sync)
    puts, deletes = store.recover(log.recovered.records)
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

    @rule()
    def compact(self) -> None:
        """A snapshot replaces the log so far: every later step, and the restart after, work
        from it (and the records after it)."""
        before = self.store.stats()
        self.store.compact()
        stats = self.store.durable_stats()
        assert stats is not None and stats.snapshot_seq == stats.durable_seq or not self.store.compact()
        assert self.store.stats() == before  # the store itself does not change
        log = self.directory / LOG_DIR
        assert all(int(p.name[:16]) > stats.snapshot_seq for p in log.iterdir())

    @rule(half=st.booleans())
    def spill(self, half: bool) -> None:
        """Move the coldest values (half the memory, or all) to disk: every later read, append,
        replacement, delete and restart works on them as on values in memory."""
        before = self.store.stats()
        freed = self.store.spill(before.memory_bytes // 2 if half else None)
        after = self.store.stats()
        assert (after.bytes, after.shards) == (before.bytes, before.shards)
        assert after.memory_bytes == before.memory_bytes - freed
        assert after.on_disk_bytes == before.on_disk_bytes + freed

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
    (aside,) = (tmp_path / DROPPED_DIR).iterdir()  # a folder for each recovery that set some aside
    assert sorted(p.name for p in aside.iterdir()) == sorted(
        [files[2].name, files[3].name, f".{files[-1].name}.tmp"]
    )
    # The log goes on after the last whole record: numbers without a gap.
    again.put({("t9", "x"): u8(b"z")})
    again.close()
    assert [r.seq for r in read_log(tmp_path).records] == [1, 2, 3]


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
    assert stats.pending_records == 0 and stats.pending_bytes == 0  # the unwritable records let go
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


def _four_puts(directory: Path) -> list[Path]:
    store, _ = durable_store(directory, sync=True)
    for i in range(4):
        store.put({(f"t{i}", "x"): u8(bytes([i]) * 100)})
    store.close()
    return sorted((directory / LOG_DIR).iterdir())


def test_a_missing_record_ends_the_replay_there(tmp_path: Path) -> None:
    files = _four_puts(tmp_path)
    files[1].unlink()  # a record lost in the middle: the later ones may build on it
    again, replayed = durable_store(tmp_path)
    assert replayed == 1 and _keys(again) == [("t0", "x")]
    again.close()


def test_a_damaged_header_is_caught_too(tmp_path: Path) -> None:
    files = _four_puts(tmp_path)
    raw = bytearray(files[2].read_bytes())
    at = raw.index(b"t2")  # the task id, in the header: parses, but is not what was written
    raw[at + 1] = ord("9")
    files[2].write_bytes(raw)
    again, replayed = durable_store(tmp_path)
    assert replayed == 2 and sorted(t for t, _ in _keys(again)) == ["t0", "t1"]
    again.close()


def test_a_record_of_a_newer_format_stops_the_start_and_moves_nothing(tmp_path: Path) -> None:
    files = _four_puts(tmp_path)
    raw = files[3].read_bytes()
    files[3].write_bytes(raw.replace(b'\\"version\\":1', b'\\"version\\":9', 1))
    with pytest.raises(DurableLogError, match="newer distbatch"):
        DurableLog(tmp_path)
    assert sorted((tmp_path / LOG_DIR).iterdir()) == files and not (tmp_path / DROPPED_DIR).exists()
    files[3].write_bytes(raw)  # and the directory was not left locked:
    durable_store(tmp_path)[0].close()


def test_a_second_worker_is_refused_before_it_reads_the_log(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path)
    torn = tmp_path / LOG_DIR / ".0000000000000009-0-1.safetensors.tmp"
    torn.write_bytes(b"being written")  # the live worker's file in progress
    with pytest.raises(DurableLogError, match="another worker"):
        DurableLog(tmp_path)
    assert torn.exists()  # untouched
    torn.unlink()
    store.close()


def test_new_puts_never_reuse_a_generation_a_lost_tail_may_have_had(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path, sync=True)
    newest = store.put({("a", "x"): u8(b"kept")}).generation
    store.close()
    again, _ = durable_store(tmp_path)
    assert again.put({("b", "x"): u8(b"new")}).generation >= newest + GENERATION_MARGIN
    again.close()


def test_a_record_replay_cannot_apply_ends_the_replay_and_the_log_goes_on_after_it(tmp_path: Path) -> None:
    """A well-formed record that does not apply (here: an append naming a generation the value
    never had) is set aside with every later one; new records follow the last kept one, so the
    next recovery finds no gap and keeps them."""
    store, _ = durable_store(tmp_path, sync=True)
    store.put({("a", "x"): u8(b"kept")})
    store.close()
    log = DurableLog(tmp_path)
    bad = appending({"a": b"!"}, "x")
    bad.columns["x"].append = np.asarray([12345], dtype=np.int64)  # a's value has another generation
    log.append("put", 777, [bad])
    log.append("put", 778, [bundle_from_raw({("b", "x"): u8(b"after")})])
    log.close()
    again, replayed = durable_store(tmp_path)
    assert replayed == 1 and _keys(again) == [("a", "x")]
    again.put({("c", "x"): u8(b"new")})
    again.close()
    final, replayed = durable_store(tmp_path)
    assert replayed == 2 and _keys(final) == [("a", "x"), ("c", "x")]
    final.close()


# ---------------------------------------------------------------------- spilling past --max-bytes


def _rows(prefix: str, fill: int, n: int = 10, size: int = 100) -> dict[tuple[str, str], Any]:
    return {(f"{prefix}{j}", "x"): u8(bytes([fill]) * size) for j in range(n)}


def _ids(prefix: str, n: int = 10) -> list[str]:
    return [f"{prefix}{j}" for j in range(n)]


def test_a_put_past_max_bytes_spills_the_coldest_instead_of_refusing(tmp_path: Path) -> None:
    """Ten puts of 1,000 bytes into 3,000 bytes of memory (written behind, not synced): every put
    is taken, memory stays within the bound, the puts used longest ago go to disk (one fetched
    meanwhile stays), and every value reads back intact, counted when it comes from disk."""
    store = ShardStore(max_bytes=3000, log=DurableLog(tmp_path))
    for i in range(10):
        store.put(_rows(f"p{i}-", i))
        if i >= 1:
            store.fetch(_ids("p0-"), ["x"])  # p0 is read all along: the warmest
        stats = store.stats()
        assert stats.memory_bytes <= 3000 and stats.bytes == 1000 * (i + 1)
    stats = store.stats()
    assert (stats.on_disk_bytes, stats.spilled_bytes, stats.read_back_bytes) == (7000, 7000, 0)
    for i in range(10):
        column = store.fetch(_ids(f"p{i}-"), ["x"]).columns["x"]
        assert bytes(column.single_buffer()) == bytes([i]) * 1000
    stats = store.stats()
    assert stats.read_back_shards == 70 and stats.read_back_bytes == 7000  # p1..p7, not p0, p8, p9
    assert stats.as_dict()["free"] == 0
    store.close()


def test_a_spilled_value_can_be_replaced_appended_to_and_deleted(tmp_path: Path) -> None:
    store = ShardStore(max_bytes=10_000, log=DurableLog(tmp_path))
    store.put(_rows("a", 1))
    store.put({("m", "meta"): {"k": 1}})
    assert store.spill() == 1000  # the JSON value stays in memory
    store.put(appending({"a0": b"++"}, "x"))  # reads the old value back from disk
    store.put({("a1", "x"): u8(b"new")})
    store.delete_keys([ShardKey("a2", "x")])
    assert bytes(store.fetch(["a0"], ["x"]).columns["x"].single_buffer()) == bytes([1]) * 100 + b"++"
    assert bytes(store.fetch(["a1"], ["x"]).columns["x"].single_buffer()) == b"new"
    stats = store.stats()
    assert stats.on_disk_bytes == 700  # a0, a1 replaced and a2 deleted: 7 rows left on disk
    store.close()


def test_memory_no_record_holds_is_written_to_a_file_of_its_own(tmp_path: Path) -> None:
    """A value an append extended holds memory of its own (the record holds only the appended
    bytes): spilled, it is written to a file under DIR/spill/, unlinked at once."""
    store = ShardStore(log=DurableLog(tmp_path))
    store.put(_rows("a", 1, n=2))
    store.put(appending({"a0": b"++"}, "x"))
    assert store.spill() == 202  # a1 from its record, a0's own 102 bytes written
    assert store.stats().memory_bytes == 0
    assert bytes(store.fetch(["a0"], ["x"]).columns["x"].single_buffer()) == bytes([1]) * 100 + b"++"
    assert not list((tmp_path / "spill").iterdir())  # mapped, not named: nothing left behind
    store.close()


def test_a_record_that_no_longer_matches_its_value_is_written_instead_and_not_tried_again(
    tmp_path: Path,
) -> None:
    """A buffer's record file that no longer holds its bytes as they are (here: another put's
    record copied over it, a value of another size under the same field): the spill writes the
    value to a file of its own, and forgets the record, instead of mapping and parsing it again
    at every later spill and keeping the value in memory."""
    store, _ = durable_store(tmp_path, sync=True)
    store.put(_rows("a", 1))  # 1,000 bytes, record 1
    store.put(_rows("b", 2, n=5))  # 500 bytes, record 2
    records = sorted((tmp_path / "log").iterdir())
    assert len(records) == 2
    shutil.copyfile(records[1], records[0])
    assert store.spill() == 1500
    assert store.stats().memory_bytes == 0
    assert bytes(store.fetch(_ids("a"), ["x"]).columns["x"].single_buffer()) == bytes([1]) * 1000
    store.close()


def test_without_room_to_spill_a_put_is_still_refused(tmp_path: Path) -> None:
    """JSON values live in memory only: past the bound, the put is refused, nothing changes."""
    store = ShardStore(max_bytes=300, log=DurableLog(tmp_path))
    store.put({(f"t{i}", "meta"): {"v": "x" * 20} for i in range(5)})
    before = store.stats()
    with pytest.raises(StoreCapacityError, match="spilled to disk, but not all"):
        store.put({(f"u{i}", "meta"): {"v": "y" * 20} for i in range(20)})
    assert store.stats() == before
    store.close()


def test_a_restart_with_less_memory_leaves_the_rest_on_disk(tmp_path: Path) -> None:
    store, _ = durable_store(tmp_path)
    for i in range(6):
        store.put(_rows(f"p{i}-", i))
    store.close()
    log = DurableLog(tmp_path)
    again = ShardStore(max_bytes=2500, log=log)
    again.recover(log.recovered.records)
    stats = again.stats()
    assert stats.bytes == 6000 and stats.memory_bytes <= 2500 and stats.on_disk_bytes >= 3500
    for i in range(6):
        assert bytes(again.fetch(_ids(f"p{i}-"), ["x"]).columns["x"].single_buffer()) == bytes([i]) * 1000
    again.close()


def test_only_a_durable_store_spills() -> None:
    store = ShardStore(max_bytes=100)
    with pytest.raises(ValueError, match="durable"):
        store.spill()
    store.close()


# ---------------------------------------------------------------------- compaction


def _share(store: ShardStore, source: str, members: list[str], field: str = "x") -> None:
    column = RawColumn("U8", RowShapes.uniform(0, ()), [], 0, rows=np.zeros(0, dtype=np.int64))
    column.alias, column.alias_of = np.arange(len(members), dtype=np.int64), [source] * len(members)
    store.put(Bundle(members, {field: column}))


def _state(store: ShardStore) -> dict[tuple[str, str], Any]:
    """Every value with its generation (what batch handles name)."""
    keys = _keys(store)
    out = {}
    for task, field in keys:
        value = decoded(store.fetch([task], [field]))[(task, field)]
        generation = store._shards.index.generations(field, store._shards.index.rows.lookup([task]))
        out[(task, field)] = (value, int(generation[0]))
    return out


def _history(store: ShardStore) -> None:
    """Puts, a shared value whose owner is replaced, an append, deletes of every kind."""
    store.put(_rows("a", 1, n=4))
    store.put({(f"m{i}", "meta"): {"i": i} for i in range(3)})
    _share(store, "a0", ["s1", "s2"])
    store.put({("a0", "x"): u8(b"replaced")})  # the shared row now belongs to s1 and s2 only
    store.put(appending({"a1": b"++"}, "x"))
    store.delete_keys([ShardKey("a2", "x")])
    store.delete_tasks(["m1"])
    store.put(_rows("b", 2, n=3))
    store.delete_product(["b0", "b1"], ["x"])


def test_a_compacted_log_recovers_the_same_store(tmp_path: Path) -> None:
    """After a compaction the log holds a snapshot and nothing before it; a restart gives every
    value with its generation, the shared value still stored once, and the disk holds less."""
    store, _ = durable_store(tmp_path, sync=True)
    _history(store)
    before, stats = _state(store), store.stats()
    disk = store.durable_stats().disk_bytes  # type: ignore[union-attr]
    assert store.compact() and not store.compact()  # nothing changed since
    log = store.durable_stats()
    assert log is not None and log.snapshot_seq == log.durable_seq and log.compactions == 1
    assert log.disk_bytes < disk and not list((tmp_path / LOG_DIR).iterdir())
    assert log.disk_bytes == sum(p.stat().st_size for p in (tmp_path / "snapshot").rglob("*") if p.is_file())
    store.put({("c", "x"): u8(b"after")})  # a record after the snapshot
    store.close()
    again, _ = durable_store(tmp_path)
    after = _state(again)
    assert after.pop(("c", "x"))[0] == ("U8", (5,), b"after")
    assert after == before
    stats_again = again.stats()
    # c added; s1 and s2 share one row, counted once, as before
    assert (stats_again.shards, stats_again.bytes) == (stats.shards + 1, stats.bytes + 5)
    again.close()


def test_a_compaction_cut_short_leaves_the_log_as_it_was(tmp_path: Path) -> None:
    """A crash while the snapshot is written (a hidden directory with part of it): recovery
    ignores it, deletes it, and replays the whole log."""
    store, _ = durable_store(tmp_path, sync=True)
    _history(store)
    before = _state(store)
    store.close()
    half = tmp_path / "snapshot" / f".{99:016d}.tmp"
    half.mkdir(parents=True)
    (half / "0000000000000001-0-1.safetensors").write_bytes(b"half a file")
    again, _ = durable_store(tmp_path)
    assert _state(again) == before
    assert not half.exists()
    again.close()


def test_records_a_finished_snapshot_replaces_are_dropped_at_recovery(tmp_path: Path) -> None:
    """A crash after the snapshot is in place but before the records it replaces are deleted:
    recovery replays the snapshot, not those records, and deletes them."""
    store, _ = durable_store(tmp_path, sync=True)
    _history(store)
    before = _state(store)
    kept = {p.name: p.read_bytes() for p in (tmp_path / LOG_DIR).iterdir()}
    store.compact()
    store.close()
    for name, data in kept.items():  # as if the deletes never happened
        (tmp_path / LOG_DIR / name).write_bytes(data)
    again, replayed = durable_store(tmp_path)
    assert _state(again) == before
    assert not list((tmp_path / LOG_DIR).iterdir())
    again.close()


def test_a_damaged_snapshot_stops_the_start(tmp_path: Path) -> None:
    """A snapshot is all that is left of the records it replaced: a damaged one is not skipped."""
    store, _ = durable_store(tmp_path, sync=True)
    _history(store)
    store.compact()
    store.close()
    (first,) = sorted((tmp_path / "snapshot").iterdir())[:1]
    victim = sorted(first.iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DurableLogError, match="snapshot .* is damaged"):
        DurableLog(tmp_path)


def test_a_damaged_newest_snapshot_leaves_the_older_one_in_place(tmp_path: Path) -> None:
    """The start refuses a damaged newest snapshot before it deletes anything: the snapshot it
    replaced stays on disk (a crash can leave both until recovery tidies), so a person can still
    recover from it."""
    store, _ = durable_store(tmp_path, sync=True)
    _history(store)
    store.compact()
    older = sorted((tmp_path / "snapshot").iterdir())
    assert len(older) == 1
    kept = tmp_path / "kept"
    shutil.copytree(older[0], kept)  # as a crash between a compaction's rename and its tidy leaves it
    store.put({("late", "x"): u8(b"after")})
    store.compact()
    store.close()
    shutil.copytree(kept, older[0])
    newest = max((tmp_path / "snapshot").iterdir())
    assert newest != older[0]
    victim = sorted(newest.iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DurableLogError, match="snapshot .* is damaged"):
        DurableLog(tmp_path)
    assert older[0].is_dir() and sorted(p.name for p in older[0].iterdir()) == sorted(
        p.name for p in kept.iterdir()
    )


def test_a_snapshot_keeps_the_newest_generation_given_even_when_nothing_is_held(tmp_path: Path) -> None:
    """Everything deleted, then compacted: the snapshot holds no value, yet a restarted store's
    puts still start above every generation it gave (a handle may name a deleted value)."""
    store, _ = durable_store(tmp_path, sync=True)
    last = store.put({("a", "x"): u8(b"one")}).generation
    store.delete_tasks(["a"])
    assert store.compact()
    store.close()
    again, _ = durable_store(tmp_path)
    assert len(again) == 0
    assert again.put({("b", "x"): u8(b"two")}).generation > last + GENERATION_MARGIN - 1
    again.close()


def test_a_compaction_the_disk_refuses_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fails on the snapshot's second file: the half snapshot is deleted, the log is
    kept whole, and the store serves and recovers as before."""
    import rpc_server.store.durable as durable

    store, _ = durable_store(tmp_path, sync=True)
    _history(store)
    before = _state(store)
    real = durable._write_file
    calls = []

    def failing(directory: Path, name: str, parts: Any) -> int:
        calls.append(name)
        if len(calls) == 2 and directory.parent.name == "snapshot":
            raise OSError(28, "No space left on device")
        return real(directory, name, parts)

    monkeypatch.setattr(durable, "_write_file", failing)
    with pytest.raises(OSError, match="No space"):
        store.compact()
    monkeypatch.setattr(durable, "_write_file", real)
    assert not list((tmp_path / "snapshot").iterdir())
    assert store.durable_stats().snapshot_seq == 0  # type: ignore[union-attr]
    store.close()
    again, _ = durable_store(tmp_path)
    assert _state(again) == before
    again.close()


def test_spilling_a_same_host_put_lets_its_shared_region_go(tmp_path: Path) -> None:
    """A put whose body is a shared region, with a JSON field: spilled, the region goes too (the
    JSON values left hold none of it), and memory, held and shared bytes all say so."""
    from distbatch.transport.shm import SharedRegion
    from distbatch.wire.bundle import build_bundle, parse_bundle

    store = ShardStore(log=DurableLog(tmp_path))
    raw = bundle_from_raw(
        {**_rows("a", 1, n=10, size=10_000), **{(f"a{j}", "uid"): f"u{j}" for j in range(10)}}
    )
    region = SharedRegion.from_parts(build_bundle(raw))
    store.put(parse_bundle(region.array), body_size=region.size, region=region)
    assert store.stats().shared_bytes == region.size
    assert store.spill() == 100_000
    stats = store.stats()
    assert (stats.shared_bytes, stats.shared_regions) == (0, 0)
    assert stats.memory_bytes < 100 and stats.held_bytes < 10_000
    assert not store._shards.segments.spill_candidates(1 << 62)  # JSON alone is not worth a look
    assert bytes(store.fetch(["a3"], ["x"]).columns["x"].single_buffer()) == bytes([1]) * 10_000
    store.close()


def test_a_spilled_put_mostly_deleted_lets_its_file_go(tmp_path: Path) -> None:
    """80 of 100 spilled rows deleted: the 20 left are copied back into memory (compacted, as
    in memory), so the put's record file is no longer held for them; values intact."""
    store = ShardStore(log=DurableLog(tmp_path))
    store.put(_rows("a", 7, n=100, size=20_000))
    assert store.spill() == 2_000_000
    store.delete_tasks(_ids("a", 80))
    stats = store.stats()
    assert (stats.on_disk_bytes, stats.memory_bytes) == (0, 400_000)
    column = store.fetch(_ids("a", 100)[80:], ["x"]).columns["x"]
    assert bytes(column.single_buffer()) == bytes([7]) * 400_000
    store.close()
