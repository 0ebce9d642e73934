"""The worker's endpoints: health, shards (put / fetch / delete), stats, metrics, and its engine's
(build one, call its methods, abandon calls)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

from flask import Blueprint, Response, current_app, jsonify, request
from werkzeug.exceptions import ClientDisconnected

from distbatch import wire
from distbatch.gc_pause import paused_gc
from distbatch.ids import ShardKey, validate_id, validate_key
from distbatch.protocol import CALL_ID_HEADER, MAX_LIST_LIMIT
from distbatch.serving.handler import SENDS_BUFFERS
from distbatch.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from distbatch.serving.server import connection_gauges
from rpc_server.announce import ControllerNotice
from rpc_server.checks import (
    answer_ids_as_count,
    check_field_count,
    check_put,
    check_response_size,
    generation_list,
    key_list,
)
from rpc_server.context import state
from rpc_server.errors import ApiError
from rpc_server.store.durable import LogStats
from rpc_server.store.records import StoreStats

data_routes = Blueprint("data", __name__)
logger = logging.getLogger("rpc_server")

STREAM_SLICE_BYTES = 8 << 20
BINARY_TYPES = {"application/octet-stream", "application/x-safetensors"}


# A body is read into chunks that grow as bytes arrive (never allocated from the declared
# length), then joined once: a client that declares a big body and stalls holds one small chunk.
FIRST_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 8 << 20


def _read_body(limit: int, what: str = "request body") -> bytearray:
    """The request body, or 413 if it is over `limit` bytes, with or without a Content-Length.

    Memory follows the bytes received, not the Content-Length a client declares
    (at most one chunk ahead), so clients that declare big bodies and stall cost
    little; an honest body costs one extra copy (the final join). A client that
    stops sending for the server's read timeout gets 408. The app lets
    werkzeug's stream run one byte past `max_request_bytes`, so a chunked body
    over the limit is seen (and refused) instead of cut short.
    """
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, "payload_too_large", f"{what} over {limit} bytes")
    expected = limit + 1 if length is None else length
    chunks: list[bytearray] = []
    received = 0
    chunk_size = FIRST_CHUNK_BYTES
    ended = False
    while received < expected and not ended:
        chunk = bytearray(min(chunk_size, expected - received))
        with memoryview(chunk) as view:
            filled = _fill(view, what, received, length)
        ended = filled < len(chunk)
        if ended:
            del chunk[filled:]
        chunks.append(chunk)
        received += filled
        chunk_size = min(chunk_size * 2, MAX_CHUNK_BYTES)
    if length is not None and received < length:
        raise ApiError(400, "truncated_body", f"{what} ended after {received} of {length} bytes")
    if received > limit:
        raise ApiError(413, "payload_too_large", f"{what} over {limit} bytes")
    if len(chunks) == 1:
        return chunks[0]
    return bytearray().join(chunks)  # also the empty body


def _receive_body(limit: int, what: str = "request body") -> Any:
    """The request body, or 413 if it is over `limit` bytes; the caller owns the buffer.

    With a Content-Length the body is read straight into a buffer of that size from the
    worker's body pool (`ServerState.body_pool`): a big one is an anonymous private mapping,
    recycled from a recent put when one of that size is idle (its pages already mapped in,
    so no page faults), else fresh, where a body that declares a big length and stalls costs
    only the pages that arrived. An honest body costs one copy of itself (the socket read).
    The store keeps a put's columns as views of this very buffer, so it goes back to the
    pool when the last of them goes. Without a Content-Length (chunked), or if the mapping
    is refused (strict overcommit), it is read as `_read_body` does.
    """
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, "payload_too_large", f"{what} over {limit} bytes")
    try:
        body = state().body_pool.take(length) if length else None
    except OSError:
        body = None
    if body is None:
        return _read_body(limit, what)
    with memoryview(body) as view:  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs disagree
        received = _fill(view, what, 0, length)
    if received < length:  # type: ignore[operator]
        raise ApiError(400, "truncated_body", f"{what} ended after {received} of {length} bytes")
    return body


def _fill(view: memoryview, what: str, received: int, length: int | None) -> int:
    """Read body bytes into `view` until it is full or the body ends; how many were read.

    Each read's target view is released at once, so none outlives the buffer's owner.
    `received` and `length` only word the error for a stalled or cut-short body.
    """
    stream = request.stream
    filled = 0
    while filled < len(view):
        with view[filled:] as target:
            try:
                n = stream.readinto(target)  # type: ignore[attr-defined]  # werkzeug hands a raw reader
            except ClientDisconnected as exc:
                _raise_body_error(exc, what, received + filled, length)
        if not n:
            break
        filled += n
    return filled


def _raise_body_error(exc: ClientDisconnected, what: str, received: int, length: int | None) -> NoReturn:
    """408 if the client stopped sending for the read timeout, else 400: the body ended early.

    `received` counts whole reads, so a few bytes of the last one may be missing from it.
    """
    of = "" if length is None else f" of {length}"
    if isinstance(exc.__context__, TimeoutError):
        raise ApiError(
            408,
            "request_timeout",
            f"{what} stalled: nothing received for the server's read timeout (--read-timeout)"
            f" after at least {received}{of} bytes",
        ) from None
    raise ApiError(400, "truncated_body", f"{what} ended after at least {received}{of} bytes") from None


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
    return key_list(value, name, state().config.max_keys_per_request)


def _distinct_ids(values: list[Any], what: str) -> list[str]:
    """Valid ids, a repeated one kept once (deletes are idempotent), checked in one regex pass."""
    if set(map(type, values)) - {str}:
        for value in values:
            validate_id(value, what)  # names the first id that is not a string
    return wire.validate_id_list(list(dict.fromkeys(values)), what)


def _validated_keys(value: Any) -> list[ShardKey]:
    return [validate_key(k) for k in _key_list(value, "keys")]


@data_routes.get("/health")
def health() -> Response:
    current = state()
    config = current.config
    engine = current.engine.name if current.engine is not None else None
    return jsonify(
        {
            "status": "ok",
            "node": config.node,
            "engine": engine,
            "rank": config.rank,
            "world_size": config.world_size,
        }
    )


@data_routes.put("/v1/shards")
def put_shards() -> Response:
    """Store a bundle (all or nothing); with `?stage=ID[&part=K]`, hold it until commit."""
    if request.mimetype not in BINARY_TYPES:
        raise ApiError(415, "unsupported_media_type", "expected Content-Type: application/octet-stream")
    body = _receive_body(state().config.max_request_bytes)
    size = len(body)
    try:
        bundle = wire.parse_bundle(body)
        check_put(bundle, state().config.max_keys_per_request)
    except BaseException as exc:
        _clear_frames(exc)
        del body
        raise
    stage_id = request.args.get("stage")
    if stage_id is not None:
        part = request.args.get("part", "")
        if part:
            validate_id(part, "part")
        staged, nbytes = state().store.stage(validate_id(stage_id, "stage"), bundle, size, part)
        return jsonify({"staged": staged, "bytes": nbytes})
    receipt = state().store.put(bundle, size)
    return jsonify({"stored": receipt.stored, "bytes": receipt.bytes, "generation": receipt.generation})


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of a failed parse's frames, so views of a refused body die with it."""
    error: BaseException | None = exc
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__context__


def _stage_id_from_body() -> str:
    return validate_id(_read_json_body().get("stage"), "stage")


@data_routes.post("/v1/shards/commit")
def commit_stage() -> Response:
    """Make a staged multi-request put visible, all at once (idempotent)."""
    stored, nbytes, generation = state().store.commit(_stage_id_from_body())
    return jsonify({"stored": stored, "bytes": nbytes, "generation": generation})


@data_routes.post("/v1/shards/abort")
def abort_stage() -> Response:
    """Drop a staged put (idempotent)."""
    return jsonify({"aborted": state().store.abort(_stage_id_from_body())})


@data_routes.post("/v1/shards/fetch")
def fetch_shards() -> Response:
    """Body `{"task_ids": [...], "fields": [...]}` (a product) or `{"keys": [...]}` -> a bundle.

    413 `response_too_large` over `max_response_bytes`, checked from the stored sizes
    before anything is built, so one request can never copy the store into a response
    (clients split and retry). The response streams the stored bytes as they are (a
    contiguous run of rows is sent straight from its segment, no copy).
    """
    body = _read_json_body()
    has_product, has_keys = "task_ids" in body, "keys" in body
    if has_product == has_keys:
        raise ApiError(400, "bad_request", "give either 'task_ids' and 'fields', or 'keys'")
    store = state().store
    ids_as_count = has_product and answer_ids_as_count(body.get("answer_ids", True))
    if has_product:
        task_ids = wire.validate_id_list(_key_list(body["task_ids"], "task_ids"))
        fields = wire.validate_id_list(_key_list(body.get("fields"), "fields"), "field")
        check_field_count(len(fields))
        bundle = store.fetch(task_ids, fields, generation_list(body.get("generations"), len(task_ids)))
    else:
        bundle = store.fetch_keys(_validated_keys(body["keys"]))
    limit = state().config.max_response_bytes
    shards = bundle.shard_count()
    stored = sum(c.nbytes for c in bundle.columns.values())
    check_response_size(shards, stored, limit)
    with paused_gc():
        parts = wire.build_bundle(bundle, ids_as_count)
    size = wire.parts_size(parts)
    check_response_size(shards, size, limit)
    response = Response(
        _stream(parts, bool(request.environ.get(SENDS_BUFFERS))),  # type: ignore[arg-type]  # see _stream
        mimetype=wire.CONTENT_TYPE,
        direct_passthrough=True,
    )
    response.content_length = size
    return response


def _stream(parts: list[wire.Buffer], as_buffers: bool) -> Iterator[bytes | memoryview]:
    """The response's parts: as they are (views of stored segments) for our server, which
    sends any buffer without copying it; as `bytes` slices for other WSGI servers (PEP 3333
    asks for bytes), a slice at a time, so the copy is transient and bounded."""
    for part in parts:
        view = wire.byte_view(part)
        if as_buffers:
            yield view
            continue
        for start in range(0, view.nbytes, STREAM_SLICE_BYTES):
            yield bytes(view[start : start + STREAM_SLICE_BYTES])


@data_routes.post("/v1/shards/delete")
def delete_shards() -> Response:
    body = _read_json_body()
    has_tasks, has_keys = "task_ids" in body, "keys" in body
    if has_tasks == has_keys:
        raise ApiError(400, "bad_request", "give exactly one of 'task_ids' or 'keys'")
    if "fields" in body and not has_tasks:
        raise ApiError(400, "bad_request", "'fields' goes with 'task_ids'")
    store = state().store
    if "generations" in body and "fields" not in body:
        raise ApiError(400, "bad_request", "'generations' goes with 'task_ids' and 'fields'")
    if has_tasks:
        raw_ids = _key_list(body["task_ids"], "task_ids")
        # Generations pair with the ids one to one, so those ids must be distinct.
        checked = "generations" in body
        task_ids = wire.validate_id_list(raw_ids) if checked else _distinct_ids(raw_ids, "task_id")
        if "fields" in body:
            fields = _distinct_ids(_key_list(body["fields"], "fields"), "field")
            generations = generation_list(body.get("generations"), len(task_ids))
            count, freed = store.delete_product(task_ids, fields, generations)
        else:
            count, freed = store.delete_tasks(task_ids)
    else:
        count, freed = store.delete_keys(_validated_keys(body["keys"]))
    return jsonify({"deleted": count, "bytes_freed": freed})


# `GET /v1/tasks` pages hold at most this many tasks.


@data_routes.get("/v1/tasks")
def list_tasks() -> Response:
    """`?after=ID&limit=N`: the held tasks in id order after ID, with their fields (for operators:
    `distbatch ls`); `next` is the id to ask after for the next page, null at the end.
    `?ids=A,B,...` (at most the page limit): those tasks' fields, and which of them it does not
    hold (`missing`: `distbatch show` and `clear --tasks`)."""
    if "ids" in request.args:
        return _named_tasks(request.args["ids"])
    after = request.args.get("after")
    if after is not None:
        validate_id(after, "after")
    try:
        limit = int(request.args.get("limit", "1000"))
    except ValueError:
        raise ApiError(400, "bad_request", "'limit' must be a whole number") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ApiError(400, "bad_request", f"'limit' must be 1 to {MAX_LIST_LIMIT}")
    tasks, total = state().store.list_tasks(after, limit)
    following = tasks[-1][0] if len(tasks) == limit else None
    return jsonify({"tasks": [[t, f] for t, f in tasks], "next": following, "total": total})


def _named_tasks(text: str) -> Response:
    task_ids = text.split(",") if text else []
    if not 1 <= len(task_ids) <= MAX_LIST_LIMIT:
        raise ApiError(400, "bad_request", f"'ids' must name 1 to {MAX_LIST_LIMIT} tasks")
    task_ids = wire.validate_id_list(list(dict.fromkeys(task_ids)))
    fields = state().store.fields_of(task_ids)
    held = [[t, f] for t, f in zip(task_ids, fields) if f]
    missing = [t for t, f in zip(task_ids, fields) if not f]
    return jsonify({"tasks": held, "missing": missing})


@data_routes.get("/v1/shm")
def shared_memory() -> Response:
    """How a client on this host reaches the same-host endpoint (`rpc_server.shm_server`), or why
    it cannot: behind the bearer token like every data endpoint, since it shows the secret."""
    return jsonify(state().shared_memory())


@data_routes.get("/v1/stats")
def stats() -> Response:
    current = state()
    return jsonify(
        {
            "node": current.config.node,
            **current.store.stats().as_dict(),
            **current.metrics.traffic(),
            "uptime_seconds": round(time.monotonic() - current.started, 3),
            "engine": current.engine.name if current.engine is not None else None,
            "durable": _durable_stats(
                current.store.durable_stats(), current.previous_nodes, current.controller_notice
            ),
        }
    )


def _durable_stats(
    log: LogStats | None, previous_nodes: list[str], notice: ControllerNotice | None
) -> dict[str, Any] | None:
    """A durable worker's log, for `/v1/stats` (None: shards live in memory only)."""
    if log is None:
        return None
    return {
        **dataclasses.asdict(log),
        "lag_seconds": round(log.lag_seconds, 3),
        "previous_nodes": previous_nodes,
        "controller": None if notice is None else notice.as_dict(),
    }


@data_routes.get("/metrics")
def metrics() -> Response:
    current = state()
    stats = current.store.stats()
    log = current.store.durable_stats()
    text = current.metrics.render(
        {
            "distbatch_shards": ("Shards stored.", stats.shards),
            "distbatch_tasks": ("Tasks with at least one stored shard.", stats.tasks),
            "distbatch_stored_bytes": ("Bytes of shard data stored.", stats.bytes),
            "distbatch_held_bytes": (
                "Bytes held for shards: live ones plus deleted rows not compacted yet.",
                stats.held_bytes,
            ),
            "distbatch_segments": ("Stored column segments.", stats.segments),
            "distbatch_shared_bytes": (
                "Bytes in shared regions that clients on this host map (same-host path).",
                stats.shared_bytes,
            ),
            "distbatch_shared_regions": ("Shared regions held.", stats.shared_regions),
            "distbatch_capacity_bytes": ("Configured capacity in bytes.", stats.capacity),
            **connection_gauges(current_app),
            **_durable_gauges(log, stats),
        },
        {
            "distbatch_evicted_shards_total": ("Shards deleted for being idle.", stats.evicted_shards),
            "distbatch_evicted_bytes_total": ("Bytes of shards deleted for being idle.", stats.evicted_bytes),
            **_durable_counters(log, stats),
        },
    )
    return Response(text, content_type=METRICS_CONTENT_TYPE)


def _durable_gauges(log: LogStats | None, stats: StoreStats) -> dict[str, tuple[str, Any]]:
    if log is None:
        return {}
    return {
        "distbatch_memory_bytes": (
            "Bytes of shard data held in memory (what capacity counts).",
            stats.memory_bytes,
        ),
        "distbatch_on_disk_bytes": (
            "Bytes of shard data spilled: served from the data directory.",
            stats.on_disk_bytes,
        ),
        "distbatch_durable_pending_bytes": (
            "Bytes committed but not yet on disk (--data-dir).",
            log.pending_bytes,
        ),
        "distbatch_durable_lag_seconds": ("Age of the oldest change not yet on disk.", log.lag_seconds),
        "distbatch_durable_disk_bytes": ("Bytes the durable log holds on disk.", log.disk_bytes),
        "distbatch_durable_failed": (
            "1 once the durable log could not write (changes are refused).",
            int(bool(log.failed)),
        ),
    }


def _durable_counters(log: LogStats | None, stats: StoreStats) -> dict[str, tuple[str, Any]]:
    if log is None:
        return {}
    return {
        "distbatch_spilled_bytes_total": (
            "Bytes of shard data spilled to disk past --max-bytes.",
            stats.spilled_bytes,
        ),
        "distbatch_read_back_shards_total": (
            "Spilled shards read back from disk by fetches.",
            stats.read_back_shards,
        ),
        "distbatch_read_back_bytes_total": (
            "Bytes of spilled shards read back from disk.",
            stats.read_back_bytes,
        ),
        "distbatch_durable_records_total": ("Records written to the durable log.", log.written_records),
        "distbatch_durable_compactions_total": (
            "Snapshots written to replace the durable log so far (compactions).",
            log.compactions,
        ),
        "distbatch_durable_written_bytes_total": ("Bytes written to the durable log.", log.written_bytes),
    }


@data_routes.post("/v1/call/<method>")
def call_engine(method: str) -> Response:
    """Run an engine method; batches in and out travel as metadata."""
    host = state().engine
    if host is None:
        raise ApiError(
            404, "no_engine", "this worker runs no engine (start it with --engine pkg.module:Factory)"
        )
    host.method(method)  # 404 before reading the body if there is no such method
    return jsonify({"result": host.call(method, _read_json_body(), call_id=_call_id())})


@data_routes.post("/v1/engine")
def start_engine() -> Response:
    """Build an engine on a worker started without one: `{"engine": "pkg.module:Factory", "kwargs":
    {...}, "rank": i, "world_size": n}` (`WorkerGroup.connect(..., engine=)`); answers once built."""
    from rpc_server.engine import start_requested_engine  # imports torch

    return jsonify(start_requested_engine(state(), _read_json_body()))


def _call_id() -> str | None:
    """The client's id for this engine call (lets it abandon the call), if it sent one."""
    value = request.headers.get(CALL_ID_HEADER)
    return None if value is None else validate_id(value, "call id")


@data_routes.post("/v1/calls/abandon")
def abandon_calls() -> Response:
    """Body `{"call_ids": [...]}`: the client gave up on these engine calls, drop their results.

    A queued call is not run, a running one stores nothing, a finished one has what it
    stored deleted; ids not seen yet are remembered (the notice may beat its call).
    """
    call_ids = [validate_id(c, "call id") for c in _key_list(_read_json_body().get("call_ids"), "call_ids")]
    host = state().engine
    if host is None:
        return jsonify({"calls": 0, "deleted": 0, "bytes_freed": 0})
    dropped = host.abandon(call_ids)
    logger.warning(
        "the client abandoned %d engine call(s) (%s); dropped their results: %d shard(s), %d bytes",
        len(call_ids),
        ", ".join(call_ids[:5]) + (" ..." if len(call_ids) > 5 else ""),
        dropped["deleted"],
        dropped["bytes_freed"],
    )
    return jsonify(dropped)
