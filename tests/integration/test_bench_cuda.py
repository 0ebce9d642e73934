"""`bench.cuda`, the GPU rows (a GPU batch's put and gather against the host-device copy limit):
its steps run with CPU tensors (`device="cpu"`), so they work before a GPU machine runs them;
without a device the rows say so and measure nothing. tests/integration/test_cuda.py runs it
on a device where there is one."""

from __future__ import annotations

import pytest
import torch

from bench import cuda
from bench.workloads import WORKLOADS, make_columns, payload_bytes


def test_the_gpu_rows_run_their_steps_with_cpu_tensors() -> None:
    result = cuda.run("tiny", workers=1, repeats=1, device="cpu")
    assert result["device"] == "cpu" and set(result["kinds"]) == set(cuda.KINDS)
    ragged = result["kinds"]["ragged"]
    assert ragged["put"]["bytes"] == payload_bytes(make_columns(WORKLOADS["tiny"], 0))
    assert ragged["fields"] == ["input_ids", "logprobs", "advantages", "rewards"]  # uid is JSON
    for entry in result["kinds"].values():
        for row in ("put", "gather", "d2h", "h2d"):
            assert entry[row]["gbps"] > 0, row
        assert entry["put_over_d2h"] > 0 and entry["gather_over_h2d"] > 0
    shown = cuda.table(result)
    assert "ragged" in shown and "dense" in shown and "the figures mean nothing" in shown


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_device_the_gpu_rows_say_so() -> None:
    result = cuda.run("tiny", workers=1, repeats=1)
    assert "no CUDA device" in result["skipped"]
    assert cuda.table(result).startswith("GPU rows: no CUDA device")
