"""The wire format's JSON values (exact types, NaN and infinities, depth and size limits) and the ids
it refuses at encode.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from bundle_support import (
    forge,
    split_container,
)
from wire_support import as_json, assert_wire_error, description_of, json_identical, round_trip

from distbatch import wire
from distbatch.ids import ShardKey

# --------------------------------------------------------------------------- JSON values

JSON_VALUES = [
    pytest.param("", id="empty-str"),
    pytest.param("héllo wörld ✓ 🎉 \U0001f9ea 中文 \x00 \n\t\"'\\", id="unicode"),
    pytest.param(0, id="zero"),
    pytest.param(-17, id="negative-int"),
    pytest.param(2**63, id="2**63"),
    pytest.param(-(2**64) - 1, id="below-i64"),
    pytest.param(10**300 + 7, id="big-int"),
    pytest.param(1.5, id="float"),
    pytest.param(0.1, id="float-0.1"),
    pytest.param(5e-324, id="subnormal"),
    pytest.param(1.7976931348623157e308, id="max-float"),
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="inf"),
    pytest.param(float("-inf"), id="-inf"),
    pytest.param(-0.0, id="-0.0"),
    pytest.param(True, id="true"),
    pytest.param(False, id="false"),
    pytest.param(None, id="none"),
    pytest.param([], id="empty-list"),
    pytest.param({}, id="empty-dict"),
    pytest.param([1, "a", None, True, 2.5, [[], {}]], id="mixed-list"),
    pytest.param({"b": 1, "a": [1, {"x": None}], "": "", "🎉": -0.0, "nan": float("nan")}, id="nested-dict"),
    pytest.param((1, (2, "x"), []), id="tuple"),
    pytest.param({"t": (1.0, -0.0)}, id="tuple-in-dict"),
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_json_values_round_trip_exactly(value: Any) -> None:
    buf = wire.encode_bundle_bytes({("task", "val"): value, ("task", "t"): torch.ones(1)})
    for source in (buf, bytearray(buf)):
        got = wire.decode_bundle(source)[("task", "val")]
        assert json_identical(got, as_json(value)), (got, value)


def test_negative_zero_keeps_its_sign() -> None:
    got = round_trip({("t", "z"): -0.0, ("t", "l"): [0.0, -0.0]})
    assert math.copysign(1.0, got[("t", "z")]) == -1.0
    assert [math.copysign(1.0, v) for v in got[("t", "l")]] == [1.0, -1.0]


def test_bool_stays_bool_and_int_stays_int() -> None:
    got = round_trip({("t", "b"): True, ("t", "i"): 1, ("t", "f"): 1.0})
    assert got[("t", "b")] is True
    assert type(got[("t", "i")]) is int
    assert type(got[("t", "f")]) is float


def test_json_values_ride_in_metadata_as_one_json_array_per_field() -> None:
    buf = wire.encode_bundle_bytes({("t", "j"): {"a": [1, 2]}, ("u", "j"): "é", ("t", "x"): torch.zeros(2)})
    header, _ = split_container(buf)
    assert json.loads(header["__metadata__"]["json/j"]) == [{"a": [1, 2]}, "é"]
    assert "j" not in header and "json/j" not in header  # no tensor entry for a JSON field
    assert description_of(buf) == {
        "version": 2,
        "task_ids": ["t", "u"],
        "fields": {"j": {"dtype": None}, "x": {"dtype": "F32", "rows": True, "layout": "uniform"}},
    }
    parsed = wire.parse_bundle(buf)
    assert parsed.columns["j"].values == [{"a": [1, 2]}, "é"] and parsed.columns["j"].rows is None
    assert parsed.columns["x"].rows is not None and parsed.columns["x"].rows.tolist() == [0]
    assert parsed.shard_count() == 3


def test_big_ints_up_to_the_interpreter_limit_round_trip_and_beyond_it_raise() -> None:
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        pytest.skip("the int/str digit limit is disabled in this interpreter")
    for value in (10 ** (limit - 1), -(10 ** (limit - 1))):
        assert round_trip({("t", "n"): value})[("t", "n")] == value
    too_big = 10 ** (limit + 10)
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "n"): too_big}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "n"): [1, {"k": -too_big}]}))
    # A peer sending such a number: the decoder refuses it the same way.
    forged = forge(["t"], {"n": {"dtype": None}}, json_fields={"n": "[" + "1" * (limit + 10) + "]"})
    assert_wire_error(lambda: wire.decode_bundle(forged))
    fine = forge(["t"], {"n": {"dtype": None}}, json_fields={"n": "[" + "1" * (limit - 1) + "]"})
    assert wire.decode_bundle(fine)[("t", "n")] == int("1" * (limit - 1))


class Opaque:
    pass


@pytest.mark.parametrize(
    "value",
    [
        pytest.param({1: "a"}, id="int-key"),
        pytest.param({None: 1}, id="none-key"),
        pytest.param({True: 1}, id="bool-key"),
        pytest.param({(1, 2): 1}, id="tuple-key"),
        pytest.param({"ok": {2.5: 1}}, id="nested-float-key"),
        pytest.param({1, 2}, id="set"),
        pytest.param(frozenset(), id="frozenset"),
        pytest.param([1, {2}], id="set-in-list"),
        pytest.param(Opaque(), id="object"),
        pytest.param(object(), id="bare-object"),
        pytest.param(b"bytes", id="bytes"),
        pytest.param(bytearray(b"x"), id="bytearray"),
        pytest.param(1j, id="complex"),
        pytest.param(range(3), id="range"),
        pytest.param(print, id="function"),
        pytest.param(np.int64(3), id="np.int64"),
        pytest.param(np.int32(3), id="np.int32"),
        pytest.param(np.uint8(3), id="np.uint8"),
        pytest.param(np.float32(1.5), id="np.float32"),
        pytest.param(np.float16(1.5), id="np.float16"),
        pytest.param(np.bool_(True), id="np.bool_"),
        pytest.param(np.complex64(1j), id="np.complex64"),
        pytest.param([np.int64(1)], id="np-scalar-in-list"),
        pytest.param({"k": np.float32(2.0)}, id="np-scalar-in-dict"),
    ],
)
def test_values_that_are_not_json_raise_at_encode(value: Any) -> None:
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "v"): value}))
    assert_wire_error(lambda: wire.encode_bundle({("t", "ok"): 1, ("t", "v"): value}))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("\ud800", id="lone-surrogate"),
        pytest.param({"\udfff": 1}, id="lone-surrogate-key"),
        pytest.param(["é", "a\udc80b"], id="lone-surrogate-beside-unicode"),
    ],
)
def test_lone_surrogates_travel_as_json_escapes(value: Any) -> None:
    """A str holding a lone surrogate is valid JSON once escaped (`\\ud800`): the field's array
    is sent ASCII-escaped, so the header stays valid UTF-8 (safetensors reads it) and the value
    comes back the same. A raw surrogate in the header's text is refused (see MALFORMED_BUNDLES)."""
    buf = wire.encode_bundle_bytes({("t", "v"): value, ("u", "v"): "ü"})
    header_len = int.from_bytes(buf[:8], "little")
    header = buf[8 : 8 + header_len].decode("utf-8")  # strict: no surrogates in the bytes
    assert "\\ud" in header
    text = json.loads(header)["__metadata__"]["json/v"]
    assert text.isascii()
    assert json_identical(json.loads(text), [as_json(value), "ü"])
    got = round_trip({("t", "v"): value})[("t", "v")]
    assert json_identical(got, as_json(value))
    assert safetensors.torch.load(buf) == {}  # no tensors, and a header safetensors accepts


def nested_lists(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def nested_dicts(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"k": value}
    return value


def test_nesting_up_to_the_limit_round_trips() -> None:
    for value in (nested_lists(wire.MAX_JSON_DEPTH), nested_dicts(wire.MAX_JSON_DEPTH)):
        got = round_trip({("t", "deep"): value})[("t", "deep")]
        assert got == value


@pytest.mark.parametrize("depth", [wire.MAX_JSON_DEPTH + 5, 500, 100_000])
def test_excessive_nesting_raises_at_encode(depth: int) -> None:
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "deep"): nested_lists(depth)}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "deep"): nested_dicts(depth)}))


@pytest.mark.parametrize("text", ["]" * 200, '\\"]' * 70, "[" * 200, '\\"[' * 70])
def test_brackets_inside_strings_leave_the_depth_as_it_is(text: str) -> None:
    """The depth is read off a column's JSON text with its strings' brackets left out, whether a
    string holds escapes or not: closing ones cannot hide a value nested too deep, opening ones
    cannot refuse a value within the limit."""
    assert_wire_error(
        lambda: wire.encode_bundle_bytes({("t", "x"): [text, nested_lists(wire.MAX_JSON_DEPTH + 5)]})
    )
    fine = [text, nested_lists(wire.MAX_JSON_DEPTH - 1)]
    assert round_trip({("t", "x"): fine})[("t", "x")] == fine


def test_self_referencing_value_raises_at_encode() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "loop"): loop}))
    cyclic: dict[str, Any] = {}
    cyclic["me"] = cyclic
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "loop"): cyclic}))


# --------------------------------------------------------------------------- invalid keys at encode

BAD_IDS = [
    "",
    "a" * 201,
    "a/b",
    "../x",
    "..\\x",
    "a b",
    "tab\t",
    "line\n",
    "é",
    "🎉",
    "a\x00",
    "a,b",
    "a*",
    "~home",
    None,
    1,
    1.5,
    b"ab",
    ("a",),
]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_invalid_task_id_or_field_raises_at_encode(bad: Any) -> None:
    value = torch.zeros(1)
    assert_wire_error(lambda: wire.encode_bundle_bytes({(bad, "field"): value}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("task", bad): 1}))
    # ShardKey does no checking of its own; the wire must still refuse it.
    assert_wire_error(lambda: wire.encode_bundle_bytes({ShardKey("task", bad): 1}))


@pytest.mark.parametrize(
    "key",
    ["ab", "task/field", ("a",), ("a", "b", "c"), (), 1, None, frozenset({"a", "b"})],
    # Ids that do not depend on set order (hash seeds differ between xdist's workers).
    ids=lambda key: "frozenset" if isinstance(key, frozenset) else repr(key),
)
def test_keys_that_are_not_pairs_raise_at_encode(key: Any) -> None:
    assert_wire_error(lambda: wire.encode_bundle_bytes({key: 1}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("ok", "ok"): 1, key: torch.ones(1)}))


def test_shallow_columns_skip_the_decode_and_every_other_column_still_gets_it() -> None:
    """A column of exact scalars, or of dicts of them under string keys, is known to decode back
    equal without decoding it; anything else is still decoded and compared (or walked)."""
    from distbatch.wire.json_values import MAX_JSON_DEPTH, dump_if_exact

    class Tag(str):
        pass

    shallow = [{"uid": f"p{i}", "turn": i, "ok": i % 2 == 0, "none": None} for i in range(100)]
    assert dump_if_exact(shallow) == json.dumps(shallow, separators=(",", ":"), ensure_ascii=False)
    assert dump_if_exact(["a", 1, True, None, 2**70]) == '["a",1,true,null,1180591620717411303424]'
    assert dump_if_exact([{"a": 1}, {2: 1}]) is None  # an int key would come back a string
    assert dump_if_exact([1.0, math.nan]) is None  # NaN never equals itself
    assert dump_if_exact([Tag("b"), "c"]) == '["b","c"]'  # equal once decoded, as before
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = {"k": deep}
    assert dump_if_exact([{"a": 1}, deep]) is None  # nested too deep: walked, refused
