"""Gathering writes (`distbatch.transport.gather`): every byte once, in order, however the kernel
cuts the writes."""

from __future__ import annotations

import os
import select
import socket
import threading

import numpy as np
import pytest
import torch

from distbatch import wire
from distbatch.transport.gather import IOV_MAX, GatherWrite
from distbatch.wire.tensors import list_column


def _pieces(n: int, seed: int) -> wire.Pieces:
    gen = torch.Generator().manual_seed(seed)
    values = [
        torch.randint(0, 255, (int(k),), generator=gen, dtype=torch.int16)
        for k in torch.randint(0, 40, (n,), generator=gen)
    ]
    (part,) = list_column("x", values, [f"t{i}" for i in range(n)], scatter=True).parts
    assert isinstance(part, wire.Pieces)
    return part


def _receive_all(sock: socket.socket, size: int, out: bytearray) -> None:
    while len(out) < size:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return
        out += chunk


@pytest.mark.parametrize("rows", [3 * IOV_MAX + 7, 70])
def test_a_non_blocking_socket_gets_every_byte_in_order_through_short_writes(rows: int) -> None:
    pieces = _pieces(rows, seed=rows)
    parts: list[wire.Part] = [b"head", b"", pieces, memoryview(b"tail" * 1000), pieces.rows(5, 60)]
    want = b"".join(bytes(wire.byte_view(p)) for p in parts)
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # many short writes
    sender.setblocking(False)
    got = bytearray()
    reader = threading.Thread(target=_receive_all, args=(receiver, len(want), got))
    reader.start()
    body, calls = GatherWrite(parts), 0
    try:
        while not body.done:
            try:
                body.write(sender.fileno())
                calls += 1
            except BlockingIOError:
                select.select([], [sender], [], 5.0)
    finally:
        reader.join(10)
        sender.close()
        receiver.close()
    assert body.sent == body.size == len(want)
    assert bytes(got) == want
    assert calls > 1


def test_a_blocking_descriptor_is_written_whole_and_empty_rows_cost_nothing() -> None:
    pieces = _pieces(IOV_MAX + 1, seed=1)
    empty = pieces.rows(0, 0)
    assert empty.nbytes == 0 and len(empty.iov) == 0
    read_end, write_end = os.pipe()
    try:
        body = GatherWrite([empty, b"x", pieces])
        assert len(body.iov) == 1 + int(np.count_nonzero(pieces.iov[:, 1]))
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(_read_all(read_end, body.size)))
        reader.start()
        assert body.write_all(write_end) == 1 + pieces.nbytes
        reader.join(10)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert bytes(got) == b"x" + bytes(wire.byte_view(pieces))


def _read_all(fd: int, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        chunk = os.read(fd, size - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("runs", [1, IOV_MAX * 2 + 3])
def test_copy_runs_lays_every_run_end_to_end_in_order(runs: int) -> None:
    """Runs from two buffers of this process, shuffled, some empty, more than one call takes."""
    from distbatch.transport.gather import copy_runs

    rng = np.random.default_rng(runs)
    buffers = [rng.integers(0, 256, 50_000, dtype=np.uint8) for _ in range(2)]
    which = rng.integers(0, 2, runs)
    starts = rng.integers(0, 40_000, runs)
    lengths = rng.integers(0, 300, runs)
    sources = np.stack(
        [
            np.array([buffers[w].ctypes.data + s for w, s in zip(which, starts)], dtype=np.uint64),
            lengths.astype(np.uint64),
        ],
        axis=1,
    )
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    if not copy_runs(out, sources):
        pytest.skip("this kernel or sandbox refuses process_vm_readv")
    want = np.concatenate([buffers[w][s : s + n] for w, s, n in zip(which, starts, lengths)])
    assert np.array_equal(out, want)


def test_a_strided_buffer_is_written_from_its_flat_copy_kept_alive_until_written() -> None:
    """`byte_view` copies a strided buffer; the gathering write must point at (and hold) that
    copy, not at the buffer it came from."""
    values = np.arange(200_000, dtype=np.int64)[::2]
    read_end, write_end = os.pipe()
    try:
        body = GatherWrite([memoryview(values), b"end"])
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(_read_all(read_end, body.size)))
        reader.start()
        body.write_all(write_end)
        reader.join(10)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert bytes(got) == values.tobytes() + b"end"


def test_copy_runs_in_calls_of_a_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls carry at most MAX_CALL_BYTES (the kernel copies under 2 GiB a call); a run longer
    than that goes alone. Shrunk here so that a few KiB take many calls."""
    from distbatch.transport import gather

    monkeypatch.setattr(gather, "MAX_CALL_BYTES", 1000)
    source = np.random.default_rng(7).integers(0, 256, 100_000, dtype=np.uint8)
    lengths = np.array([10, 3000, 0, 999, 1, 2500, 400], dtype=np.uint64)
    starts = np.array([0, 50, 70_000, 9_000, 5, 20_000, 99_000], dtype=np.uint64)
    sources = np.stack([np.uint64(source.ctypes.data) + starts, lengths], axis=1)
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    if not gather.copy_runs(out, sources):
        pytest.skip("this kernel or sandbox refuses process_vm_readv")
    want = np.concatenate([source[int(s) : int(s) + int(n)] for s, n in zip(starts, lengths)])
    assert np.array_equal(out, want)


def test_the_request_head_frames_the_body_once() -> None:
    """Host and Content-Length come from the request itself: ones among the caller's headers
    (the transport's own carry a Content-Length) are not repeated (RFC 9112: a repeated length
    makes the framing ambiguous)."""
    from distbatch.client.http_recv import _head

    head = _head("PUT", "/v1/shards", "127.0.0.1", 9, {"Content-Length": "5", "host": "x", "X-A": "1"}, 5)
    lines = head.decode("latin-1").split("\r\n")
    assert [line.split(":")[0].lower() for line in lines[1:] if line].count("content-length") == 1
    assert sum(line.lower().startswith("host:") for line in lines) == 1 and "X-A: 1" in lines
