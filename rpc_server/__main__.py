"""`python -m rpc_server`: run one worker; prints its `host:port` as the first stdout line.

Everything else the process writes to stdout (an engine's prints, C code, subprocesses) goes
to stderr instead, so the address line is never preceded by, or stuck behind, engine output.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from distbatch.atomic import write_text_atomically
from rpc_server.app import (
    DEFAULT_MAX_JSON_BYTES,
    DEFAULT_MAX_KEYS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MAX_THREADS,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_STAGE_TTL,
    ServerConfig,
    create_app,
)
from rpc_server.errors import EngineLoadError
from rpc_server.serve import WorkerServer


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The worker's command line; launchers that host the app in-process (Ray) reuse it."""
    parser = argparse.ArgumentParser(
        prog="python -m rpc_server", description=__doc__, exit_on_error=exit_on_error
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--max-bytes", type=int, default=None, help="store capacity in bytes")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    parser.add_argument("--max-json-bytes", type=int, default=DEFAULT_MAX_JSON_BYTES)
    parser.add_argument("--max-keys-per-request", type=int, default=DEFAULT_MAX_KEYS_PER_REQUEST)
    parser.add_argument(
        "--max-response-bytes",
        type=int,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        help="refuse (413) a fetch whose response would be larger; clients split below it",
    )
    parser.add_argument(
        "--stage-ttl",
        type=float,
        default=DEFAULT_STAGE_TTL,
        metavar="S",
        help="drop a multi-request put not committed within S seconds, releasing its capacity",
    )
    parser.add_argument(
        "--max-threads",
        type=int,
        default=DEFAULT_MAX_THREADS,
        help="requests served at once; 4 reserve threads answer /health and abandon notices, others 503 busy",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT,
        metavar="S",
        help="close a connection that sends nothing for S seconds (idle or stalled)",
    )
    parser.add_argument(
        "--max-idle-seconds",
        type=float,
        default=None,
        metavar="S",
        help="delete shards nobody put or fetched for S seconds (default: never)",
    )
    parser.add_argument("--engine", help="engine factory to host, as pkg.module:Factory")
    parser.add_argument("--address-file", type=Path, help="also write host:port to this file")
    parser.add_argument(
        "--exit-with-parent",
        type=int,
        metavar="PID",
        help="exit when process PID is no longer our parent (no orphans if a launcher dies)",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` the parsed flags ask for; ValueError for a value no server runs with."""
    if args.max_idle_seconds is not None and not args.max_idle_seconds > 0:
        raise ValueError("--max-idle-seconds must be > 0")
    for flag, value in (
        ("--stage-ttl", args.stage_ttl),
        ("--read-timeout", args.read_timeout),
        ("--max-threads", args.max_threads),
        ("--max-response-bytes", args.max_response_bytes),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0")
    return ServerConfig(
        max_bytes=args.max_bytes,
        max_request_bytes=args.max_request_bytes,
        max_json_bytes=args.max_json_bytes,
        max_keys_per_request=args.max_keys_per_request,
        engine=args.engine,
        max_idle_seconds=args.max_idle_seconds,
        max_response_bytes=args.max_response_bytes,
        stage_ttl=args.stage_ttl,
        max_threads=args.max_threads,
        read_timeout=args.read_timeout,
    )


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


def server_config_from_flags(flags: Sequence[str]) -> ServerConfig:
    """A `ServerConfig` from store flags (`--max-bytes N`, ...); ValueError, never an exit, on bad ones."""
    return server_config(parse_flags(flags))


def _watch_parent(parent_pid: int, interval: float = 0.5) -> None:
    """SIGTERM ourselves once `parent_pid` stops being our parent (it died; we were re-parented)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _divert_stdout() -> int | None:
    """Keep a private copy of stdout for the address line and point fd 1 (and `sys.stdout`) at stderr.

    Called before the engine is imported. From then on whatever anyone writes to stdout --
    `print`, C extensions, subprocesses -- lands in stderr (a launcher sends it to a log file),
    so the address stays the first stdout line and no engine output waits on a stdout pipe the
    launcher stops reading after that line. Returns the private fd (not inheritable by
    subprocesses), or None if there is no stdout or stderr to work with.
    """
    try:
        address_fd = os.dup(1)
    except OSError:
        return None  # started with stdout closed
    if sys.stdout is not None:
        sys.stdout.flush()
    try:
        os.dup2(2, 1)
    except OSError:  # started with stderr closed: leave stdout as it is
        os.close(address_fd)
        return None
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # prints reach the log as lines, not 8 KiB blocks
    return address_fd


def _announce(node: str, address_fd: int | None) -> None:
    """Write `node` as the one line of the private stdout copy, then close it (EOF for the reader)."""
    line = (node + "\n").encode()
    if address_fd is None:
        print(node, flush=True)
        return
    try:
        while line:
            line = line[os.write(address_fd, line) :]
    except OSError as exc:  # the launcher stopped listening; it may still use --address-file
        logging.getLogger("rpc_server").warning("could not write the address to stdout: %s", exc)
    finally:
        os.close(address_fd)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        config = server_config(args)
    except ValueError as exc:
        print(f"rpc_server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    address_fd = _divert_stdout()  # before create_app, which imports the engine
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        app = create_app(config)
    except EngineLoadError as exc:
        print(f"rpc_server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    server = WorkerServer(app, args.host, args.port)

    def stop_on_sigterm(signum: int, frame: object) -> None:
        # Ask the serve loop to return (from another thread: shutdown() waits for
        # the loop) instead of raising in whatever frame the signal interrupted.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Thread(target=server.stop_serving, name="sigterm", daemon=True).start()

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    if args.exit_with_parent is not None:
        _watch_parent(args.exit_with_parent)
    # The file first: whoever read the stdout line may look for the file at once.
    if args.address_file is not None:
        write_text_atomically(args.address_file, server.node + "\n")
    _announce(server.node, address_fd)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    # The server is closed and the store goes with the process; don't let interpreter
    # exit wait for an engine method still running on its thread (it could take minutes).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
