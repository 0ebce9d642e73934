"""Resource bounds of a real worker: stalled uploads, threads, read timeouts, response size, metrics text.

Every worker is a `python -m rpc_server` process on loopback (port 0) started by
the `start_worker` fixture, which stops it; raw sockets stand in for hostile or
slow clients, a `ShardClient` for honest ones.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import pytest
import torch

from distbatch import ShardClient, wire
from distbatch.batch.calls import decode_value, encode_call
from distbatch.errors import RequestError, ShardNotFoundError
from distbatch.ids import ShardKey
from distbatch.launch import WorkerProcess
from rpc_server.context import BODY_POOL_IDLE_SECONDS
from rpc_server.metrics import Metrics
from rpc_server.serve import RESERVE_THREADS

StartWorker = Callable[..., WorkerProcess]
NO_TOKEN = {"DISTBATCH_TOKEN": ""}
ECHO_ENGINE = "tests.engines_for_tests:make_echo_engine"
GIB = 1 << 30
MIB = 1 << 20


def proc_status(pid: int, field: str) -> int:
    """A numeric field of /proc/<pid>/status (VmRSS in bytes, Threads as a count)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                value = line.split()
                return int(value[1]) * (1024 if value[2:] == ["kB"] else 1)
    raise KeyError(field)


def gauge(worker: WorkerProcess, name: str) -> float:
    """One unlabelled sample of the worker's `/metrics`."""
    with urllib.request.urlopen(f"http://{worker.node}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for_server(read: Callable[[], float], target: float, what: str, stalled_after: float = 60) -> None:
    """Wait until the server reports `target`; fail only once its report stops moving for
    `stalled_after` s. A loaded machine is slow to get there, not wrong: only a stuck server fails."""
    best, moved = read(), time.monotonic()
    while best < target:
        time.sleep(0.05)
        now = read()
        if now > best:
            best, moved = now, time.monotonic()
        elif time.monotonic() - moved > stalled_after:
            raise AssertionError(f"{what}: stuck at {best:g} of {target:g} for {stalled_after} s")


def address(worker: WorkerProcess) -> tuple[str, int]:
    host, port = worker.node.rsplit(":", 1)
    return host, int(port)


def request_head(method: str, path: str, content_type: str, length: int) -> bytes:
    """A request head that asks the server to close the connection after answering (the tests
    read a response until the connection closes)."""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: worker\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


@contextmanager
def stalled_puts(worker: WorkerProcess, count: int, declared: int) -> Iterator[list[socket.socket]]:
    """`count` connections that each declare a `declared`-byte PUT body, send 100 bytes of it, and stall."""
    with ExitStack() as stack:
        socks = []
        for _ in range(count):
            sock = stack.enter_context(socket.create_connection(address(worker), timeout=10))
            head = request_head("PUT", "/v1/shards", "application/octet-stream", declared)
            sock.sendall(head + b"\0" * 100)
            socks.append(sock)
        yield socks


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection; TimeoutError if it does not."""
    sock.settimeout(timeout)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def roundtrip(client: ShardClient, node: str, task_id: str, value: torch.Tensor) -> None:
    client.put(node, {(task_id, "x"): value})
    (got,) = client.fetch([(node, task_id, "x")])
    assert torch.equal(got, value)


# ---------------------------------------------------------------- stalled uploads, threads, timeouts


def test_stalled_big_uploads_cost_little_memory(start_worker: StartWorker) -> None:
    """100 clients declaring 1 GiB bodies and stalling: RSS stays flat, other clients are served."""
    worker = start_worker(env=NO_TOKEN)
    with ShardClient(timeout=20) as client:
        roundtrip(client, worker.node, "warm", torch.arange(1000))  # import and allocate what a put needs
        rss = proc_status(worker.pid, "VmRSS")
        with stalled_puts(worker, 100, GIB):
            # What the server reports: 100 connections in a request (reading their bodies), besides
            # the one asking. Not a thread count under a deadline, which a busy machine can miss.
            wait_for_server(lambda: gauge(worker, "distbatch_connections_active"), 101, "connections served")
            time.sleep(0.5)  # let every handler reach its read of the body
            grown = proc_status(worker.pid, "VmRSS") - rss
            assert grown < 100 * MIB, f"RSS grew by {grown / MIB:.0f} MiB for 100 stalled uploads"
            roundtrip(client, worker.node, "meanwhile", torch.randn(256, 1024))


def test_stalled_and_idle_connections_are_closed(start_worker: StartWorker) -> None:
    """With 4 threads and a 1 s read timeout, 8 stalled connections hold at most 4 threads (plus the
    reserve ones), are closed within a bounded time (stalled uploads with a JSON 408, or a 503 `busy`
    on a reserve thread), and a waiting client is served."""
    worker = start_worker("--max-threads", "4", "--read-timeout", "1", env=NO_TOKEN)
    with ShardClient(timeout=30) as client:
        roundtrip(client, worker.node, "warm", torch.arange(10))
        threads = proc_status(worker.pid, "Threads")
        started = time.monotonic()
        with stalled_puts(worker, 6, 10 * MIB) as stalled, ExitStack() as stack:
            idle = [stack.enter_context(socket.create_connection(address(worker))) for _ in range(2)]
            time.sleep(0.3)
            assert proc_status(worker.pid, "Threads") <= threads + 4 + RESERVE_THREADS, "too many threads"
            errors = []
            for sock in stalled:
                answer = read_until_closed(sock, timeout=10)
                assert answer.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")), answer[:200]
                errors.append(json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"])
            assert errors.count("request_timeout") >= 4 and set(errors) <= {"request_timeout", "busy"}, errors
            for sock in idle:
                assert read_until_closed(sock, timeout=10) == b""
            closed_after = time.monotonic() - started
        # Two waves of 4 connections, 1 s each, plus slack for a loaded machine.
        assert closed_after < 8, f"stalled connections closed only after {closed_after:.1f} s"
        roundtrip(client, worker.node, "after", torch.randn(1000))


def test_client_waiting_behind_busy_threads_is_served_not_refused(start_worker: StartWorker) -> None:
    """All threads held by stalled uploads: a new client's put is answered 503 `busy` by a reserve
    thread and retried (even with retries=0) until served, once the uploads time out."""
    worker = start_worker("--max-threads", "2", "--read-timeout", "1.5", env=NO_TOKEN)
    with ShardClient(timeout=30, retries=0) as client:
        client.health(worker.node)
        with stalled_puts(worker, 2, MIB):
            time.sleep(0.3)
            started = time.monotonic()
            roundtrip(client, worker.node, "queued", torch.arange(100))
            waited = time.monotonic() - started
    assert waited > 0.5, f"served after {waited:.2f} s: the stalled uploads did not hold the threads"


def test_large_put_round_trips_with_short_read_timeout(start_worker: StartWorker) -> None:
    """A 64 MiB put and fetch in one request each, byte-identical, with --read-timeout 1."""
    worker = start_worker("--read-timeout", "1", env=NO_TOKEN)
    value = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8)
    with ShardClient(timeout=60, max_bytes_per_request=128 * MIB) as client:
        roundtrip(client, worker.node, "big", value)
        assert client.stats(worker.node)["put_bytes_received"] > 64 * MIB


def test_slow_reader_gets_a_whole_response_past_the_read_timeout(start_worker: StartWorker) -> None:
    """The read timeout bounds a stall, not a transfer: a 24 MiB response read at ~8 MiB/s
    (3 s, with --read-timeout 1) arrives whole."""
    worker = start_worker("--read-timeout", "1", env=NO_TOKEN)
    value = torch.randint(0, 256, (24 * MIB,), dtype=torch.uint8)
    with ShardClient(timeout=60) as client:
        client.put(worker.node, {("slow", "x"): value})
    body = json.dumps({"keys": [["slow", "x"]]}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
        sock.settimeout(10)
        sock.connect(address(worker))
        sock.sendall(request_head("POST", "/v1/shards/fetch", "application/json", len(body)) + body)
        received = 0
        while chunk := sock.recv(MIB):
            received += len(chunk)
            time.sleep(0.1 * len(chunk) / MIB)
    assert received > 24 * MIB, f"got {received} bytes of a {24 * MIB}-byte response"


def test_slow_upload_that_keeps_sending_is_stored(start_worker: StartWorker) -> None:
    """An upload that sends 512 KiB every 0.2 s for 3 s is not cut by a 1 s read timeout."""
    worker = start_worker("--read-timeout", "1", env=NO_TOKEN)
    from distbatch.wire import encode_bundle_bytes

    value = torch.randint(0, 256, (8 * MIB,), dtype=torch.uint8)
    bundle = encode_bundle_bytes({("trickle", "x"): value})
    with socket.create_connection(address(worker), timeout=10) as sock:
        sock.sendall(request_head("PUT", "/v1/shards", "application/octet-stream", len(bundle)))
        for start in range(0, len(bundle), 512 << 10):
            sock.sendall(bundle[start : start + (512 << 10)])
            time.sleep(0.2)
        answer = read_until_closed(sock, timeout=10)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    with ShardClient() as client:
        (got,) = client.fetch([(worker.node, "trickle", "x")])
    assert torch.equal(got, value)


def test_idle_past_read_timeout_then_engine_call_and_data(start_worker: StartWorker) -> None:
    """A client idle longer than --read-timeout still makes an engine call (itself longer than the
    timeout: no socket operation runs while the engine does) and a put + fetch."""
    worker = start_worker("--engine", ECHO_ENGINE, "--read-timeout", "1", env=NO_TOKEN)
    with ShardClient(timeout=30) as client:
        roundtrip(client, worker.node, "before", torch.arange(10))
        assert client.call_raw(worker.node, "whoami", encode_call([], {}))
        time.sleep(2.5)
        reply = client.call_raw(worker.node, "slow", encode_call([], {"seconds": 2.0}), timeout=30)
        assert reply is not None
        roundtrip(client, worker.node, "after", torch.arange(20))
        time.sleep(2.5)
        assert client.call_raw(worker.node, "whoami", encode_call([], {}))


# ---------------------------------------------------------------- fetch response bound


RESPONSE_LIMIT = 1_000_000


@pytest.fixture
def small_response_worker(start_worker: StartWorker) -> Iterator[tuple[WorkerProcess, dict]]:
    """A worker with --max-response-bytes 1 MB holding 10 MB in 40 shards of 250 kB."""
    worker = start_worker("--max-response-bytes", str(RESPONSE_LIMIT), env=NO_TOKEN)
    shards = {(f"t{i}", "x"): torch.randint(0, 256, (250_000,), dtype=torch.uint8) for i in range(40)}
    with ShardClient(max_bytes_per_request=64 * MIB) as client:
        client.put(worker.node, shards)
    yield worker, shards


def test_gather_over_response_limit_is_split(small_response_worker: tuple[WorkerProcess, dict]) -> None:
    worker, shards = small_response_worker
    with ShardClient(max_bytes_per_request=64 * MIB, timeout=30) as client:
        before = client.stats(worker.node)["fetch_requests"]
        got = client.fetch([(worker.node, t, f) for t, f in shards])
        after = client.stats(worker.node)["fetch_requests"]
    for value, expected in zip(got, shards.values()):
        assert torch.equal(value, expected)
    # 10 MB under a 1 MB bound: the refused first request, then at least 10 parts.
    assert after - before >= 11, after - before


def test_raw_fetch_over_response_limit_is_413(small_response_worker: tuple[WorkerProcess, dict]) -> None:
    worker, shards = small_response_worker
    body = json.dumps({"keys": [list(k) for k in shards]}).encode()
    with socket.create_connection(address(worker), timeout=10) as sock:
        sock.sendall(request_head("POST", "/v1/shards/fetch", "application/json", len(body)) + body)
        answer = read_until_closed(sock, timeout=10)
    head, payload = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 413"), head
    error = json.loads(payload)
    assert error["error"] == "response_too_large"
    assert error["limit"] == RESPONSE_LIMIT and str(RESPONSE_LIMIT) in error["message"]


def test_single_shard_over_response_limit_and_missing_keys(
    small_response_worker: tuple[WorkerProcess, dict],
) -> None:
    worker, shards = small_response_worker
    with ShardClient(timeout=30) as client:
        client.put(worker.node, {("huge", "x"): torch.zeros(2_000_000, dtype=torch.uint8)})
        with pytest.raises(RequestError, match="huge/x alone is over") as info:
            client.fetch([(worker.node, "huge", "x")])
        assert info.value.code == "response_too_large" and info.value.payload["limit"] == RESPONSE_LIMIT
        # A missing key is reported by name, even among keys over the response limit.
        with pytest.raises(ShardNotFoundError) as missing:
            client.fetch([*((worker.node, t, f) for t, f in shards), (worker.node, "nope", "x")])
        assert missing.value.keys == [("nope", "x")]


def test_response_limit_counts_the_whole_response_exactly(start_worker: StartWorker) -> None:
    """A fetch answer of exactly --max-response-bytes (header and JSON shards included) is served;
    with a limit one byte lower it is refused, naming that exact size."""
    shards = {ShardKey("t", "x"): torch.arange(1000), ShardKey("t", "j"): {"a": [1, 2, 3], "b": "text"}}
    size = len(wire.encode_bundle_bytes(shards))  # the worker answers with the same bundle
    body = json.dumps({"keys": [list(key) for key in shards]}).encode()
    head = request_head("POST", "/v1/shards/fetch", "application/json", len(body))
    for limit in (size, size - 1):
        worker = start_worker("--max-response-bytes", str(limit), env=NO_TOKEN)
        with ShardClient() as client:
            client.put(worker.node, dict(shards))
        with socket.create_connection(address(worker), timeout=10) as sock:
            sock.sendall(head + body)
            status, payload = read_until_closed(sock, timeout=10).split(b"\r\n\r\n", 1)
        if limit == size:
            assert status.startswith(b"HTTP/1.1 200") and len(payload) == size, status
        else:
            assert status.startswith(b"HTTP/1.1 413"), status
            assert json.loads(payload)["bytes"] == size


# ---------------------------------------------------------------- Prometheus text

# One sample line with labels whose values are properly escaped (no raw quote, backslash or newline),
# and a Prometheus float for a value (counters' `_created` samples read like 1.76e+09).
SAMPLE = re.compile(r'^[a-z_]+\{([a-z_]+="(?:[^"\\\n]|\\["\\n])*",?)*\} [-+]?\d+(\.\d+)?([eE][-+]?\d+)?$')


def test_odd_methods_keep_metrics_valid_and_bounded(start_worker: StartWorker) -> None:
    """Methods from the request line (quotes, backslashes, made-up names) neither break the
    exposition text nor add a series each."""
    worker = start_worker(env=NO_TOKEN)
    for i in range(30):
        with socket.create_connection(address(worker), timeout=10) as sock:
            line = f'GE"T\\{i} /health HTTP/1.1\r\n'
            sock.sendall(f"{line}Host: worker\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            assert read_until_closed(sock, timeout=10).startswith(b"HTTP/1.1 ")
    with ShardClient() as client:
        client.health(worker.node)
    with socket.create_connection(address(worker), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: worker\r\nConnection: close\r\n\r\n")
        text = read_until_closed(sock, timeout=10).split(b"\r\n\r\n", 1)[1].decode()
    samples = [line for line in text.splitlines() if line.startswith("distbatch_requests_total{")]
    for line in samples:
        assert SAMPLE.match(line), line
    assert any('method="other"' in line for line in samples), samples
    assert len(samples) < 10, samples


def test_render_escapes_label_values() -> None:
    metrics = Metrics()
    metrics.observe('/odd"\\\nrule', "GET", 404, 0.01, 0, 10)
    lines = metrics.render({}).decode().splitlines()
    labelled = [line for line in lines if "{" in line and not line.startswith("#")]
    assert labelled and all(SAMPLE.match(line) for line in labelled), labelled
    assert 'endpoint="/odd\\"\\\\\\nrule"' in labelled[0]


def test_sigterm_stops_a_worker_whose_threads_are_all_busy(start_worker: StartWorker) -> None:
    """A serve loop waiting for a free thread still notices a shutdown: the worker exits at once."""
    worker = start_worker("--max-threads", "2", env=NO_TOKEN)
    with stalled_puts(worker, 4, MIB):
        time.sleep(0.3)
        started = time.monotonic()
        worker.terminate()
        assert worker.process.wait(timeout=10) == 0
        assert time.monotonic() - started < 5


# ---------------------------------------------------------------- reserve threads (every thread busy)


def raw_request(
    worker: WorkerProcess, head: bytes, body: bytes = b"", timeout: float = 5
) -> tuple[bytes, dict]:
    """Send one request on a fresh connection; (status line + headers, JSON body) of the answer."""
    with socket.create_connection(address(worker), timeout=timeout) as sock:
        sock.sendall(head + body)
        answer = read_until_closed(sock, timeout=timeout)
    head_part, payload = answer.split(b"\r\n\r\n", 1)
    return head_part, json.loads(payload)


def test_engine_calls_holding_every_thread_still_pass_the_liveness_probe(start_worker: StartWorker) -> None:
    """Two engine calls hold both of 2 request threads (one runs, one queues for the engine
    thread): the liveness probe is answered on a reserve thread, so neither call is declared dead.
    Without it, the queued call would go unanswered for 5 s, past its 2 s liveness timeout (2 s,
    not 1: under the suite's load on 2 cores, a probe once took over 1 s to be answered)."""
    worker = start_worker("--engine", ECHO_ENGINE, "--max-threads", "2", env=NO_TOKEN)
    body = encode_call([], {"seconds": 2.5})
    with ShardClient(timeout=30) as client, ThreadPoolExecutor(2) as pool:
        client.health(worker.node)
        started = time.monotonic()
        calls = [
            pool.submit(client.call_raw, worker.node, "slow", body, liveness_timeout=2.0) for _ in range(2)
        ]
        replies = [decode_value(call.result(timeout=30)["result"]) for call in calls]
    assert all(reply["end"] - reply["start"] >= 2.5 for reply in replies), replies
    assert time.monotonic() - started >= 5.0  # the engine ran them one after the other


def test_reserve_threads_serve_health_and_abandon_and_refuse_the_rest(start_worker: StartWorker) -> None:
    """Both threads held by stalled uploads: /health and abandon notices are answered at once, any
    other request gets a quick JSON 503 `busy` with Retry-After (nothing ran)."""
    worker = start_worker("--max-threads", "2", "--read-timeout", "30", env=NO_TOKEN)
    with stalled_puts(worker, 2, MIB):
        time.sleep(0.3)
        started = time.monotonic()
        head, health = raw_request(worker, b"GET /health HTTP/1.1\r\nHost: worker\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and health["status"] == "ok", head
        abandon = json.dumps({"call_ids": ["c1"]}).encode()
        head, answer = raw_request(
            worker, request_head("POST", "/v1/calls/abandon", "application/json", len(abandon)), abandon
        )
        assert head.startswith(b"HTTP/1.1 200") and answer["calls"] == 0, head
        head, refused = raw_request(worker, b"GET /v1/stats HTTP/1.1\r\nHost: worker\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert b"\r\nRetry-After: 1\r\n" in head and refused["error"] == "busy", (head, refused)
        fetch = json.dumps({"keys": [["t", "x"]]}).encode()
        head, refused = raw_request(
            worker, request_head("POST", "/v1/shards/fetch", "application/json", len(fetch)), fetch
        )
        assert head.startswith(b"HTTP/1.1 503") and refused["error"] == "busy", head
        assert time.monotonic() - started < 3, "the reserve threads did not answer at once"


def test_engine_call_refused_busy_is_retried_until_served(start_worker: StartWorker) -> None:
    """With one request thread, a second engine call is refused `busy` (it never ran) and the
    client retries it, although engine calls are otherwise never retried."""
    worker = start_worker("--engine", ECHO_ENGINE, "--max-threads", "1", env=NO_TOKEN)
    with ShardClient(timeout=30, retries=0) as client, ThreadPoolExecutor(2) as pool:
        client.health(worker.node)
        first = pool.submit(client.call_raw, worker.node, "slow", encode_call([], {"seconds": 1.5}))
        time.sleep(0.3)  # the first call holds the only thread
        before = client.traffic().requests
        reply = client.call_raw(worker.node, "slow", encode_call([], {"seconds": 0.1, "label": "2nd"}))
        attempts = client.traffic().requests - before
        second = decode_value(reply["result"])
        assert decode_value(first.result(timeout=30)["result"])["end"] <= second["start"]
    assert second["label"] == "2nd" and attempts > 1, attempts


def test_big_upload_refused_busy_is_retried_whole(start_worker: StartWorker) -> None:
    """A 64 MiB put refused `busy` while its body is still being sent reads the 503 (the server
    drains before closing, no reset) and is retried until served, with retries=0."""
    worker = start_worker("--max-threads", "1", "--read-timeout", "1.5", env=NO_TOKEN)
    value = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8)
    with ShardClient(timeout=30, retries=0, max_bytes_per_request=128 * MIB) as client:
        client.health(worker.node)
        with stalled_puts(worker, 1, MIB):
            time.sleep(0.3)
            before = client.traffic().requests
            client.put(worker.node, {("big", "x"): value})
            attempts = client.traffic().requests - before
        (got,) = client.fetch([(worker.node, "big", "x")])
    assert torch.equal(got, value)
    assert attempts > 1, "the put was never refused busy: the stalled upload did not hold the thread"


def test_received_body_is_held_once_and_released(start_worker: StartWorker) -> None:
    """A 128 MiB upload costs the worker about 128 MiB of peak memory while it is read, not twice
    that (no chunks joined into a second copy), and none once answered (after the body pool's
    idle time), whether the put failed (no container: nothing stored) or succeeded (only the
    stored copy stays)."""
    worker = start_worker(env=NO_TOKEN)
    with ShardClient() as client:
        roundtrip(client, worker.node, "warm", torch.arange(1000))
    size = 128 * MIB
    peak, rss = proc_status(worker.pid, "VmHWM"), proc_status(worker.pid, "VmRSS")
    head, answer = raw_request(
        worker, request_head("PUT", "/v1/shards", "application/octet-stream", size), b"\0" * size, timeout=30
    )
    assert head.startswith(b"HTTP/1.1 400") and answer["error"] == "bad_container", (head, answer)
    grown = proc_status(worker.pid, "VmHWM") - peak
    assert grown < size * 3 // 2, f"peak RSS grew by {grown / MIB:.0f} MiB for a {size // MIB} MiB body"
    # The refused body's mapping waits in the worker's body pool for a next put, then goes.
    deadline = time.monotonic() + BODY_POOL_IDLE_SECONDS + 5
    while (kept := proc_status(worker.pid, "VmRSS") - rss) >= 32 * MIB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kept < 32 * MIB, f"a refused {size // MIB} MiB body still holds {kept / MIB:.0f} MiB"
    value = torch.randint(0, 256, (size,), dtype=torch.uint8)
    with ShardClient(max_bytes_per_request=2 * size) as client:
        client.put(worker.node, {("big", "x"): value})
    kept = proc_status(worker.pid, "VmRSS") - rss
    assert kept < size + 32 * MIB, f"a stored {size // MIB} MiB shard holds {kept / MIB:.0f} MiB"
