"""Where the shared bearer token comes from (read in this one place)."""

from __future__ import annotations

import os

TOKEN_ENV = "DISTBATCH_TOKEN"


def token_from_env() -> str | None:
    """The token in `DISTBATCH_TOKEN`, or None when unset or empty."""
    return os.environ.get(TOKEN_ENV) or None
