"""Workers as Ray actors: the multi-node launcher behind `WorkerGroup.ray` (needs `distbatch[ray]`).

Each actor hosts the same `rpc_server` app as `python -m rpc_server`, in-process,
on the node's IP and a free port. Ray only places, starts and stops the actors:
batches and engine calls travel over the workers' HTTP data plane, never through
Ray's object store. Import this module only when Ray is wanted: it imports `ray`.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distbatch.errors import WorkerUnavailableError

STRATEGIES = {"spread": "SPREAD", "strict_spread": "STRICT_SPREAD", "pack": "PACK"}
DEFAULT_CPUS_PER_WORKER = 0.25  # a worker mostly waits on sockets; keeps 2+ workers on a 2-CPU node


def init_local_ray(**kwargs: Any) -> Any:
    """`ray.init` for a closed machine: no dashboard, no usage stats, no token file written to ~.

    Ray 2.60 turns token auth on for a new local cluster and saves a token to
    ~/.ray/auth_token; here the mode is set explicitly and a fresh token is kept
    in this process's environment (which Ray's own processes inherit) instead.
    Variables already set win. `kwargs` go to `ray.init` (e.g. `num_cpus`, `address`).
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not (
        os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    ):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _reload_ray_auth_config()
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, **kwargs}
    if options.get("address") in (None, "local"):
        # A new single-machine cluster (never a stale one some crashed run left registered),
        # with Ray's processes and our workers on loopback.
        options["address"] = "local"
        options.setdefault("_node_ip_address", "127.0.0.1")
    return ray.init(**options)


def _reload_ray_auth_config() -> None:
    """Make this process see the auth variables set above (Ray reads its config once, at import).

    The same refresh Ray does when it turns token auth on by itself; private API, so best effort.
    """
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # another Ray version: the variables still reach its processes
        pass


class _WorkerActor:
    """One worker: an `rpc_server` app served on a thread of this actor's process."""

    def __init__(self, engine: str | None, env: Mapping[str, str]) -> None:
        from rpc_server.app import ServerConfig, create_app
        from rpc_server.serve import WorkerServer

        os.environ.update(env)  # before the app: ServerConfig reads DISTBATCH_TOKEN, engines read the rest
        for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)  # the process is running: PYTHONPATH alone would not reach imports
        app = create_app(ServerConfig(engine=engine))
        self.server = WorkerServer(app, ray.util.get_node_ip_address(), 0).start_background()

    def node(self) -> str:
        return self.server.node

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.shutdown()


class RayWorkers:
    """The actors and placement group behind a Ray `WorkerGroup`; `stop()` releases both."""

    def __init__(self, actors: list[Any], group: Any, nodes: list[str]) -> None:
        self.actors = actors
        self.placement_group = group
        self.nodes = nodes

    def actor(self, node: str) -> Any:
        return self.actors[self.nodes.index(node)]

    def dead(self, node: str) -> bool:
        """True once the actor serving `node` is known to be gone (a cheap local check)."""
        if not ray.is_initialized():
            return True
        try:
            ray.get(self.actor(node).node.remote(), timeout=5.0)
        except ray.exceptions.RayActorError:
            return True
        except Exception:
            return False
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """Shut each server down (so engines release what they hold), kill the actors, free the bundles."""
        if not ray.is_initialized():  # the cluster went first: the actors went with it
            return
        stopping = []
        for actor in self.actors:
            try:
                stopping.append(actor.stop.remote())
            except Exception:
                pass
        try:
            ray.wait(stopping, num_returns=len(stopping), timeout=timeout)
        except Exception:
            pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(self.placement_group)
        except Exception:
            pass
        self.actors = []


def start_ray_workers(
    n: int,
    engine: str | None = None,
    *,
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    placement: str = "spread",
    resources: Mapping[str, float] | None = None,
    startup_timeout: float = 120.0,
) -> RayWorkers:
    """Place `n` worker actors with a placement group and start their servers; returns once all serve."""
    if n < 1:
        raise ValueError(f"worker count must be >= 1, got {n}")
    if placement not in STRATEGIES:
        raise ValueError(f"placement must be one of {sorted(STRATEGIES)}, got {placement!r}")
    envs = list(env) if isinstance(env, Sequence) else [env or {}] * n
    if len(envs) != n:
        raise ValueError(f"{len(envs)} env mappings for {n} workers")
    bundle = {"CPU": DEFAULT_CPUS_PER_WORKER}
    for key, value in (resources or {}).items():
        bundle[{"num_cpus": "CPU", "num_gpus": "GPU"}.get(key, key)] = float(value)
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if not ray.is_initialized():
        init_local_ray()

    group = placement_group([dict(bundle) for _ in range(n)], strategy=STRATEGIES[placement])
    actors: list[Any] = []
    workers = RayWorkers(actors, group, [])
    try:
        ready, _ = ray.wait([group.ready()], timeout=startup_timeout)
        if not ready:
            raise WorkerUnavailableError(
                f"ray placement group {group.id.hex()}",
                f"{n} bundles of {bundle} ({STRATEGIES[placement]}) not placed within {startup_timeout}s "
                f"(cluster resources: {ray.available_resources()})",
            )
        others = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor_class = ray.remote(_WorkerActor)
        for i, extra in enumerate(envs):
            options: dict[str, Any] = {
                "num_cpus": bundle.get("CPU", 0),
                "num_gpus": bundle.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=i
                ),
            }
            if others:
                options["resources"] = others
            actors.append(actor_class.options(**options).remote(engine, dict(extra)))
        refs = [actor.node.remote() for actor in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=startup_timeout)
        if len(ready) < len(refs):
            raise WorkerUnavailableError("ray actors", f"workers did not start within {startup_timeout}s")
        try:
            workers.nodes = list(ray.get(refs))
        except ray.exceptions.RayActorError as exc:
            raise WorkerUnavailableError("ray actor", f"worker failed to start: {exc}") from None
    except BaseException:
        workers.stop(timeout=1.0)
        raise
    return workers
