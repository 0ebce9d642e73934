"""`python -m bench.servers`: which HTTP server the worker app runs on, chosen by measurement.

Each server runs the real worker app (`rpc_server.app.create_app`) in a child process; this
process times it over loopback with the real `ShardClient`:

- `small`: sequential `GET /v1/stats` requests (a kept-alive connection where the server
  keeps one, else a new connection each);
- `put` and `fetch`: one column of `--mib` MiB, put and fetched whole.

Servers: `distbatch` (werkzeug's threaded server with our request loop: keep-alive, buffer
writes; what workers run), `werkzeug` (its own loop: a connection per request, `bytes`
slices copied out of the store) and `waitress` (when installed: keep-alive, its own output
buffers). Medians; each ratio is to werkzeug's own server measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distbatch import ShardClient

SERVERS = ("distbatch", "werkzeug", "waitress")


def serve(kind: str) -> None:
    """Child process: serve a worker app on 127.0.0.1 (port 0), print the port, run until stdin closes."""
    import logging
    import threading

    from rpc_server.app import create_app

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request

    app = create_app()
    if kind == "distbatch":
        from rpc_server.serve import WorkerServer

        server: Any = WorkerServer(app)
        port, run, stop = server._server.server_port, server.serve_forever, server.stop_serving
    elif kind == "werkzeug":
        from werkzeug.serving import make_server

        server = make_server("127.0.0.1", 0, app, threaded=True)
        port, run, stop = server.server_port, server.serve_forever, server.shutdown
    else:
        from waitress.server import create_server

        server = create_server(app, host="127.0.0.1", port=0, threads=8)
        port, run, stop = server.effective_port, server.run, server.close
    print(port, flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), stop()), daemon=True).start()
    run()


def available(kind: str) -> bool:
    if kind != "waitress":
        return True
    try:
        import waitress  # noqa: F401
    except ImportError:
        return False
    return True


def median(values: list[float]) -> float:
    return statistics.median(values)


def measure(node: str, mib: int, repeats: int, small: int) -> dict[str, float]:
    value = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8)
    out: dict[str, float] = {}
    with ShardClient(timeout=120, max_bytes_per_request=(mib + 1) << 20) as client:
        client.stats(node)
        started = time.perf_counter()
        for _ in range(small):
            client.stats(node)
        out["small_per_s"] = small / (time.perf_counter() - started)
        puts, fetches = [], []
        for i in range(repeats):
            key = (f"t{i}", "x")
            started = time.perf_counter()
            client.put(node, {key: value})
            puts.append(time.perf_counter() - started)
            started = time.perf_counter()
            (got,) = client.fetch([(node, *key)])
            fetches.append(time.perf_counter() - started)
            if not torch.equal(got, value):
                raise AssertionError("fetched bytes differ from what was put")
            client.delete(node, keys=[key])
        out["put_gbps"] = value.nbytes / median(puts) / 1e9
        out["fetch_gbps"] = value.nbytes / median(fetches) / 1e9
    return out


def run(kinds: list[str], mib: int, repeats: int, small: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for kind in kinds:
        if not available(kind):
            print(f"{kind}: not installed, skipped", file=sys.stderr)
            continue
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.servers", "--serve", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(child.stdout.readline())  # type: ignore[union-attr]
            results[kind] = measure(f"127.0.0.1:{port}", mib, repeats, small)
        finally:
            child.stdin.close()  # type: ignore[union-attr]
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    base = results.get("werkzeug")
    lines = [f"{'server':<10} {'small req/s':>12} {'put GB/s':>9} {'fetch GB/s':>11}   (x werkzeug's own)"]
    for kind, r in results.items():
        ratio = ""
        if base:
            ratio = (
                f"   {r['small_per_s'] / base['small_per_s']:.2f}x / {r['put_gbps'] / base['put_gbps']:.2f}x"
                f" / {r['fetch_gbps'] / base['fetch_gbps']:.2f}x"
            )
        lines.append(
            f"{kind:<10} {r['small_per_s']:>12.0f} {r['put_gbps']:>9.2f} {r['fetch_gbps']:>11.2f}{ratio}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m bench.servers", description=__doc__)
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma list (default: %(default)s)")
    parser.add_argument("--mib", type=int, default=256, help="size of the put/fetch column")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", type=int, default=2000, help="small requests per server")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return {}
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    for kind in kinds:
        if kind not in SERVERS:
            parser.error(f"unknown server {kind!r} (choose from {SERVERS})")
    results = run(kinds, args.mib, args.repeats, args.small)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "servers.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
