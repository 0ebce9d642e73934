"""What the client's verbs return, and its traffic counters: plain values, no behaviour."""

from __future__ import annotations

from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class PutResult:
    """A put's answer: shards stored, their bytes, and the put's generation on the worker (what a
    batch handle names so that a later put of the same keys is told apart; 0 if not given)."""

    stored: int
    bytes: int
    generation: int = 0


@dataclass(frozen=True)
class DeleteResult:
    """A delete's answer: shards deleted and the bytes that freed; results add up."""

    deleted: int
    bytes_freed: int

    def __add__(self, other: DeleteResult) -> DeleteResult:
        return DeleteResult(self.deleted + other.deleted, self.bytes_freed + other.bytes_freed)


@dataclass
class Traffic:
    """HTTP body bytes and requests this client moved (its view of the network), and the
    requests and bytes that took the same-host path instead (shared memory, no socket copy), and
    the same-host requests that fell back to HTTP (the worker could not share the answer, or the
    connection broke: each is logged once per node and kind of reason)."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    same_host_requests: int = 0
    same_host_sent: int = 0
    same_host_received: int = 0
    same_host_fallbacks: int = 0

    @property
    def total(self) -> int:
        return self.bytes_sent + self.bytes_received

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(*(a - b for a, b in zip(astuple(self), astuple(other))))

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(astuple(self), astuple(other))))

    @property
    def same_host_bytes(self) -> int:
        return self.same_host_sent + self.same_host_received
