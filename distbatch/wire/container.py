"""The safetensors container: named raw tensors plus string metadata, no torch needed.

Layout (the safetensors spec): 8-byte little-endian header length, a UTF-8 JSON
header, then the raw tensor bytes with no holes. `build_container` lays one out as
a list of buffers (header first, then each entry's parts, never joined), so a
worker can stream stored bytes straight into a response; `parse_container`
validates one and hands out zero-copy views of its entries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from distbatch.errors import WireFormatError

Buffer = bytes | bytearray | memoryview

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_DIMS = 64
MAX_INDEX = 2**63 - 1  # the most elements (zero dims counted as 1) a tensor's shape may span
METADATA_KEY = "__metadata__"
CONTENT_TYPE = "application/octet-stream"

# safetensors dtype name -> bytes per element. The names are the spec's, so a
# container we write loads with the `safetensors` package and vice versa.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
    "C128": 16,  # not in the spec; our extension so complex128 is not lost
}

# Where the tensor data starts in a container we build: a multiple of every element size.
DATA_ALIGNMENT = max(ITEMSIZE.values())


class RawTensor(NamedTuple):
    """A tensor as the container sees it: dtype name, shape and C-contiguous bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: Buffer

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


class Entry(NamedTuple):
    """One tensor to write: its bytes may come as several parts (gathered runs of rows)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: Sequence[Part]


@dataclass(slots=True)
class Container:
    """A parsed container: entries as `RawTensor` views into the buffer, and the metadata."""

    tensors: dict[str, RawTensor]
    metadata: dict[str, str]


def build_container(entries: Sequence[Entry], metadata: Mapping[str, str]) -> list[Part]:
    """Lay out a container; returns its parts, header first (send them in order, or join them).

    Entries are ordered by element size, largest first, and the header is padded so the
    data starts at a multiple of the largest element size: every tensor then starts
    aligned to its element size, which keeps zero-copy decoding aligned without breaking
    the spec's rule that the byte buffer has no holes.
    """
    header: dict[str, Any] = {METADATA_KEY: dict(metadata)}
    parts: list[Part] = [b""]
    offset = 0
    for entry in sorted(entries, key=lambda e: -ITEMSIZE[e.dtype]):
        nbytes = math.prod(entry.shape) * ITEMSIZE[entry.dtype]
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        for part in entry.parts:
            if len(part):
                parts.append(part)
        offset += nbytes
    try:
        header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise WireFormatError(f"JSON value is not valid UTF-8: {exc}") from None
    header_bytes += b" " * (-(8 + len(header_bytes)) % DATA_ALIGNMENT)
    parts[0] = len(header_bytes).to_bytes(8, "little") + header_bytes
    return parts


class Pieces:
    """Bytes lying in many buffers, one row each: a ragged column's per-task tensors, as they are.

    Packing thousands of per-task tensors into one column costs a `cat` (~1-2 us a tensor) and
    a copy of every byte into fresh memory, most of a ragged put. Kept as (address, length)
    rows instead, they go out with gathering writes (`distbatch.transport.gather`): the kernel
    copies each straight into the socket or the shared region, one copy and no per-task object.
    `owners` keep the memory alive (one per row); `concat` joins them into one buffer, the one
    copy a reader that needs contiguous bytes pays (`byte_view`).
    """

    __slots__ = ("owners", "iov", "nbytes", "_concat")

    def __init__(
        self, owners: Sequence[Any], iov: Any, concat: Callable[[Sequence[Any]], memoryview]
    ) -> None:
        self.owners = owners
        self.iov = iov  # (rows, 2) uint64: address and length, struct iovec's layout
        self.nbytes = int(iov[:, 1].sum()) if len(iov) else 0
        self._concat = concat

    def __len__(self) -> int:
        return self.nbytes

    def rows(self, start: int, stop: int) -> Pieces:
        """Rows `start:stop` (no copy)."""
        return Pieces(self.owners[start:stop], self.iov[start:stop], self._concat)

    def join(self) -> memoryview:
        """Every row's bytes in one buffer (one copy)."""
        return self._concat(self.owners) if self.nbytes else memoryview(b"")


Part = Buffer | Pieces
"""One part of a body: a buffer, or many (`Pieces`)."""


def byte_view(buf: Buffer | Any) -> memoryview:
    """A flat byte view (format "B", one dimension) of any buffer, without a copy where the
    buffer is C-contiguous.

    `memoryview.cast("B")` refuses a view with a zero in its shape (a `(3, 0)` tensor's numpy
    array) and one that is not C-contiguous; every place that sends, writes or slices a part's
    bytes goes through here instead, so an empty field never leaves a fast path.
    """
    if isinstance(buf, Pieces):
        return buf.join()
    view = memoryview(buf)
    if view.ndim == 1 and view.format == "B" and view.c_contiguous:
        return view
    if view.nbytes == 0:
        return memoryview(b"")
    if not view.c_contiguous:
        return memoryview(view.tobytes())  # the one copy a strided buffer needs to be flat
    return view.cast("B")


def parts_size(parts: Sequence[Part]) -> int:
    return sum(p.nbytes if isinstance(p, Pieces) else memoryview(p).nbytes for p in parts)


def join_parts(parts: Sequence[Part]) -> bytes:
    return b"".join(byte_view(p) if isinstance(p, Pieces) else p for p in parts)


def unique_keys(pairs: list[tuple[str, Any]], where: str = "container header") -> dict[str, Any]:
    """A `json.loads` object hook that refuses an object naming a key twice (`WireFormatError`)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise WireFormatError(f"duplicate key {dup!r} in {where}")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(info, dict):
        raise WireFormatError(f"header entry {name!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise WireFormatError(f"{name!r}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise WireFormatError(f"{name!r}: shape must be a list of non-negative ints, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise WireFormatError(f"{name!r}: bad data_offsets {offsets!r}")
    if math.prod(max(d, 1) for d in shape) > MAX_INDEX:
        # torch (strides) and safetensors (sizes) compute in 64 bits: such a shape, even with a
        # zero dimension and no bytes, is no tensor either can make.
        raise WireFormatError(f"{name!r}: shape {shape} is too large to index with 64-bit integers")
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != expected:
        raise WireFormatError(
            f"{name!r}: data_offsets span {offsets[1] - offsets[0]} bytes, "
            f"dtype {dtype} and shape {shape} need {expected}"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def parse_container(buf: Buffer) -> Container:
    """Validate a container and split it into entries (views into `buf`, no copies).

    Every malformation raises `WireFormatError`: truncation, a header length past
    the end, bad JSON, unknown dtypes, sizes that do not match shapes,
    overlapping / out-of-range / gapped offsets, non-string metadata.
    """
    view = byte_view(buf)
    header, header_len = _read_header(view)
    data = view[8 + header_len :]
    metadata = header.pop(METADATA_KEY, None)
    if metadata is None:  # absent, or null (which safetensors accepts too)
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireFormatError("__metadata__ must map strings to strings")
    tensors: dict[str, RawTensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        dtype, shape, start, end = _parse_entry(name, info)
        spans.append((start, end, name))
        tensors[name] = RawTensor(dtype, shape, data[start:end])
    _check_spans_tile(spans, data.nbytes)
    return Container(tensors, metadata)


def _read_header(view: memoryview) -> tuple[dict[str, Any], int]:
    """The container's JSON header (an object) and its length, checked against the buffer."""
    if view.nbytes < 8:
        raise WireFormatError(f"container truncated: {view.nbytes} bytes, need at least 8")
    header_len = int.from_bytes(view[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise WireFormatError(f"header length {header_len} exceeds {MAX_HEADER_BYTES}")
    if 8 + header_len > view.nbytes:
        raise WireFormatError(
            f"header length {header_len} runs past the end of a {view.nbytes}-byte container"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]).decode("utf-8"), object_pairs_hook=unique_keys)
    except WireFormatError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireFormatError(f"container header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireFormatError("container header must be a JSON object")
    return header, header_len


def _check_spans_tile(spans: list[tuple[int, int, str]], nbytes: int) -> None:
    """The entries' byte ranges cover the data exactly: no overlap, no gap, nothing past the end."""
    spans.sort()
    position = 0
    for start, end, name in spans:
        if start != position:
            problem = "overlaps the previous tensor" if start < position else "leaves a gap"
            raise WireFormatError(f"{name!r}: data_offsets start at {start}, {problem}")
        position = end
    if position != nbytes:
        raise WireFormatError(f"tensor data covers {position} bytes but the container carries {nbytes}")
