"""bench.suite_cpu counts the CPU of processes its command does not wait for, by kind and test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.suite_cpu import _kind

ROOT = Path(__file__).resolve().parents[2]

# A parent that starts a busy child and never waits for it (so `time` would not count the
# child), watches it burn a second of CPU and become a zombie, then leaves the zombie a moment
# (its CPU stays readable) and exits: the sampler must count the child, however loaded the
# machine is.
ORPHAN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nend = time.process_time() + 1.0\\n"
                          "while time.process_time() < end: pass"])
stat = f"/proc/{child.pid}/stat"
while open(stat).read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.05)
time.sleep(0.5)
"""


def test_a_process_nobody_waits_for_is_counted_with_its_kind(tmp_path: Path) -> None:
    listing = tmp_path / "processes.jsonl"
    command = [sys.executable, "-m", "bench.suite_cpu", "--period", "0.1", "--processes", str(listing)]
    out = subprocess.run(
        [*command, "--", sys.executable, "-c", ORPHAN],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stderr.splitlines() if line.endswith("python -c")]
    assert rows, out.stderr
    assert float(rows[0][0]) >= 1.0, out.stderr  # the child's second of CPU, not only the parent's
    listed = [json.loads(line) for line in listing.read_text().splitlines()]
    # Only the child: other processes the machine started meanwhile are listed too.
    children = [p for p in listed if "process_time() + 1.0" in p["command"] and "Popen" not in p["command"]]
    assert len(children) == 1 and children[0]["cpu"] >= 1.0, listed


def test_kinds_name_what_a_process_runs() -> None:
    engine_worker = "/v/bin/python -m rpc_server --host 127.0.0.1 --engine e:E"
    assert _kind(engine_worker) == "python -m rpc_server --engine"
    assert _kind("/v/bin/python -m rpc_server --port 0") == "python -m rpc_server"
    assert _kind("ray::TransferQueueController.__init__") == "ray::TransferQueueController"
    assert _kind("/usr/bin/raylet --a b") == "raylet"
    assert _kind("") == "(no command line)"
