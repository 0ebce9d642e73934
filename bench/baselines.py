"""What we are compared with, each run in its own process on loopback, moving the same batch.

- raw TCP: `sendall` into `recv_into` a preallocated buffer — the physical ceiling here;
- pickle over HTTP: the whole batch pickled behind one werkzeug endpoint (how
  single-controller RPC often ships data);
- base64 in JSON: tensors as base64 strings inside JSON, bf16 upcast to fp32
  (AReaL's RTensor transport);
- Ray's object store, when `ray` is installed: the ragged batch as lists of per-task tensors,
  and the dense variant (one [tasks, width] tensor per field: Ray's best case).

Benchmark-only code: the pickle baseline unpickles bytes that this very
benchmark produced on loopback. Nothing in distbatch's own network path
unpickles anything.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import pickle
import socket
import threading
import time
from typing import Any

import torch

from bench.workloads import WORKLOADS, make_columns, make_dense_columns

_CHUNK = 1 << 20


# ----------------------------------------------------------------------------- raw TCP


def serve_raw(sock: socket.socket, size: int) -> None:
    """Answer every 8-byte request with that many bytes from one preallocated buffer."""
    payload = memoryview(bytearray(size))
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                request = conn.recv(8)
                if len(request) < 8:
                    break
                conn.sendall(payload[: int.from_bytes(request, "little")])


def raw_fetch(node: str, size: int, buffer: bytearray | None = None) -> float:
    """Seconds to receive `size` bytes into a preallocated buffer."""
    host, port = node.rsplit(":", 1)
    buffer = buffer if buffer is not None else bytearray(size)
    view = memoryview(buffer)
    with socket.create_connection((host, int(port))) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        conn.sendall(size.to_bytes(8, "little"))
        got = 0
        while got < size:
            n = conn.recv_into(view[got:], min(size - got, 16 * _CHUNK))
            if n == 0:
                raise ConnectionError("raw server closed early")
            got += n
        return time.perf_counter() - started


# ----------------------------------------------------------------------------- pickle / base64 over HTTP


def _b64_document(columns: dict[str, list]) -> bytes:
    out: dict[str, list] = {}
    for name, values in columns.items():
        encoded = []
        for v in values:
            if isinstance(v, torch.Tensor):
                t = v.float() if v.dtype == torch.bfloat16 else v  # numpy has no bf16: AReaL upcasts
                encoded.append(
                    {
                        "dtype": str(t.dtype),
                        "shape": list(t.shape),
                        "data": base64.b64encode(t.numpy().tobytes()).decode(),
                    }
                )
            else:
                encoded.append(v)
        out[name] = encoded
    return json.dumps(out).encode()


def http_app(columns: dict[str, list]) -> Any:
    from flask import Flask, Response

    blobs = {"pickle": pickle.dumps(columns, protocol=5), "b64json": _b64_document(columns)}
    app = Flask("bench-baselines")

    @app.get("/<kind>")
    def blob(kind: str) -> Response:
        return Response(blobs[kind], mimetype="application/octet-stream")

    return app


def _http_get(node: str, path: str) -> bytes:
    host, port = node.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.read()
    finally:
        conn.close()


def pickle_fetch(node: str) -> tuple[float, dict[str, list]]:
    started = time.perf_counter()
    columns = pickle.loads(_http_get(node, "/pickle"))  # noqa: S301 - benchmark baseline, our own loopback bytes
    return time.perf_counter() - started, columns


_TORCH_DTYPES = {str(d): d for d in (torch.float32, torch.int32, torch.int64, torch.float64, torch.bool)}


def b64json_fetch(node: str) -> tuple[float, dict[str, list]]:
    started = time.perf_counter()
    document = json.loads(_http_get(node, "/b64json"))
    columns: dict[str, list] = {}
    for name, values in document.items():
        decoded = []
        for v in values:
            if isinstance(v, dict) and "data" in v:
                raw = bytearray(base64.b64decode(v["data"]))
                dtype = _TORCH_DTYPES[v["dtype"]]
                decoded.append(
                    torch.frombuffer(raw, dtype=dtype).reshape(v["shape"])
                    if raw
                    else torch.empty(v["shape"], dtype=dtype)
                )
            else:
                decoded.append(v)
        columns[name] = decoded
    return time.perf_counter() - started, columns


# ----------------------------------------------------------------------------- Ray


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def ray_roundtrips(
    workload: str, seed: int, repeats: int, kinds: tuple[str, ...] = ("ragged",)
) -> dict[str, list[float]]:
    """Per kind ("ragged", "dense"): seconds for `ray.get` here of the batch an actor `ray.put`.

    One local Ray session serves every kind, so Ray starts once per workload.
    """
    import ray

    from distbatch.launch.ray_actors import init_local_ray

    init_local_ray(num_cpus=2, ignore_reinit_error=True)  # loopback only, no dashboard
    try:

        @ray.remote
        class Producer:
            def __init__(self, kind: str) -> None:
                make = make_dense_columns if kind == "dense" else make_columns
                self.columns = make(WORKLOADS[workload], seed)

            def put(self) -> Any:
                return [ray.put(self.columns)]

        out: dict[str, list[float]] = {}
        for kind in kinds:
            actor_class: Any = Producer  # what @ray.remote made of it (Ray's types do not say)
            producer = actor_class.remote(kind)
            times = []
            for _ in range(repeats):
                (ref,) = ray.get(producer.put.remote())
                started = time.perf_counter()
                ray.get(ref)
                times.append(time.perf_counter() - started)
                del ref
            out[kind] = times
            ray.kill(producer)
        return out
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- server entry point


def main(argv: list[str] | None = None) -> None:
    """Serve the raw and HTTP baselines for one workload; print `raw_node http_node`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    import logging

    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    columns = make_columns(WORKLOADS[args.workload], args.seed)
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve_raw, args=(raw, args.raw_bytes), daemon=True).start()
    server = make_server("127.0.0.1", 0, http_app(columns), threaded=True)
    print(f"127.0.0.1:{raw.getsockname()[1]} 127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
