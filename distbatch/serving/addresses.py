"""Where a server listens and how peers reach it: `host:port` text, port checks, the address to
advertise for a wildcard bind, and the error a failed bind raises.

Apart from the HTTP machinery because they need none of it: plain functions of a host and a port
that the server (`server.HttpServer`) and its callers (the worker's `rpc_server.serve`) share.
"""

from __future__ import annotations

import errno
import socket

from distbatch.errors import InvalidArgumentError, ServerBindError

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def format_node(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port(port: object) -> int:
    """`port` if a server can listen on it: an int from 0 (any free port) to 65535, else
    `ValueError` naming it (the socket layer would take 70000 as 4464, modulo 65536)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidArgumentError(
            f"port {port!r} is not a port to listen on: use 0 to 65535 (0 picks a free one)"
        )
    return port


def advertised_host(bind_host: str) -> str:
    """The host peers should dial: the bind host, or this machine's address for a wildcard."""
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def bind_error(host: str, port: int, error: OSError) -> ServerBindError:
    """The `ServerBindError` for a failed bind or listen on `host`:`port`, with what to do about
    the usual causes (the port taken, a host that is not this machine's)."""
    hint = ""
    if error.errno == errno.EADDRINUSE:
        hint = "; another process holds the port: stop it, pick another port, or pass port 0 for a free one"
    elif error.errno == errno.EADDRNOTAVAIL:
        hint = "; that host is not an address of this machine (0.0.0.0 listens on all of them)"
    where = format_node(host, port) if port else f"{host} (a free port)"
    return ServerBindError(error.errno, f"cannot listen on {where}: {error.strerror or error}{hint}")
