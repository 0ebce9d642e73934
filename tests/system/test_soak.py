"""Load: many client threads on real workers; every gathered byte and every stored byte accounted for."""

from __future__ import annotations

import pytest
import torch

from bench.soak import bundle_checksum, main, value_nbytes
from distbatch.transport.shm import ENV_SWITCH


def _check_invariants(result: dict, ops: int) -> None:
    assert result["ok"], result["failures"]
    assert result["errors"] == 0
    assert result["ops_done"] == ops
    assert sum(s["count"] for s in result["ops"].values()) == ops
    for op in ("put", "fetch", "delete"):
        assert result["ops"][op]["count"] > 0, f"no {op} ran"
    # Every fetch compared a SHA-256 of keys, dtypes, shapes and bytes; a wrong one is a failure.
    assert result["bytes_fetched"] > 0
    # The workers held exactly the bundles still alive, then nothing once those were deleted.
    assert result["stored_bytes_at_end"] == result["alive_bytes_at_end"] > 0
    assert result["stored_shards_at_end"] == result["alive_shards_at_end"]
    assert result["bytes_put"] - result["bytes_deleted"] == result["alive_bytes_at_end"]
    assert result["cleared_bytes"] == result["alive_bytes_at_end"]
    assert result["left_bytes"] == 0 and result["left_shards"] == 0
    assert result["workers_alive_at_end"] == result["workers"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["HTTP", "same host"])
def test_short_soak_32_threads_shared_client(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths, each checked to be the one taken: the suite turns the same-host path off
    (conftest), so the "same host" run turns it back on for the soak's client and workers; a
    request that fell back to HTTP fails the soak (the counters, not the log, say so)."""
    if path == "same host":
        monkeypatch.delenv(ENV_SWITCH)
    ops = 600
    result = main(
        ["--workers", "3", "--clients", "32", "--ops", str(ops), "--seed", "7", "--max-seconds", "60"]
    )
    _check_invariants(result, ops)
    assert result["clients"] == 32 and not result["client_per_thread"]
    assert result["staged_puts"] > 0  # some bundles went as staged multi-request puts, under load
    wire = result["wire"]
    assert wire["same_host_fallbacks"] == 0
    if path == "same host":
        assert wire["same_host_requests"] > ops // 2 and wire["same_host_bytes"] > 0
    else:
        assert wire["same_host_requests"] == 0


@pytest.mark.timeout(120)
def test_short_soak_one_client_per_thread() -> None:
    ops = 200
    result = main(
        ["--workers", "2", "--clients", "8", "--ops", str(ops), "--client-per-thread", "--max-seconds", "60"]
    )
    _check_invariants(result, ops)
    assert result["client_per_thread"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_long_soak_10000_ops() -> None:
    ops = 10_000
    result = main(
        ["--workers", "3", "--clients", "32", "--ops", str(ops), "--seed", "11", "--max-seconds", "600"]
    )
    _check_invariants(result, ops)


def test_checksum_sees_every_byte_dtype_and_shape() -> None:
    """The soak's comparison is meaningful: any difference in a value changes the checksum."""
    base = {("t", "x"): torch.arange(6, dtype=torch.int32), ("t", "m"): {"a": [1, 2]}}
    same = {("t", "m"): {"a": [1, 2]}, ("t", "x"): torch.arange(6, dtype=torch.int32).clone()}
    assert bundle_checksum(base) == bundle_checksum(same)
    flipped = torch.arange(6, dtype=torch.int32)
    flipped[3] ^= 1 << 20
    variants = [
        {**base, ("t", "x"): flipped},
        {**base, ("t", "x"): torch.arange(6, dtype=torch.int32).reshape(2, 3)},
        {**base, ("t", "x"): torch.arange(6, dtype=torch.int32).view(torch.float32)},
        {**base, ("t", "m"): {"a": [1, 3]}},
        {("t", "y"): base[("t", "x")], ("t", "m"): base[("t", "m")]},
    ]
    for variant in variants:
        assert bundle_checksum(variant) != bundle_checksum(base)
    assert value_nbytes(torch.zeros(3, 2, dtype=torch.bfloat16)) == 12
    # Strided views checksum as their values: a one-element view with stride 2 (which torch calls
    # contiguous, and which once made the checksum raise) and a transposed one.
    one = torch.arange(2.0)[::2]
    assert bundle_checksum({("t", "x"): one}) == bundle_checksum({("t", "x"): torch.zeros(1)})
    grid = torch.arange(6.0).reshape(2, 3)
    assert bundle_checksum({("t", "x"): grid.T}) == bundle_checksum({("t", "x"): grid.T.contiguous()})
    assert value_nbytes({"note": "é"}) == len('{"note":"é"}'.encode())
