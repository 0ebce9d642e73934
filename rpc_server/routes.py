"""The worker's data endpoints: health, shards (put / fetch / delete), stats, metrics."""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, Response, jsonify, request

from distbatch import wire
from distbatch.ids import ShardKey, validate_id, validate_key
from rpc_server.app import ApiError, state
from rpc_server.store import StoredShard

data_routes = Blueprint("data", __name__)

BINARY_TYPES = {"application/octet-stream", "application/x-safetensors"}


def _read_body(limit: int, what: str = "request body") -> bytearray:
    """The request body, or 413 if it is over `limit` bytes, with or without a Content-Length.

    The app lets werkzeug's stream run one byte past `max_request_bytes`, so a
    chunked body over the limit is seen (and refused) instead of cut short.
    """
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, "payload_too_large", f"{what} over {limit} bytes")
    stream = request.stream
    if length is not None:
        body = bytearray(length)
        with memoryview(body) as view:
            filled = 0
            while filled < length:
                n = stream.readinto(view[filled:])
                if not n:
                    raise ApiError(400, "truncated_body", f"{what} ended after {filled} of {length} bytes")
                filled += n
        return body
    body = bytearray()
    while len(body) <= limit:
        chunk = stream.read(min(4 << 20, limit + 1 - len(body)))
        if not chunk:
            break
        body += chunk
    if len(body) > limit:
        raise ApiError(413, "payload_too_large", f"{what} over {limit} bytes")
    return body


def _read_json_body() -> dict[str, Any]:
    """The request's JSON object, bounded by `max_json_bytes`."""
    if request.mimetype != "application/json":
        raise ApiError(415, "unsupported_media_type", "expected Content-Type: application/json")
    raw = _read_body(state().config.max_json_bytes, "JSON body")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "bad_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "body must be a JSON object")
    return body


def _key_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise ApiError(400, "bad_request", f"'{name}' must be a list")
    limit = state().config.max_keys_per_request
    if len(value) > limit:
        raise ApiError(413, "too_many_keys", f"{len(value)} entries in '{name}', limit {limit}")
    return value


def _validated_keys(value: Any) -> list[ShardKey]:
    return [validate_key(k) for k in _key_list(value, "keys")]


@data_routes.get("/health")
def health() -> Response:
    current = state()
    engine = current.engine.name if current.engine is not None else None
    return jsonify({"status": "ok", "node": current.config.node, "engine": engine})


@data_routes.put("/v1/shards")
def put_shards() -> Response:
    if request.mimetype not in BINARY_TYPES:
        raise ApiError(415, "unsupported_media_type", "expected Content-Type: application/octet-stream")
    body = _read_body(state().config.max_request_bytes)
    container = wire.parse_container(body)
    if len(container) > state().config.max_keys_per_request:
        raise ApiError(413, "too_many_keys", f"{len(container)} shards in one request")
    # Copy each shard out of the request body so that deleting one frees its memory.
    with wire.paused_gc():
        shards: dict[ShardKey, StoredShard] = {
            key: StoredShard(raw.dtype, raw.shape, bytes(raw.data)) for key, raw in container.tensors.items()
        }
        for key, text in container.json_texts.items():
            shards[key] = StoredShard(None, (), text.encode())
    stage_id = request.args.get("stage")
    if stage_id is not None:
        staged, nbytes = state().store.stage(validate_id(stage_id, "stage"), shards)
        return jsonify({"staged": staged, "bytes": nbytes})
    stored, nbytes = state().store.put(shards)
    return jsonify({"stored": stored, "bytes": nbytes})


def _stage_id_from_body() -> str:
    return validate_id(_read_json_body().get("stage"), "stage")


@data_routes.post("/v1/shards/commit")
def commit_stage() -> Response:
    """Make a staged multi-request put visible, all at once (idempotent)."""
    stored, nbytes = state().store.commit(_stage_id_from_body())
    return jsonify({"stored": stored, "bytes": nbytes})


@data_routes.post("/v1/shards/abort")
def abort_stage() -> Response:
    """Drop a staged put (idempotent)."""
    return jsonify({"aborted": state().store.abort(_stage_id_from_body())})


@data_routes.post("/v1/shards/fetch")
def fetch_shards() -> Response:
    keys = _validated_keys(_read_json_body().get("keys"))
    found = state().store.get(keys)
    tensors: dict[ShardKey, wire.RawTensor] = {}
    json_texts: dict[ShardKey, str] = {}
    with wire.paused_gc():
        for key, shard in zip(keys, found):
            if shard.dtype is None:
                json_texts[key] = shard.data.decode()
            else:
                tensors[key] = wire.RawTensor(shard.dtype, shard.shape, shard.data)
        body = wire.join_parts(wire.build_container(tensors, json_texts))
    return Response(body, mimetype=wire.CONTENT_TYPE)


@data_routes.post("/v1/shards/delete")
def delete_shards() -> Response:
    body = _read_json_body()
    has_tasks, has_keys = "task_ids" in body, "keys" in body
    if has_tasks == has_keys:
        raise ApiError(400, "bad_request", "give exactly one of 'task_ids' or 'keys'")
    if "fields" in body and not has_tasks:
        raise ApiError(400, "bad_request", "'fields' goes with 'task_ids'")
    store = state().store
    if has_tasks:
        task_ids = [validate_id(t, "task_id") for t in _key_list(body["task_ids"], "task_ids")]
        if "fields" in body:
            fields = [validate_id(f, "field") for f in _key_list(body["fields"], "fields")]
            limit = state().config.max_keys_per_request
            if len(task_ids) * len(fields) > limit:
                raise ApiError(
                    413, "too_many_keys", f"{len(task_ids)} tasks x {len(fields)} fields > {limit}"
                )
            count, freed = store.delete_keys([ShardKey(t, f) for t in task_ids for f in fields])
        else:
            count, freed = store.delete_tasks(task_ids)
    else:
        count, freed = store.delete_keys(_validated_keys(body["keys"]))
    return jsonify({"deleted": count, "bytes_freed": freed})


@data_routes.get("/v1/stats")
def stats() -> Response:
    current = state()
    return jsonify(
        {"node": current.config.node, **current.store.stats().as_dict(), **current.metrics.traffic()}
    )


@data_routes.get("/metrics")
def metrics() -> Response:
    current = state()
    stats = current.store.stats()
    text = current.metrics.render(
        {
            "distbatch_shards": ("Shards stored.", stats.shards),
            "distbatch_tasks": ("Tasks with at least one stored shard.", stats.tasks),
            "distbatch_stored_bytes": ("Bytes of shard data stored.", stats.bytes),
            "distbatch_capacity_bytes": ("Configured capacity in bytes.", stats.capacity),
        },
        {
            "distbatch_evicted_shards_total": ("Shards deleted for being idle.", stats.evicted_shards),
            "distbatch_evicted_bytes_total": ("Bytes of shards deleted for being idle.", stats.evicted_bytes),
        },
    )
    return Response(text, mimetype="text/plain; version=0.0.4")


@data_routes.post("/v1/call/<method>")
def call_engine(method: str) -> Response:
    """Run an engine method; batches in and out travel as metadata."""
    host = state().engine
    if host is None:
        raise ApiError(
            404, "no_engine", "this worker runs no engine (start it with --engine pkg.module:Factory)"
        )
    host.method(method)  # 404 before reading the body if there is no such method
    return jsonify({"result": host.call(method, _read_json_body())})
