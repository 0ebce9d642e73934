"""The cluster figures the README and the many-hosts guide show are the saved run's
(docs/guide/cluster-results.json, written by `scripts/bench cluster`), table for table, and the
plots they show exist: a rerun that changes the numbers must change the pages too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cluster.job import markdown_table

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide"
RESULTS = json.loads((GUIDE / "cluster-results.json").read_text())


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_the_many_hosts_guide_shows_the_saved_run(layout: str) -> None:
    saved = RESULTS[layout]["results"]
    assert all(r["layout"] == layout for r in saved)
    assert markdown_table(saved) in (GUIDE / "many-hosts.md").read_text()
    assert (GUIDE / f"cluster-{layout}.png").stat().st_size > 10_000


def test_the_readme_headline_is_the_disaggregated_run() -> None:
    assert markdown_table(RESULTS["disaggregated"]["results"]) in (ROOT / "README.md").read_text()


def test_the_saved_run_is_what_the_pages_claim() -> None:
    """The prose's claims, from the numbers: 2 -> 8 disaggregated hosts speeds the data step up
    about 3x, 8 hosts distributed beats centralised by 7x or more, within 15% of plain TCP."""
    by_hosts = {r["hosts"]: r for r in RESULTS["disaggregated"]["results"]}
    assert by_hosts[2]["data_distributed_s"] / by_hosts[8]["data_distributed_s"] > 3.0
    for layout in ("colocated", "disaggregated"):
        eight = next(r for r in RESULTS[layout]["results"] if r["hosts"] == 8)
        assert eight["data_centralised_over_distributed"] > 7.0
        assert eight["data_distributed_s"] / eight["data_tcp_s"] < 1.15
        assert eight["shards_left"] == 0
