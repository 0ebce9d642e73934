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

from distbatch.atomic import write_text_atomically
from distbatch.errors import ServerBindError
from distbatch.launch.flags import build_parser, check_flag_values, worker_data_dir
from rpc_server.app import create_app
from rpc_server.config import ServerConfig
from rpc_server.errors import EngineLoadError
from rpc_server.serve import WorkerServer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`distbatch.launch.flags`, shared with the launchers that check flags)."""
    parser = build_parser()
    parser.description = f"{parser.prog}: {(__doc__ or '').split(': ', 1)[-1]}"  # named as it was called
    return parser.parse_args(argv)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` the parsed flags ask for; ValueError for a value no server runs with."""
    check_flag_values(args)
    return ServerConfig(
        max_bytes=args.max_bytes,
        max_request_bytes=args.max_request_bytes,
        max_json_bytes=args.max_json_bytes,
        max_keys_per_request=args.max_keys_per_request,
        engine=args.engine,
        engine_kwargs=args.engine_kwargs or {},
        accept_engine=args.accept_engine,
        rank=args.rank,
        world_size=args.world_size,
        max_idle_seconds=args.max_idle_seconds,
        max_response_bytes=args.max_response_bytes,
        stage_ttl=args.stage_ttl,
        max_threads=args.max_threads,
        read_timeout=args.read_timeout,
        shm_max_bytes=args.shm_max_bytes,
        data_dir=None if args.data_dir is None else str(worker_data_dir(args.data_dir, args.rank)),
        sync_writes=args.sync,
        controller=args.controller,
    )


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


def _started_line(node: str, config: ServerConfig) -> str:
    capacity = "unbounded" if config.max_bytes is None else f"{config.max_bytes} bytes"
    return (
        f"distbatch worker {node} serving: pid {os.getpid()}, rank {config.rank} of "
        f"{config.world_size}, engine {config.engine or 'none'}, capacity {capacity}, "
        f"token {'on' if config.token else 'off'}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        config = server_config(args)
    except ValueError as exc:
        print(f"rpc_server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    address_fd = _divert_stdout()  # before the engine is imported
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        # Binding builds the engine, once its node is known (see `create_app`).
        server = WorkerServer(create_app(config), args.host, args.port)
    except EngineLoadError as exc:
        print(f"rpc_server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ServerBindError as exc:
        print(f"rpc_server: {exc}", file=sys.stderr)
        raise SystemExit(1) from None

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
    # Its log says from the first moment what it is (a worker killed later leaves this much).
    print(_started_line(server.node, config), file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        print(f"distbatch worker {server.node} stopped", file=sys.stderr, flush=True)
    # The server is closed and the store goes with the process; don't let interpreter
    # exit wait for an engine method still running on its thread (it could take minutes).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
