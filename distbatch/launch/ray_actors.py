"""Workers as Ray actors: the multi-node launcher behind `WorkerGroup.ray` (needs `distbatch[ray]`).

Each actor supervises one `python -m rpc_server` process, started on the actor's node with
`distbatch.launch` (as `WorkerGroup.local` starts them), bound on the node's IP and a free
port, and exiting with the actor. Ray only places, starts and stops the actors: batches and
engine calls travel over the workers' HTTP data plane, never through Ray's object store.
Import this module only when Ray is wanted: it imports `ray`.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from distbatch.errors import InvalidArgumentError, StateError, WorkerUnavailableError
from distbatch.launch.flags import GROUP_OPTIONS, check_launcher_flags
from distbatch.launch.local import LOG_DIR_PREFIX, WorkerLogs, spawn_worker

STRATEGIES = {"spread": "SPREAD", "strict_spread": "STRICT_SPREAD", "pack": "PACK"}
DEFAULT_CPUS_PER_WORKER = 0.25  # a worker mostly waits on sockets; keeps 2+ workers on a 2-CPU node


def prepare_ray_environment(new_cluster: bool = True) -> None:
    """Set Ray's closed-machine defaults in this process's environment, before any Ray process starts.

    Usage stats off; for a `new_cluster`, token auth set explicitly too: Ray 2.60 turns it on
    for a new local cluster and saves a token to ~/.ray/auth_token; here a fresh token is kept
    in this process's environment (which Ray's own processes inherit) instead. Variables already
    set win; joining an existing cluster leaves auth to that cluster's settings. Call it before
    `ray.init` or `ray.cluster_utils.Cluster` on a machine with no way out; `init_local_ray`
    calls it for you.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not new_cluster:
        return
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not (
        os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    ):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _reload_ray_auth_config()


def loopback_node_ip() -> str:
    """A loopback address Ray keeps as a node's IP.

    Ray replaces 127.0.0.1 (and "localhost") by the machine's external address, so a local
    cluster given 127.0.0.1 binds, and our workers listen on, the external interface. Linux
    routes all of 127.0.0.0/8 to loopback: 127.0.0.2 stays put. Where it cannot be bound
    (macOS configures only 127.0.0.1, and there Ray keeps clusters on localhost anyway),
    127.0.0.1.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.2", 0))
    except OSError:
        return "127.0.0.1"
    return "127.0.0.2"


logger = logging.getLogger("distbatch.launch")

NEW_CLUSTER_ATTEMPTS = 3
RAY_STARTUP_TIMED_OUT = "timed out during startup"  # Ray's message when its node did not register


def init_local_ray(**kwargs: Any) -> Any:
    """`ray.init` for a closed machine: no dashboard, no usage stats, no token file written to ~.

    With an `address` it joins that cluster; with none it joins `$RAY_ADDRESS` when that is set
    (as `ray job submit` and `ray start` leave it), and otherwise, or with "local", starts a new
    single-machine cluster on loopback, started again (up to `NEW_CLUSTER_ATTEMPTS` times) when
    Ray says its node timed out starting, which a busy machine makes happen. `kwargs` go to
    `ray.init` (e.g. `num_cpus`, `address`).
    """
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, **kwargs}
    if options.get("address") is None and os.environ.get("RAY_ADDRESS"):
        options["address"] = os.environ["RAY_ADDRESS"]
    new_cluster = options.get("address") in (None, "local")
    prepare_ray_environment(new_cluster)
    if not new_cluster:
        return ray.init(**options)
    # A new single-machine cluster (never a stale one some crashed run left registered), with
    # Ray's processes and our workers on loopback.
    options["address"] = "local"
    options.setdefault("_node_ip_address", loopback_node_ip())
    for attempt in range(1, NEW_CLUSTER_ATTEMPTS + 1):
        try:
            return ray.init(**options)
        except Exception as exc:
            # Ray gives its new node a fixed 30 s to register; on a machine busy enough that it
            # takes longer, Ray's daemons are stopped and the cluster is started again.
            if RAY_STARTUP_TIMED_OUT not in str(exc) or attempt == NEW_CLUSTER_ATTEMPTS:
                raise
            logger.warning("a new Ray cluster timed out starting (attempt %d): starting it again", attempt)
            ray.shutdown()
    raise AssertionError("unreachable")


def _reload_ray_auth_config() -> None:
    """Make this process see the auth variables set above (Ray reads its config once, at import).

    The same refresh Ray does when it turns token auth on by itself; private API, so best effort.
    """
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # another Ray version: the variables still reach its processes
        pass


class _WorkerActor:
    """One worker: a `python -m rpc_server` child process of this actor, on the actor's node.

    The child gets `env` on top of the actor's environment (Ray's `runtime_env` variables,
    CUDA_VISIBLE_DEVICES, ...) and imports with the actor's import path, as local workers do
    with the controller's. It is rank `rank` of `world_size`. Its output goes to a log file on
    this node (`log_file()`): in `$DISTBATCH_LOG_DIR` when `env` or the actor's environment sets
    it, else in the temporary directory's `log_name`, which the group's workers on this node
    share and which goes once they all stopped cleanly (see `WorkerLogs`). It exits with the
    actor, even when the actor is killed (`--exit-with-parent`).
    """

    def __init__(
        self,
        engine: str | None,
        env: Mapping[str, str],
        flags: Sequence[str],
        startup_timeout: float,
        rank: int = 0,
        world_size: int = 1,
        log_name: str | None = None,
    ) -> None:
        try:
            self.worker = spawn_worker(
                host=ray.util.get_node_ip_address(),
                args=[*flags, *(["--engine", engine] if engine else [])],
                env=env,
                startup_timeout=startup_timeout,
                log_dir=WorkerLogs.open(env.get("DISTBATCH_LOG_DIR") or None, shared_name=log_name),
                rank=rank,
                world_size=world_size,
                # An actor starts one worker in its life: a fork server would cost what it saves.
                fork=False,
            )
        except WorkerUnavailableError as exc:
            # Ray pickles a creation error to the driver, and this one's constructor does not
            # round-trip (the driver would get an UnserializableException): send its text.
            raise StateError(str(exc)) from None

    def node(self) -> str:
        return self.worker.node

    def pid(self) -> int:
        """The worker process's pid (the actor's child, which serves the node)."""
        return self.worker.pid

    def alive(self) -> bool:
        """Whether the worker process still runs (the actor may outlive it)."""
        return self.worker.alive()

    def log_file(self) -> str | None:
        """The worker's log file, on this actor's node."""
        return str(self.worker.log_file) if self.worker.log_file is not None else None

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex id), to check or report placement."""
        return ray.get_runtime_context().get_node_id()

    def stop(self, timeout: float = 4.0) -> None:
        """SIGTERM the worker (its engine releases what it holds), SIGKILL it after `timeout`."""
        self.worker.stop(timeout)


class RayWorkers:
    """The actors and placement group behind a Ray `WorkerGroup`; `stop()` releases both."""

    def __init__(self, actors: list[Any], group: Any | None, nodes: list[str]) -> None:
        self.actors = actors
        self.placement_group = group
        self.nodes = nodes

    def actor(self, node: str) -> Any:
        return self.actors[self.nodes.index(node)]

    def dead(self, node: str) -> bool:
        """True once the actor serving `node`, or its worker process, is known to be gone."""
        if not ray.is_initialized():
            return True
        try:
            return not ray.get(self.actor(node).alive.remote(), timeout=5.0)
        except ray.exceptions.RayActorError:
            return True
        except Exception:
            return False

    def stop(self, timeout: float = 5.0) -> None:
        """Stop each worker process (so engines release what they hold), kill the actors, free the bundles."""
        if not ray.is_initialized():  # the cluster went first: the actors went with it
            return
        stopping = []
        for actor in self.actors:
            try:
                stopping.append(actor.stop.remote(0.8 * timeout))  # SIGKILL falls within our wait
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
        _wait_until_dead(self.actors, timeout)
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
        self.actors = []


def _wait_until_dead(actors: list[Any], timeout: float) -> None:
    """Return once every actor is dead, or `timeout` seconds have passed: `ray.kill` only asks,
    and a call made right after it (a caller checking that `shutdown()` did its job) could still
    reach the actor."""
    deadline = time.monotonic() + timeout
    for actor in actors:
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=remaining)
            except ray.exceptions.RayActorError:
                break  # dead
            except Exception:  # a timeout or the cluster going: nothing more to wait for
                return
            time.sleep(0.05)


# The flags Ray placement decides (argparse dest -> why), besides those any group decides.
PLACEMENT_OPTIONS = dict.fromkeys(
    ("host", "port", "address_file", "exit_with_parent"),
    "does not apply to Ray workers: each binds its node's address on a free port",
)


def check_ray_worker_flags(flags: Sequence[str]) -> None:
    """ValueError for worker flags that are bad, or that Ray placement or the group decides instead."""
    check_launcher_flags(flags, {**PLACEMENT_OPTIONS, **GROUP_OPTIONS})


def start_ray_workers(
    n: int,
    engine: str | None = None,
    *,
    engine_flags: Sequence[str] = (),
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    placement: str = "spread",
    resources: Mapping[str, float] | None = None,
    node_ids: Sequence[str] | None = None,
    args: Sequence[str] = (),
    runtime_env: Mapping[str, Any] | None = None,
    startup_timeout: float = 120.0,
) -> RayWorkers:
    """Place `n` worker actors and start their servers; returns once all serve.

    Placed by a placement group with `placement`'s strategy, or, with `node_ids` (one Ray
    node ID per worker), pinned to those nodes by hard node affinity. `args` are the store
    flags of `python -m rpc_server` (`--max-bytes`, `--max-idle-seconds`, ...), checked here;
    `engine_flags` (`--engine-kwargs JSON`, checked by the caller) go to every worker too. Worker
    i is rank i of `n`. `runtime_env` is Ray's, per actor (env_vars, pip, container, ...).
    """
    check_ray_worker_flags(args)
    envs = _checked_placement(n, env, placement, node_ids)
    bundle = _bundle(resources)
    if not ray.is_initialized():
        init_local_ray()
    group, strategies = _strategies(n, bundle, placement, node_ids)
    actors: list[Any] = []
    workers = RayWorkers(actors, group, [])
    try:
        if group is not None:
            _wait_placed(group, n, bundle, placement, startup_timeout)
        options = _actor_options(bundle, runtime_env)
        actor_class = ray.remote(_WorkerActor)
        log_name = LOG_DIR_PREFIX + secrets.token_hex(6)  # the group's log directory on each node
        flags = [*args, *engine_flags]
        for rank, (extra, strategy) in enumerate(zip(envs, strategies)):
            actor = actor_class.options(**options, scheduling_strategy=strategy)
            actors.append(actor.remote(engine, dict(extra), flags, startup_timeout, rank, n, log_name))
        workers.nodes = _wait_serving(actors, startup_timeout)
    except BaseException:
        workers.stop(timeout=1.0)
        raise
    return workers


def _checked_placement(
    n: int,
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None,
    placement: str,
    node_ids: Sequence[str] | None,
) -> list[Mapping[str, str]]:
    """Refuse a bad count, strategy or per-worker list before Ray is touched; the per-worker envs."""
    if n < 1:
        raise InvalidArgumentError(f"worker count must be >= 1, got {n}")
    if placement not in STRATEGIES:
        raise InvalidArgumentError(f"placement must be one of {sorted(STRATEGIES)}, got {placement!r}")
    envs = list(env) if isinstance(env, Sequence) else [env or {}] * n
    if len(envs) != n:
        raise InvalidArgumentError(f"{len(envs)} env mappings for {n} workers")
    if node_ids is not None and len(node_ids) != n:
        raise InvalidArgumentError(f"{len(node_ids)} node ids for {n} workers")
    return envs


def _bundle(resources: Mapping[str, float] | None) -> dict[str, float]:
    """One worker's Ray resources (`num_cpus` / `num_gpus` named as Ray's bundles name them)."""
    bundle = {"CPU": DEFAULT_CPUS_PER_WORKER}
    for key, value in (resources or {}).items():
        bundle[{"num_cpus": "CPU", "num_gpus": "GPU"}.get(key, key)] = float(value)
    return {k: v for k, v in bundle.items() if v > 0}


def _strategies(
    n: int, bundle: dict[str, float], placement: str, node_ids: Sequence[str] | None
) -> tuple[Any, list[Any]]:
    """(placement group or None, one scheduling strategy per worker)."""
    if node_ids is not None:
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        unknown = sorted(set(node_ids) - alive)
        if unknown:
            raise InvalidArgumentError(f"no live Ray node with id {unknown[0]!r} (live: {sorted(alive)})")
        return None, [NodeAffinitySchedulingStrategy(node_id, soft=False) for node_id in node_ids]
    group = placement_group([dict(bundle) for _ in range(n)], strategy=STRATEGIES[placement])
    return group, [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(n)]


def _wait_placed(group: Any, n: int, bundle: dict[str, float], placement: str, timeout: float) -> None:
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        raise WorkerUnavailableError(
            f"ray placement group {group.id.hex()}",
            f"{n} bundles of {bundle} ({STRATEGIES[placement]}) not placed within "
            f"{timeout}s (cluster resources: {ray.available_resources()})",
        )


def _actor_options(bundle: dict[str, float], runtime_env: Mapping[str, Any] | None) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    others = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    if others:
        options["resources"] = others
    if runtime_env:
        options["runtime_env"] = dict(runtime_env)
    return options


def _wait_serving(actors: list[Any], timeout: float) -> list[str]:
    """The workers' addresses once every one serves; `WorkerUnavailableError` otherwise."""
    refs = [actor.node.remote() for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if len(ready) < len(refs):
        raise WorkerUnavailableError(
            "ray actors",
            f"{len(refs) - len(ready)} of {len(refs)} workers did not start within {timeout}s "
            f"(cluster resources: {ray.available_resources()})",
        )
    try:
        return list(ray.get(refs))
    except ray.exceptions.RayActorError as exc:
        raise WorkerUnavailableError("ray actor", f"worker failed to start: {exc}") from None
