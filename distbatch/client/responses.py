"""A worker's answers as values or exceptions: JSON replies, bodies read in place, error mapping.

A worker answers an error with a status and a JSON body `{"error": code, "message": ...}`;
`error_from_response` turns it into the `NodeError` subclass callers catch (`AuthError`,
`CapacityError`, `ShardNotFoundError`, `EngineError`, `ServerError`, `RequestError`), the
same whether the answer came over HTTP or the same-host channel.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import aiohttp

from distbatch.errors import (
    AuthError,
    CapacityError,
    EngineError,
    NodeError,
    ProtocolError,
    RequestError,
    ServerError,
    ShardNotFoundError,
    ShardsReplacedError,
)

T = TypeVar("T")


async def read_into_bytearray(response: aiohttp.ClientResponse) -> bytearray:
    """Read the body into one writable buffer, so tensors can be decoded without a copy."""
    size = response.content_length
    if size is None:
        return bytearray(await response.read())
    buffer = bytearray(size)
    view = memoryview(buffer)
    position = 0
    async for chunk in response.content.iter_any():
        end = position + len(chunk)
        if end > size:
            raise aiohttp.ClientPayloadError("response longer than its Content-Length")
        view[position:end] = chunk
        position = end
    if position != size:
        raise aiohttp.ClientPayloadError(f"response ended after {position} of {size} bytes")
    return buffer


def json_reply(node: str, request: str, response: aiohttp.ClientResponse, body: bytes) -> Any:
    """A success reply's JSON; a body that is not JSON means the peer is not a distbatch worker."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        kind = response.headers.get("Content-Type") or "no Content-Type"
        raise ProtocolError(
            node,
            f"{request} answered HTTP {response.status} with a body that is not JSON "
            f"({kind}, {len(body)} bytes: {bytes(body[:60])!r}); is this address a distbatch worker?",
        ) from None


def error_from_response(node: str, status: int, body: bytes) -> NodeError:
    """The exception a worker's error answer (`status`, JSON `body`) means."""
    try:
        payload = json.loads(body)
        code, message = str(payload.get("error", "error")), str(payload.get("message", ""))
    except (ValueError, AttributeError):
        payload, code, message = {}, "error", body[:200].decode(errors="replace")
    if status == 401:
        return AuthError(
            node,
            f"{message or 'unauthorized'}: the worker wants the token it was started with "
            "(DISTBATCH_TOKEN in its environment); a client sends the one it was made with "
            "(ShardClient(token=...), else DISTBATCH_TOKEN then), and the process-wide client "
            "reads DISTBATCH_TOKEN again whenever it changes",
        )
    if status == 507:
        return CapacityError(node, message)
    if status == 404 and isinstance(payload.get("missing"), list):
        return ShardNotFoundError(node, [tuple(k) for k in payload["missing"]])
    if status == 409 and code == "shards_replaced":
        return ShardsReplacedError(node, status, code, message, payload)
    if code == "engine_error":
        return EngineError(
            node, str(payload.get("exception", "Exception")), message, str(payload.get("traceback", ""))
        )
    if status >= 500:
        return ServerError(node, status, code, message)
    return RequestError(node, status, code, message, payload if isinstance(payload, dict) else {})


def merge_errors(errors: list[BaseException]) -> BaseException:
    """One error for several failed requests: all missing keys together, else the first."""
    not_found = [e for e in errors if isinstance(e, ShardNotFoundError)]
    others = [e for e in errors if not isinstance(e, ShardNotFoundError)]
    if others:
        return others[0]
    if len(not_found) == 1:
        return not_found[0]
    nodes = sorted({e.node for e in not_found})
    merged = ShardNotFoundError(", ".join(nodes), [k for e in not_found for k in e.keys])
    merged.missing_by_node = {n: [k for e in not_found if e.node == n for k in e.keys] for n in nodes}
    return merged


def all_results(results: list[T | BaseException]) -> list[T]:
    """`asyncio.gather(..., return_exceptions=True)`'s results, or one error for its failures."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise merge_errors(errors)
    return results  # type: ignore[return-value]  # no exception among them
