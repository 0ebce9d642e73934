"""Test helpers for driving a `ShardStore` directly: shards of a given size and a clock tests move."""

from __future__ import annotations

from distbatch.wire import RawTensor


def shard(n: int) -> RawTensor:
    """An `n`-byte uint8 shard (`ShardStore.put` / `stage` take a mapping of these)."""
    return RawTensor("U8", (n,), b"\x00" * n)


class FakeClock:
    """A store clock that only moves when a test sets `now`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
