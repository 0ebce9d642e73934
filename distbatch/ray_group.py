"""Kept so `from distbatch.ray_group import init_local_ray` goes on working: the Ray launcher
lives in `distbatch.launch.ray_actors`. Importing this imports `ray`."""

from distbatch.launch.ray_actors import (
    RayWorkers,
    init_local_ray,
    loopback_node_ip,
    prepare_ray_environment,
    start_ray_workers,
)

__all__ = ["RayWorkers", "init_local_ray", "loopback_node_ip", "prepare_ray_environment", "start_ray_workers"]
