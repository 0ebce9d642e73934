"""Where a command's CPU goes, every process counted: `python -m bench.suite_cpu -- bash scripts/test`.

`time` counts only the processes its command waits for; a test suite's Ray workers and
daemons, and the workers a test's script leaves to exit on their own, are nobody's children by
the time they exit, and their CPU is missing from it (the TransferQueue backend's option tests:
10.7 CPU-s by `time`, 63.6 machine-wide). This samples every process in /proc while the command
runs (each process's CPU at its last sample; one shorter than a period is missed) and reports
the CPU of the processes that started after it began, by kind (`python -m rpc_server`, a Ray
worker's actor, ...) and by the test that started them (the `PYTEST_CURRENT_TEST` each process
inherited), beside the machine's own count from /proc/stat.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

TICKS = os.sysconf("SC_CLK_TCK")
TEST_VARIABLE = "PYTEST_CURRENT_TEST="
# A Ray worker's command line until it names its actor (`ray::Name.method`): read again.
RAY_STARTING = ("setup_worker.py", "default_worker.py", "ray::IDLE")


@dataclass
class Seen:
    """A process as last sampled: what it runs, the test that started it, its CPU seconds."""

    command: str
    test: str
    cpu: float


def machine_cpu() -> float:
    """Busy CPU-seconds of the whole machine since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:8]]
    return (sum(values) - values[3] - values[4]) / TICKS


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def _kind(command: str) -> str:
    """A short name for what a process runs."""
    words = command.split()
    if not words:
        return "(no command line)"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]
    if "python" in os.path.basename(words[0]) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            return f"python -m {words[2]}" + (" --engine" if "--engine" in words else "")
        return "python " + os.path.basename(words[1])[:40]
    return os.path.basename(words[0])[:40]


class Sampler:
    """Samples /proc every `period` seconds on a thread until `stop()`."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.seen: dict[tuple[str, str], Seen] = {}
        self.before: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.before = set(self._sample())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _sample(self) -> list[tuple[str, str]]:
        keys = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = _read(f"/proc/{pid}/stat")
                fields = stat[stat.rindex(")") + 2 :].split()
                key = (pid, fields[19])  # a pid and its start time: one process
                cpu = (int(fields[11]) + int(fields[12])) / TICKS
                seen = self.seen.get(key)
                if seen is None or any(name in seen.command for name in RAY_STARTING):
                    command = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
                    environ = _read(f"/proc/{pid}/environ").split("\0")
                    test = next((e[len(TEST_VARIABLE) :] for e in environ if e.startswith(TEST_VARIABLE)), "")
                    seen = self.seen[key] = Seen(command, test, cpu)
                seen.cpu = cpu
                keys.append(key)
            except (OSError, ValueError, IndexError):
                continue  # gone between listing and reading
        return keys


def _largest(totals: dict[str, float], top: int) -> list[tuple[str, float]]:
    return sorted(totals.items(), key=lambda item: -item[1])[:top]


def report(sampler: Sampler, machine: float, wall: float, top: int) -> str:
    new = [seen for key, seen in sampler.seen.items() if key not in sampler.before]
    by_kind: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    by_test: dict[str, float] = collections.defaultdict(float)
    for seen in new:
        kind = _kind(seen.command)
        by_kind[kind] += seen.cpu
        count[kind] += 1
        by_test[seen.test.split("::")[0] or "(no test)"] += seen.cpu
    lines = [
        f"wall {wall:.0f} s; machine busy {machine:.0f} CPU-s; processes started since: "
        f"{len(new)}, {sum(by_kind.values()):.0f} CPU-s",
        "",
        "CPU-s  processes  kind",
    ]
    lines += [f"{cpu:6.1f} {count[kind]:6d}     {kind}" for kind, cpu in _largest(by_kind, top)]
    lines += ["", "CPU-s  started by (test module)"]
    lines += [f"{cpu:6.1f}  {test}" for test, cpu in _largest(by_test, top)]
    return "\n".join(lines)


def write_processes(sampler: Sampler, path: str) -> None:
    """Every process that started after the sampler began, one JSON object per line."""
    with open(path, "w") as out:
        for key, seen in sampler.seen.items():
            if key not in sampler.before:
                kind = _kind(seen.command)
                row = {"command": seen.command, "kind": kind, "test": seen.test, "cpu": seen.cpu}
                out.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suite_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--period", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--top", type=int, default=30, help="rows of each table")
    parser.add_argument(
        "--processes",
        metavar="FILE",
        help="also write every new process there, one JSON line each "
        "(command, kind, test, cpu): for tables this report does not make",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sampler = Sampler(args.period)
    sampler.start()
    started, busy = time.monotonic(), machine_cpu()
    code = subprocess.call(command)
    machine, wall = machine_cpu() - busy, time.monotonic() - started
    sampler.stop()
    print(report(sampler, machine, wall, args.top), file=sys.stderr)
    if args.processes:
        write_processes(sampler, args.processes)
    return code


if __name__ == "__main__":
    sys.exit(main())
