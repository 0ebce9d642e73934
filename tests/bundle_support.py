"""Test helpers for the columnar wire format, shared by the library and worker tests.

Bundles here are written by the `safetensors` package (or, where it cannot write the
case, by a few lines of container layout below), never by `distbatch.wire`: a test
that feeds them to our decoder or to a worker checks the format as documented, not
our encoder against itself.

`GOOD` is one bundle using every part of the format (uniform, ragged and general
layouts, partial fields with `rows`, JSON fields, a field split over `field#k`
columns); `GOOD_VALUES` is what it decodes to. `MALFORMED_BUNDLES` holds bundles
that are valid safetensors containers but break one rule of the bundle format each,
most of them `GOOD` with one thing changed.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import safetensors.numpy

VERSION = 2  # the bundle format version these helpers write (stated here, not read from wire.py)


class Raw(NamedTuple):
    """A tensor entry numpy cannot hold (a shape too large to allocate even with no bytes)."""

    dtype: str
    shape: list[int]
    data: bytes = b""


def container(header: Any, data: bytes = b"", *, length: int | None = None, pad: bool = True) -> bytes:
    """Hand-assemble a container: 8-byte LE header length + header (JSON-dumped unless bytes) + data."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        head += b" " * (-(8 + len(head)) % 8)
    size = len(head) if length is None else length
    return size.to_bytes(8, "little") + head + data


def split_container(buf: bytes) -> tuple[dict[str, Any], bytes]:
    header_len = int.from_bytes(buf[:8], "little")
    return json.loads(buf[8 : 8 + header_len]), buf[8 + header_len :]


def describe(task_ids: Any, fields: Any, version: Any = VERSION) -> str:
    """The `__metadata__["distbatch"]` text of a bundle."""
    return json.dumps({"version": version, "task_ids": task_ids, "fields": fields})


_NUMPY_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex64": "C64",
    "complex128": "C128",
}


def _hand_save(tensors: dict[str, Any], metadata: dict[str, str]) -> bytes:
    """What `safetensors.numpy.save` writes, for entries it cannot take (`Raw` ones)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    data = b""
    for name, value in tensors.items():
        if not isinstance(value, Raw):
            array = np.ascontiguousarray(value)
            value = Raw(_NUMPY_NAMES[array.dtype.name], list(array.shape), array.tobytes())
        header[name] = {
            "dtype": value.dtype,
            "shape": value.shape,
            "data_offsets": [len(data), len(data) + len(value.data)],
        }
        data += value.data
    return container(header, data)


def forge(
    task_ids: Any = None,
    fields: Any = None,
    tensors: dict[str, Any] | None = None,
    json_fields: dict[str, Any] | None = None,
    *,
    metadata: dict[str, str] | None = None,
    description: str | None = None,
) -> bytes:
    """A bundle written by `safetensors.numpy.save`: `tensors` (arrays, or lists numpy takes as
    int64) under their entry names, each `json_fields[f]` (a list, or the text itself) as
    `json/<f>`, `description` (default: `describe(task_ids, fields)`) as `distbatch`, plus any
    `metadata`. Entries given as `Raw`, or metadata no Rust string holds, are laid out by hand."""
    meta: dict[str, str] = {}
    if description is not None or task_ids is not None:
        meta["distbatch"] = description if description is not None else describe(task_ids, fields)
    for name, value in (json_fields or {}).items():
        meta[f"json/{name}"] = value if isinstance(value, str) else json.dumps(value)
    meta.update(metadata or {})
    arrays = {
        k: v if isinstance(v, (Raw, np.ndarray)) else np.asarray(v, dtype=np.int64)
        for k, v in (tensors or {}).items()
    }
    if any(isinstance(v, Raw) for v in arrays.values()) or not all(_encodable(t) for t in meta.values()):
        return _hand_save(arrays, meta)
    return safetensors.numpy.save(arrays, metadata=meta)


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------------- the good bundle


def good_spec() -> dict[str, Any]:
    """The parts of `GOOD` (a fresh copy each call, for a test to change one of them)."""
    return {
        "task_ids": ["t0", "t1", "t2"],
        "fields": {
            "u": {"dtype": "F32", "layout": "uniform"},
            "r": {"dtype": "I64", "layout": "ragged"},
            "g": {"dtype": "U8", "layout": "general"},
            "p": {"dtype": "I32", "layout": "uniform", "rows": True},
            "j": {"dtype": None},
            "k": {"dtype": None, "rows": True},
            "q": {"dtype": "I16", "layout": "uniform", "rows": True},
            "q#1": {"dtype": None, "rows": True},
        },
        "tensors": {
            "u": np.arange(6, dtype=np.float32).reshape(3, 2) / 4,
            "r": np.arange(6, dtype=np.int64).reshape(3, 2),
            "r/lengths": [1, 0, 2],
            "g": np.arange(7, dtype=np.uint8),
            "g/ranks": [2, 0, 1],
            "g/dims": [[2, 3], [0, 0], [0, 0]],
            "p": np.array([7, -9], dtype=np.int32),
            "p/rows": [2, 0],  # any order: the rows say which task each value is
            "k/rows": [1],
            "q": np.array([[1, 2, 3]], dtype=np.int16),
            "q/rows": [0],
            "q#1/rows": [1, 2],
        },
        "json": {"j": [1, "two", None], "k": [{"a": [1.5, -0.0]}], "q#1": ["x", [True]]},
        "metadata": {"format": "pt"},
    }


def forge_spec(spec: dict[str, Any]) -> bytes:
    return forge(
        spec.get("task_ids"),
        spec.get("fields"),
        spec["tensors"],
        spec["json"],
        metadata=spec["metadata"],
        description=spec.get("description"),
    )


GOOD = forge_spec(good_spec())

# (task_id, field) -> the value GOOD decodes to: numpy arrays for tensors, else JSON.
GOOD_VALUES: dict[tuple[str, str], Any] = {
    ("t0", "u"): np.array([0.0, 0.25], dtype=np.float32),
    ("t1", "u"): np.array([0.5, 0.75], dtype=np.float32),
    ("t2", "u"): np.array([1.0, 1.25], dtype=np.float32),
    ("t0", "r"): np.array([[0, 1]], dtype=np.int64),
    ("t1", "r"): np.zeros((0, 2), dtype=np.int64),
    ("t2", "r"): np.array([[2, 3], [4, 5]], dtype=np.int64),
    ("t0", "g"): np.arange(6, dtype=np.uint8).reshape(2, 3),
    ("t1", "g"): np.array(6, dtype=np.uint8),
    ("t2", "g"): np.zeros((0,), dtype=np.uint8),
    ("t2", "p"): np.array(7, dtype=np.int32),
    ("t0", "p"): np.array(-9, dtype=np.int32),
    ("t0", "j"): 1,
    ("t1", "j"): "two",
    ("t2", "j"): None,
    ("t1", "k"): {"a": [1.5, -0.0]},
    ("t0", "q"): np.array([1, 2, 3], dtype=np.int16),
    ("t1", "q"): "x",
    ("t2", "q"): [True],
}


def bundle_keys(bundle: Any) -> list[tuple[str, str]]:
    """The (task_id, field) keys a parsed `wire.Bundle` holds, from its raw columns."""
    keys = []
    for name, column in bundle.columns.items():
        field = name.partition("#")[0]
        rows = range(len(bundle.task_ids)) if column.rows is None else column.rows.tolist()
        keys += [(bundle.task_ids[r], field) for r in rows]
    return keys


# --------------------------------------------------------------------------- malformed bundles

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    """Set `spec[a][b]...` for a path `a.b...` (keys may hold `/`, not `.`)."""

    def apply(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = spec
        for key in parents:
            node = node[key]
        node[last] = value

    return apply


def _drop(path: str) -> Mutation:
    def apply(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = spec
        for key in parents:
            node = node[key]
        del node[last]

    return apply


def _rename(old: str, new: str) -> Mutation:
    """Give field `old` the name `new` everywhere (description, entries, JSON)."""

    def apply(spec: dict[str, Any]) -> None:
        spec["fields"] = {new if k == old else k: v for k, v in spec["fields"].items()}
        spec["tensors"] = {
            (new + k[len(old) :] if k == old or k.startswith(old + "/") else k): v
            for k, v in spec["tensors"].items()
        }
        spec["json"] = {new if k == old else k: v for k, v in spec["json"].items()}

    return apply


def _all(*steps: Mutation) -> Mutation:
    def apply(spec: dict[str, Any]) -> None:
        for step in steps:
            step(spec)

    return apply


def _raw_description(text: str) -> Mutation:
    return _set("description", text)


def _with_description(**changes: Any) -> Mutation:
    """Replace or drop (value `...`) top-level keys of the description object."""

    def apply(spec: dict[str, Any]) -> None:
        body = {"version": VERSION, "task_ids": spec["task_ids"], "fields": spec["fields"]}
        for key, value in changes.items():
            if value is ...:
                del body[key]
            else:
                body[key] = value
        spec["description"] = json.dumps(body)

    return apply


def _no_description(spec: dict[str, Any]) -> None:
    spec.pop("task_ids")
    spec.pop("fields")


_GOOD_DESCRIPTION = describe(good_spec()["task_ids"], good_spec()["fields"])
_LIMIT = sys.get_int_max_str_digits() or 4300
BAD_IDS = {
    "slash": "a/b",
    "traversal": "../x",
    "empty": "",
    "space": "a b",
    "tab": "a\tb",
    "newline-inside": "a\nb",  # passed a one-regex check of the newline-joined ids
    "newline-end": "ab\n",
    "nul": "a\x00",
    "unicode": "é",
    "201-chars": "x" * 201,
    "hash": "a#1",
    "backslash": "a\\b",
    "comma": "a,b",
}

MUTATIONS: dict[str, Mutation] = {
    # the description
    "no-description": _no_description,
    "no-description-json-only": _all(_no_description, _set("tensors", {})),
    "no-description-tables-only": _all(
        _no_description, _set("tensors", {"r/lengths": [1]}), _set("json", {})
    ),
    "description-invalid-json": _raw_description(_GOOD_DESCRIPTION[:-1]),
    "description-empty": _raw_description(""),
    "description-array": _raw_description("[]"),
    "description-null": _raw_description("null"),
    "description-string": _raw_description('"bundle"'),
    "description-python-literal": _raw_description(_GOOD_DESCRIPTION.replace("null", "None")),
    "description-duplicate-key": _raw_description(
        _GOOD_DESCRIPTION[:-1] + ', "task_ids": ["t0", "t1", "t9"]}'
    ),
    "description-duplicate-field": _raw_description(
        _GOOD_DESCRIPTION.replace('"u": {', '"u": {"dtype": "F32", "layout": "ragged"}, "u": {', 1)
    ),
    "description-lone-surrogate": _raw_description(_GOOD_DESCRIPTION.replace('"t2"', '"t2\ud800"')),
    "version-missing": _with_description(version=...),
    "version-1": _with_description(version=1),
    "version-3": _with_description(version=3),
    "version-string": _with_description(version="2"),
    "version-null": _with_description(version=None),
    "task-ids-missing": _with_description(task_ids=...),
    "task-ids-string": _with_description(task_ids="t0"),
    "task-ids-object": _with_description(task_ids={"t0": 0}),
    "task-ids-null": _with_description(task_ids=None),
    "task-id-number": _with_description(task_ids=["t0", 1, "t2"]),
    "task-id-null": _with_description(task_ids=["t0", None, "t2"]),
    "task-id-list": _with_description(task_ids=["t0", ["t1"], "t2"]),
    "task-ids-duplicate": _with_description(task_ids=["t0", "t1", "t0"]),
    "fields-missing": _with_description(fields=...),
    "fields-array": _with_description(fields=[["u", {"dtype": "F32", "layout": "uniform"}]]),
    "fields-null": _with_description(fields=None),
    "field-info-string": _set("fields.u", "F32"),
    "field-info-null": _set("fields.u", None),
    "field-info-list": _set("fields.u", ["F32", "uniform"]),
    # column names
    **{f"task-id-{label}": _set("task_ids", ["t0", bad, "t2"]) for label, bad in BAD_IDS.items()},
    **{f"field-name-{label}": _rename("u", bad) for label, bad in BAD_IDS.items() if bad != "a#1"},
    **{f"json-field-name-{label}": _rename("j", bad) for label, bad in BAD_IDS.items() if bad != "a#1"},
    "field-name-table-suffix": _rename("u", "u/lengths"),
    "layer-zero": _rename("q#1", "q#0"),
    "layer-leading-zero": _rename("q#1", "q#01"),
    "layer-empty": _rename("q#1", "q#"),
    "layer-letters": _rename("q#1", "q#a"),
    "layer-negative": _rename("q#1", "q#-1"),
    "layer-twice": _rename("q#1", "q#1#2"),
    "layer-five-digits": _rename("q#1", "q#10000"),
    "layer-space": _rename("q#1", "q# 1"),
    "layer-no-field": _rename("q#1", "#1"),
    "layer-bad-field": _rename("q#1", "q/x#1"),
    "layers-overlap": _set("tensors.q#1/rows", [0, 2]),
    "layers-both-whole": _all(
        _set("fields.q", {"dtype": "I16", "layout": "uniform"}),
        _set("tensors.q", np.zeros((3, 3), dtype=np.int16)),
        _drop("tensors.q/rows"),
    ),
    # dtypes and data entries
    "dtype-unknown": _set("fields.u.dtype", "F128"),
    "dtype-torch-name": _set("fields.u.dtype", "float32"),
    "dtype-lowercase": _set("fields.u.dtype", "f32"),
    "dtype-number": _set("fields.u.dtype", 4),
    "dtype-list": _set("fields.u.dtype", ["F32"]),
    "dtype-mismatch": _set("fields.u.dtype", "F64"),
    "dtype-mismatch-same-size": _set("fields.u.dtype", "I32"),
    "data-missing": _drop("tensors.u"),
    "data-missing-with-rows": _drop("tensors.p"),
    "layout-missing": _drop("fields.u.layout"),
    "layout-unknown": _set("fields.u.layout", "packed"),
    "layout-null": _set("fields.u.layout", None),
    "layout-general-without-tables": _set("fields.u.layout", "general"),
    "layout-ragged-without-lengths": _set("fields.u.layout", "ragged"),
    # uniform
    "uniform-too-few-rows": _set("tensors.u", np.zeros((2, 2), dtype=np.float32)),
    "uniform-too-many-rows": _set("tensors.u", np.zeros((4, 2), dtype=np.float32)),
    "uniform-0d": _set("tensors.u", np.array(1.0, dtype=np.float32)),
    "uniform-rows-count-mismatch": _set("tensors.p", np.array([1, 2, 3], dtype=np.int32)),
    # ragged
    "lengths-missing": _drop("tensors.r/lengths"),
    "lengths-too-few": _set("tensors.r/lengths", [1, 2]),
    "lengths-too-many": _set("tensors.r/lengths", [1, 0, 2, 0]),
    "lengths-i32": _set("tensors.r/lengths", np.array([1, 0, 2], dtype=np.int32)),
    "lengths-u64": _set("tensors.r/lengths", np.array([1, 0, 2], dtype=np.uint64)),
    "lengths-f64": _set("tensors.r/lengths", np.array([1, 0, 2], dtype=np.float64)),
    "lengths-2d": _set("tensors.r/lengths", [[1, 0, 2]]),
    "lengths-0d": _set("tensors.r/lengths", np.array(3, dtype=np.int64)),
    "lengths-negative": _set("tensors.r/lengths", [2, -1, 2]),
    "lengths-sum-short": _set("tensors.r/lengths", [1, 0, 1]),
    "lengths-sum-long": _set("tensors.r/lengths", [1, 1, 2]),
    # numpy's int64 sum of these wraps around to 2**62, the data's first dimension
    "lengths-sum-wraps": _all(
        _set("fields.r.dtype", "U8"),
        _set("tensors.r", Raw("U8", [2**62, 0])),
        _set("tensors.r/lengths", [2**63 - 1, 2**63 - 1, 2**62 + 2]),
    ),
    "ragged-0d-data": _set("tensors.r", np.array(5, dtype=np.int64)),
    # general
    "ranks-missing": _drop("tensors.g/ranks"),
    "dims-missing": _drop("tensors.g/dims"),
    "ranks-too-few": _set("tensors.g/ranks", [2, 0]),
    "ranks-2d": _set("tensors.g/ranks", [[2, 0, 1]]),
    "ranks-i32": _set("tensors.g/ranks", np.array([2, 0, 1], dtype=np.int32)),
    "ranks-negative": _set("tensors.g/ranks", [2, -1, 1]),
    "rank-past-width": _set("tensors.g/ranks", [3, 0, 1]),
    "rank-huge": _set("tensors.g/ranks", [2**62, 0, 1]),
    "dims-1d": _set("tensors.g/dims", [2, 3, 0, 0, 0, 0]),
    "dims-3d": _set("tensors.g/dims", [[[2, 3]], [[0, 0]], [[0, 0]]]),
    "dims-too-few-rows": _set("tensors.g/dims", [[2, 3], [0, 0]]),
    "dims-f64": _set("tensors.g/dims", np.array([[2, 3], [0, 0], [0, 0]], dtype=np.float64)),
    "dims-negative": _set("tensors.g/dims", [[-2, -3], [0, 0], [0, 0]]),
    "dims-past-rank": _set("tensors.g/dims", [[2, 3], [5, 0], [0, 0]]),
    "dims-too-wide": _all(
        _set("tensors.g/dims", np.zeros((3, 65), dtype=np.int64)),
        _set("tensors.g/ranks", [0, 0, 0]),
        _set("tensors.g", np.zeros(3, dtype=np.uint8)),
    ),
    "general-data-short": _set("tensors.g", np.zeros(6, dtype=np.uint8)),
    "general-data-long": _set("tensors.g", np.zeros(8, dtype=np.uint8)),
    "general-data-2d": _set("tensors.g", np.zeros((7, 1), dtype=np.uint8)),
    "general-data-0d": _all(
        _set("tensors.g", np.array(1, dtype=np.uint8)),
        _set("tensors.g/ranks", [0, 0, 0]),
        _set("tensors.g/dims", np.zeros((3, 2), dtype=np.int64)),
    ),
    # a row's element count wraps around int64 to 0: 2**32 * 2**32 elements claimed, none sent
    "general-count-wraps": _all(
        _set("tensors.g/dims", [[2**32, 2**32], [0, 0], [0, 0]]),
        _set("tensors.g", np.zeros(1, dtype=np.uint8)),
    ),
    # no elements, but a shape no tensor can take (its strides overflow int64)
    "general-span-too-large": _all(
        _set("tensors.g/ranks", [3, 0, 1]),
        _set("tensors.g/dims", [[2**40, 2**30, 0], [0, 0, 0], [0, 0, 0]]),
        _set("tensors.g", np.zeros(1, dtype=np.uint8)),
    ),
    # rows
    "rows-flag-one": _set("fields.p.rows", 1),
    "rows-flag-string": _set("fields.p.rows", "yes"),
    "rows-flag-null": _set("fields.p.rows", None),
    "rows-flag-list": _set("fields.p.rows", [2, 0]),
    "rows-missing": _drop("tensors.p/rows"),
    "rows-missing-json": _drop("tensors.k/rows"),
    "rows-i32": _set("tensors.p/rows", np.array([2, 0], dtype=np.int32)),
    "rows-u64": _set("tensors.p/rows", np.array([2, 0], dtype=np.uint64)),
    "rows-0d": _all(
        _set("tensors.p/rows", np.array(2, dtype=np.int64)), _set("tensors.p", np.array([7], dtype=np.int32))
    ),
    "rows-2d": _set("tensors.p/rows", [[2, 0]]),
    "rows-negative": _set("tensors.p/rows", [2, -1]),
    "rows-past-the-tasks": _set("tensors.p/rows", [3, 0]),
    "rows-far-past-the-tasks": _set("tensors.p/rows", [2**63 - 1, 0]),
    "rows-repeated": _set("tensors.p/rows", [2, 2]),
    "rows-json-count-mismatch": _set("tensors.k/rows", [1, 2]),
    "rows-json-past-the-tasks": _set("tensors.k/rows", [3]),
    # entries and metadata no field claims
    "stray-entry": _set("tensors.zz", np.zeros(2, dtype=np.uint8)),
    "stray-empty-entry": _set("tensors.zz", np.zeros(0, dtype=np.uint8)),
    "stray-lengths-on-uniform": _set("tensors.u/lengths", [2, 2, 2]),
    "stray-rows-without-flag": _set("tensors.u/rows", [0, 1, 2]),
    "stray-ranks-on-ragged": _set("tensors.r/ranks", [2, 2, 2]),
    "stray-dims-on-ragged": _set("tensors.r/dims", [[1, 2], [0, 2], [2, 2]]),
    "stray-lengths-on-general": _set("tensors.g/lengths", [6, 1, 0]),
    "stray-table-of-no-field": _set("tensors.zz/lengths", [1, 1, 1]),
    "stray-entry-for-json-field": _set("tensors.j", np.zeros(3, dtype=np.uint8)),
    "stray-json-of-no-field": _set("json.zz", [1, 2, 3]),
    "stray-json-for-tensor-field": _set("json.u", [1, 2, 3]),
    "stray-json-for-layer": _set("json.q", ["y"]),
    # JSON fields
    "json-missing": _drop("json.j"),
    "json-too-few": _set("json.j", [1, "two"]),
    "json-too-many": _set("json.j", [1, "two", None, 4]),
    "json-empty-array": _set("json.j", []),
    "json-object": _set("json.j", {"t0": 1, "t1": "two", "t2": None}),
    "json-number": _set("json.j", "3"),
    "json-string": _set("json.j", '"abc"'),
    "json-null": _set("json.j", "null"),
    "json-invalid": _set("json.j", "[1, "),
    "json-empty-text": _set("json.j", ""),
    "json-trailing": _set("json.j", '[1, "two", null] 4'),
    "json-python-literal": _set("json.j", "[1, 'two', None]"),
    "json-too-deep": _set("json.j", "[" * 100_000 + "]" * 100_000),
    "json-non-json-escape": _set("json.j", '["\\x41", 2, 3]'),
    "json-lone-surrogate": _set("json.j", '["\ud800", 2, 3]'),
    "json-int-past-the-digit-limit": _set("json.j", "[" + "1" * (_LIMIT + 10) + ", 2, 3]"),
}


def _mutated(mutation: Mutation) -> bytes:
    spec = copy.deepcopy(good_spec())
    mutation(spec)
    return forge_spec(spec)


MALFORMED_BUNDLES: dict[str, bytes] = {label: _mutated(mutation) for label, mutation in MUTATIONS.items()}

# The same rule broken where one spec with three tasks cannot: five rows of about 2**62 elements
# each, whose int64 sum wraps around to the 1 element sent.
_BIG = 2**62 - 2**10
MALFORMED_BUNDLES["general-count-sum-wraps"] = forge(
    ["a", "b", "c", "d", "e"],
    {"x": {"dtype": "U8", "layout": "general"}},
    {
        "x": np.zeros(1, dtype=np.uint8),
        "x/ranks": [1, 1, 1, 1, 1],
        "x/dims": [[_BIG], [_BIG], [_BIG], [_BIG], [2**64 + 1 - 4 * _BIG]],
    },
)
assert sum([_BIG] * 4 + [2**64 + 1 - 4 * _BIG]) % 2**64 == 1
