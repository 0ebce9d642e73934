"""TransferQueue's API with its SimpleStorage (a peer baseline) or with distbatch as its storage
backend (`Distbatch`, over HTTP or the same-host path): put and get of the same batch, in a
child process.

`run(...)` (called by `python -m bench`) starts `python -m bench.transferqueue` in its own
process group, bounded by a timeout, and reads the figures it writes as JSON. The child:

1. starts a local Ray cluster on loopback (`distbatch.launch.ray_actors.init_local_ray`);
2. `transfer_queue.init(conf)` with `backend.storage_backend = SimpleStorage` and
   `num_data_storage_units = units`: a `TransferQueueController` actor plus `units`
   `SimpleStorageUnit` actors, which talk ZMQ to the client living in this process; or with
   `Distbatch` and `workers = units`: `units` distbatch workers as Ray actors, which the client
   in this process puts to (its home worker) and gathers from, over HTTP or shared memory;
3. per repeat, with fresh keys: `kv_batch_put(keys, partition_id, fields=TensorDict)` (timed),
   `kv_batch_get(keys, partition_id)` (timed), then `kv_clear(keys, partition_id)`;
4. `transfer_queue.close()` and `ray.shutdown()`, also on SIGTERM.

Dense fields go as [tasks, width] tensors, ragged ones as jagged nested tensors (TransferQueue
has no list-of-tensors column), and again (kind `strided`) as strided nested tensors, the
default layout TransferQueue's own README and tests build; JSON-like values as a
`NonTensorStack`. Gets are checked against what was put; TransferQueue returns every non-scalar
tensor field as a jagged nested tensor, dense input included, and the check compares row by row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.measure import check_columns, stats, timed
from bench.workloads import WORKLOADS, make_columns, make_dense_columns, payload_bytes

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.1.11"  # the release this baseline was written against (setup.cfg pins it in [bench])
KINDS = ("dense", "ragged", "strided")  # strided: the ragged batch as strided nested tensors
MULTIMODAL = "multimodal"  # `bench.shared_fields`' batch (its own workload and kind)
_PARTITION = "bench"


def available() -> str | None:
    """None when `transfer_queue` can be imported; else why not (a skip reason)."""
    if importlib.util.find_spec("transfer_queue") is None:
        return f"transferqueue is not installed (pip install transferqueue=={VERSION}, or the [bench] extra)"
    return None


# ----------------------------------------------------------------------------- parent side


def run(
    workload: str,
    seed: int,
    repeats: int,
    units: int,
    timeout: float,
    log_path: Path,
    kinds: tuple[str, ...] = KINDS,
    backend: str = "SimpleStorage",
    same_host: bool = False,
    prompts: int | None = None,
) -> dict[str, Any]:
    """Figures of the child run (see the module doc), or `{"error": ...}` if it failed or timed out."""
    with tempfile.TemporaryDirectory(prefix="bench-tq-") as tmp:
        result_path = Path(tmp) / "result.json"
        command = [
            sys.executable,
            "-m",
            "bench.transferqueue",
            "--workload",
            workload,
            "--seed",
            str(seed),
            "--repeats",
            str(repeats),
            "--units",
            str(units),
            "--kinds",
            ",".join(kinds),
            "--result",
            str(result_path),
            "--backend",
            backend,
            *(["--same-host"] if same_host else []),
            *(["--prompts", str(prompts)] if prompts is not None else []),
        ]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            # Own session: on a timeout the whole group goes (the child and Ray's helpers it started).
            env = dict(os.environ)
            if same_host:
                env.pop("DISTBATCH_SHM", None)
            elif backend == "Distbatch":
                env["DISTBATCH_SHM"] = "0"  # HTTP only, clients and workers alike
            child = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
            try:
                code = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop_group(child)
                return {"error": f"timed out after {timeout:.0f} s (log: {log_path})"}
        if code != 0 or not result_path.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            return {"error": f"child exited with {code} (log: {log_path}):\n{tail}"}
        return json.loads(result_path.read_text())


def _stop_group(child: subprocess.Popen) -> None:
    """SIGTERM the child's process group (it shuts TransferQueue and Ray down), then SIGKILL it."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------- child side


def to_tensordict(columns: dict[str, Any], strided: bool = False) -> Any:
    """The batch as TransferQueue takes it: a TensorDict with one entry per field; ragged fields
    as jagged nested tensors, or (`strided`) as the strided ones TransferQueue's README and
    tests build with `torch.nested.nested_tensor(rows)`."""
    from tensordict import NonTensorStack, TensorDict

    fields: dict[str, Any] = {}
    tasks = 0
    for name, column in columns.items():
        if isinstance(column, torch.Tensor):
            fields[name] = column
        elif column and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in column):
            fields[name] = torch.stack(column)
        elif column and all(isinstance(v, torch.Tensor) for v in column):
            layout = torch.strided if strided else torch.jagged
            fields[name] = torch.nested.as_nested_tensor(column, layout=layout)
        else:
            fields[name] = NonTensorStack.from_list(list(column))
        tasks = len(column)
    return TensorDict(fields, batch_size=[tasks])


def _returned_as(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"nested {value.layout}".replace("torch.", "") if value.is_nested else "dense tensor"
    return type(value).__name__


def _comparable(got: Any, names: list[str]) -> dict[str, Any]:
    """The gathered TensorDict as plain columns: tensors as they are, non-tensor stacks as lists."""
    out: dict[str, Any] = {}
    for name in names:
        value = got[name]
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            out[name] = list(value.tolist() if hasattr(value, "tolist") else value)
    return out


def measure(tq: Any, kind: str, columns: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Put and get `columns` `repeats` times under fresh keys, clearing after each."""
    fields = to_tensordict(columns, strided=kind == "strided")
    nbytes = payload_bytes(columns)
    tasks = fields.batch_size[0]
    put_times, get_times = [], []
    returned: dict[str, str] = {}
    for r in range(repeats):
        keys = [f"{kind}-{r}-{i}" for i in range(tasks)]
        seconds, _ = timed(partial(tq.kv_batch_put, keys=keys, partition_id=_PARTITION, fields=fields))
        put_times.append(seconds)
        seconds, got = timed(partial(tq.kv_batch_get, keys=keys, partition_id=_PARTITION))
        get_times.append(seconds)
        if r == 0:
            returned = {name: _returned_as(got[name]) for name in columns}
            check_columns(_comparable(got, list(columns)), columns)
        del got
        tq.kv_clear(keys=keys, partition_id=_PARTITION)
    left = tq.kv_list(partition_id=_PARTITION).get(_PARTITION, {})
    return {
        "tasks": tasks,
        "payload_bytes": nbytes,
        "put": stats(put_times, nbytes),
        "get": stats(get_times, nbytes),
        "checked": True,
        "returned_as": returned,
        "keys_left_after_clear": len(left),
    }


def child_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.transferqueue", description=__doc__)
    parser.add_argument("--workload", required=True, choices=[*sorted(WORKLOADS), MULTIMODAL])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--units", type=int, default=2, help="SimpleStorage units (Ray actors)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {KINDS} or {MULTIMODAL}")
    parser.add_argument("--result", type=Path, required=True, help="where to write the figures (JSON)")
    parser.add_argument("--backend", default="SimpleStorage", choices=["SimpleStorage", "Distbatch"])
    parser.add_argument("--same-host", action="store_true", help="Distbatch: the same-host path on")
    parser.add_argument("--prompts", type=int, default=None, help=f"{MULTIMODAL}: prompts in the batch")
    parser.add_argument(
        "--no-freeze-gc",
        action="store_true",
        help="Distbatch: backend option freeze_gc false (the collector keeps walking the start-up heap)",
    )
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in (*KINDS, MULTIMODAL) for k in kinds):
        parser.error(f"--kinds must name some of {KINDS}, or {MULTIMODAL}")
    # SIGTERM (a timeout in the parent) unwinds through the finally blocks below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    from distbatch.launch.ray_actors import init_local_ray

    workload = WORKLOADS.get(args.workload)
    out: dict[str, Any] = {"version": tq.__version__, "backend": args.backend, "units": args.units}
    init_local_ray(num_cpus=args.units + 2)  # the controller and each unit ask for 1 CPU
    try:
        if args.backend == "Distbatch":
            import distbatch.transferqueue  # noqa: F401  (registers the backend)

            options = {"workers": args.units, "same_host": args.same_host, "freeze_gc": not args.no_freeze_gc}
            out["same_host"] = args.same_host
            out["freeze_gc"] = not args.no_freeze_gc
        else:
            options = {"num_data_storage_units": args.units}
        conf = {"backend": {"storage_backend": args.backend, args.backend: options}}
        tq.init(OmegaConf.create(conf))
        try:
            for kind in kinds:
                if kind == MULTIMODAL:
                    from bench import shared_fields

                    prompts = args.prompts or shared_fields.PROMPTS
                    columns = shared_fields.make_columns(args.seed, prompts=prompts)
                else:
                    assert workload is not None
                    make = make_dense_columns if kind == "dense" else make_columns
                    columns = make(workload, args.seed)
                try:
                    out[kind] = measure(tq, kind, columns, args.repeats)
                except Exception as exc:  # report it: a format TransferQueue refuses is a finding
                    out[kind] = {"error": f"{type(exc).__name__}: {exc}"}
                del columns
        finally:
            if args.backend == "Distbatch":
                import distbatch.transferqueue as dtq

                dtq.close()  # tq.close(), and the workers tq.init started
            else:
                tq.close()
    finally:
        ray.shutdown()
    args.result.write_text(json.dumps(out))


if __name__ == "__main__":
    child_main()
