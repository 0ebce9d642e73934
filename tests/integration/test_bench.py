"""The benchmark at a tiny size: its accounting, checksums and outputs, never its timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from areal_support import areal_imported
from ray_support import import_ray

from bench import areal, baselines, control_plane, scaling, shared_fields, transferqueue
from bench.__main__ import main, parse_args, summary
from bench.workloads import WORKLOADS, make_columns, make_dense_columns, payload_bytes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_written(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > len(PNG_SIGNATURE), path
    assert path.read_bytes()[: len(PNG_SIGNATURE)] == PNG_SIGNATURE


def test_tiny_bench_accounts_for_every_byte(tmp_path: Path) -> None:
    results = main(
        [
            "--workloads",
            "tiny",
            "--repeats",
            "2",
            "--no-ray",
            "--no-pipeline",
            "--peers",
            "",
            "--out",
            str(tmp_path),
        ]
    )
    tiny = results["workloads"]["tiny"]
    columns = make_columns(WORKLOADS["tiny"], 0)
    payload = payload_bytes(columns)
    json_bytes = sum(len(json.dumps(uid)) for uid in columns["uid"])
    assert tiny["payload_bytes"] == payload
    # What the workers stored is exactly the tensors plus the JSON text of the uids.
    assert tiny["distbatch"]["stored_bytes"] == payload + json_bytes
    assert tiny["distbatch"]["cleared_shards"] == WORKLOADS["tiny"].tasks * len(columns)
    assert tiny["distbatch"]["left_bytes"] == 0
    # Each transport moved the batch's payload (gathers are checksummed inside the bench).
    for name in ("raw_tcp", "pickle_http", "base64_json"):
        assert tiny["baselines"][name]["bytes"] == payload
        assert len(tiny["baselines"][name]["seconds"]) == 2
    assert tiny["distbatch"]["gather_one_field"]["bytes"] == sum(t.nbytes for t in columns["input_ids"])
    assert 0 < tiny["ratios"]["metadata_fraction"] < 1
    assert "peers" not in tiny and "scaling" not in results
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["workloads"]["tiny"]["distbatch"]["stored_bytes"] == payload + json_bytes


def test_the_multimodal_rows_store_and_move_a_shared_image_once(tmp_path: Path) -> None:
    """`--workloads multimodal` in small (2 prompts): shared, the workers hold each image once
    and the client puts and gathers it once; as n copies, 8 times; every gather checked."""
    args = ["--workloads", "multimodal", "--multimodal-prompts", "2", "--repeats", "1", "--workers", "1"]
    results = main([*args, "--no-tq"])
    r = results["multimodal"]
    images, group = r["image_bytes"], shared_fields.GROUP
    own = r["payload_bytes"] - group * images  # input_ids: each task's own
    assert images <= r["shared"]["stored_bytes"] - own < images + 2_000  # + the uids' JSON
    assert group * images <= r["copies"]["stored_bytes"] - own < group * images + 2_000
    for key in ("put_bytes", "gathered_bytes"):
        assert r["shared"][key] < own + images + 64_000 < group * images <= r["copies"][key]
    assert 0.1 < r["ratios"]["stored_bytes_vs_copies"] < 0.2
    assert "distbatch, shared" in summary(results)


def test_dense_variant_is_the_same_fields_padded() -> None:
    workload = WORKLOADS["grpo"]
    assert workload.dense_shape == (5_120, 1_536)
    dense = make_dense_columns(WORKLOADS["tiny"], 0)
    tasks, width = WORKLOADS["tiny"].dense_shape
    assert set(dense) == set(make_columns(WORKLOADS["tiny"], 0))
    assert dense["input_ids"].shape == dense["advantages"].shape == (tasks, width)
    assert payload_bytes(dense) == tasks * width * (4 + 4 + 2) + tasks * 4


def test_peers_run_distbatch_on_the_dense_batch_and_say_why_tq_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dense comparison is wired into the same run; TransferQueue skipped here (--no-tq), and
    AReaL's rows (--no-areal: `test_areal_rows_...` runs them, importing AReaL only inside
    `areal_imported`, since importing it reconfigures this process's logging)."""
    monkeypatch.delenv("DISTBATCH_SHM")  # the suite's default; the same-host run needs the path on
    results = main(
        ["--workloads", "tiny", "--repeats", "1", "--no-ray", "--no-pipeline", "--no-tq", "--no-areal"]
        + ["--peers", "tiny", "--no-rss", "--out", str(tmp_path)]
    )
    peers = results["workloads"]["tiny"]["peers"]
    dense = peers["distbatch_dense"]
    assert dense["put"]["bytes"] == peers["dense_payload_bytes"] == dense["gather_all"]["bytes"]
    assert dense["left_bytes"] == 0
    assert peers["transferqueue"] == {"skipped": "--no-tq"}
    assert "areal" not in results["workloads"]["tiny"]
    # The transport figures above are HTTP's; the same-host run beside them took shared memory.
    same = results["workloads"]["tiny"]["same_host"]
    for kind in ("ragged", "dense"):
        entry = same[kind]
        ours = entry["distbatch"]
        assert (
            ours["put"]["bytes"]
            == ours["gather"]["bytes"]
            == entry["memcpy"]["bytes"]
            == entry["region"]["bytes"]
            == entry["payload_bytes"]
        )
        assert ours["same_host_requests"] >= 1 and ours["shared_regions"] >= 1
        assert ours["http_bytes"] < entry["payload_bytes"]  # only metadata went over HTTP
        assert set(entry["ratios"]) == {
            "gather_vs_memcpy",
            "gather_read_vs_memcpy",
            "put_vs_memcpy",
            "put_vs_region",
            "region_vs_memcpy",
        }
    assert "same host, tiny" in summary(results)


# Distbatch over HTTP runs the same harness code with one flag turned off (the backend's HTTP path
# is what tests/system/test_transferqueue_backend.py checks, the suite being on HTTP).
@pytest.mark.parametrize(("backend", "same_host"), [("SimpleStorage", False), ("Distbatch", True)])
def test_transferqueue_backends_put_and_get_the_same_batches(
    tmp_path: Path, backend: str, same_host: bool
) -> None:
    """The bench's TransferQueue rows, each backend on its usual path. Long (10-15 s alone each):
    every run starts Ray, TransferQueue's actors and, for Distbatch, our workers, as the bench
    does."""
    reason = transferqueue.available()
    if reason:
        pytest.skip(reason)
    # SimpleStorage also moves the multimodal batch (small), in the same child.
    multimodal = (transferqueue.MULTIMODAL,) if backend == "SimpleStorage" else ()
    result = transferqueue.run(
        "tiny",
        0,
        1,
        2,
        timeout=240,
        log_path=tmp_path / "tq.log",
        kinds=(*transferqueue.KINDS, *multimodal),
        backend=backend,
        same_host=same_host,
        prompts=2,
    )
    if multimodal:
        figures = result[transferqueue.MULTIMODAL]
        assert figures["checked"] and figures["tasks"] == 2 * shared_fields.GROUP, figures
    assert "error" not in result, result
    assert result["backend"] == backend and result["units"] == 2
    assert result.get("same_host", False) == same_host
    for kind, columns in (("dense", make_dense_columns), ("ragged", make_columns), ("strided", make_columns)):
        figures = result[kind]
        assert "error" not in figures, figures
        assert figures["checked"] and figures["keys_left_after_clear"] == 0
        assert (
            figures["put"]["bytes"] == figures["get"]["bytes"] == payload_bytes(columns(WORKLOADS["tiny"], 0))
        )


def test_areal_rows_fetch_the_batch_both_ways_and_check_it(tmp_path: Path) -> None:
    """The bench's AReaL RTensor rows on AReaL's HTTP backend and ours: an engine process each
    remotizes the batch and returns the RTensors as AReaL's RPC does (`serialize_value`), this
    process localizes them, checked tensor by tensor against the batch: AReaL across processes.
    Long (20-40 s under load): each engine process imports AReaL (6 CPU-s, more the first time,
    when its bytecode is written)."""
    with areal_imported():  # the bench imports AReaL in this process too: undone afterwards
        result = areal.run("tiny", 0, 2, 120, tmp_path, modes=("areal_http", "distbatch_same_host"))
    want = areal.trajectories("tiny", 0)
    assert result["tasks"] == len(want) == WORKLOADS["tiny"].tasks
    for row in ("areal_http", "distbatch_same_host"):
        assert "error" not in result[row], result[row]
        assert len(result[row]["fetch"]["seconds"]) == 2  # each repeat checked what came back
        assert (
            result[row]["fetch"]["bytes"]
            == result["bytes"]
            == payload_bytes(make_columns(WORKLOADS["tiny"], 0))
        )
    table = areal.table("tiny", result)
    assert "AReaL HttpRTensorBackend" in table and "distbatch, same host" in table
    assert "distbatch, HTTP" not in table  # not run


def test_ray_object_store_times_the_ragged_and_padded_dense_batch() -> None:
    """The bench's Ray baseline runs and times both batches. Long on a busy machine (20 s alone):
    it starts a Ray cluster of its own, as the bench does, and puts and gets through it."""
    import_ray()
    times = baselines.ray_roundtrips("tiny", 0, 1, ("ragged", "dense"))
    assert set(times) == {"ragged", "dense"} and all(len(t) == 1 for t in times.values())


def test_scaling_run_checks_every_op_and_plots(tmp_path: Path) -> None:
    results = main(
        ["--workloads", "scaling", "--scaling-sizes", "16,48,96", "--max-tasks", "48", "--repeats", "1"]
        + ["--out", str(tmp_path)]
    )
    run = results["scaling"]
    assert [row["tasks"] for row in run["rows"]] == [16, 48]  # 96 is over --max-tasks
    assert run["fields"] == 8 and run["left_shards"] == 0
    for row in run["rows"]:
        assert set(row["median_s"]) == set(scaling.OPS)
        assert 0 < row["pickled_bytes"] and 0 < row["meta_json_bytes"]
    assert results["workloads"] == {}
    _png_written(tmp_path / "scaling.png")
    assert not (tmp_path / "bench.png").exists()  # no transfer workload ran
    assert json.loads((tmp_path / "results.json").read_text())["scaling"]["rows"][1]["tasks"] == 48


def test_control_plane_section_runs_small_and_reports_sane_figures(tmp_path: Path) -> None:
    """`--workloads control_plane` in small: 8 consumers in 2 groups, one paced run and one flat
    out, on a controller in a child process; every task once per group, figures that add up."""
    results = main(
        ["--workloads", "control_plane", "--control-plane-consumers", "8", "--control-plane-groups", "2"]
        + ["--control-plane-tasks", "256", "--control-plane-steps", "0.01,0", "--out", str(tmp_path)]
    )
    section = results["control_plane"]
    assert section["served"] == "a child process"
    assert [r["scenario"]["step_seconds"] for r in section["runs"]] == [0.01, 0.0]
    for run in section["runs"]:
        assert run["ok"] and run["failures"] == [] and run["errors"] == 0
        assert run["scenario"]["consumers"] == 8 and run["consumers_per_group"] == 4
        assert run["tasks_delivered"] == 2 * 256 and run["answered_calls"] == 2 * 256 // 16
        assert run["get_meta_calls"] == run["answered_calls"] + run["empty_calls"] == run["get_meta"]["count"]
        assert run["consumed"] == {"group0": 256, "group1": 256}
        for group in run["delivery"].values():
            assert group["delivered"] == group["distinct"] == 256 and group["duplicates"] == 0
        latency = run["get_meta"]
        assert 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
        assert run["seconds"] > 0 and run["calls_per_s"] == pytest.approx(
            run["get_meta_calls"] / run["seconds"]
        )
        assert run["tasks_per_s"] == pytest.approx(512 / run["seconds"])
        assert run["server_get_meta_mean_ms"] is not None and 0 < run["server_get_meta_mean_ms"]
        assert run["requests_sent"] >= run["get_meta_calls"] + run["put"]["count"]
    assert results["workloads"] == {} and "scaling" not in results
    table = summary(results)
    assert "control plane: 8 consumers in 2 groups of 4" in table and "flat out" in table
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["control_plane"]["runs"][1]["tasks_delivered"] == 512


def test_control_plane_flags_are_checked() -> None:
    with pytest.raises(SystemExit):  # 10 consumers do not split into 4 equal groups
        parse_args(["--control-plane-consumers", "10"])
    with pytest.raises(SystemExit):
        parse_args(["--control-plane-steps", "0.5,-1"])
    assert parse_args([]).control_plane_steps == list(control_plane.DEFAULT_STEPS)


def test_scaling_plot_is_a_png(tmp_path: Path) -> None:
    rows = [
        {
            "tasks": n,
            "median_s": {op: n * 1e-5 for op in scaling.OPS},
            "min_s": {op: n * 0.9e-5 for op in scaling.OPS},
            "max_s": {op: n * 1.1e-5 for op in scaling.OPS},
        }
        for n in (1_000, 3_000)
    ]
    result = {"fields": 8, "workers": 2, "ops": list(scaling.OPS), "rows": rows}
    assert scaling.plot(result, tmp_path / "s.png") == tmp_path / "s.png"
    _png_written(tmp_path / "s.png")


def test_cli_rejects_unknown_workloads_and_a_cap_below_every_size() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "nope"])
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "scaling", "--max-tasks", "10"])
    assert parse_args(["--max-tasks", "3000"]).scaling_sizes == [1_000, 3_000]


def test_rss_cycles_give_the_memory_back() -> None:
    """`python -m bench.rss` in small: every clear brings the store's held bytes to 0, and the
    worker's RSS once the recycled put bodies expired is far below its RSS while it held a put."""
    from bench import rss

    result = rss.run(cycles=3, mib=64, tasks=4)
    assert result["held_bytes_after"] == 0
    assert len(result["after_put_mib"]) == len(result["after_clear_mib"]) == 3
    assert result["settled_mib"] < result["after_put_mib"][-1] - 32  # the 64 MiB went back


def test_server_comparison_runs_each_server_on_the_real_app() -> None:
    """`python -m bench.servers` in small: every server it knows answers small requests and
    moves a column both ways byte-identical (it checks), and the table names each."""
    from bench import servers

    kinds = [k for k in servers.SERVERS if servers.available(k)]
    results = servers.run(kinds, mib=2, repeats=1, small=20)
    assert set(results) == set(kinds) and {"distbatch", "werkzeug"} <= set(results)
    for result in results.values():
        assert result["small_per_s"] > 0 and result["put_gbps"] > 0 and result["fetch_gbps"] > 0
    assert all(kind in servers.table(results) for kind in kinds)


def test_the_peak_rss_row_measures_each_role_in_a_process_of_its_own() -> None:
    """`bench.rss.roles`: a producer, a consumer and a controller, each its own process, each
    reporting its peak RSS growth and what it must hold (the consumer: the batch it gathered,
    exactly the producer's payload); the workers are left empty."""
    from bench import rss

    result = rss.roles("tiny", workers=1)
    payload = payload_bytes(make_columns(WORKLOADS["tiny"], 0))
    assert set(result) == set(rss.ROLES)
    assert result["producer"]["must_hold_bytes"] == result["consumer"]["must_hold_bytes"] == payload
    assert result["producer"]["built_bytes"] > 0 and result["controller"]["must_hold_bytes"] > 0
    for entry in result.values():
        assert entry["grown_bytes"] >= 0 and entry["ratio"] == entry["grown_bytes"] / entry["must_hold_bytes"]
    assert "producer" in rss.table("tiny", {"http": result})


def test_a_partition_keeps_its_tasks_in_columns() -> None:
    """`bench.partition_scale`: a partition of a few thousand 8-field tasks holds well under the
    ~1.7 KB a task that per-task dicts took (ids and their index included), and a consumer's
    16-task calls take what was ready, 16 at a time."""
    from bench import partition_scale

    result = partition_scale.measure(3 * partition_scale.PUT, calls=5)
    assert result["tasks"] == 3 * partition_scale.PUT and result["consumed"] == 16 * 5
    assert 0 < result["bytes_per_task"] < 800
    assert result["put_us_per_task"] > 0 and result["get_meta_16_us"] > 0 and result["meta_for_2560x8_ms"] > 0


def test_the_durable_rows_measure_each_mode_and_a_recovery() -> None:
    """`bench.durable` in small: each mode's worker took every put (the durable ones wrote a
    record for each put and each clear), and a killed worker came back holding what it held."""
    from bench import durable

    result = durable.throughput("tiny", repeats=2)
    assert set(result["modes"]) == set(durable.MODES)
    assert result["modes"]["memory"]["log"] is None
    for mode in ("write-behind", "sync"):
        log = result["modes"][mode]["log"]
        assert log["written_records"] == 4 and log["pending_records"] == 0 and log["failed"] is None
    spill = durable.spilled_gather("tiny", repeats=2)
    # One half's tensors went to disk (its JSON stays in memory), and each gather read them back.
    assert spill["bytes"] // 3 < spill["spilled_bytes"] < spill["bytes"]
    assert spill["read_back_bytes"] == 2 * spill["spilled_bytes"]
    assert "spilled" in durable.table({**result, "spill": spill})
    recovered = durable.recovery(gib=0.001, workload="tiny")
    assert recovered["bytes"] > 0 and recovered["disk_bytes"] >= recovered["bytes"]
    assert "recovery" in durable.table({**result, "recovery": recovered})
