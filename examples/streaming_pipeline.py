"""Streaming mode: producers put GRPO groups while data-parallel ranks pull balanced batches.

Two producer threads put groups of n responses (log-normal lengths) into a
partition as they "finish"; the data stays on two local workers. The
controller is served over HTTP; 2 dp ranks x 2 TP peers, each its own
process, pull through `RemoteController` + `StreamingDataLoader`. TP peers of
one rank must see identical data; different ranks must see disjoint data.

    python examples/streaming_pipeline.py --sampler seqlen   # SeqlenBalancedSampler (default)
    python examples/streaming_pipeline.py --sampler rank     # RankAwareSampler
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import threading
import time
from typing import Any

import torch

from distbatch import DistributedBatchMemory, RemoteController, WorkerGroup, serve_controller
from distbatch.controller import Controller
from distbatch.dataloader import StreamingDataLoader, StreamingDataset
from distbatch.samplers import BaseSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler

PARTITION = "step0"
FIELDS = ["input_ids", "logprobs"]


def produce(args: argparse.Namespace, producer: int, controller: RemoteController, node: str) -> None:
    """Put one GRPO group at a time, as rollouts would finish."""
    gen = torch.Generator().manual_seed(1000 + producer)
    for prompt in range(args.prompts_per_producer):
        lengths = [
            max(8, int(math.exp(math.log(args.mean_len) + 0.7 * float(torch.randn((), generator=gen)))))
            for _ in range(args.n)
        ]
        group = DistributedBatchMemory.from_dict(
            {
                "input_ids": [
                    torch.randint(0, 32_000, (n,), dtype=torch.int32, generator=gen) for n in lengths
                ],
                "logprobs": [-torch.rand(n, generator=gen) for n in lengths],
                "uid": [f"p{producer}-{prompt}"] * args.n,
            },
            task_ids=[f"p{producer}-{prompt}-r{j}" for j in range(args.n)],
        )
        controller.put(PARTITION, group.to_remote(node))
        time.sleep(args.produce_delay)


def consume(address: str, dp_rank: int, tp_rank: int, args: argparse.Namespace, steps: int, out: Any) -> None:
    """One training rank: pull `steps` batches and report what it saw."""
    dataset = StreamingDataset(
        RemoteController(address),
        PARTITION,
        task_name="train",
        fields=FIELDS,
        batch_size=args.batch_size,
        dp_rank=dp_rank,
        poll_interval=0.05,
    )
    seen = []
    for step, batch in enumerate(StreamingDataLoader(dataset)):
        tokens = sum(int(t.numel()) for t in batch["input_ids"])
        checksum = sum(float(t.sum()) for t in batch["logprobs"])
        seen.append({"task_ids": batch.task_ids, "tokens": tokens, "checksum": round(checksum, 3)})
        if step + 1 == steps:
            break
    out.put((dp_rank, tp_rank, seen))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sampler", choices=["seqlen", "rank"], default="seqlen")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--prompts-per-producer", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--tp", type=int, default=2, help="TP peers per rank (same data)")
    parser.add_argument("--batch-size", type=int, default=8, help="tasks per rank per step")
    parser.add_argument("--mean-len", type=int, default=512)
    parser.add_argument("--produce-delay", type=float, default=0.02)
    args = parser.parse_args(argv)

    total = args.producers * args.prompts_per_producer * args.n
    if total % (args.batch_size * args.dp):
        parser.error("producers x prompts x n must be a multiple of batch-size x dp")
    steps = total // (args.batch_size * args.dp)
    sampler: BaseSampler
    if args.sampler == "seqlen":
        sampler = SeqlenBalancedSampler(n_samples_per_prompt=args.n, dp_size=args.dp)
    else:
        sampler = RankAwareSampler(GRPOGroupNSampler(args.n))

    with WorkerGroup.local(args.producers) as workers, serve_controller(Controller(sampler)) as server:
        print(
            f"controller at {server.address}, data workers {workers.nodes}, sampler {type(sampler).__name__}"
        )
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        ranks = [
            ctx.Process(target=consume, args=(server.address, dp, tp, args, steps, results))
            for dp in range(args.dp)
            for tp in range(args.tp)
        ]
        for process in ranks:
            process.start()
        remote = RemoteController(server.address)
        producers = [
            threading.Thread(target=produce, args=(args, p, remote, workers.nodes[p % len(workers)]))
            for p in range(args.producers)
        ]
        for thread in producers:
            thread.start()
        for thread in producers:
            thread.join()
        seen = {}
        for _ in ranks:
            dp, tp, batches = results.get(timeout=300)
            seen[(dp, tp)] = batches
        for process in ranks:
            process.join(timeout=30)
        cleared = remote.clear_partition(PARTITION)
        left = sum(s["shards"] for s in workers.stats())

    ok = True
    print(f"\n{total} tasks streamed in {steps} steps of {args.batch_size} tasks x {args.dp} ranks")
    for dp in range(args.dp):
        peers = [seen[(dp, tp)] for tp in range(args.tp)]
        identical = all(p == peers[0] for p in peers)
        ok &= identical
        per_step = [b["tokens"] for b in peers[0]]
        print(
            f"dp rank {dp}: tokens per step {per_step} (total {sum(per_step):,}); "
            f"{args.tp} TP peers identical: {identical}"
        )
    for step in range(steps):
        totals = [seen[(dp, 0)][step]["tokens"] for dp in range(args.dp)]
        print(f"step {step}: tokens per rank {totals}  max/min {max(totals) / max(min(totals), 1):.3f}")
    all_ids = [t for dp in range(args.dp) for b in seen[(dp, 0)] for t in b["task_ids"]]
    disjoint = len(all_ids) == len(set(all_ids))
    complete = len(set(all_ids)) == total
    ok &= disjoint and complete
    print(f"ranks disjoint: {disjoint}; every task delivered once: {complete}")
    print(f"clear_partition deleted {cleared} shards; shards left on workers: {left}")
    return 0 if ok and left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
