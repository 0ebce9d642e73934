"""Hostile input, fuzzed: a real worker must answer every bad request with a JSON 4xx and lose nothing.

One module-scoped `python -m rpc_server` (bearer token on, small request / JSON
bounds so oversize cases are cheap) holds known reference data. Hypothesis
throws mutated bundles (byte flips, broken containers, broken descriptions and
tables, invalid ids), random JSON and non-JSON bodies, wrong content types,
oversized and chunked bodies, path-like ids, wrong methods, unknown paths and
bad tokens at it. Every answer must be a 4xx with a JSON
`{"error", "message"}` body (never a 5xx, never a dropped connection), and after
every example the reference shards are byte-for-byte unchanged and the store's
shard count and byte total are what they were.
"""

from __future__ import annotations

import http.client
import json
import os
import pickle
import re
import string
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
from bundle_support import MALFORMED_BUNDLES, bundle_keys, describe, forge
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from distbatch.errors import WireFormatError
from distbatch.ids import ID_PATTERN
from distbatch.launch import WorkerProcess, spawn_worker
from distbatch.wire import ITEMSIZE, decode_bundle, encode_bundle_bytes, parse_bundle

TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OCTET = "application/octet-stream"
MAX_REQUEST = 4096
MAX_JSON = 1024
MAX_KEYS = 64

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Reference ids are long enough that no same-length byte mutation of the fuzz ids ("f1", "f2") reaches them.
REFERENCE: dict[tuple[str, str], Any] = {
    ("reference-1", "x"): torch.arange(20, dtype=torch.float32).reshape(4, 5) / 7,
    ("reference-1", "ids"): torch.arange(7),
    ("reference-2", "bf"): torch.linspace(-1, 1, 6, dtype=torch.bfloat16),
    ("reference-2", "meta"): {"a": [1, 2, {"b": None}], "s": "ünï"},
}
REFERENCE_KEYS = [list(k) for k in REFERENCE]
ROUTES = {
    ("GET", "/health"),
    ("GET", "/v1/stats"),
    ("GET", "/metrics"),
    ("PUT", "/v1/shards"),
    ("POST", "/v1/shards/fetch"),
    ("POST", "/v1/shards/delete"),
    ("POST", "/v1/shards/commit"),
    ("POST", "/v1/shards/abort"),
}
LAYER_COLUMN = re.compile(r"[A-Za-z0-9._:@=+-]{1,200}#[1-9][0-9]{0,3}")
JSON_PATHS = ["/v1/shards/fetch", "/v1/shards/delete", "/v1/shards/commit", "/v1/shards/abort", "/v1/call/go"]


class Target:
    """The worker, a keep-alive session to it, and what its reference data looked like at the start."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker = worker
        self.http = requests.Session()
        self.http.trust_env = False
        self.reference_bytes = b""
        self.baseline: tuple[int, int] = (0, 0)

    def url(self, path: str) -> str:
        return f"http://{self.worker.node}{path}"

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        headers = kwargs.pop("headers", AUTH)
        return self.http.request(method, self.url(path), headers=headers, timeout=10, **kwargs)

    def put(self, body: Any, content_type: str | None = OCTET, query: str = "") -> requests.Response:
        headers = {**AUTH, **({"Content-Type": content_type} if content_type is not None else {})}
        return self.request("PUT", "/v1/shards" + query, data=body, headers=headers)

    def post(self, path: str, body: Any, content_type: str | None = "application/json") -> requests.Response:
        headers = {**AUTH, **({"Content-Type": content_type} if content_type is not None else {})}
        return self.request("POST", path, data=body, headers=headers)

    def fetch_reference(self) -> bytes:
        response = self.post("/v1/shards/fetch", json.dumps({"keys": REFERENCE_KEYS}))
        assert response.status_code == 200, response.text
        return response.content

    def store_totals(self) -> tuple[int, int]:
        response = self.request("GET", "/v1/stats")
        assert response.status_code == 200, response.text
        body = response.json()
        return body["shards"], body["bytes"]

    def assert_intact(self) -> None:
        assert self.worker.alive()
        assert self.store_totals() == self.baseline
        assert self.fetch_reference() == self.reference_bytes


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    worker = spawn_worker(
        args=(
            "--max-request-bytes",
            str(MAX_REQUEST),
            "--max-json-bytes",
            str(MAX_JSON),
            "--max-keys-per-request",
            str(MAX_KEYS),
        ),
        env={"DISTBATCH_TOKEN": TOKEN},
    )
    t = Target(worker)
    try:
        assert t.put(encode_bundle_bytes(REFERENCE)).status_code == 200
        t.reference_bytes = t.fetch_reference()
        t.baseline = t.store_totals()
        assert t.baseline[0] == len(REFERENCE)
        yield t
        # Bad input never took the worker down or logged an unhandled error (those are 5xx).
        assert worker.alive()
    finally:
        t.http.close()
        worker.stop()


def assert_json_4xx(response: requests.Response, *statuses: int) -> dict[str, Any]:
    """A 4xx (one of `statuses` if given) whose body is `{"error": str, "message": str, ...}`."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if statuses:
        assert response.status_code in statuses, (response.status_code, response.text[:500])
    assert response.headers.get("Content-Type", "").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict), body
    assert isinstance(body.get("error"), str) and body["error"], body
    assert isinstance(body.get("message"), str) and body["message"], body
    return body


def container(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


# --------------------------------------------------------------------------- strategies

valid_ids = st.text(alphabet=string.ascii_letters + string.digits + "._:@=+-", min_size=1, max_size=12)
bad_ids = st.one_of(
    st.sampled_from(
        ["../x", "a/b", "%2e%2e", "/", "x/../y", "", "x" * 201, "é", "🙂", "a b", "a\x00b", "a\\b", "\u202e"]
    ),
    st.text(max_size=30).filter(lambda s: ID_PATTERN.fullmatch(s) is None),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def valid_fuzz_container(draw: st.DrawFn) -> bytes:
    """A well-formed bundle under the fuzz ids (the seed the mutations start from)."""
    shards: dict[tuple[str, str], Any] = {}
    for i in range(draw(st.integers(1, 3))):
        key = (draw(st.sampled_from(["f1", "f2"])), f"c{i}")
        if draw(st.booleans()):
            shards[key] = torch.arange(
                draw(st.integers(0, 6)), dtype=draw(st.sampled_from([torch.uint8, torch.int32]))
            )
        else:
            shards[key] = draw(json_scalars)
    return encode_bundle_bytes(shards)


@st.composite
def invalid_containers(draw: st.DrawFn) -> bytes:
    """A container that is malformed by construction: the worker must refuse it."""
    kind = draw(
        st.sampled_from(
            [
                "truncated",
                "huge-header",
                "overlap",
                "out-of-range",
                "dtype",
                "bad-id",
                "bad-shape",
                "header",
                "known-malformed",
                "lengths",
                "rows",
            ]
        )
    )
    if kind == "truncated":
        good = valid_fuzz_container(draw)
        return good[: draw(st.integers(0, len(good) - 1))]
    if kind == "huge-header":
        good = valid_fuzz_container(draw)
        length = draw(st.integers(len(good) - 7, 2**64 - 1))
        return length.to_bytes(8, "little") + good[8:]
    if kind == "overlap":
        n = draw(st.integers(1, 8))
        back = draw(st.integers(1, n))
        header = {
            "f1/a": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]},
            "f1/b": {"dtype": "U8", "shape": [n], "data_offsets": [n - back, 2 * n - back]},
        }
        return container(header, b"\x00" * (2 * n))
    if kind == "out-of-range":
        start = draw(st.integers(0, 64))
        n = draw(st.integers(1, 64))
        carried = draw(st.integers(0, start + n - 1))
        header = {"f1/a": {"dtype": "U8", "shape": [n], "data_offsets": [start, start + n]}}
        return container(header, b"\x01" * carried)
    if kind == "dtype":
        dtype = draw(
            st.one_of(st.text(max_size=10), st.integers(), st.none(), st.sampled_from(["F128", "f32", "O"]))
        )
        assume(dtype not in ITEMSIZE)
        return container({"f1/a": {"dtype": dtype, "shape": [1], "data_offsets": [0, 1]}}, b"\x00")
    if kind == "bad-id":
        # An invalid task id in the description, or an invalid field name (tensor or JSON field).
        bad = draw(bad_ids)
        where = draw(st.sampled_from(["task", "tensor-field", "json-field"]))
        # `x#1` is no id, but a valid column name: the second column of field `x`.
        assume(where == "task" or LAYER_COLUMN.fullmatch(bad) is None)
        task_ids = ["f1", bad] if where == "task" else ["f1"]
        field = bad if where != "task" else "c0"
        if where == "json-field":
            meta = {"distbatch": describe(task_ids, {field: {"dtype": None}}), f"json/{field}": "[1]"}
            return container({"__metadata__": meta})
        meta = {"distbatch": describe(task_ids, {field: {"dtype": "U8", "layout": "uniform"}})}
        rows = len(task_ids)
        return container(
            {"__metadata__": meta, field: {"dtype": "U8", "shape": [rows], "data_offsets": [0, rows]}},
            b"\x00" * rows,
        )
    if kind == "known-malformed":
        return MALFORMED_BUNDLES[draw(st.sampled_from(sorted(MALFORMED_BUNDLES)))]
    if kind == "lengths":
        # A ragged field whose lengths are negative or do not add up to the data (numpy's sums wrap).
        lengths = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=2, max_size=2))
        first = draw(st.integers(0, 6))
        assume(min(lengths) < 0 or sum(lengths) != first)
        return forge(
            ["f1", "f2"],
            {"c0": {"dtype": "U8", "layout": "ragged"}},
            {"c0": np.zeros(first, dtype=np.uint8), "c0/lengths": lengths},
        )
    if kind == "rows":
        # A partial field whose rows are negative, past the two tasks, or repeated.
        rows = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=3))
        assume(min(rows) < 0 or max(rows) >= 2 or len(set(rows)) < len(rows))
        return forge(
            ["f1", "f2"],
            {"c0": {"dtype": "U8", "layout": "uniform", "rows": True}},
            {"c0": np.zeros(len(rows), dtype=np.uint8), "c0/rows": rows},
        )
    if kind == "bad-shape":
        shape = draw(st.one_of(st.lists(st.integers(-3, 3), max_size=4), json_values))
        ok = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        nbytes = draw(st.integers(0, 8))
        if ok:  # a valid shape whose size does not match the span
            size = 1
            for d in shape:
                size *= d
            assume(size != nbytes)
        return container(
            {"f1/a": {"dtype": "U8", "shape": shape, "data_offsets": [0, nbytes]}}, b"\x00" * nbytes
        )
    # a header that is not a valid container header
    header = draw(
        st.one_of(
            st.binary(max_size=40),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.dictionaries(st.sampled_from(["f1/a", "__metadata__"]), json_values, min_size=1).map(
                lambda v: json.dumps(v).encode()
            ),
        )
    )
    try:
        parse_bundle(container(header))
    except WireFormatError:
        return container(header)
    assume(False)
    raise AssertionError  # unreachable


def body_of(draw_value: Any) -> bytes:
    return json.dumps(draw_value).encode()


# --------------------------------------------------------------------------- PUT /v1/shards


@FUZZ
@given(body=invalid_containers())
def test_invalid_containers_are_refused(target: Target, body: bytes) -> None:
    with pytest.raises(WireFormatError):
        parse_bundle(body)  # malformed by construction: the library refuses it too
    assert_json_4xx(target.put(body), 400, 413)
    target.assert_intact()


@FUZZ
@given(
    seed=st.data(),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
)
def test_mutated_containers_are_refused_or_stored_whole(
    target: Target, seed: st.DataObject, flips: list[tuple[int, int]]
) -> None:
    """Random byte flips of a valid bundle: either still valid (then stored whole, and removed
    again here) or refused with a JSON 4xx. Never a 5xx, never touches the reference data."""
    body = bytearray(valid_fuzz_container(seed.draw))
    for position, value in flips:
        body[position % len(body)] = value
    response = target.put(bytes(body))
    try:
        parsed = parse_bundle(bytes(body))
    except WireFormatError:
        assert_json_4xx(response, 400)
    else:
        assert response.status_code == 200, response.text
        keys = [list(k) for k in bundle_keys(parsed)]
        assert not any(tuple(k) in REFERENCE for k in keys)
        assert response.json()["stored"] == len(keys)
        if keys:
            # Stored whole: every shard comes back as the body had it.
            fetched = target.post("/v1/shards/fetch", json.dumps({"keys": keys}))
            assert fetched.status_code == 200, fetched.text
            sent, got = decode_bundle(bytes(body)), decode_bundle(fetched.content)
            assert set(got) == set(sent)
            for key, value in sent.items():
                if isinstance(value, torch.Tensor):
                    assert got[key].dtype == value.dtype and got[key].shape == value.shape
                    assert bytes(got[key].reshape(-1).view(torch.uint8).numpy()) == bytes(
                        value.reshape(-1).view(torch.uint8).numpy()
                    )
                else:
                    assert json.dumps(got[key]) == json.dumps(value)
            cleanup = target.post("/v1/shards/delete", json.dumps({"keys": keys}))
            assert cleanup.status_code == 200, cleanup.text
    target.assert_intact()


@FUZZ
@given(body=st.binary(max_size=600))
def test_random_bytes_put(target: Target, body: bytes) -> None:
    response = target.put(body)
    try:
        parsed = parse_bundle(body)
    except WireFormatError:
        assert_json_4xx(response, 400)
    else:  # e.g. b"\x02\0\0\0\0\0\0\0{}": a valid, empty bundle
        assert response.status_code == 200 and parsed.shard_count() == 0, response.text
    target.assert_intact()


def _json_field_bundle(text: str, task_id: str = "f1") -> bytes:
    """A one-task bundle whose JSON field `u` has the array text `text` (header JSON-escaped, so
    a lone surrogate in `text` arrives as a \\udxxx escape in the header: valid bytes)."""
    meta = {"distbatch": describe([task_id], {"u": {"dtype": None}}), "json/u": text}
    return container({"__metadata__": meta})


def test_lone_surrogate_json_shard_is_400_not_500(target: Target) -> None:
    """Regression: a JSON shard whose text holds a lone surrogate (a \\ud800 escape in the
    header) passed validation, then failed to UTF-8-encode in the view: a 500."""
    text = json.dumps(["\ud800"], ensure_ascii=False)
    body = assert_json_4xx(target.put(_json_field_bundle(text)), 400)
    assert body["error"] == "bad_container"
    # The same in the description (a task id), where it is no id anyway.
    raw = {"__metadata__": {"distbatch": describe(["f1\ud800"], {"u": {"dtype": None}}), "json/u": "[1]"}}
    assert assert_json_4xx(target.put(container(raw)), 400)["error"] == "bad_container"
    target.assert_intact()


def test_escaped_lone_surrogate_is_a_valid_json_value(target: Target) -> None:
    """Escaped inside the field's own JSON text (`"\\ud800"`, what our encoder sends), a lone
    surrogate is a valid JSON string: stored, served back the same, counted, deleted; no 500."""
    value = ["a\ud800", {"\udfff": "é"}]
    response = target.put(_json_field_bundle(json.dumps([value])))
    assert response.status_code == 200, response.text
    assert response.json()["stored"] == 1
    fetched = target.post("/v1/shards/fetch", json.dumps({"task_ids": ["f1"], "fields": ["u"]}))
    assert fetched.status_code == 200, fetched.text
    assert decode_bundle(fetched.content) == {("f1", "u"): value}
    assert target.post("/v1/shards/delete", json.dumps({"task_ids": ["f1"]})).json()["deleted"] == 1
    target.assert_intact()


@FUZZ
@given(
    text=st.text(alphabet=st.characters(categories=["Cs"]) | st.characters(), max_size=8).map(
        lambda s: json.dumps([s], ensure_ascii=False)
    )
)
def test_arbitrary_unicode_json_shards(target: Target, text: str) -> None:
    response = target.put(_json_field_bundle(text))
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert_json_4xx(response, 400)
    else:
        assert response.status_code == 200, response.text
        fetched = target.post("/v1/shards/fetch", json.dumps({"keys": [["f1", "u"]]}))
        assert decode_bundle(fetched.content) == {("f1", "u"): json.loads(text)[0]}
        assert target.post("/v1/shards/delete", json.dumps({"task_ids": ["f1"]})).json()["deleted"] == 1
    target.assert_intact()


@FUZZ
@given(
    content_type=st.one_of(
        st.none(),
        st.sampled_from(
            ["text/plain", "application/json", "application/python-pickle", "multipart/form-data"]
        ),
        # Stripped: a header value with leading/trailing spaces cannot be sent (requests refuses it).
        st.text(alphabet=string.ascii_letters + string.digits + "/+-.;= ", max_size=40).map(str.strip),
    ),
    seed=st.data(),
)
def test_put_wrong_content_type_is_415(target: Target, content_type: str | None, seed: st.DataObject) -> None:
    mimetype = (content_type or "").split(";")[0].strip().lower()
    assume(mimetype not in {"application/octet-stream", "application/x-safetensors"})
    assert_json_4xx(target.put(valid_fuzz_container(seed.draw), content_type), 415)
    target.assert_intact()


@FUZZ
@given(
    size=st.integers(MAX_REQUEST + 1, 16 * MAX_REQUEST),
    chunked=st.booleans(),
    content_type=st.sampled_from([OCTET, "text/plain"]),
)
def test_oversized_put_is_413(target: Target, size: int, chunked: bool, content_type: str) -> None:
    payload = os.urandom(size)
    body: Any = payload
    if chunked:  # no Content-Length: the worker must still stop at the bound
        body = (payload[start : start + 1500] for start in range(0, size, 1500))
    response = target.put(body, content_type)
    assert_json_4xx(response, 413 if content_type == OCTET else 415)
    target.assert_intact()


@FUZZ
@given(stage=bad_ids, seed=st.data())
def test_put_with_bad_stage_id_is_400(target: Target, stage: str, seed: st.DataObject) -> None:
    query = "?" + urllib.parse.urlencode({"stage": stage})
    assert_json_4xx(target.put(valid_fuzz_container(seed.draw), query=query), 400)
    target.assert_intact()


# --------------------------------------------------------------------------- JSON endpoints


@FUZZ
@given(path=st.sampled_from(JSON_PATHS), value=json_values)
def test_random_json_bodies(target: Target, path: str, value: Any) -> None:
    """Arbitrary JSON at fetch/delete/commit/abort/call: a JSON 4xx, or a harmless 200."""
    assume("reference" not in json.dumps(value))
    response = target.post(path, body_of(value))
    if response.status_code == 200:  # e.g. {"keys": []}, {"task_ids": []}, {"stage": "x"} to abort
        assert path != "/v1/call/go"
        if path == "/v1/shards/delete":
            assert response.json()["deleted"] == 0
    else:
        assert_json_4xx(response)
    target.assert_intact()


@FUZZ
@given(
    path=st.sampled_from(JSON_PATHS),
    field=st.sampled_from(["keys", "task_ids", "fields", "stage"]),
    value=json_values,
    extra=st.dictionaries(
        st.sampled_from(["keys", "task_ids", "fields", "stage", "x"]), json_values, max_size=2
    ),
)
def test_structured_json_bodies(
    target: Target, path: str, field: str, value: Any, extra: dict[str, Any]
) -> None:
    body = {**extra, field: value}
    assume("reference" not in json.dumps(body))
    response = target.post(path, body_of(body))
    if response.status_code == 200:
        if path == "/v1/shards/delete":
            assert response.json()["deleted"] == 0
    else:
        assert_json_4xx(response)
    target.assert_intact()


@FUZZ
@given(
    bad=bad_ids,
    where=st.sampled_from(
        ["fetch-task", "fetch-field", "delete-key", "delete-task", "delete-field", "commit", "abort"]
    ),
)
def test_invalid_ids_in_json_are_400(target: Target, bad: str, where: str) -> None:
    path, body = {
        "fetch-task": ("/v1/shards/fetch", {"keys": [[bad, "x"]]}),
        "fetch-field": ("/v1/shards/fetch", {"keys": [["reference-1", bad]]}),
        "delete-key": ("/v1/shards/delete", {"keys": [["reference-1", "x"], ["reference-1", bad]]}),
        "delete-task": ("/v1/shards/delete", {"task_ids": ["reference-1", bad]}),
        "delete-field": ("/v1/shards/delete", {"task_ids": ["reference-1"], "fields": ["x", bad]}),
        "commit": ("/v1/shards/commit", {"stage": bad}),
        "abort": ("/v1/shards/abort", {"stage": bad}),
    }[where]
    body = assert_json_4xx(target.post(path, body_of(body)), 400)
    assert body["error"] == "invalid_id"
    target.assert_intact()  # one bad id spoils the whole delete: reference-1 is still there


@FUZZ
@given(
    path=st.sampled_from(JSON_PATHS),
    body=st.binary(max_size=200),
    content_type=st.sampled_from(["application/json", "text/plain", None, OCTET]),
)
def test_non_json_bodies(target: Target, path: str, body: bytes, content_type: str | None) -> None:
    try:
        json.loads(body)
        assume(False)  # valid JSON is the other tests' business
    except (ValueError, UnicodeDecodeError):
        pass
    response = target.post(path, body, content_type)
    if path == "/v1/call/go":
        assert_json_4xx(response, 404)  # no engine: refused before the body is read
    else:
        assert_json_4xx(response, 400 if content_type == "application/json" else 415)
    target.assert_intact()


@FUZZ
@given(
    path=st.sampled_from(JSON_PATHS[:4]), size=st.integers(MAX_JSON + 1, 8 * MAX_JSON), chunked=st.booleans()
)
def test_oversized_json_is_413(target: Target, path: str, size: int, chunked: bool) -> None:
    keys = [["f1", f"k{i}"] for i in range(size // 12 + 1)]
    payload = json.dumps({"keys": keys})
    payload += " " * max(0, size - len(payload))
    body: Any = payload.encode()
    if chunked:
        raw = body
        body = iter([raw[:500], raw[500:]])
    assert_json_4xx(target.post(path, body), 413)
    target.assert_intact()


def test_too_many_keys_is_413(target: Target) -> None:
    keys = [["f1", str(i)] for i in range(MAX_KEYS + 1)]
    assert len(json.dumps({"keys": keys})) < MAX_JSON
    assert_json_4xx(target.post("/v1/shards/fetch", json.dumps({"keys": keys})), 413)
    assert_json_4xx(target.post("/v1/shards/delete", json.dumps({"task_ids": [k[1] for k in keys]})), 413)
    target.assert_intact()


# --------------------------------------------------------------------------- routing and auth

path_segments = st.one_of(
    st.text(alphabet=string.ascii_letters + string.digits + "-._~%:@", max_size=12),
    st.sampled_from(["..", ".", "%2e%2e", "%2F", "v1", "shards", "fetch", "call", "stats", "%00", "%ff"]),
)
methods = st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH"])


def raw_request(
    target: Target, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """One request with the path sent exactly as given (no client-side normalisation)."""
    host, port = target.worker.node.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def assert_raw_json_4xx(status: int, headers: dict[str, str], body: bytes, *statuses: int) -> str:
    assert 400 <= status < 500 and (not statuses or status in statuses), (status, body[:300])
    assert headers.get("Content-Type", "").startswith("application/json"), headers
    parsed = json.loads(body)
    assert isinstance(parsed.get("error"), str) and isinstance(parsed.get("message"), str), parsed
    return parsed["error"]


@FUZZ
@given(method=methods, segments=st.lists(path_segments, min_size=1, max_size=5), authorized=st.booleans())
# Werkzeug merged "//" inside a path and answered a 308 HTML redirect (fixed: url_map.merge_slashes off).
@example(method="GET", segments=["v1", "", "stats"], authorized=True)
@example(method="POST", segments=["v1", "shards", "", "fetch"], authorized=True)
@example(method="GET", segments=["v1", "stats", ""], authorized=True)
@example(method="GET", segments=["v1", "shards", "..", "..", "metrics"], authorized=True)
def test_unknown_paths_and_wrong_methods(
    target: Target, method: str, segments: list[str], authorized: bool
) -> None:
    path = "/" + "/".join(segments)
    # The dev server reads a leading "//x" as "/x" (never a redirect): judge it as that path.
    normalized = "/" + path.lstrip("/")
    assume((method, normalized) not in ROUTES and not normalized.startswith("/v1/call/"))
    headers = {**(AUTH if authorized else {}), "Content-Type": "application/json"}
    status, response_headers, body = raw_request(target, method, path, headers, b"{}")
    if authorized:
        assert_raw_json_4xx(status, response_headers, body, 404, 405)
    else:
        assert assert_raw_json_4xx(status, response_headers, body, 401) == "unauthorized"
    target.assert_intact()


@FUZZ
@given(method=methods, route=st.sampled_from(sorted(ROUTES)))
def test_wrong_method_on_known_routes(target: Target, method: str, route: tuple[str, str]) -> None:
    path = route[1]
    assume((method, path) not in ROUTES)
    status, headers, body = raw_request(
        target, method, path, {**AUTH, "Content-Type": "application/json"}, b"{}"
    )
    assert_raw_json_4xx(status, headers, body, 405)
    target.assert_intact()


auth_headers = st.one_of(
    st.none(),
    st.sampled_from(
        [
            "Bearer",
            "Bearer ",
            "bearer wrong",
            f"Basic {TOKEN}",
            TOKEN,
            f"Bearer {TOKEN}x",
            f"Bearer {TOKEN[:-1]}",
            f"Token {TOKEN}",
        ]
    ),
    st.text(alphabet=string.printable.strip() + " ", max_size=40).filter(lambda s: s and s == s.strip()),
)


@FUZZ
@given(
    authorization=auth_headers, route=st.sampled_from(sorted(ROUTES - {("GET", "/health")})), seed=st.data()
)
def test_missing_or_wrong_token_is_401(
    target: Target, authorization: str | None, route: tuple[str, str], seed: st.DataObject
) -> None:
    scheme, _, provided = (authorization or "").partition(" ")
    assume(not (scheme.lower() == "bearer" and provided.strip() == TOKEN))
    method, path = route
    headers = {} if authorization is None else {"Authorization": authorization}
    if method == "PUT":
        headers["Content-Type"] = OCTET
        body = valid_fuzz_container(seed.draw)
    elif method == "POST":
        headers["Content-Type"] = "application/json"
        body = body_of({"keys": REFERENCE_KEYS, "task_ids": ["reference-1"], "stage": "s"})
        if path == "/v1/shards/delete":
            body = body_of({"task_ids": ["reference-1", "reference-2"]})
    else:
        body = b""
    response = target.http.request(method, target.url(path), data=body or None, headers=headers, timeout=10)
    assert assert_json_4xx(response, 401)["error"] == "unauthorized"
    target.assert_intact()


# --------------------------------------------------------------------------- never unpickle


class _CreatesMarker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_pickle_payloads_are_refused_and_never_run(target: Target, tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_CreatesMarker(probe)))  # noqa: S301 - our own payload: proves it is live
    assert probe.exists()

    marker = tmp_path / "marker"
    payloads = [pickle.dumps(_CreatesMarker(marker), protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    payloads.append(pickle.dumps({("f1", "x"): _CreatesMarker(marker)}))
    for payload in payloads:
        assert len(payload) < MAX_JSON
        for content_type in (OCTET, "application/python-pickle", "application/json", None):
            expected = (400,) if content_type == OCTET else (415,)
            assert_json_4xx(target.put(payload, content_type), *expected)
            for path in JSON_PATHS:
                assert_json_4xx(target.post(path, payload, content_type))
    time.sleep(0.2)
    assert not marker.exists()
    target.assert_intact()
