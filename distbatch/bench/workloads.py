"""Realistic RL batch shapes, generated deterministically from a seed (no files, no downloads)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    tasks: int
    mean_len: int
    max_len: int
    group: int = 8  # GRPO responses per prompt

    def lengths(self, seed: int = 0) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        mu = math.log(self.mean_len)
        values = torch.exp(mu + 0.6 * torch.randn(self.tasks, generator=gen))
        return [int(v) for v in values.clamp(16, self.max_len).tolist()]


WORKLOADS = {
    "tiny": Workload("tiny", tasks=32, mean_len=128, max_len=512),
    "small": Workload("small", tasks=1024, mean_len=1500, max_len=8192),
    "grpo": Workload("grpo", tasks=5120, mean_len=1500, max_len=8192),
    # Long context, scaled to fit a 24 GiB machine with several copies in flight.
    "long": Workload("long", tasks=128, mean_len=32768, max_len=65536),
}


def make_columns(workload: Workload, seed: int = 0) -> dict[str, list]:
    """Per-task values: ragged int32 input_ids, fp32 logprobs, bf16 advantages, scalar rewards, uid."""
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = workload.lengths(seed)
    columns: dict[str, list] = {"input_ids": [], "logprobs": [], "advantages": [], "rewards": [], "uid": []}
    for i, n in enumerate(lengths):
        columns["input_ids"].append(torch.randint(0, 151_000, (n,), dtype=torch.int32, generator=gen))
        columns["logprobs"].append(-torch.rand(n, generator=gen))
        columns["advantages"].append(torch.randn(n, generator=gen).to(torch.bfloat16))
        columns["rewards"].append(torch.rand((), generator=gen))
        columns["uid"].append(f"prompt-{i // workload.group}")
    return columns


def payload_bytes(columns: dict[str, list]) -> int:
    """Tensor bytes in the batch (what every transport must move at least)."""
    return sum(
        v.numel() * v.element_size() for col in columns.values() for v in col if isinstance(v, torch.Tensor)
    )
