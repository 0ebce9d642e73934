"""A GRPO step as verl's v1 trainer moves it through TransferQueue, with distbatch as the storage.

verl (and ROLL, NeMo-RL) put and get every batch through TransferQueue's API. One config line
selects distbatch as TransferQueue's storage backend; the trainer code does not change:

    tq.init({"backend": {"storage_backend": "Distbatch", "Distbatch": {}}})

Here: rollout puts a GRPO batch with `kv_batch_put` (ragged responses as jagged nested tensors,
a reward per sample, the prompt text); "training" gets it back with `kv_batch_get`, computes
group-normalised advantages and puts them as a new field of the same keys; the step ends with
`kv_clear`. `tq.init` starts one distbatch worker per Ray node and
`distbatch.transferqueue.close()` stops them with TransferQueue.

    .venv/bin/python examples/transferqueue_backend.py          # needs the ray and tq extras
    .venv/bin/python examples/transferqueue_backend.py --backend SimpleStorage   # to compare
"""

from __future__ import annotations

import argparse
import time

import torch


def rollout(prompts: int, n: int, seed: int) -> tuple[list[str], object]:
    """A GRPO batch in TransferQueue's layout: `prompts` groups of `n` responses."""
    from tensordict import NonTensorStack, TensorDict

    gen = torch.Generator().manual_seed(seed)
    count = prompts * n
    lengths = torch.randint(64, 1024, (count,), generator=gen).tolist()
    fields = TensorDict(
        {
            "responses": torch.nested.nested_tensor(
                [torch.randint(0, 32000, (k,), generator=gen) for k in lengths], layout=torch.jagged
            ),
            "old_logprobs": torch.nested.nested_tensor(
                [torch.randn(k, generator=gen).to(torch.bfloat16) for k in lengths], layout=torch.jagged
            ),
            "reward": torch.rand(count, generator=gen),
            "prompt": NonTensorStack(*[f"prompt {i // n}" for i in range(count)]),
        },
        batch_size=[count],
    )
    return [f"step0/p{i // n}/r{i % n}" for i in range(count)], fields


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="Distbatch", choices=["Distbatch", "SimpleStorage"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (the GRPO group)")
    args = parser.parse_args()

    import transfer_queue as tq
    from tensordict import TensorDict

    import distbatch.transferqueue as dtq  # registers the Distbatch backend in this process
    from distbatch.launch.ray_actors import init_local_ray

    init_local_ray(num_cpus=8)  # TransferQueue's controller and storage are Ray actors
    tq.init({"backend": {"storage_backend": args.backend, args.backend: {}}})
    try:
        keys, batch = rollout(args.prompts, args.n, seed=0)
        started = time.perf_counter()
        tq.kv_batch_put(keys=keys, partition_id="train", fields=batch, tags=[{"step": 0}] * len(keys))
        got = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["responses", "reward"])
        rewards = got["reward"].view(args.prompts, args.n)
        advantage = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
        tq.kv_batch_put(
            keys=keys,
            partition_id="train",
            fields=TensorDict({"advantage": advantage.reshape(-1)}, batch_size=[len(keys)]),
        )
        train = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["responses", "advantage"])
        seconds = time.perf_counter() - started
        tokens = int(train["responses"].offsets()[-1])
        print(
            f"[{args.backend}] {len(keys)} samples, {tokens:,} tokens: put, get, put advantages, get in "
            f"{seconds:.3f}s; responses come back {train['responses'].layout}, {train['responses'].dtype}"
        )
        tq.kv_clear(keys=keys, partition_id="train")
        print(f"[{args.backend}] cleared; keys left: {sum(len(v) for v in tq.kv_list().values())}")
    finally:
        stopped = dtq.close()  # tq.close(), and stop the workers tq.init started for Distbatch
        print(f"[{args.backend}] closed; distbatch workers stopped: {stopped}")


if __name__ == "__main__":
    main()
