"""Store a realistic RL batch on two local workers, gather it back, and show what moved.

Run it from the repository root with a Python that has distbatch (the venv `scripts/demo`
made): `.venv/bin/python examples/gather_demo.py` (1,024 tasks; `--tasks 512` for fewer, `--help`
for the rest). It starts its own two workers and stops them.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from distbatch import ShardClient
from distbatch.launch import spawn_worker


def make_rollout(num_tasks: int, mean_len: int, seed: int) -> dict[tuple[str, str], Any]:
    """GRPO-like shards: ragged int32 input_ids, fp32 logprobs, bf16 advantages, scalars, uids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.distributions.LogNormal(torch.log(torch.tensor(float(mean_len))), 0.6).sample(
        (num_tasks,)
    )
    shards: dict[tuple[str, str], Any] = {}
    for i, length in enumerate(lengths.clamp(16, 8 * mean_len).int().tolist()):
        task = f"step0-task{i:05d}"
        shards[(task, "input_ids")] = torch.randint(0, 150_000, (length,), dtype=torch.int32, generator=gen)
        shards[(task, "logprobs")] = -torch.rand(length, generator=gen)
        shards[(task, "advantages")] = torch.randn(length, generator=gen).to(torch.bfloat16)
        shards[(task, "rewards")] = float(torch.rand((), generator=gen))
        shards[(task, "uid")] = f"prompt-{i // 8}"
    return shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=1024)
    parser.add_argument("--mean-len", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workers = [spawn_worker(), spawn_worker()]
    try:
        client = ShardClient()
        print(f"workers: {', '.join(w.node for w in workers)}")
        shards = make_rollout(args.tasks, args.mean_len, args.seed)
        keys = list(shards)
        # Each worker keeps the half of the rollout it "produced".
        halves = [
            {k: shards[k] for k in keys[: len(keys) // 2]},
            {k: shards[k] for k in keys[len(keys) // 2 :]},
        ]
        started = time.perf_counter()
        for worker, half in zip(workers, halves):
            result = client.put(worker.node, half)
            print(f"put  {result.stored:6d} shards, {result.bytes / 1e6:8.1f} MB -> {worker.node}")
        put_s = time.perf_counter() - started

        refs = [(workers[0 if k in halves[0] else 1].node, *k) for k in keys]
        started = time.perf_counter()
        gathered = client.fetch(refs)
        gather_s = time.perf_counter() - started
        for key, value in zip(keys, gathered):
            original = shards[key]
            same = torch.equal(value, original) if isinstance(original, torch.Tensor) else value == original
            if not same:
                raise SystemExit(f"mismatch in {key}")
        total = sum(client.stats(w.node)["bytes"] for w in workers)
        tokens = sum(shards[k].numel() for k in keys if k[1] == "input_ids")
        print(
            f"gathered {len(keys)} shards ({tokens} tokens, {total / 1e6:.1f} MB) from 2 workers, "
            f"all bit-exact"
        )
        print(f"put {total / put_s / 1e9:.2f} GB/s, gather {total / gather_s / 1e9:.2f} GB/s (loopback)")
        deleted = client.delete_many(
            {w.node: [k for k in keys if k in half] for w, half in zip(workers, halves)}
        )
        left = [client.stats(w.node)["shards"] for w in workers]
        print(
            f"cleared {deleted.deleted} shards, {deleted.bytes_freed / 1e6:.1f} MB; "
            f"shards left per worker: {left}"
        )
        client.close()
    finally:
        for worker in workers:
            worker.stop()


if __name__ == "__main__":
    main()
