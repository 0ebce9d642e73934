"""`ParkedConnections`: idle connections wait on one thread until readable, idle timeout, bound or close.

Real sockets (socketpairs): the server's end is parked, the test plays the client on the other.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterator

import pytest

from distbatch.serving.parking import ParkedConnections


class Resumed:
    """The `resume` callback: records which connections came back (and their address)."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[socket.socket, object]] = queue.Queue()

    def __call__(self, connection: socket.socket, address: object) -> None:
        self.calls.put((connection, address))

    def next(self, timeout: float = 5.0) -> tuple[socket.socket, object]:
        return self.calls.get(timeout=timeout)


def closed_by_other_end(client: socket.socket, timeout: float = 5.0) -> bool:
    client.settimeout(timeout)
    try:
        return client.recv(1) == b""
    except TimeoutError:
        return False


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for server_end, client_end in made:
        server_end.close()
        client_end.close()


def pair(pairs: list[tuple[socket.socket, socket.socket]]) -> tuple[socket.socket, socket.socket]:
    made = socket.socketpair()
    pairs.append(made)
    return made


def test_a_connection_comes_back_when_its_next_request_arrives(pairs: list) -> None:
    resumed = Resumed()
    parked = ParkedConnections(resumed, idle_timeout=30, max_parked=8)
    try:
        server_end, client_end = pair(pairs)
        parked.park(server_end, ("10.0.0.1", 5))
        time.sleep(0.05)
        assert resumed.calls.empty() and parked.count() == 1
        client_end.sendall(b"GET / HTTP/1.1\r\n")
        assert resumed.next() == (server_end, ("10.0.0.1", 5))
        assert parked.count() == 0
        assert server_end.recv(3) == b"GET"  # nothing of the request was read while parked
        parked.park(server_end, "again")  # parked once more after its answer
        client_end.sendall(b"x")
        assert resumed.next()[1] == "again"
    finally:
        parked.close()


def test_a_connection_its_client_closes_is_closed_not_resumed(pairs: list) -> None:
    resumed = Resumed()
    parked = ParkedConnections(resumed, idle_timeout=30, max_parked=8)
    try:
        server_end, client_end = pair(pairs)
        parked.park(server_end, None)
        client_end.close()
        deadline = time.monotonic() + 5
        while server_end.fileno() != -1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server_end.fileno() == -1 and resumed.calls.empty() and parked.count() == 0
    finally:
        parked.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(pairs: list) -> None:
    resumed = Resumed()
    parked = ParkedConnections(resumed, idle_timeout=0.3, max_parked=8)
    try:
        server_end, client_end = pair(pairs)
        started = time.monotonic()
        parked.park(server_end, None)
        assert closed_by_other_end(client_end)
        assert 0.25 <= time.monotonic() - started < 5
        assert resumed.calls.empty()
    finally:
        parked.close()


def test_past_the_bound_the_longest_idle_connections_close(pairs: list) -> None:
    resumed = Resumed()
    parked = ParkedConnections(resumed, idle_timeout=30, max_parked=3)
    try:
        ends = [pair(pairs) for _ in range(5)]
        for server_end, _ in ends:
            parked.park(server_end, None)
            time.sleep(0.02)  # parked in this order
        assert closed_by_other_end(ends[0][1]) and closed_by_other_end(ends[1][1])
        assert not any(closed_by_other_end(client, timeout=0.05) for _, client in ends[2:])
        assert parked.count() == 3
    finally:
        parked.close()


def test_close_closes_every_parked_connection_and_any_parked_later(pairs: list) -> None:
    parked = ParkedConnections(Resumed(), idle_timeout=30, max_parked=8)
    ends = [pair(pairs) for _ in range(3)]
    for server_end, _ in ends[:2]:
        parked.park(server_end, None)
    parked.close()
    assert all(closed_by_other_end(client) for _, client in ends[:2])
    parked.park(ends[2][0], None)
    assert closed_by_other_end(ends[2][1])
    parked.close()  # again: nothing to do


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="idle_timeout"):
        ParkedConnections(Resumed(), idle_timeout=0, max_parked=1)
    with pytest.raises(ValueError, match="max_parked"):
        ParkedConnections(Resumed(), idle_timeout=1, max_parked=0)
