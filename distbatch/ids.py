"""Task ids, field names and shard keys: what they may contain and how they are checked."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from distbatch.errors import InvalidArgumentError, InvalidIdError

ID_PATTERN = re.compile(r"[A-Za-z0-9._:@=+-]{1,200}")
# Not in the id alphabet, so "task/field" splits unambiguously.
KEY_SEPARATOR = "/"


class ShardKey(NamedTuple):
    """Names one shard: one field of one task."""

    task_id: str
    field: str

    def wire_name(self) -> str:
        return f"{self.task_id}{KEY_SEPARATOR}{self.field}"


SHOWN_CHARS = 60  # how much of a rejected value an error quotes


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for an error message, cut to about `limit` characters: a 5,000-character id
    (or a whole tensor passed by mistake) is named, not echoed."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"a {type(value).__name__}"
    return f"{text[:limit]}... ({size})"


def validate_id(value: Any, what: str = "id") -> str:
    """Return `value` if it is a valid task id / field name, else raise `InvalidIdError`."""
    if not isinstance(value, str) or ID_PATTERN.fullmatch(value) is None:
        raise InvalidIdError(f"invalid {what} {shown(value)}: must be 1-200 characters of [A-Za-z0-9._:@=+-]")
    return value


def validate_key(key: Any) -> ShardKey:
    """Coerce a `(task_id, field)` pair to a validated `ShardKey`."""
    if (type(key) is tuple or type(key) is ShardKey or type(key) is list) and len(key) == 2:
        task_id, field = key
        if (
            type(task_id) is str
            and type(field) is str
            and ID_PATTERN.fullmatch(task_id)
            and ID_PATTERN.fullmatch(field)
        ):
            return key if type(key) is ShardKey else ShardKey(task_id, field)
    if isinstance(key, ShardKey):
        task_id, field = key
    elif isinstance(key, (tuple, list)) and len(key) == 2:
        task_id, field = key
    else:
        raise InvalidIdError(f"invalid shard key {shown(key)}: expected a (task_id, field) pair")
    return ShardKey(validate_id(task_id, "task_id"), validate_id(field, "field"))




_NODE_PATTERN = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}")


def validate_node(node: Any) -> str:
    """Return `node` as `host:port` (an `http://` prefix is dropped) or raise `ValueError`."""
    if isinstance(node, str) and node.startswith("http://"):
        node = node[len("http://") :].rstrip("/")
    if not isinstance(node, str) or _NODE_PATTERN.fullmatch(node) is None:
        raise InvalidArgumentError(f"invalid node address {shown(node)}: expected 'host:port'")
    if not 1 <= int(node.rpartition(":")[2]) <= 65535:  # 0 is "any port" when binding, not a peer
        raise InvalidArgumentError(f"invalid node address {shown(node)}: the port must be 1-65535")
    return node


class ShardRef(NamedTuple):
    """Where one shard lives; `nbytes` (if known) lets the client bound response sizes."""

    node: str
    task_id: str
    field: str
    nbytes: int | None = None
