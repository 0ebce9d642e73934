"""`batch.nested()` builds torch's jagged nested tensor without torch 2.13's fx note.

`torch.nested.nested_tensor_from_jagged` first asks `torch.fx`'s `is_fx_tracing()`, which in
torch 2.13 logs, once per process, "is_fx_tracing will return true for both fx.symbolic_trace and
torch.export ..." -- a note to callers of `is_fx_tracing`, printed on a user's first `nested()`.
`jagged_nested` builds the same view without asking, leaving the note to code that does call
`is_fx_tracing` (it is not used up), and calls the public function while an fx trace runs.
That the note stays unprinted is checked in a fresh interpreter, in
`tests/integration/test_nested_fx_note.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx import _symbolic_trace as fx_trace

from distbatch import DistributedBatchMemory
from distbatch.batch.ragged import jagged_nested


def test_the_view_is_the_one_torch_builds() -> None:
    values = torch.arange(16.0).reshape(8, 2)
    offsets = torch.tensor([0, 3, 3, 8], dtype=torch.int64)
    ours = jagged_nested(values, offsets, min_seqlen=0, max_seqlen=5)
    theirs = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=0, max_seqlen=5)
    assert ours.is_nested and ours.layout == torch.jagged
    assert ours.values().data_ptr() == values.data_ptr()  # a view: nothing copied
    assert torch.equal(ours.offsets(), offsets)
    for attribute, value in (("_ragged_idx", 1), ("_min_seqlen", 0), ("_max_seqlen", 5)):
        assert getattr(ours, attribute) == getattr(theirs, attribute) == value
    assert [t.tolist() for t in ours.unbind()] == [t.tolist() for t in theirs.unbind()]


def test_under_an_fx_trace_the_public_function_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fx_trace, "_is_fx_tracing_flag", True)
    with pytest.raises(RuntimeError, match="does not support tracing with fx.symbolic_trace"):
        jagged_nested(torch.zeros(3), torch.tensor([0, 1, 3]))


def test_an_empty_batch_nested_too() -> None:
    nt = DistributedBatchMemory.from_dict({"x": [torch.arange(3)]})[1:].nested("x")
    assert nt.is_nested and nt.size(0) == 0
