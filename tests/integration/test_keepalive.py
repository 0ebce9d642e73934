"""The HTTP server's connection handling: keep-alive, body draining, idle connections yielding
their thread, chunked and buffer responses. A real `HttpServer` on loopback (port 0) serving a
small Flask app, and real workers for the data path."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from flask import Flask, Response, request

from distbatch import ShardClient, wire
from distbatch.launch import WorkerProcess
from distbatch.serving.handler import GIVE_TURN_BACK
from distbatch.serving.response import DRAIN_MAX_BYTES
from distbatch.serving.server import HttpServer

NO_TOKEN = {"DISTBATCH_TOKEN": ""}


def make_app() -> Flask:
    app = Flask("keepalive")

    @app.post("/echo")
    def echo() -> Response:
        return Response(request.get_data(), mimetype="application/octet-stream")

    @app.post("/ignore")
    def ignore() -> Response:
        return Response(b"ignored", mimetype="text/plain")  # never reads the body

    @app.get("/views")
    def views() -> Response:
        parts = [memoryview(bytearray(b"ab" * 1000)), memoryview(b"cd" * 1000)]
        return Response(iter(parts), mimetype="application/octet-stream")  # no length: chunked

    @app.get("/ping")
    def ping() -> Response:
        return Response(b"pong", mimetype="text/plain")

    return app


StartServer = Callable[..., HttpServer]


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    servers: list[HttpServer] = []

    def start(**bounds: float) -> HttpServer:
        server = HttpServer(make_app(), **bounds).start_background()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def connect(server: HttpServer) -> socket.socket:
    host, _, port = server.node.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def request_bytes(method: str, path: str, body: bytes = b"", close: bool = False) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n"
    if close:
        head += "Connection: close\r\n"
    return (head + "\r\n").encode() + body


class Reader:
    """Reads HTTP/1.1 responses off one connection, by their Content-Length or chunks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed by the server")
        self.buffer += chunk

    def _take_line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status = int(self._take_line().split()[1])
        headers: dict[str, str] = {}
        while line := self._take_line():
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._take_line(), 16):
                body += self._take(size)
                self._take_line()
            self._take_line()
            return status, headers, body
        return status, headers, self._take(int(headers.get("content-length", "0")))

    def closed(self, timeout: float) -> bool:
        """Whether the server closes the connection within `timeout` seconds (no bytes first)."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


def test_one_connection_carries_many_requests(start_server: StartServer) -> None:
    server = start_server()
    with connect(server) as sock:
        reader = Reader(sock)
        for i in range(20):
            payload = bytes([i]) * (1000 * i)
            sock.sendall(request_bytes("POST", "/echo", payload))
            status, headers, body = reader.response()
            assert status == 200 and body == payload
            assert headers.get("connection") != "close"


def test_pipelined_requests_are_all_answered(start_server: StartServer) -> None:
    server = start_server()
    with connect(server) as sock:
        sock.sendall(request_bytes("GET", "/ping") + request_bytes("POST", "/echo", b"x" * 5000))
        reader = Reader(sock)
        assert reader.response()[2] == b"pong"
        assert reader.response()[2] == b"x" * 5000


def test_connection_close_is_honoured(start_server: StartServer) -> None:
    server = start_server()
    with connect(server) as sock:
        sock.sendall(request_bytes("GET", "/ping", close=True))
        reader = Reader(sock)
        status, headers, _ = reader.response()
        assert status == 200 and headers["connection"] == "close"
        assert reader.closed(timeout=5)


def test_an_unread_small_body_is_drained_and_the_connection_kept(start_server: StartServer) -> None:
    """The app answered without reading the body: the rest is read and dropped, so the next
    request on the connection parses from its own first byte."""
    server = start_server()
    with connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(request_bytes("POST", "/ignore", b"GET /ping HTTP/1.1\r\n\r\n" * 1000))
        status, headers, body = reader.response()
        assert (status, body) == (200, b"ignored") and headers.get("connection") != "close"
        sock.sendall(request_bytes("GET", "/ping"))
        assert reader.response()[2] == b"pong"


def test_an_unread_big_body_closes_the_connection_after_a_whole_answer(start_server: StartServer) -> None:
    """More than `DRAIN_MAX_BYTES` unread: the answer says `Connection: close` and arrives whole
    while the client is still sending (no reset), then the server closes its side."""
    server = start_server()
    size = 4 * DRAIN_MAX_BYTES
    with connect(server) as sock:
        sock.sendall(f"POST /ignore HTTP/1.1\r\nHost: test\r\nContent-Length: {size}\r\n\r\n".encode())
        sock.sendall(b"\0" * (1 << 20))  # some of the body, then read the answer
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert (status, body, headers["connection"]) == (200, b"ignored", "close")
        sock.sendall(b"\0" * (1 << 20))  # the server still reads (and drops) what follows
        assert reader.closed(timeout=5)


def test_chunked_responses_carry_buffers_the_app_yields(start_server: StartServer) -> None:
    server = start_server()
    with connect(server) as sock:
        reader = Reader(sock)
        for _ in range(2):  # and the connection stays usable after a chunked answer
            sock.sendall(request_bytes("GET", "/views"))
            status, headers, body = reader.response()
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            assert body == b"ab" * 1000 + b"cd" * 1000


def test_a_chunked_request_is_answered_and_its_connection_closed(start_server: StartServer) -> None:
    server = start_server()
    with connect(server) as sock:
        head = b"POST /echo HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert (status, body, headers["connection"]) == (200, b"hello world", "close")
        assert reader.closed(timeout=5)


def test_an_idle_connection_is_closed_after_the_idle_timeout(start_server: StartServer) -> None:
    server = start_server(idle_timeout=0.5)
    with connect(server) as sock:
        sock.sendall(request_bytes("GET", "/ping"))
        reader = Reader(sock)
        assert reader.response()[2] == b"pong"
        started = time.monotonic()
        assert reader.closed(timeout=10)
        assert time.monotonic() - started < 5


def test_idle_connections_hold_no_thread(start_server: StartServer) -> None:
    """With one thread and an idle kept-alive connection, new connections are served at once (not
    after the 60 s idle timeout, not refused 503 `busy`) while the idle one stays open, parked
    without a thread, and is served again when its next request comes."""
    server = start_server(max_threads=1, idle_timeout=60)
    with connect(server) as idle:
        idle.sendall(request_bytes("GET", "/ping"))
        idle_reader = Reader(idle)
        assert idle_reader.response()[2] == b"pong"
        started = time.monotonic()
        for _ in range(3):
            with connect(server) as fresh:
                fresh.sendall(request_bytes("GET", "/ping"))
                status, _, body = Reader(fresh).response()
                assert (status, body) == (200, b"pong")
        assert time.monotonic() - started < 10
        assert not idle_reader.closed(timeout=0.2)
        for _ in range(2):
            idle.sendall(request_bytes("GET", "/ping"))
            assert idle_reader.response()[:3:2] == (200, b"pong")


def test_more_kept_alive_clients_than_threads_all_stay_open(start_server: StartServer) -> None:
    """More kept-alive clients than threads: each is answered, stays open between requests, and
    the connections gauge counts them idle (parked), none active."""
    server = start_server(max_threads=2, idle_timeout=60)
    sockets = [connect(server) for _ in range(12)]
    try:
        readers = [Reader(sock) for sock in sockets]
        for _ in range(2):
            for sock, reader in zip(sockets, readers):
                sock.sendall(request_bytes("GET", "/ping"))
                assert reader.response()[2] == b"pong"
        deadline = time.monotonic() + 5
        while (counts := server.connections()) != (0, 12) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counts == (0, 12)
        assert not any(reader.closed(timeout=0.01) for reader in readers)
    finally:
        for sock in sockets:
            sock.close()


def test_shutdown_closes_idle_connections(start_server: StartServer) -> None:
    server = start_server(idle_timeout=60)
    sock = connect(server)
    with sock:
        sock.sendall(request_bytes("GET", "/ping"))
        reader = Reader(sock)
        assert reader.response()[2] == b"pong"
        server.shutdown()
        assert reader.closed(timeout=5)


# ---------------------------------------------------------------- the worker's data path


@pytest.fixture(scope="module")
def tokenless_module_worker(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory(env=NO_TOKEN)


def test_fetch_responses_stream_stored_bytes_over_a_kept_connection(
    tokenless_module_worker: WorkerProcess,
) -> None:
    """Two fetches of a stored column on one connection come back byte-identical: the views of
    the stored segments the worker sends without copying are the bytes that were put."""
    value = torch.randint(0, 1 << 30, (3 << 20,), dtype=torch.int32)
    with ShardClient(timeout=30) as client:
        client.put(tokenless_module_worker.node, {("kept", "x"): value, ("kept", "y"): value[:100]})
    body = json.dumps({"task_ids": ["kept"], "fields": ["x", "y"]}).encode()
    host, _, port = tokenless_module_worker.node.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        reader = Reader(sock)
        for _ in range(2):
            head = (
                "POST /v1/shards/fetch HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            sock.sendall(head + body)
            status, headers, payload = reader.response()
            assert status == 200 and headers.get("connection") != "close"
            shards = wire.decode_bundle(bytearray(payload))
            assert torch.equal(shards[("kept", "x")], value)
            assert torch.equal(shards[("kept", "y")], value[:100])


def test_other_wsgi_servers_get_bytes_with_the_same_content() -> None:
    """Under a WSGI server that is not ours (here werkzeug's test client), a fetch response is
    built of `bytes` (what PEP 3333 asks for) and decodes to the same values."""
    from rpc_server.app import create_app

    app = create_app()
    client = app.test_client()
    value = torch.arange(10_000, dtype=torch.int64)
    body = wire.encode_bundle_bytes({("t", "x"): value})
    answer = client.put("/v1/shards", data=body, content_type=wire.CONTENT_TYPE)
    assert answer.status_code == 200, answer.get_data()
    answer = client.post("/v1/shards/fetch", json={"task_ids": ["t"], "fields": ["x"]})
    assert answer.status_code == 200
    chunks = list(answer.response)
    assert chunks and all(isinstance(chunk, bytes) for chunk in chunks)
    shards = wire.decode_bundle(bytearray(b"".join(chunks)))
    assert torch.equal(shards[("t", "x")], value)


def test_a_request_without_content_length_keeps_its_connection(start_server: StartServer) -> None:
    """A GET with neither Content-Length nor Transfer-Encoding has an empty body (what aiohttp
    sends for GETs): its connection stays open for the next request."""
    server = start_server()
    with connect(server) as sock:
        reader = Reader(sock)
        for _ in range(3):
            sock.sendall(b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n")
            status, headers, body = reader.response()
            assert (status, body) == (200, b"pong") and headers.get("connection") != "close"


@pytest.mark.parametrize(
    "lengths",
    [["5", "5"], ["5", "6"], ["\u00b2"], ["+5"]],
    ids=["repeated", "conflicting", "superscript-digit", "signed"],
)
def test_ambiguous_framing_closes_the_connection(start_server: StartServer, lengths: list[str]) -> None:
    """A Content-Length that is repeated or not plain ASCII digits gets an answer, then the
    connection closes: nothing after it is read as a next request (no smuggling)."""
    server = start_server()
    with connect(server) as sock:
        head = "POST /echo HTTP/1.1\r\nHost: test\r\n" + "".join(f"Content-Length: {v}\r\n" for v in lengths)
        smuggled = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"
        sock.sendall(head.encode() + b"\r\nhello" + smuggled)
        reader = Reader(sock)
        status, headers, _ = reader.response()
        assert headers.get("connection") == "close", (status, headers)
        assert reader.closed(timeout=5)
        assert b"pong" not in reader.buffer


def test_http10_gets_an_unchunked_answer_ended_by_the_close(start_server: StartServer) -> None:
    server = start_server()
    with connect(server) as sock:
        sock.sendall(b"GET /views HTTP/1.0\r\nHost: test\r\n\r\n")
        sock.settimeout(10)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower() and body == b"ab" * 1000 + b"cd" * 1000


def test_expect_100_continue_is_answered_once(start_server: StartServer) -> None:
    server = start_server()
    with connect(server) as sock:
        head = b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        sock.sendall(head)
        reader = Reader(sock)
        assert reader._take_line() == b"HTTP/1.1 100 Continue"
        assert reader._take_line() == b""
        sock.sendall(b"hello")
        status, _, body = reader.response()
        assert (status, body) == (200, b"hello")


# ---------------------------------------------------------------- request turns


def turns_app(state: dict[str, Any]) -> Flask:
    """/work takes 0.2 s holding its turn; /wait gives its turn back, then waits 0.2 s. `state`
    counts how many run at once (`now`, `most`) and when each began and ended (`spans`)."""
    app = Flask("turns")
    lock = threading.Lock()

    def busy(give_back: bool) -> Response:
        if give_back:
            request.environ[GIVE_TURN_BACK]()
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        began = time.monotonic()
        time.sleep(0.2)
        with lock:
            state["now"] -= 1
            state.setdefault("spans", []).append((began, time.monotonic()))
        return Response(b"done", mimetype="text/plain")

    app.add_url_rule("/work", "work", lambda: busy(False))
    app.add_url_rule("/wait", "wait", lambda: busy(True))
    app.add_url_rule("/ping", "ping", lambda: Response(b"pong", mimetype="text/plain"))
    return app


def test_request_turns_serve_one_kind_a_few_at_a_time_and_others_at_once() -> None:
    """`request_turns`: 6 concurrent requests of a kind allowed 2 at once never run more than 2
    at a time, all are answered, and a request of another kind is answered meanwhile without
    waiting for them; a request that gives its turn back early no longer counts."""
    from concurrent.futures import ThreadPoolExecutor

    state: dict[str, Any] = {"now": 0, "most": 0}
    turns = {("GET", "/work"): 2, ("GET", "/wait"): 1}
    server = HttpServer(turns_app(state), request_turns=turns).start_background()
    try:

        def get(path: str) -> tuple[bytes, float]:
            started = time.monotonic()
            with connect(server) as sock:
                sock.sendall(request_bytes("GET", path))
                return Reader(sock).response()[2], time.monotonic() - started

        with ThreadPoolExecutor(8) as pool:
            work = [pool.submit(get, "/work") for _ in range(6)]
            time.sleep(0.1)
            assert get("/ping")[0] == b"pong"
            assert not all(f.done() for f in work)  # answered while the six still run
            assert [f.result()[0] for f in work] == [b"done"] * 6
        assert state["most"] == 2
        # Three rounds of two, judged inside the server (a client thread that a busy machine
        # starts late measures less than the rounds took): the six ran over at least 0.6 s.
        began, ended = zip(*state["spans"])
        assert len(began) == 6 and max(ended) - min(began) >= 0.6

        state["most"] = 0
        with ThreadPoolExecutor(4) as pool:
            waits = [pool.submit(get, "/wait") for _ in range(4)]
            assert [f.result()[0] for f in waits] == [b"done"] * 4
        assert state["most"] >= 2  # given back: they overlapped although one turn
    finally:
        server.shutdown()


def test_an_encoded_path_takes_the_turns_of_the_path_it_routes_to() -> None:
    """`/wor%6B` is routed to `/work`: it waits for the same turns (no way around them)."""
    from concurrent.futures import ThreadPoolExecutor

    state: dict[str, Any] = {"now": 0, "most": 0}
    server = HttpServer(turns_app(state), request_turns={("GET", "/work"): 1}).start_background()
    try:

        def get(path: str) -> bytes:
            with connect(server) as sock:
                sock.sendall(request_bytes("GET", path))
                return Reader(sock).response()[2]

        with ThreadPoolExecutor(4) as pool:
            bodies = list(pool.map(get, ["/work", "/wor%6B", "/%77ork", "/work"]))
        assert bodies == [b"done"] * 4 and state["most"] == 1
    finally:
        server.shutdown()


def test_request_turns_refuse_a_kind_allowed_none() -> None:
    with pytest.raises(ValueError, match="request_turns"):
        HttpServer(make_app(), request_turns={("GET", "/ping"): 0})


def slow_client_app() -> Flask:
    app = make_app()
    app.add_url_rule(
        "/big", "big", lambda: Response(b"z" * (64 << 20), mimetype="application/octet-stream")
    )
    return app


@pytest.mark.parametrize(
    "stalled",
    [
        b"POST /echo HTTP/1.1\r\nHost: test\r\n",  # headers never end
        b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\nhal",  # nor does the body
    ],
    ids=["headers", "body"],
)
def test_a_request_that_stalls_arriving_holds_no_turn(stalled: bytes) -> None:
    """A client that sends part of a request with turns and stops holds no turn while the server
    waits (60 s read timeout) for the rest: one such client per turn must not stop the others."""
    server = HttpServer(make_app(), request_turns={("POST", "/echo"): 1}).start_background()
    try:
        with connect(server) as stalling:
            stalling.sendall(stalled)
            time.sleep(0.2)  # its request line is in: it would hold the turn from here
            started = time.monotonic()
            with connect(server) as sock:
                sock.sendall(request_bytes("POST", "/echo", b"hello"))
                assert Reader(sock).response()[::2] == (200, b"hello")
            assert time.monotonic() - started < 10
    finally:
        server.shutdown()


def test_a_client_that_stops_reading_its_response_holds_no_turn() -> None:
    """A response is sent without the turn: a client that stops reading a big one (the server
    waits for it until the read timeout) does not hold up the next request of that kind. Judged
    against that timeout, which a held turn would make the next request wait out, not against
    how fast 64 MiB move on a loaded machine (a 10 s bound once failed under a CPU hog)."""
    read_timeout = 120.0
    server = HttpServer(
        slow_client_app(), request_turns={("GET", "/big"): 1}, read_timeout=read_timeout
    ).start_background()
    try:
        with connect(server) as stuck:
            stuck.sendall(request_bytes("GET", "/big"))
            time.sleep(0.5)  # its response fills the socket buffers, then the server waits
            started = time.monotonic()
            with connect(server) as sock:
                sock.sendall(request_bytes("GET", "/big", close=True))
                status, _, body = Reader(sock).response()
                assert (status, len(body)) == (200, 64 << 20)
            assert time.monotonic() - started < read_timeout
    finally:
        server.shutdown()


# A server in a process allowed few open files (`FEW_FILES`), with few threads.
FEW_FILES = 200
FEW_FILES_SERVER = f"""
import resource, sys
from flask import Flask, Response
resource.setrlimit(resource.RLIMIT_NOFILE, ({FEW_FILES}, {FEW_FILES}))  # hard too: nothing to lift
from distbatch.serving.server import HttpServer
app = Flask("few_files")
app.add_url_rule("/ping", "ping", lambda: Response(b"pong", mimetype="text/plain"))
server = HttpServer(app, max_threads=4, idle_timeout=60).start_background()
print(server.node, flush=True)
sys.stdin.read()
"""


def test_idle_connections_never_use_up_the_servers_open_files() -> None:
    """More idle kept-alive clients than the server's process may open files: the longest idle are
    closed, so the server still accepts and answers a new connection (it could accept none, and
    spun, until idle ones timed out)."""
    child = subprocess.Popen(
        [sys.executable, "-c", FEW_FILES_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    idle: list[socket.socket] = []
    try:
        assert child.stdout is not None
        host, _, port = child.stdout.readline().strip().rpartition(":")
        for _ in range(FEW_FILES + 100):
            sock = socket.create_connection((host, int(port)), timeout=10)
            idle.append(sock)
            sock.sendall(request_bytes("GET", "/ping"))
            assert Reader(sock).response()[2] == b"pong"
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request_bytes("GET", "/ping", close=True))
            assert Reader(sock).response()[2] == b"pong"
    finally:
        for sock in idle:
            sock.close()
        child.kill()
        child.wait()
