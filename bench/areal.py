"""AReaL's RTensor path on the GRPO batch: AReaL's own HTTP backend against distbatch's
(`distbatch.areal`), over HTTP and the same-host path, in one run.

As AReaL runs it: an engine process (`python -m bench.areal`) `RTensor.remotize`s the batch,
one dict per trajectory (ragged int32 input_ids, fp32 logprobs, bf16 advantages, a scalar
reward, its group's uid), and hands the RTensors to the controller as AReaL's RPC does
(`serialize_value`, JSON); the controller (the bench process) `RTensor.localize`s them: every
tensor is fetched from where the engine keeps it. With AReaL's `HttpRTensorBackend` the engine
keeps its tensors in its own process and serves them with AReaL's data blueprint on werkzeug, as
AReaL's RPC server does; with distbatch's, on the distbatch worker it stores to. Timed: the
engine's `remotize` (store) and the controller's `localize` (fetch), medians of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from bench.measure import stats, timed
from bench.workloads import WORKLOADS, make_columns

ROOT = Path(__file__).resolve().parents[1]
VERSION = "1.0.4"
# (row, engine's backend, the controller's client may take the same-host path)
MODES = (("areal_http", "http", False), ("distbatch_http", "distbatch", False),
         ("distbatch_same_host", "distbatch", True))  # fmt: skip
READY = "ready"


def available() -> str | None:
    """None when AReaL's RTensor can be imported; else why not (a skip reason)."""
    if importlib.util.find_spec("areal") is None:
        return f"AReaL is not installed (pip install --no-deps areal=={VERSION}, plus the areal-test extra)"
    return None


def trajectories(workload: str, seed: int) -> list[dict[str, Any]]:
    """The GRPO batch as AReaL's engines return it: one dict per trajectory."""
    columns = make_columns(WORKLOADS[workload], seed)
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]


# ----------------------------------------------------------------------------- parent side


def run(
    workload: str,
    seed: int,
    repeats: int,
    timeout: float,
    log_dir: Path,
    modes: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Figures per mode (see the module doc; `modes` names some of them), each `{"store": stats,
    "fetch": stats}`, or the reason AReaL is skipped; a mode that failed is `{"error": ...}`."""
    skip = available()
    if skip:
        return {"skipped": skip}
    from distbatch.launch import spawn_worker

    want = trajectories(workload, seed)
    out: dict[str, Any] = {"tasks": len(want), "bytes": _tensor_bytes(want)}
    worker = spawn_worker()
    policy = asyncio.get_event_loop_policy()  # importing AReaL installs uvloop's
    try:
        for row, backend, same_host in MODES:
            if modes is not None and row not in modes:
                continue
            log = log_dir / f"areal-{row}-{workload}.log"
            try:
                out[row] = _measure(
                    workload, seed, repeats, timeout, log, backend, same_host, worker.node, want
                )
            except Exception as exc:  # one failed mode is a row that says why, not a lost bench
                out[row] = {"error": f"{type(exc).__name__}: {exc} (log: {log})"}
    finally:
        worker.stop()
        asyncio.set_event_loop_policy(policy)  # the rest of the bench runs on the loop it had
    return out


def _measure(
    workload: str,
    seed: int,
    repeats: int,
    timeout: float,
    log_path: Path,
    backend: str,
    same_host: bool,
    worker: str,
    want: list[dict[str, Any]],
) -> dict[str, Any]:
    from areal.infra.rpc import rtensor
    from areal.infra.rpc.serialization import deserialize_value

    from distbatch.areal import DistbatchRTensorBackend

    chosen = (
        rtensor.HttpRTensorBackend() if backend == "http" else DistbatchRTensorBackend(same_host=same_host)
    )
    store_seconds, fetch_seconds = [], []
    command = [sys.executable, "-m", "bench.areal", "--workload", workload, "--seed", str(seed),
               "--backend", backend, "--worker", worker]  # fmt: skip
    env = dict(os.environ)
    if not same_host:
        env["DISTBATCH_SHM"] = "0"  # HTTP only, the engine's put included
    rtensor.set_backend(chosen)
    try:
        with Engine(command, env, log_path, timeout) as engine:
            for _ in range(repeats):
                store_s, remotized = engine.remotize()
                store_seconds.append(store_s)
                remote = deserialize_value(remotized)
                rtensor.clear_fetch_buffer()
                fetch_s, got = timed(functools.partial(rtensor.RTensor.localize, remote))
                fetch_seconds.append(fetch_s)
                _check(got, want)
                del got
                for node, ids in rtensor.RTensor.collect_shards(remote).items():  # AReaL's end of step
                    asyncio.run(rtensor.RTensor.clear_node(node, ids))
    finally:
        rtensor.set_backend(None)
        rtensor.clear_fetch_buffer()
        if isinstance(chosen, DistbatchRTensorBackend):
            chosen.close()
    nbytes = _tensor_bytes(want)
    return {"store": stats(store_seconds, nbytes), "fetch": stats(fetch_seconds, nbytes)}


def _tensor_bytes(batch: list[dict[str, Any]]) -> int:
    return sum(v.numel() * v.element_size() for t in batch for v in t.values() if isinstance(v, torch.Tensor))


class Engine:
    """An engine process (`engine_main`) that remotizes the batch each time it is asked. It keeps
    serving (AReaL's HTTP backend keeps the tensors in it) until the block ends: then its stdin
    closes and it exits."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, timeout: float) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("a")
        self._child = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env
        )
        self._timeout = timeout
        self._log_path = log_path

    def __enter__(self) -> Engine:
        return self

    def remotize(self) -> tuple[float, Any]:
        """Ask for the batch once more: the engine's store seconds and its RTensors (parsed JSON)."""
        import orjson

        assert self._child.stdin is not None
        self._child.stdin.write(b"go\n")
        self._child.stdin.flush()
        line = self._read_line()
        if not line.startswith(READY):
            raise RuntimeError(f"the engine process said {line[:200]!r} (log: {self._log_path})")
        return float(line.split()[1]), orjson.loads(self._read_line())

    def _read_line(self) -> str:
        """One line of the engine's output, within the timeout (a reader thread: a pipe has none)."""
        stdout = self._child.stdout
        assert stdout is not None
        box: list[bytes] = []
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(self._timeout)
        if not box:
            raise TimeoutError(
                f"the engine process gave no answer in {self._timeout:.0f} s (log: {self._log_path})"
            )
        if not box[0]:
            raise RuntimeError(f"the engine process exited with {self._child.wait()} (log: {self._log_path})")
        return box[0].decode()

    def __exit__(self, failed: type[BaseException] | None = None, *exc: object) -> None:
        if self._child.stdin is not None:
            self._child.stdin.close()  # it exits when its stdin ends
        try:
            if failed is not None:  # it may be stuck writing what nobody reads now
                raise subprocess.TimeoutExpired(self._child.args, 0)
            self._child.wait(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        if self._child.stdout is not None:
            self._child.stdout.close()  # after it exited: a reader blocked on it has had its EOF
        self._log.close()


def _check(got: Any, want: list[dict[str, Any]]) -> None:
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} trajectories back, {len(want)} sent")
    for g, w in zip(got, want):
        for name, value in w.items():
            if isinstance(value, torch.Tensor):
                same = g[name].dtype == value.dtype and torch.equal(g[name], value)
            else:
                same = g[name] == value
            if not same:
                raise AssertionError(f"field {name!r} came back different")


# ----------------------------------------------------------------------------- engine side


def serve_areal_data(host: str = "127.0.0.1") -> str:
    """AReaL's data blueprint (its `/data/*` endpoints over this process's RTensor storage) on a
    werkzeug threaded server, as AReaL's RPC server runs it, in a daemon thread; its address."""
    from areal.infra.rpc.guard.data_blueprint import data_bp
    from flask import Flask
    from werkzeug.serving import make_server

    app = Flask("areal-engine")
    app.register_blueprint(data_bp)
    server = make_server(host, 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"{host}:{server.server_port}"


def engine_main(argv: list[str] | None = None) -> None:
    """For each line on stdin: remotize the batch with the chosen backend, print `ready <store
    seconds>` and the RTensors as AReaL's RPC sends them (JSON); serve until stdin closes."""
    import orjson
    from areal.infra.rpc import rtensor
    from areal.infra.rpc.serialization import serialize_value

    parser = argparse.ArgumentParser(description=engine_main.__doc__)
    parser.add_argument("--workload", default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("http", "distbatch"), required=True)
    parser.add_argument("--worker", required=True, help="the distbatch worker to store on")
    args = parser.parse_args(argv)
    # The answers go on our own copy of stdout; AReaL's loggers print there too, so what else is
    # written to stdout goes to stderr (the engine's log).
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    batch = trajectories(args.workload, args.seed)
    if args.backend == "http":
        node = serve_areal_data()
        rtensor.set_backend(rtensor.HttpRTensorBackend())
    else:
        from distbatch.areal import install

        node = "engine-0"
        install(args.worker)
    for _ in sys.stdin:  # one line per repeat, until the controller closes our stdin
        # AReaL's own store keeps what the last repeat stored until its controller clears it
        # (over HTTP, DELETE /data/clear): this one replaces it, as a new step would.
        store_s, remote = timed(functools.partial(rtensor.RTensor.remotize, batch, node_addr=node))
        answers.write(f"{READY} {store_s}\n".encode() + orjson.dumps(serialize_value(remote)) + b"\n")
        answers.flush()


if __name__ == "__main__":
    engine_main()


def table(name: str, r: dict[str, Any]) -> str:
    """The AReaL rows of the summary: store and fetch per mode, and ours over AReaL's HTTP backend."""
    if "skipped" in r:
        return f"AReaL RTensor, {name}: skipped ({r['skipped']})"
    lines = [
        f"AReaL RTensor, {name} ({r['tasks']:,} trajectories, {4 * r['tasks']:,} tensors; GB/s, medians; "
        "ratio = over AReaL's HTTP backend):",
        f"  {'backend':<26} {'remotize':>9} {'localize':>9} {'ratio':>8}",
    ]
    base = r.get("areal_http", {}).get("fetch", {}).get("gbps", float("nan"))
    labels = {"areal_http": "AReaL HttpRTensorBackend", "distbatch_http": "distbatch, HTTP",
              "distbatch_same_host": "distbatch, same host"}  # fmt: skip
    for row, label in labels.items():
        got = r.get(row)
        if got is None:
            continue
        if "error" in got:
            lines.append(f"  {label:<26} failed: {got['error']}")
            continue
        fetch = got["fetch"]["gbps"]
        lines.append(f"  {label:<26} {got['store']['gbps']:>9.3f} {fetch:>9.3f} {fetch / base:>7.2f}x")
    lines.append(
        "  (remotize: the engine stores its result, AReaL's own store keeps it in the engine process;"
        " localize: the controller fetches all of it)"
    )
    return "\n".join(lines)
