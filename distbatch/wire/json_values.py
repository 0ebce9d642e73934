"""JSON values on the wire: which values are JSON (exact types, NaN and infinities allowed,
nesting bounded by `MAX_JSON_DEPTH`), how a column of them is dumped once and how a header's JSON
is loaded (repeated keys refused). Needs neither numpy nor torch."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from distbatch.errors import WireFormatError
from distbatch.wire.container import (
    unique_keys,
)

if TYPE_CHECKING:
    pass


MAX_JSON_DEPTH = 64


def dump_json_array(values: Sequence[Any]) -> str:
    """A JSON array's compact UTF-8 text (its size is what the store counts); values holding
    lone surrogates, which UTF-8 cannot carry, travel as `\\u` escapes instead."""
    try:
        text = json.dumps(values, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise WireFormatError(f"cannot encode JSON value: {exc}") from None
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(values, separators=(",", ":"))
    return text


def check_json(value: Any, depth: int = 0) -> Any:
    """Return `value` as plain JSON types, or raise if it would not round-trip exactly."""
    if depth > MAX_JSON_DEPTH:
        raise WireFormatError(f"JSON value nested deeper than {MAX_JSON_DEPTH}")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [check_json(v, depth + 1) for v in value]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise WireFormatError(f"JSON object keys must be strings, got {k!r}")
        return {k: check_json(v, depth + 1) for k, v in value.items()}
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
        check_json(value)
    except WireFormatError:
        return True
    return False


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def dump_if_exact(values: list[Any]) -> str | None:
    """The values' JSON text if they encode, decode back equal and nest at most `MAX_JSON_DEPTH`
    deep; None when any value needs the careful walk (which says what is wrong)."""
    try:
        text = json.dumps(values, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
        flat = _surely_exact(values)
        if not flat and json.loads(text) != values:
            return None
    except (TypeError, ValueError, RecursionError):
        return None
    if not flat and _depth(text) > MAX_JSON_DEPTH + 1:  # +1: the array
        return None
    return text


# Values of these exact types encode to JSON that decodes back equal (a float may not: NaN).
_EXACT_SCALARS = frozenset({str, int, bool, type(None)})


def _surely_exact(values: list[Any]) -> bool:
    """Whether the values need no decode to know they come back equal and shallow: each a
    scalar of an exact type above, or each a dict of them under string keys (C-level passes,
    no step per value in Python)."""
    kinds = set(map(type, values))
    if kinds <= _EXACT_SCALARS:
        return True
    if kinds != {dict}:
        return False
    keys = set(map(type, itertools.chain.from_iterable(values)))
    items = set(map(type, itertools.chain.from_iterable(map(dict.values, values))))
    return keys <= {str} and items <= _EXACT_SCALARS


def _depth(text: str) -> int:
    """The most brackets and braces open at once in JSON `text`, those inside strings left out
    (numpy over its bytes; a regex takes the strings out where one holds an escape)."""
    raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate is never a bracket or a quote
    if b"\\" in raw:
        raw = _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass")
    skeleton = np.frombuffer(raw, dtype=np.uint8)
    # Only the brackets and the quotes matter: a bracket is inside a string when an odd number
    # of quotes come before it (no escapes left, so quotes pair up).
    brackets = np.flatnonzero(
        (skeleton == ord("[")) | (skeleton == ord("{")) | (skeleton == ord("]")) | (skeleton == ord("}"))
    )
    quotes = np.flatnonzero(skeleton == ord('"'))
    outside = brackets[(np.searchsorted(quotes, brackets) & 1) == 0]
    if not len(outside):
        return 0
    kinds = skeleton[outside]
    steps = np.where((kinds == ord("[")) | (kinds == ord("{")), 1, -1)
    return int(np.cumsum(steps, dtype=np.int64).max())


def load_json(name: str, text: str, unique_keys: bool = False) -> Any:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate, which no UTF-8 encoder accepts
            raise WireFormatError(f"{name!r}: JSON is not valid UTF-8: {exc}") from None
    try:
        # The description names each thing once: a repeated key (read as "last one wins" here,
        # maybe otherwise by another reader) is refused, as the container header does.
        return json.loads(text, object_pairs_hook=_unique_pairs if unique_keys else None)
    except WireFormatError as exc:
        raise WireFormatError(f"{name!r}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise WireFormatError(f"{name!r}: invalid JSON: {exc}") from None


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return unique_keys(pairs, "the bundle description")
