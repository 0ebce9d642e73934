"""Realistic RL batch shapes, generated deterministically from a seed (no files, no downloads)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    tasks: int
    mean_len: int
    max_len: int
    group: int = 8  # GRPO responses per prompt
    dense_len: int = 0  # the padded width of the dense variant; 0: mean_len rounded up to 512

    def lengths(self, seed: int = 0) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        mu = math.log(self.mean_len)
        values = torch.exp(mu + 0.6 * torch.randn(self.tasks, generator=gen))
        return [int(v) for v in values.clamp(16, self.max_len).tolist()]

    @property
    def dense_shape(self) -> tuple[int, int]:
        """(tasks, tokens) of the dense variant: every task padded to one length."""
        return self.tasks, self.dense_len or -(-self.mean_len // 512) * 512


WORKLOADS = {
    "tiny": Workload("tiny", tasks=32, mean_len=128, max_len=512),
    "small": Workload("small", tasks=1024, mean_len=1500, max_len=8192),
    "grpo": Workload("grpo", tasks=5120, mean_len=1500, max_len=8192),  # dense: 5,120 x 1,536
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


def make_dense_columns(workload: Workload, seed: int = 0) -> dict[str, Any]:
    """The same fields as `make_columns`, padded to one length: [tasks, dense_len] tensors.

    What a user of a tensor-only transport ships (one contiguous tensor per field): the best
    case for Ray's object store and TransferQueue, compared on the very same batch.
    """
    gen = torch.Generator().manual_seed(seed + 2)
    tasks, width = workload.dense_shape
    return {
        "input_ids": torch.randint(0, 151_000, (tasks, width), dtype=torch.int32, generator=gen),
        "logprobs": -torch.rand(tasks, width, generator=gen),
        "advantages": torch.randn(tasks, width, generator=gen).to(torch.bfloat16),
        "rewards": torch.rand(tasks, generator=gen),
        "uid": [f"prompt-{i // workload.group}" for i in range(tasks)],
    }


def column_bytes(column: Any) -> int:
    """Tensor bytes of one column: a stacked tensor or a list of per-task values."""
    if isinstance(column, torch.Tensor):
        return column.numel() * column.element_size()
    return sum(v.numel() * v.element_size() for v in column if isinstance(v, torch.Tensor))


def payload_bytes(columns: dict[str, Any]) -> int:
    """Tensor bytes in the batch (what every transport must move at least)."""
    return sum(column_bytes(col) for col in columns.values())
