"""The worker's command line (`python -m rpc_server`): its flags, their defaults and checks.

In the library, not the server, because launchers check a worker's flags before they start
anything (`WorkerGroup.ray` refuses bad ones before placing an actor), and the library never
imports `rpc_server`. Pure argparse: no server, store or engine is imported here.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from distbatch.serving.server import DEFAULT_MAX_THREADS, DEFAULT_READ_TIMEOUT

__all__ = [
    "DEFAULT_MAX_JSON_BYTES",
    "DEFAULT_MAX_KEYS_PER_REQUEST",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_MAX_THREADS",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_STAGE_TTL",
    "UNSET",
    "build_parser",
    "check_flag_values",
    "parse_flags",
]

DEFAULT_MAX_REQUEST_BYTES = 1 << 30
DEFAULT_MAX_JSON_BYTES = 64 << 20
DEFAULT_MAX_KEYS_PER_REQUEST = 200_000
DEFAULT_MAX_RESPONSE_BYTES = 1 << 30
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_STAGE_TTL = 600.0

DESCRIPTION = "Run one distbatch worker; prints its `host:port` as the first stdout line."
EPILOG = (
    "Sizes take a plain byte count or a binary unit: 64K, 512M, 8G, 1.5T (K = 1024 bytes). "
    "DISTBATCH_TOKEN in the environment, if set and not empty, is the bearer token every "
    "request but /health must carry; clients read the same variable."
)
PROG_ENV = "DISTBATCH_WORKER_PROG"  # what --help calls the command (`distbatch worker` sets it)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def byte_size(text: str) -> int:
    """`8G` -> 8589934592: a byte count, plain or with a binary unit (argparse type)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a unit, e.g. 512M or 8G")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def human_size(value: int) -> str:
    """1073741824 -> '1G': how a default size reads in `--help`."""
    for unit in ("T", "G", "M", "K"):
        if value >= _UNITS[unit] and value % _UNITS[unit] == 0:
            return f"{value // _UNITS[unit]}{unit}"
    return str(value)


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The worker's command line, for `python -m rpc_server` and for launchers that check flags."""
    parser = argparse.ArgumentParser(
        prog=os.environ.get(PROG_ENV) or "python -m rpc_server",
        description=DESCRIPTION,
        epilog=EPILOG,
        exit_on_error=exit_on_error,
    )
    # In this order: it is the order `--help` lists them in.
    _add_address_flags(parser)
    _add_bound_flags(parser)
    _add_release_flags(parser)
    _add_process_flags(parser)
    return parser


def _add_address_flags(parser: argparse.ArgumentParser) -> None:
    """Where the worker listens."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="bind address; 0.0.0.0 for every interface (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default: %(default)s)")


def _add_bound_flags(parser: argparse.ArgumentParser) -> None:
    """How much the worker stores, accepts and answers at once."""
    parser.add_argument(
        "--max-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="store capacity; a put past it is refused with 507 (default: no bound)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=byte_size,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="SIZE",
        help="refuse (413) a request body larger than this"
        f" (default: {human_size(DEFAULT_MAX_REQUEST_BYTES)})",
    )
    parser.add_argument(
        "--max-json-bytes",
        type=byte_size,
        default=DEFAULT_MAX_JSON_BYTES,
        metavar="SIZE",
        help=f"refuse (413) a JSON body larger than this (default: {human_size(DEFAULT_MAX_JSON_BYTES)})",
    )
    parser.add_argument(
        "--max-keys-per-request",
        type=int,
        default=DEFAULT_MAX_KEYS_PER_REQUEST,
        metavar="N",
        help="refuse (413) a request naming more shards (default: %(default)s)",
    )
    parser.add_argument(
        "--max-response-bytes",
        type=byte_size,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        metavar="SIZE",
        help="refuse (413) a fetch whose response would be larger; clients split below it"
        f" (default: {human_size(DEFAULT_MAX_RESPONSE_BYTES)})",
    )
    parser.add_argument(
        "--stage-ttl",
        type=float,
        default=DEFAULT_STAGE_TTL,
        metavar="S",
        help="drop a multi-request put not committed within S seconds, releasing its capacity"
        " (default: %(default)s)",
    )
    parser.add_argument(
        "--max-threads",
        type=int,
        default=DEFAULT_MAX_THREADS,
        help="requests served at once; 4 reserve threads answer /health and abandon notices, others"
        " 503 busy (default: %(default)s)",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT,
        metavar="S",
        help="close a connection that sends nothing for S seconds (idle or stalled) (default: %(default)s)",
    )


def _add_release_flags(parser: argparse.ArgumentParser) -> None:
    """When the worker lets go of shards and shared memory."""
    parser.add_argument(
        "--max-idle-seconds",
        type=float,
        default=None,
        metavar="S",
        help="delete shards nobody put or fetched for S seconds (default: never)",
    )
    parser.add_argument(
        "--shm-max-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="same-host readers and writers share at most SIZE of shared regions; past it they"
        " use HTTP (default: no bound beyond --max-bytes)",
    )


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    """What the worker hosts, how it reports its address, when it exits, what it logs."""
    parser.add_argument(
        "--engine", help="engine factory to host, as pkg.module:Factory (default: none, a store only)"
    )
    parser.add_argument(
        "--address-file", type=Path, help="also write host:port to this file, atomically (default: none)"
    )
    parser.add_argument(
        "--exit-with-parent",
        type=int,
        metavar="PID",
        help="exit when process PID is no longer our parent, so no worker outlives its launcher"
        " (default: none)",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="the worker's logging level, any case (default: %(default)s)",
    )


def check_flag_values(args: argparse.Namespace) -> None:
    """ValueError for a parsed value no worker runs with (argparse only checks types)."""
    if args.max_idle_seconds is not None and not args.max_idle_seconds > 0:
        raise ValueError("--max-idle-seconds must be > 0")
    if args.shm_max_bytes is not None and args.shm_max_bytes < 0:
        raise ValueError("--shm-max-bytes must be >= 0")
    for flag, value in (
        ("--stage-ttl", args.stage_ttl),
        ("--read-timeout", args.read_timeout),
        ("--max-threads", args.max_threads),
        ("--max-response-bytes", args.max_response_bytes),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0")


UNSET = object()  # the default `parse_flags` gives the options a caller asks about


def parse_flags(flags: Sequence[str], *, unset: Iterable[str] = ()) -> argparse.Namespace:
    """Parse worker flags; ValueError, never an exit, on bad or unknown ones.

    Options named in `unset` (argparse dests, e.g. "host") default to `UNSET`, so a caller can
    tell whether they were given at all, abbreviated or not.
    """
    parser = build_parser(exit_on_error=False)
    parser.set_defaults(**dict.fromkeys(unset, UNSET))
    try:
        args, unknown = parser.parse_known_args(list(flags))
    except argparse.ArgumentError as exc:
        raise ValueError(f"bad worker flag: {exc}") from None
    if unknown:
        raise ValueError(f"unknown worker flags: {unknown}")
    return args
