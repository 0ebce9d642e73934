"""Where the shared bearer token comes from (read in this one place)."""

from __future__ import annotations

import hmac
import os

TOKEN_ENV = "DISTBATCH_TOKEN"


def token_from_env() -> str | None:
    """The token in `DISTBATCH_TOKEN`, or None when unset or empty."""
    return os.environ.get(TOKEN_ENV) or None


def bearer_ok(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries `token` (compared in constant time)."""
    scheme, _, provided = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and same_secret(provided.strip(), token)


def same_secret(given: object, expected: str) -> bool:
    """Whether `given` is the string `expected` (compared in constant time)."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
