"""Ragged columns over one packed tensor, and torch's jagged nested tensors in and out.

`RaggedViews` is a ragged column (a list of per-task tensors) that also keeps the packed tensor
its tasks are views of, so `packed()` and the wire use that tensor as it is instead of joining
the tasks again. A jagged nested tensor (`layout=torch.jagged`, TransferQueue's convention for
every non-scalar field) becomes one without a copy: its `values()` are the packed tensor and
its `offsets()` say where each task starts. `nested_of_packed` goes the other way.
Separate from `columns` because this is the one place that knows torch's nested API.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from distbatch import wire
from distbatch.errors import InvalidArgumentError
from distbatch.gc_pause import paused_gc
from distbatch.wire.shapes import ragged_positions


class RaggedViews(list[torch.Tensor]):
    """A ragged column held as one packed tensor: task i is a view of the next `lengths[i]` rows
    (along dim 0) of `values`. A list like any ragged column; never changed in place (a batch
    hands out copies of its lists), so `values` and the views always agree."""

    __slots__ = ("values", "lengths")
    values: torch.Tensor
    lengths: np.ndarray

    @classmethod
    def of(cls, values: torch.Tensor, lengths: np.ndarray) -> RaggedViews:
        """Views of `values` (rows along dim 0, `sum(lengths)` of them), one per task: one `split`."""
        with paused_gc():  # one tensor per task: no collection passes over them mid-build
            col = cls(values.split(lengths.tolist()) if len(lengths) else ())
        col.values, col.lengths = values, lengths
        return col

    def rows(self, start: int, stop: int) -> RaggedViews:
        """Tasks `start:stop` (a chunk or a slice), still over one packed tensor (a view of ours)."""
        first = int(self.lengths[:start].sum())
        lengths = self.lengths[start:stop]
        col = RaggedViews(self[start:stop])
        col.values, col.lengths = self.values[first : first + int(lengths.sum())], lengths
        return col

    def __reduce__(self) -> tuple[Any, ...]:
        # The packed tensor once (owning just its bytes), not one tensor per task.
        return (RaggedViews.of, (compact_tensor(self.values), self.lengths))


def compact_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes, so pickling a view does not drag its base along."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def nested_problem(value: torch.Tensor) -> str | None:
    """Why a nested tensor cannot be a column (None: it can). Any layout and any ragged dimension
    is a column; only its dtype or device can stop it, as for a dense tensor."""
    return wire.tensor_problem(value.values())


def column_problem(value: torch.Tensor) -> str | None:
    """Why a tensor given as a column cannot be stored (None: it can); callers prefix the field.

    A nested tensor is a ragged column; any other tensor must be one the wire carries.
    """
    return nested_problem(value) if value.is_nested else wire.tensor_problem(value)


def nested_sizes(value: torch.Tensor) -> np.ndarray:
    """Each task's shape in a nested tensor of any layout, one row per task (int64, [tasks, dims]),
    read from its metadata: no task is split out. (dims counts a task's dimensions, the nested
    tensor's less one.)"""
    if value.layout == torch.strided:
        return value._nested_tensor_size().numpy().astype(np.int64, copy=False)
    lengths = value.lengths()  # type: ignore[attr-defined]  # a jagged nested tensor's holes
    if lengths is None:
        lengths = value.offsets().diff()  # type: ignore[attr-defined]
    lengths = lengths.detach().cpu().numpy().astype(np.int64, copy=False)
    shape = [int(d) if isinstance(d, int) else -1 for d in value.shape[1:]]  # -1: the ragged one
    sizes = np.empty((len(lengths), len(shape)), dtype=np.int64)
    sizes[:] = shape
    sizes[:, value._ragged_idx - 1] = lengths  # type: ignore[attr-defined]
    return sizes


def nested_column(name: str, value: torch.Tensor) -> list[torch.Tensor]:
    """A nested tensor as a ragged column whose tasks are `value.unbind()`.

    Jagged and ragged in dim 1 (TransferQueue's layout, `layout=torch.jagged`): its `values()`
    are the packed tensor, no copy (one gather when it has holes, as `torch.nested.narrow`
    leaves). Strided (`torch.nested.nested_tensor`'s default) whose tasks share their trailing
    dimensions: its buffer is the packed tensor, read through its per-task sizes, no copy when
    it is contiguous. Anything else (tasks differing beyond their first dimension): the tasks,
    unbound, as TransferQueue itself stores them.
    """
    if (problem := nested_problem(value)) is not None:
        raise InvalidArgumentError(f"field {name!r}: {problem}")
    if value.layout == torch.jagged and value._ragged_idx == 1:  # type: ignore[attr-defined]
        return _jagged_column(value)
    if value.layout == torch.strided and value.dim() > 1:
        sizes = nested_sizes(value)
        if len(sizes) and bool((sizes[:, 1:] == sizes[0, 1:]).all()):
            buffer = (value if value.is_contiguous() else value.contiguous()).values()
            tail = tuple(int(d) for d in sizes[0, 1:])
            return RaggedViews.of(buffer.view(int(sizes[:, 0].sum()), *tail), sizes[:, 0].copy())
    return list(value.unbind())


def _jagged_column(value: torch.Tensor) -> RaggedViews:
    # torch's stubs type a jagged nested tensor as a plain Tensor, which has no offsets or lengths
    values, offsets, holes = value.values(), value.offsets(), value.lengths()  # type: ignore[attr-defined]
    bounds = offsets.detach().cpu().numpy().astype(np.int64, copy=False)
    if holes is None:
        lengths = np.diff(bounds)
        start, stop = int(bounds[0]), int(bounds[-1])
        if start != 0 or stop != values.shape[0]:
            values = values[start:stop]
        return RaggedViews.of(values, lengths)
    lengths = holes.detach().cpu().numpy().astype(np.int64, copy=False)
    index = ragged_positions(bounds[:-1], lengths)
    return RaggedViews.of(values.index_select(0, torch.from_numpy(index).to(values.device)), lengths)


def nested_of_packed(
    values: torch.Tensor, cu_seqlens: torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """A jagged nested tensor over packed `values` (not copied unless moved to `device`), task i
    being `values[cu_seqlens[i]:cu_seqlens[i + 1]]`; its offsets are `cu_seqlens` as int64 (torch's
    own dtype for them), on the values' device. `cu_seqlens` is on the CPU: the min and max
    lengths are read there, so kernels that want them need no device sync."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    shortest, longest = (int(lengths.min()), int(lengths.max())) if len(lengths) else (None, None)
    if device is not None:
        values = values.to(device)
    offsets = cu_seqlens.to(device=values.device, dtype=torch.int64)  # beside the values (a GPU column)
    return jagged_nested(values, offsets, min_seqlen=shortest, max_seqlen=longest)


def jagged_nested(
    values: torch.Tensor, offsets: torch.Tensor, min_seqlen: int | None = None, max_seqlen: int | None = None
) -> torch.Tensor:
    """`torch.nested.nested_tensor_from_jagged(values, offsets, ...)`: a jagged nested tensor
    viewing `values` (ragged along dim 1), task i from `offsets[i]` to `offsets[i + 1]`.

    Where torch's public function would log "is_fx_tracing will return true for both
    fx.symbolic_trace and torch.export ..." (torch 2.13 does, once per process, from the fx
    check it makes first: a note to callers of `is_fx_tracing`, which we are not), the view is
    built with the function the public one calls after that check, so the note is neither
    printed nor used up for code that does call `is_fx_tracing`. Under fx symbolic tracing,
    and in torch versions without the note, the public function is called.
    """
    view = _quiet_jagged_view()
    if view is None:
        return torch.nested.nested_tensor_from_jagged(
            values, offsets, min_seqlen=min_seqlen, max_seqlen=max_seqlen
        )
    return view(values, offsets, None, ragged_idx=1, min_seqlen=min_seqlen, max_seqlen=max_seqlen)


def _quiet_jagged_view() -> Any:
    """torch's `nested_view_from_values_offsets_lengths`, where the public constructor would log
    the fx note and no fx symbolic trace is running; else None (use the public one)."""
    try:
        from torch.fx import _symbolic_trace as fx_trace
        from torch.nested._internal.nested_tensor import nested_view_from_values_offsets_lengths
    except ImportError:
        return None
    if not hasattr(fx_trace, "is_fx_tracing_warning") or getattr(fx_trace, "_is_fx_tracing_flag", True):
        return None
    return nested_view_from_values_offsets_lengths
