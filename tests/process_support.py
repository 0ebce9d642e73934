"""This test process's child processes, read from /proc: tests check that a failed or refused
start leaves none behind (imported by every tier; Linux only)."""

from __future__ import annotations

import os
from pathlib import Path


def children(zombies: bool = True) -> set[int]:
    """Pids of this process's child processes; `zombies`: count those not waited for too."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[1]) == os.getpid() and (zombies or fields[0] not in ("Z", "X")):
            found.add(int(entry))
    return found
