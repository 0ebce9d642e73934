"""The benchmark at a tiny size: its accounting and checksums, never its timings."""

from __future__ import annotations

import json
from pathlib import Path

from distbatch.bench.__main__ import main
from distbatch.bench.workloads import WORKLOADS, make_columns, payload_bytes


def test_tiny_bench_accounts_for_every_byte(tmp_path: Path) -> None:
    results = main(
        ["--workloads", "tiny", "--repeats", "2", "--no-ray", "--no-pipeline", "--out", str(tmp_path)]
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
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["workloads"]["tiny"]["distbatch"]["stored_bytes"] == payload + json_bytes
