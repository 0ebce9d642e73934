"""The wire format: a bundle of shards as one safetensors container.

Layout (the safetensors spec): 8-byte little-endian header length, a UTF-8 JSON
header, then the raw tensor bytes. Tensors are named ``task_id/field``; JSON
(non-tensor) shards ride in the header's ``__metadata__`` under the same names,
as JSON text. Nothing here pickles, evaluates or base64-encodes anything.

Two layers: the *raw* layer (`parse_container`, `build_container`) works on
dtype names, shapes and bytes and needs no torch, so a worker can validate,
store and serve shards without ever materialising a tensor; the *torch* layer
(`encode_bundle`, `decode_bundle`) converts to and from tensors, zero-copy on
decode when the buffer is writable.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from distbatch.errors import InvalidIdError, WireFormatError
from distbatch.gc_pause import paused_gc
from distbatch.ids import ShardKey, parse_wire_name, validate_key

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_DIMS = 64
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
_DATA_ALIGNMENT = max(ITEMSIZE.values())

_TORCH_DTYPE_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex64": "C64",
    "complex128": "C128",
}


class RawTensor(NamedTuple):
    """A tensor as the wire sees it: dtype name, shape and C-contiguous bytes.

    A NamedTuple, not a frozen dataclass: one is made per shard on every hot
    path, and a frozen dataclass's __init__ costs several times more.
    """

    dtype: str
    shape: tuple[int, ...]
    data: Buffer

    @property
    def nbytes(self) -> int:
        # From dtype and shape: re-exporting `data`'s buffer costs tens of microseconds
        # (numpy-backed views), which added up to most of a put's time for small shards.
        # Parsing checks that the byte span matches; tensor_to_raw builds it that way.
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(slots=True)
class Container:
    """A parsed container: tensors as `RawTensor`, JSON shards as their JSON text."""

    tensors: dict[ShardKey, RawTensor]
    json_texts: dict[ShardKey, str]
    # (start, end, key) of every tensor in data order, and the data region they index:
    # lets a decoder turn a run of same-dtype tensors into tensors with one call.
    layout: list[tuple[int, int, ShardKey]] = field(default_factory=list)
    data: memoryview | None = None
    # JSON shards as values, parsed once while validating.
    json_values: dict[ShardKey, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tensors) + len(self.json_texts)


# --------------------------------------------------------------------------- raw layer


def build_container(
    tensors: Mapping[ShardKey, RawTensor], json_texts: Mapping[ShardKey, str]
) -> list[Buffer]:
    """Lay out a container; returns its parts (header first) to send or join.

    Tensors are ordered by element size, largest first, so that every tensor's
    data starts aligned to its element size (the header is padded so the data
    starts at a multiple of the largest element size, 16 for C128),
    which keeps zero-copy decoding aligned without breaking the spec's rule
    that the byte buffer has no holes.
    """
    metadata = {"format": "pt"}
    for key, text in json_texts.items():
        metadata[key.wire_name()] = text
    entries = [f'"{METADATA_KEY}":' + json.dumps(metadata, separators=(",", ":"), ensure_ascii=False)]
    parts: list[Buffer] = [b""]
    offset = 0
    # Same-dtype tensors stay adjacent too, so a decoder can take each run in one call.
    ordered = sorted(tensors.items(), key=lambda item: (-ITEMSIZE[item[1].dtype], item[1].dtype))
    for (task_id, field_name), raw in ordered:
        nbytes = raw.nbytes
        # Written directly rather than through json.dumps of a dict per tensor (the
        # worker's hottest line when serving many shards). Ids and dtype names come
        # from alphabets that need no JSON escaping; the text equals json.dumps's.
        shape = ",".join(map(str, raw.shape))
        entries.append(
            f'"{task_id}/{field_name}":{{"dtype":"{raw.dtype}","shape":[{shape}],'
            f'"data_offsets":[{offset},{offset + nbytes}]}}'
        )
        if nbytes:
            parts.append(raw.data)
        offset += nbytes
    try:
        header_bytes = ("{" + ",".join(entries) + "}").encode()
    except UnicodeEncodeError as exc:
        raise WireFormatError(f"JSON value is not valid UTF-8: {exc}") from None
    header_bytes += b" " * (-(8 + len(header_bytes)) % _DATA_ALIGNMENT)
    parts[0] = len(header_bytes).to_bytes(8, "little") + header_bytes
    return parts


def join_parts(parts: list[Buffer]) -> bytes:
    return b"".join(parts)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise WireFormatError(f"duplicate key {key!r} in container header")
        out[key] = value
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_tensor_entry(name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    # Fast path for a well-formed entry; anything else takes the careful path below,
    # which says exactly what is wrong. (`type(x) is int` also rules out bool.)
    if type(info) is dict:
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if (
            type(dtype) is str
            and dtype in ITEMSIZE
            and type(shape) is list
            and len(shape) <= MAX_DIMS
            and type(offsets) is list
            and len(offsets) == 2
        ):
            start, end = offsets
            if type(start) is int and type(end) is int and 0 <= start <= end:
                count = 1
                for dim in shape:
                    if type(dim) is not int or dim < 0:
                        break
                    count *= dim
                else:
                    if end - start == count * ITEMSIZE[dtype]:
                        return dtype, tuple(shape), start, end
    return _parse_tensor_entry_checked(name, info)


def _parse_tensor_entry_checked(name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
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
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != expected:
        raise WireFormatError(
            f"{name!r}: data_offsets span {offsets[1] - offsets[0]} bytes, "
            f"dtype {dtype} and shape {shape} need {expected}"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def parse_container(buf: Buffer) -> Container:
    """Validate a container and split it into raw shards (views into `buf`, no copies).

    Every malformation raises `WireFormatError`: truncation, a header length
    past the end, bad JSON, unknown dtypes, sizes that do not match shapes,
    overlapping / out-of-range / gapped offsets, invalid ids.
    """
    with paused_gc():
        return _parse_container(buf)


def _parse_container(buf: Buffer) -> Container:
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
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
        header = json.loads(
            bytes(view[8 : 8 + header_len]).decode("utf-8"), object_pairs_hook=_reject_duplicates
        )
    except WireFormatError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireFormatError(f"container header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireFormatError("container header must be a JSON object")
    data = view[8 + header_len :]
    metadata = header.pop(METADATA_KEY, None)
    if metadata is None:  # absent, or null (which safetensors accepts too)
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireFormatError("__metadata__ must map strings to strings")

    try:
        tensors: dict[ShardKey, RawTensor] = {}
        spans: list[tuple[int, int, ShardKey]] = []
        for name, info in header.items():
            key = parse_wire_name(name)
            dtype, shape, start, end = _parse_tensor_entry(name, info)
            spans.append((start, end, key))
            tensors[key] = RawTensor(dtype, shape, data[start:end])
        json_texts: dict[ShardKey, str] = {}
        json_values: dict[ShardKey, Any] = {}
        for name, text in metadata.items():
            if "/" not in name:
                continue  # free-form metadata such as "format"
            key = parse_wire_name(name)
            if key in tensors:
                raise WireFormatError(f"{name!r} is both a tensor and a JSON value")
            if not text.isascii():
                _check_utf8(name, text)
            json_values[key] = _load_json_text(name, text)
            json_texts[key] = text
    except InvalidIdError as exc:
        raise WireFormatError(str(exc)) from None

    spans.sort()
    position = 0
    for start, end, key in spans:
        if start != position:
            problem = "overlaps the previous tensor" if start < position else "leaves a gap"
            raise WireFormatError(f"{key.wire_name()!r}: data_offsets start at {start}, {problem}")
        position = end
    if position != data.nbytes:
        raise WireFormatError(f"tensor data covers {position} bytes but the container carries {data.nbytes}")
    return Container(tensors, json_texts, spans, data, json_values)


def _check_utf8(name: str, text: str) -> None:
    # A \ud800 escape in the header decodes to a lone surrogate, which no UTF-8 encoder accepts.
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise WireFormatError(f"{name!r}: JSON value is not valid UTF-8: {exc}") from None


def _load_json_text(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise WireFormatError(f"{name!r}: invalid JSON value: {exc}") from None


# --------------------------------------------------------------------------- torch layer


@functools.cache
def _torch_dtype_table() -> tuple[dict[Any, str], dict[str, Any]]:
    import torch

    to_name: dict[Any, str] = {}
    for attr, name in _TORCH_DTYPE_NAMES.items():
        dtype = getattr(torch, attr, None)
        if isinstance(dtype, torch.dtype):
            to_name[dtype] = name
    return to_name, {name: dtype for dtype, name in to_name.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (`WireFormatError` if it has none)."""
    try:
        return _torch_dtype_table()[0][dtype]
    except KeyError:
        raise WireFormatError(f"unsupported tensor dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name (`WireFormatError` if this torch lacks it)."""
    try:
        return _torch_dtype_table()[1][name]
    except KeyError:
        raise WireFormatError(f"dtype {name!r} is not available in this torch build") from None


def tensor_problem(tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be stored or sent, or None if it can; callers prefix the field's name.

    Only dense (strided) tensors with data, of a dtype in `ITEMSIZE`, travel:
    sparse, nested, quantized and meta tensors do not.
    """
    import torch

    if tensor.is_nested:
        return "a nested tensor cannot be stored: pass its components as a list of tensors (a ragged field)"
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor cannot be stored, only a dense one: call .to_dense() first"
    if tensor.device.type == "meta":
        return "a tensor on the meta device holds no data to store"
    if tensor.dtype not in _torch_dtype_table()[0]:
        hint = ": call .dequantize() first" if tensor.is_quantized else ""
        return f"a {tensor.dtype} tensor cannot be stored{hint}"
    return None


def tensor_to_raw(tensor: torch.Tensor) -> RawTensor:
    """Describe a tensor's bytes without copying when it is already a contiguous CPU tensor."""
    import torch

    if tensor.layout != torch.strided or tensor.is_nested:
        raise WireFormatError(str(tensor_problem(tensor)))
    name = dtype_name(tensor.dtype)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        if tensor.device.type == "meta":
            raise WireFormatError(str(tensor_problem(tensor)))
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    shape = tuple(tensor.shape)
    if tensor.numel() == 0:
        return RawTensor(name, shape, b"")
    flat = tensor.reshape(-1).view(torch.uint8)
    return RawTensor(name, shape, memoryview(flat.numpy()))


def raw_to_tensor(raw: RawTensor) -> torch.Tensor:
    """A tensor over `raw.data` (zero-copy when the buffer is writable)."""
    import torch

    dtype = torch_dtype(raw.dtype)
    if raw.nbytes == 0:
        return torch.empty(raw.shape, dtype=dtype)
    tensor = torch.frombuffer(raw.data, dtype=dtype)
    if tensor.data_ptr() % tensor.element_size():
        # The spec allows unaligned offsets; copy rather than hand out an unaligned tensor.
        tensor = torch.frombuffer(raw.data, dtype=torch.uint8).clone().view(dtype)
    return tensor.reshape(raw.shape)


def _check_json(value: Any, depth: int = 0) -> Any:
    """Return `value` as plain JSON types, or raise if it would not round-trip exactly."""
    if depth > MAX_JSON_DEPTH:
        raise WireFormatError(f"JSON value nested deeper than {MAX_JSON_DEPTH}")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_check_json(v, depth + 1) for v in value]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise WireFormatError(f"JSON object keys must be strings, got {k!r}")
        return {k: _check_json(v, depth + 1) for k, v in value.items()}
    name = type(value).__name__
    if type(value).__module__.partition(".")[0] in ("torch", "numpy"):  # no torch import: raw layer
        # A shard value is a tensor or JSON; a tensor cannot be *part of* a JSON value.
        raise WireFormatError(
            f"a {name} cannot be part of a JSON value (str, int, float, bool, None, lists and dicts "
            "of those): make the tensor a value of its own, or convert it with .tolist() / .item()"
        )
    raise WireFormatError(
        f"cannot send a value of type {name}: a value is a torch.Tensor or JSON "
        "(str, int, float, bool, None, lists and dicts of those)"
    )


def find_non_json(value: Any) -> tuple[str, Any]:
    """The first part of `value` that JSON cannot hold: its path (`['key'][0]`, "" for `value`) and it.

    For a dict with a non-string key, the dict itself. Only called once encoding
    failed (it walks the value again), so the hot path pays nothing.
    """
    path = ""
    for _ in range(MAX_JSON_DEPTH + 2):
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                return path, value
            bad = next(((k, v) for k, v in value.items() if _not_json(v)), None)
        elif isinstance(value, (list, tuple)):
            bad = next(((i, v) for i, v in enumerate(value) if _not_json(v)), None)
        else:
            return path, value
        if bad is None:  # too deep: the container itself is the problem
            return path, value
        path, value = f"{path}[{bad[0]!r}]", bad[1]
    return path, value


def _not_json(value: Any) -> bool:
    try:
        _check_json(value)
    except WireFormatError:
        return True
    return False


def is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def value_to_wire(value: Any) -> RawTensor | str:
    """One shard value as a `RawTensor` (tensors, numpy arrays) or JSON text."""
    import torch

    if isinstance(value, torch.Tensor):
        return tensor_to_raw(value)
    if type(value).__module__ == "numpy" and hasattr(value, "__array_interface__"):
        if getattr(value, "ndim", 0) or type(value).__name__ == "ndarray":
            if any(stride < 0 for stride in value.strides):
                value = value.copy()  # torch.from_numpy refuses negative strides
            try:
                return tensor_to_raw(torch.from_numpy(value))
            except TypeError:
                raise WireFormatError(f"unsupported numpy dtype {value.dtype}") from None
    checked = _check_json(value)
    try:
        return json.dumps(checked, separators=(",", ":"), ensure_ascii=False)
    except ValueError as exc:  # e.g. an int longer than sys.get_int_max_str_digits()
        raise WireFormatError(f"cannot encode JSON value: {exc}") from None


def split_values(
    shards: Mapping[Any, Any],
) -> tuple[dict[ShardKey, RawTensor], dict[ShardKey, str]]:
    """Validate keys and convert values; the raw layer's input."""
    import torch

    by_dtype: dict[str, list[tuple[ShardKey, Any]]] = {}
    json_texts: dict[ShardKey, str] = {}
    for key, value in shards.items():
        try:
            shard_key = validate_key(key)
        except InvalidIdError as exc:
            raise WireFormatError(str(exc)) from None
        try:
            if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested:
                by_dtype.setdefault(dtype_name(value.dtype), []).append((shard_key, value))
                continue
            encoded = value_to_wire(value)
        except WireFormatError as exc:
            raise WireFormatError(shard_problem(shard_key, value, exc)) from None
        if isinstance(encoded, RawTensor):
            by_dtype.setdefault(encoded.dtype, []).append((shard_key, raw_to_tensor(encoded)))
        else:
            json_texts[shard_key] = encoded
    tensors: dict[ShardKey, RawTensor] = {}
    for name, items in by_dtype.items():
        try:
            tensors.update(_pack_same_dtype(name, items))
        except RuntimeError as exc:  # e.g. NotImplementedError: a meta tensor has no data to copy
            for shard_key, tensor in items:
                if tensor_problem(tensor) is not None:
                    raise WireFormatError(shard_problem(shard_key, tensor, exc)) from None
            raise
    return tensors, json_texts


def shard_problem(key: ShardKey, value: Any, exc: Exception) -> str:
    """What is wrong with one shard's value, naming its task and field (and the spot inside JSON)."""
    name = f"task {key.task_id!r}, field {key.field!r}"
    if is_tensor(value) and (problem := tensor_problem(value)) is not None:
        return f"{name}: {problem}"
    where = find_non_json(value)[0] if isinstance(value, (dict, list, tuple)) else ""
    return f"{name}{', at ' + where if where else ''}: {exc}"


def encode_bundle(shards: Mapping[Any, Any]) -> list[Buffer]:
    """Encode `{(task_id, field): value}` as container parts (join them to get the bytes)."""
    with paused_gc():
        tensors, json_texts = split_values(shards)
        return build_container(tensors, json_texts)


def _pack_same_dtype(name: str, items: list[tuple[ShardKey, Any]]) -> dict[ShardKey, RawTensor]:
    """Tensors of one dtype as `RawTensor`s over one packed buffer (one `cat`, one copy).

    Per-tensor byte export cost more than the data for small shards; packing
    also moves GPU tensors to the host in one transfer per dtype and device.
    """
    import torch

    with torch.no_grad():
        flats = []
        for _, tensor in items:
            if tensor.is_conj() or tensor.is_neg():
                tensor = tensor.resolve_conj().resolve_neg()
            flats.append(tensor.reshape(-1))
        by_device: dict[Any, list[int]] = {}
        for index, flat in enumerate(flats):
            by_device.setdefault(flat.device, []).append(index)
        out: dict[ShardKey, RawTensor] = {}
        for indexes in by_device.values():
            group = [flats[k] for k in indexes]
            packed = torch.cat(group) if len(group) > 1 else group[0].contiguous()
            packed = packed.cpu()
            buffer = memoryview(packed.view(torch.uint8).numpy()) if packed.numel() else memoryview(b"")
            itemsize = ITEMSIZE[name]
            offset = 0
            for k, flat in zip(indexes, group):
                nbytes = flat.numel() * itemsize
                key, tensor = items[k]
                out[key] = RawTensor(name, tuple(tensor.shape), buffer[offset : offset + nbytes])
                offset += nbytes
    return out


def encode_bundle_bytes(shards: Mapping[Any, Any]) -> bytes:
    """Encode a bundle into one `bytes` object."""
    return join_parts(encode_bundle(shards))


def decode_bundle(buf: Buffer) -> dict[ShardKey, Any]:
    """Decode a container into `{ShardKey: tensor | JSON value}`.

    Tensors share memory with `buf` when it is writable (a `bytearray`); a
    read-only buffer (`bytes`) is copied once first, so no tensor ever aliases
    immutable memory.
    """
    if memoryview(buf).readonly:
        buf = bytearray(buf)
    with paused_gc():
        container = _parse_container(buf)
        out: dict[ShardKey, Any] = _decode_tensor_runs(container)
        out.update(container.json_values)
    return out


def _decode_tensor_runs(container: Container) -> dict[ShardKey, Any]:
    """Tensors of a parsed container, one `frombuffer` per run of same-dtype tensors.

    Per-shard Python work dominated decoding of bundles of many small shards;
    a run becomes one flat tensor, then `split` (one C call) makes the views.
    """
    import torch

    out: dict[ShardKey, Any] = {}
    layout, tensors = container.layout, container.tensors
    i = 0
    while i < len(layout):
        dtype = tensors[layout[i][2]].dtype
        j = i
        while j + 1 < len(layout) and tensors[layout[j + 1][2]].dtype == dtype:
            j += 1
        run = layout[i : j + 1]
        i = j + 1
        start, end = run[0][0], run[-1][1]
        itemsize = ITEMSIZE[dtype]
        if end == start or container.data is None:
            for _, _, key in run:
                out[key] = raw_to_tensor(tensors[key])
            continue
        flat = raw_to_tensor(RawTensor(dtype, ((end - start) // itemsize,), container.data[start:end]))
        counts = [(e - s) // itemsize for s, e, _ in run]
        for (_, _, key), piece in zip(run, torch.split(flat, counts)):
            shape = tensors[key].shape
            out[key] = piece if len(shape) == 1 else piece.view(shape)
    return {key: out[key] for key in tensors}  # the header's order, not the data's
