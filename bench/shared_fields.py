"""The `multimodal` workload: a GRPO batch whose n responses per prompt share one image.

`PROMPTS` prompts x `GROUP` responses; each prompt has ~1 MB of bf16 `pixel_values` (its patch
count varies: a ragged field) that its n tasks share, plus each task's own `input_ids`. Three
ways to move it, in one run, HTTP only:

- distbatch, shared: `to_remote(node, share={"pixel_values": n})`: the image is stored and put
  once per group, and a gather moves it once per reader (the tasks get views of it);
- distbatch, n copies: the same batch with every task's image its own tensor (what a store
  without shared fields holds);
- TransferQueue 0.1.11 (SimpleStorage, in a child process, `bench.transferqueue`): its
  `kv_batch_put` / `kv_batch_get` of the same batch, which stores and moves n copies.

Per row: bytes stored on the workers, bytes put and gathered over the wire (the client's
count), put and gather time (medians); ratios against n copies in the same run.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from bench import transferqueue
from bench.measure import check_columns, timed
from distbatch import DistributedBatchMemory, ShardClient
from distbatch.launch import spawn_workers

PROMPTS = 32
GROUP = 8
HIDDEN = 1024  # bf16 values per patch: 2 KiB; 384-640 patches: 0.75-1.25 MiB an image


def make_columns(seed: int = 0, shared: bool = True, prompts: int = PROMPTS) -> dict[str, list[Any]]:
    """The batch: per task its prompt's image (the same tensor for a group's n tasks, or, with
    `shared=False`, a copy of its own), its `input_ids` and its group's `uid`."""
    gen = torch.Generator().manual_seed(seed + 7)
    images = [
        torch.randn(int(torch.randint(384, 641, (), generator=gen)), HIDDEN, generator=gen).to(torch.bfloat16)
        for _ in range(prompts)
    ]
    tasks = prompts * GROUP
    lengths = torch.randint(200, 1500, (tasks,), generator=gen).tolist()
    pixel_values = [images[i // GROUP] if shared else images[i // GROUP].clone() for i in range(tasks)]
    return {
        "pixel_values": pixel_values,
        "input_ids": [torch.randint(0, 151_000, (n,), dtype=torch.int32, generator=gen) for n in lengths],
        "uid": [f"prompt-{i // GROUP}" for i in range(tasks)],
    }


def _bytes(columns: dict[str, list[Any]], unique: bool) -> int:
    """Tensor bytes of the batch, each distinct tensor once (`unique`) or per task."""
    seen: dict[int, int] = {}
    total = 0
    for column in columns.values():
        for value in column:
            if isinstance(value, torch.Tensor):
                size = value.numel() * value.element_size()
                if unique:
                    seen[id(value)] = size
                else:
                    total += size
    return sum(seen.values()) if unique else total


def _distbatch(columns: dict[str, list[Any]], nodes: list[str], repeats: int, share: bool) -> dict[str, Any]:
    """Put the batch (its groups spread over `nodes`), gather it all in this process, clear."""
    local = DistributedBatchMemory.from_dict(columns)
    parts = local.chunk(len(nodes))  # whole groups per node when the prompts split evenly
    puts, gathers = [], []
    stored = put_bytes = gathered_bytes = 0
    with ShardClient() as client:
        for r in range(repeats):
            before = client.traffic()

            def put() -> DistributedBatchMemory:
                pushed = [
                    part.to_remote(node, client, share={"pixel_values": GROUP} if share else None)
                    for part, node in zip(parts, nodes)
                ]
                return DistributedBatchMemory.concat(pushed)

            seconds, batch = timed(put)
            puts.append(seconds)
            middle = client.traffic()
            seconds, got = timed(batch.to_local)
            gathers.append(seconds)
            if r == 0:
                stored = sum(int(client.stats(node)["bytes"]) for node in nodes)
                put_bytes = (middle - before).bytes_sent
                gathered_bytes = (client.traffic() - middle).bytes_received
                check_columns({name: got[name] for name in columns}, columns)
            del got
            batch.clear()
    return {
        "stored_bytes": stored,
        "put_bytes": put_bytes,
        "gathered_bytes": gathered_bytes,
        "put_s": statistics.median(puts),
        "gather_s": statistics.median(gathers),
        "put_seconds": puts,
        "gather_seconds": gathers,
    }


def run(
    workers: int, repeats: int, seed: int, use_tq: bool, timeout: float, out: Path, prompts: int = PROMPTS
) -> dict[str, Any]:
    """The workload's three rows (module doc), and the ratios of each to n copies."""
    shared_columns = make_columns(seed, shared=True, prompts=prompts)
    result: dict[str, Any] = {
        "prompts": prompts,
        "group": GROUP,
        "tasks": prompts * GROUP,
        "image_bytes": _bytes({"pixel_values": shared_columns["pixel_values"]}, unique=True),
        "payload_bytes": _bytes(shared_columns, unique=False),  # what n copies weigh
    }
    live = spawn_workers(workers)
    try:
        nodes = [w.node for w in live]
        result["shared"] = _distbatch(shared_columns, nodes, repeats, share=True)
        del shared_columns
        result["copies"] = _distbatch(make_columns(seed, False, prompts), nodes, repeats, share=False)
    finally:
        for worker in live:
            worker.stop()
    if use_tq and transferqueue.available() is None:
        mm = transferqueue.MULTIMODAL
        log = out / "transferqueue-multimodal.log"
        tq = transferqueue.run(mm, seed, repeats, workers, timeout, log, kinds=(mm,), prompts=prompts)
        result["transferqueue"] = tq.get(mm, tq)
    shared, copies = result["shared"], result["copies"]
    result["ratios"] = {
        "stored_bytes_vs_copies": shared["stored_bytes"] / copies["stored_bytes"],
        "put_bytes_vs_copies": shared["put_bytes"] / copies["put_bytes"],
        "gathered_bytes_vs_copies": shared["gathered_bytes"] / copies["gathered_bytes"],
        "put_speedup_vs_copies": copies["put_s"] / shared["put_s"],
        "gather_speedup_vs_copies": copies["gather_s"] / shared["gather_s"],
    }
    tq_row = result.get("transferqueue", {})
    if "put" in tq_row:
        result["ratios"]["put_speedup_vs_transferqueue"] = tq_row["put"]["median_s"] / shared["put_s"]
        result["ratios"]["gather_speedup_vs_transferqueue"] = tq_row["get"]["median_s"] / shared["gather_s"]
    return result


def table(r: dict[str, Any]) -> str:
    """The rows as text: MB stored, put and gathered, and seconds, medians."""
    mb = 1e6
    lines = [
        f"multimodal GRPO batch: {r['prompts']} prompts x {r['group']} responses, one image each "
        f"({r['image_bytes'] / r['prompts'] / mb:.2f} MB a prompt on average); HTTP",
        f"  {'':<26} {'stored MB':>10} {'put MB':>8} {'gathered MB':>12} {'put s':>7} {'gather s':>9}",
    ]
    for key, label in (("shared", "distbatch, shared"), ("copies", "distbatch, n copies")):
        row = r[key]
        lines.append(
            f"  {label:<26} {row['stored_bytes'] / mb:>10.1f} {row['put_bytes'] / mb:>8.1f} "
            f"{row['gathered_bytes'] / mb:>12.1f} {row['put_s']:>7.3f} {row['gather_s']:>9.3f}"
        )
    tq = r.get("transferqueue")
    if tq and "put" in tq:
        copies = r["payload_bytes"] / mb
        lines.append(
            f"  {'TransferQueue (n copies)':<26} {copies:>10.1f} {copies:>8.1f} {copies:>12.1f} "
            f"{tq['put']['median_s']:>7.3f} {tq['get']['median_s']:>9.3f}"
        )
    elif tq:
        lines.append(f"  TransferQueue: {tq.get('error', 'no figures')}")
    q = r["ratios"]
    lines.append(
        f"  shared vs n copies: stored {q['stored_bytes_vs_copies']:.3f}x, put bytes "
        f"{q['put_bytes_vs_copies']:.3f}x, gathered bytes {q['gathered_bytes_vs_copies']:.3f}x; put "
        f"{q['put_speedup_vs_copies']:.2f}x and gather {q['gather_speedup_vs_copies']:.2f}x faster"
    )
    if "put_speedup_vs_transferqueue" in q:
        lines.append(
            f"  shared vs TransferQueue: put {q['put_speedup_vs_transferqueue']:.2f}x, gather "
            f"{q['gather_speedup_vs_transferqueue']:.2f}x faster"
        )
    return "\n".join(lines)
