"""A user's first `batch.nested()` prints no torch fx note; `is_fx_tracing()` callers still get it.

torch 2.13 logs "is_fx_tracing will return true ..." once per process, on the first call of
`is_fx_tracing()`. Only a fresh interpreter shows whether the note was used up, so this runs one
(which is why it is not a unit test).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from torch.fx import _symbolic_trace as fx_trace

NOTE = "is_fx_tracing will return true"
HAS_NOTE = hasattr(fx_trace, "is_fx_tracing_warning")


@pytest.mark.skipif(not HAS_NOTE, reason="this torch has no is_fx_tracing note")
def test_nested_prints_no_fx_note_and_leaves_it_to_callers_of_is_fx_tracing() -> None:
    script = textwrap.dedent(
        """
        import sys
        import torch
        from distbatch import DistributedBatchMemory

        batch = DistributedBatchMemory.from_dict({"x": [torch.arange(3), torch.arange(5)]})
        assert batch.nested("x").size(0) == 2
        print("NESTED DONE", file=sys.stderr, flush=True)
        from torch.fx._symbolic_trace import is_fx_tracing
        assert not is_fx_tracing()  # someone else's call: the note is still theirs
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, _, after = done.stderr.partition("NESTED DONE")
    assert NOTE not in before, before
    assert NOTE in after, after
