"""The worker's command line (`python -m rpc_server`): its flags, their defaults and checks.

In the library, not the server, because launchers check a worker's flags before they start
anything (`WorkerGroup.ray` refuses bad ones before placing an actor), and the library never
imports `rpc_server`. Pure argparse: no server, store or engine is imported here.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from distbatch.errors import InvalidArgumentError, InvalidTypeError
from distbatch.ids import validate_node
from distbatch.protocol import DEFAULT_MAX_THREADS, DEFAULT_READ_TIMEOUT

__all__ = [
    "DEFAULT_MAX_JSON_BYTES",
    "DEFAULT_MAX_KEYS_PER_REQUEST",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_MAX_THREADS",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_STAGE_TTL",
    "GROUP_OPTIONS",
    "MAX_ENGINE_KWARGS_BYTES",
    "UNSET",
    "LOCAL_GROUP_OPTIONS",
    "build_parser",
    "check_engine_kwargs",
    "check_flag_values",
    "check_launcher_flags",
    "check_rank",
    "engine_kwargs_json",
    "parse_flags",
    "port_number",
]

DEFAULT_MAX_REQUEST_BYTES = 1 << 30
DEFAULT_MAX_JSON_BYTES = 64 << 20
DEFAULT_MAX_KEYS_PER_REQUEST = 200_000
DEFAULT_MAX_RESPONSE_BYTES = 1 << 30
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_STAGE_TTL = 600.0
# Engine keyword arguments travel on the worker's command line (one argument: Linux takes up to
# 128 KiB) and in the process list: configuration, not data. A path to a file carries more.
MAX_ENGINE_KWARGS_BYTES = 64 << 10
MAX_ENGINE_KWARGS_DEPTH = 32

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


def port_number(text: str) -> int:
    """`--port`: 0 (any free port) to 65535 (argparse type)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: use 0 to 65535 (0 picks a free one)")
    return port


class _RefusingParser(argparse.ArgumentParser):
    """A parser whose every usage error is a `ValueError`: no usage printed, no exit."""

    def error(self, message: str) -> NoReturn:
        raise InvalidArgumentError(f"bad worker flag: {message}")


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The worker's command line, for `python -m rpc_server` and for launchers that check flags.

    Flags are spelled out in full (`allow_abbrev=False`): `--max 1G` is no flag rather than a
    guess among the `--max-*` ones, and `--max-byte` is not taken for `--max-bytes`. Without
    `exit_on_error`, a usage error is a `ValueError` instead of a message and an exit.
    """
    parser = (argparse.ArgumentParser if exit_on_error else _RefusingParser)(
        prog=os.environ.get(PROG_ENV) or "python -m rpc_server",
        description=DESCRIPTION,
        epilog=EPILOG,
        exit_on_error=exit_on_error,
        allow_abbrev=False,
    )
    # In this order: it is the order `--help` lists them in.
    _add_address_flags(parser)
    _add_bound_flags(parser)
    _add_release_flags(parser)
    _add_durability_flags(parser)
    _add_process_flags(parser)
    return parser


def _add_address_flags(parser: argparse.ArgumentParser) -> None:
    """Where the worker listens."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="bind address; 0.0.0.0 for every interface (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=port_number, default=0, help="0 to 65535; 0 picks a free port (default: %(default)s)"
    )


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


# A durable worker's data directory names every address it was served at, oldest first, one a line.
NODE_FILE = "node"


def worker_data_dir(template: str | os.PathLike[str], rank: int) -> Path:
    """The data directory of the worker of `rank`: `template` with `{rank}` replaced."""
    return Path(str(template).replace("{rank}", str(rank)))


def served_at(data_dir: str | os.PathLike[str]) -> list[str]:
    """Every address a durable worker on `data_dir` was served at, oldest first (its ``node``
    file; empty if there is none): the last is where it serves now, or last did."""
    try:
        text = (Path(data_dir) / NODE_FILE).read_text()
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def _add_durability_flags(parser: argparse.ArgumentParser) -> None:
    """Whether the worker's shards survive its process."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write every committed put and delete to DIR (safetensors files, written behind"
        " the put) and, started again on DIR, recover every shard with its generation; {rank} in DIR"
        " is this worker's --rank, so a group's workers each get their own (default: none, shards"
        " live in memory only)",
    )
    parser.add_argument(
        "--sync",
        action="store_true",
        help="with --data-dir: answer a put or delete only once its record is on disk (default: off,"
        " written behind)",
    )
    parser.add_argument(
        "--controller",
        default=None,
        metavar="HOST:PORT",
        help="with --data-dir: a served controller (serve_controller) this worker tells where it now"
        " is when it starts again on DIR at another address (Controller.move_node for each earlier"
        " one; the worker's token); default: none, tell it yourself",
    )


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    """What the worker hosts, how it reports its address, when it exits, what it logs."""
    parser.add_argument(
        "--engine", help="engine factory to host, as pkg.module:Factory (default: none, a store only)"
    )
    parser.add_argument(
        "--engine-kwargs",
        type=_engine_kwargs_flag,
        default=None,
        metavar="JSON",
        help="keyword arguments for the engine factory, a JSON object such as '{\"lr\": 1e-06}'"
        f" (at most {human_size(MAX_ENGINE_KWARGS_BYTES)}; default: none)",
    )
    parser.add_argument(
        "--accept-engine",
        action="store_true",
        help="let a client choose and build this worker's engine (POST /v1/engine, as"
        " WorkerGroup.connect(engine=...) does): it imports and calls the factory the request names,"
        " so only where whoever can reach the worker (and holds its token) is trusted (default: off)",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=0,
        metavar="N",
        help="this worker's index in its group, the engine's context.rank (default: %(default)s)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="how many workers its group has, the engine's context.world_size (default: %(default)s)",
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
    check_rank(args.rank, args.world_size, "--rank", "--world-size")
    if args.engine_kwargs and not args.engine:
        raise InvalidArgumentError("--engine-kwargs needs --engine: they are the engine factory's arguments")
    if args.max_idle_seconds is not None and not args.max_idle_seconds > 0:
        raise InvalidArgumentError("--max-idle-seconds must be > 0")
    if args.sync and args.data_dir is None:
        raise InvalidArgumentError("--sync needs --data-dir: it waits for records written there")
    if args.controller is not None:
        if args.data_dir is None:
            raise InvalidArgumentError(
                "--controller needs --data-dir: it is told where a restarted worker is"
            )
        validate_node(args.controller)
    if args.shm_max_bytes is not None and args.shm_max_bytes < 0:
        raise InvalidArgumentError("--shm-max-bytes must be >= 0")
    for flag, value in (
        ("--stage-ttl", args.stage_ttl),
        ("--read-timeout", args.read_timeout),
        ("--max-threads", args.max_threads),
        ("--max-response-bytes", args.max_response_bytes),
    ):
        if not value > 0:
            raise InvalidArgumentError(f"{flag} must be > 0")


def check_rank(rank: Any, world_size: Any, rank_name: str = "rank", size_name: str = "world_size") -> None:
    """ValueError unless `world_size` >= 1 and 0 <= `rank` < `world_size` (both int)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgumentError(f"{size_name} must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{rank_name} must be an integer in [0, {world_size}), got {rank!r}")


def _json_problem(value: Any, where: str, depth: int = 0) -> tuple[type[Exception], str] | None:
    """Why `value` (at `where`) would not arrive as itself through JSON: (error type, message)."""
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return (
            None if math.isfinite(value) else (ValueError, f"{where} is {value!r}, which JSON cannot carry")
        )
    if depth >= MAX_ENGINE_KWARGS_DEPTH:
        return ValueError, f"{where} nests deeper than {MAX_ENGINE_KWARGS_DEPTH} levels"
    if isinstance(value, list):
        items: Iterable[tuple[Any, Any]] = enumerate(value)
    elif isinstance(value, dict):
        key = next((k for k in value if not isinstance(k, str)), None)
        if key is not None:
            return TypeError, f"{where} has the key {key!r}; JSON object keys are strings"
        items = value.items()
    else:
        name = type(value).__name__
        hint = " (it would arrive as a list: pass a list)" if isinstance(value, tuple) else ""
        if type(value).__module__.partition(".")[0] in ("torch", "numpy"):
            hint = " (.tolist() / .item() it, or pass a path to a file the engine loads)"
        return TypeError, f"{where} is a {name}, which does not arrive as itself through JSON{hint}"
    for key, item in items:
        problem = _json_problem(item, f"{where}[{key!r}]", depth + 1)
        if problem is not None:
            return problem
    return None


def check_engine_kwargs(kwargs: Any) -> dict[str, Any]:
    """`kwargs` as a dict, if it is keyword arguments that arrive in an engine unchanged.

    That is: a mapping of Python identifiers (not `context`, which the worker passes itself) to
    JSON values (str, int, float, bool, None, lists and string-keyed dicts of those; no NaN or
    infinity, no tuples or sets, no tensors) that survive a JSON round trip equal, at most
    `MAX_ENGINE_KWARGS_BYTES` as JSON. TypeError for a value of the wrong type, ValueError for
    the rest, each naming the offending key.
    """
    if not isinstance(kwargs, Mapping):
        raise InvalidTypeError(
            f"engine_kwargs must be a mapping of keyword arguments, got {type(kwargs).__name__}"
        )
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise InvalidTypeError(f"engine_kwargs key {key!r} is not a string")
        if not key.isidentifier():
            raise InvalidArgumentError(
                f"engine_kwargs key {key!r} is not a Python identifier, so not a keyword argument"
            )
        if key == "context":
            raise InvalidArgumentError(
                "engine_kwargs key 'context' is taken: the worker passes its WorkerContext as it"
            )
        problem = _json_problem(value, f"engine_kwargs[{key!r}]")
        if problem is not None:
            raise problem[0](problem[1] + "; engine_kwargs must be JSON")
    plain = dict(kwargs)
    text = _dump(plain)
    if json.loads(text) != plain:  # a subclass that encodes as something else
        raise InvalidArgumentError(f"engine_kwargs do not survive a JSON round trip unchanged: {text[:200]}")
    size = len(text.encode())
    if size > MAX_ENGINE_KWARGS_BYTES:
        biggest = max(plain, key=lambda k: len(_dump(plain[k])))
        raise InvalidArgumentError(
            f"engine_kwargs are {size} bytes as JSON, over the {human_size(MAX_ENGINE_KWARGS_BYTES)} bound"
            f" (the biggest is {biggest!r}): pass a path to a file the engine loads instead"
        )
    return plain


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def engine_kwargs_json(kwargs: Mapping[str, Any] | None) -> str | None:
    """The `--engine-kwargs` value for `kwargs` (None for none or empty), checked as
    `check_engine_kwargs` does: launchers call it before they start anything."""
    if kwargs is None:
        return None
    plain = check_engine_kwargs(kwargs)
    return _dump(plain) if plain else None


def _engine_kwargs_flag(text: str) -> dict[str, Any]:
    """`--engine-kwargs`: a JSON object of keyword arguments (argparse type)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    try:
        return check_engine_kwargs(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The flags a worker group sets for each worker itself (argparse dest -> why), refused in `args=`.
GROUP_OPTIONS = {
    "rank": "is the group's to set: worker i is rank i",
    "world_size": "is the group's to set: its worker count",
    "engine_kwargs": "is the group's to set: pass engine_kwargs= to the group",
    "accept_engine": "is for workers a controller connects to: a group names its engine itself",
}

# What `WorkerGroup.local` decides besides (argparse dest -> why), also refused in `args=`.
LOCAL_GROUP_OPTIONS = {
    "port": "is the group's to choose: each worker listens on a free port (port 0), and group.nodes"
    " lists them (distbatch.launch.spawn_worker(args=['--port', N]) starts one worker on a port of yours)",
    "address_file": "would be written by every worker of the group: group.nodes lists their addresses",
    "exit_with_parent": "is the group's to set: its workers exit when this process does",
}


UNSET = object()  # the default `parse_flags` gives the options a caller asks about


def parse_flags(flags: Sequence[str], *, unset: Iterable[str] = ()) -> argparse.Namespace:
    """Parse worker flags; ValueError, never an exit, on bad or unknown ones.

    Options named in `unset` (argparse dests, e.g. "host") default to `UNSET`, so a caller can
    tell whether they were given at all. An unknown flag (an abbreviated one too) is named.
    """
    parser = build_parser(exit_on_error=False)
    parser.set_defaults(**dict.fromkeys(unset, UNSET))
    try:
        args, unknown = parser.parse_known_args(list(flags))
    except argparse.ArgumentError as exc:
        raise InvalidArgumentError(f"bad worker flag: {exc}") from None
    if unknown:
        raise InvalidArgumentError(_unknown_flags(parser, unknown))
    return args


def _unknown_flags(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """What is wrong with arguments no worker flag took: the first unknown flag, and the flags
    it may have meant (flags are not abbreviated)."""
    given = [text for text in unknown if text.startswith("-")]
    if not given:
        return f"unexpected worker arguments {list(unknown)}: each value follows its --flag"
    name = given[0].split("=", 1)[0]
    known = [flag for flag in parser._option_string_actions if flag.startswith("--")]  # noqa: SLF001
    close = [flag for flag in known if flag.startswith(name)]
    close = close or difflib.get_close_matches(name, known, n=3, cutoff=0.8)
    if not close:
        return f"unknown worker flag {name!r}"
    meant = close[0] if len(close) == 1 else f"one of {', '.join(close)}"
    return f"unknown worker flag {name!r}: did you mean {meant}? (flags are not abbreviated)"


def check_launcher_flags(flags: Sequence[str], decided: Mapping[str, str]) -> argparse.Namespace:
    """Parse and check worker flags a launcher was given; ValueError for bad ones, or for one the
    launcher sets itself (`decided`: argparse dest -> the rest of the message, e.g. "rank" ->
    "is the group's to set: ...")."""
    args = parse_flags(flags, unset=decided)
    for name, why in decided.items():
        if getattr(args, name) is not UNSET:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} {why}")
    parser = build_parser()
    for name in decided:  # the launcher passes its own values; the defaults stand in for the checks
        setattr(args, name, parser.get_default(name))
    check_flag_values(args)
    return args
