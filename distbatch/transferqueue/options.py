"""The `backend.Distbatch` section of a TransferQueue config, checked before anything starts.

Plain Python over a mapping (TransferQueue hands over an OmegaConf *DictConfig*, which reads
as one): every option has a type and a default, an unknown or ill-typed one is a `ValueError`
naming it and listing what is accepted, so a typo fails `tq.init` instead of being ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distbatch.errors import InvalidArgumentError
from distbatch.ids import validate_node
from distbatch.launch.flags import byte_size

# The name TransferQueue's config gives the backend (`storage_backend`, and its options' section).
BACKEND_NAME = "Distbatch"
# The attribute a failed put's error carries: its TransferQueue metadata, which `rollback`
# releases where the put allocated it (set by the storage manager).
FAILED_PUT = "distbatch_failed_put"


def plain_config(config: Any) -> dict[str, Any]:
    """A config section (an OmegaConf *DictConfig*, a mapping or None) as a plain dict."""
    from omegaconf import DictConfig, OmegaConf  # TransferQueue's config library, loaded when needed

    if isinstance(config, DictConfig):
        return dict(OmegaConf.to_container(config, resolve=True))  # type: ignore[arg-type]
    return dict(config or {})


@dataclass(frozen=True)
class BackendOptions:
    """What `backend.Distbatch` may say.

    Attributes:
        endpoints: workers to use ("host:port"), started by someone else. Empty: the bootstrap
            starts its own, as Ray actors.
        workers: how many workers to start (None: one per Ray node); with `endpoints`, unused.
        token: the workers' bearer token (None: `DISTBATCH_TOKEN`, as for every client).
        capacity: bytes each started worker may hold (`--max-bytes`; "8G" or a number; None:
            no bound).
        same_host: reach workers on this host through shared memory (False: HTTP only).
        timeout: seconds one request to a worker may take, retries included.
        fast_schema: compute the field schema TransferQueue's client records after every put
            from offsets instead of one tensor per sample (equal result; see `fast_schema`). It
            applies to the whole process from the first manager that installs it until
            `distbatch.transferqueue.close()`.
        freeze_gc: the first manager of a process collects once and moves every object alive
            then (torch, Ray, TransferQueue: millions) out of the collector's sight
            (`gc.freeze()`), so full collections, which TransferQueue's per-sample metadata sets
            off during puts, stop walking them (`distbatch.gc_pause.freeze_long_lived`); not
            where something is frozen already. For the rest of the process.
        data_dir: each started worker's data directory, a durable worker (`--data-dir`; `{rank}`
            is the worker's rank: "/data/distbatch/w{rank}"). None: shards in memory only.
        sync_writes: with `data_dir`, a put is answered once its record is on disk (`--sync`).
    """

    endpoints: tuple[str, ...] = ()
    workers: int | None = None
    token: str | None = None
    capacity: int | None = None
    same_host: bool = True
    timeout: float = 60.0
    fast_schema: bool = True
    freeze_gc: bool = True
    data_dir: str | None = None
    sync_writes: bool = False

    @staticmethod
    def from_config(section: Mapping[str, Any] | None) -> BackendOptions:
        """Check `backend.Distbatch` (None or empty: every default)."""
        raw = dict(section or {})
        unknown = sorted(set(raw) - set(_CHECKS))
        if unknown:
            raise InvalidArgumentError(
                f"unknown option(s) {unknown} under backend.Distbatch; accepted: {sorted(_CHECKS)}"
            )
        values = {name: _CHECKS[name](raw[name]) for name in raw if raw[name] is not None}
        return BackendOptions(**values)

    def as_config(self) -> dict[str, Any]:
        """The section as the other processes must see it: what the bootstrap decided included."""
        return {
            "endpoints": list(self.endpoints),
            "workers": self.workers,
            "token": self.token,
            "capacity": self.capacity,
            "same_host": self.same_host,
            "timeout": self.timeout,
            "fast_schema": self.fast_schema,
            "freeze_gc": self.freeze_gc,
            "data_dir": self.data_dir,
            "sync_writes": self.sync_writes,
        }

    def worker_args(self) -> list[str]:
        """The flags of the workers the bootstrap starts."""
        args = [] if self.capacity is None else ["--max-bytes", str(self.capacity)]
        if self.data_dir is not None:
            args += ["--data-dir", self.data_dir, *(["--sync"] if self.sync_writes else [])]
        return args


def _endpoints(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise InvalidArgumentError(
            f'backend.Distbatch.endpoints must be a list of "host:port", got {value!r}'
        )
    return tuple(validate_node(_plain(v, str, "endpoints")) for v in value)


def _workers(value: Any) -> int:
    count = _plain(value, int, "workers")
    if count < 1:
        raise InvalidArgumentError(f"backend.Distbatch.workers must be at least 1, got {count}")
    return count


def _capacity(value: Any) -> int:
    if isinstance(value, str):
        try:
            return byte_size(value)
        except Exception:
            raise InvalidArgumentError(
                f"backend.Distbatch.capacity: {value!r} is not a size (e.g. 8G, 512M)"
            ) from None
    size = _plain(value, int, "capacity")
    if size < 0:
        raise InvalidArgumentError("backend.Distbatch.capacity must be >= 0")
    return size


def _timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(
            f"backend.Distbatch.timeout must be a number of seconds > 0, got {value!r}"
        )
    return float(value)


def _plain(value: Any, kind: type, name: str) -> Any:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise InvalidArgumentError(f"backend.Distbatch.{name} must be {kind.__name__}, got {value!r}")
    return value


_CHECKS: dict[str, Any] = {
    "endpoints": _endpoints,
    "workers": _workers,
    "token": lambda v: _plain(v, str, "token"),
    "capacity": _capacity,
    "same_host": lambda v: _plain(v, bool, "same_host"),
    "timeout": _timeout,
    "fast_schema": lambda v: _plain(v, bool, "fast_schema"),
    "freeze_gc": lambda v: _plain(v, bool, "freeze_gc"),
    "data_dir": lambda v: _plain(v, str, "data_dir"),
    "sync_writes": lambda v: _plain(v, bool, "sync_writes"),
}
