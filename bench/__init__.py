"""Benchmarks: distbatch against the transports and peers users compare it with, measured in one run.

Lives at the repo root, outside the installed package: run `python -m bench` from there
(`scripts/bench` does). Modules:

- `__main__` (the CLI), `workloads` (the batches), `measure` (shared timing and checks), `rss`
  (whether a worker gives memory back over put + clear cycles);
- `baselines` (raw TCP, pickle/HTTP, base64 JSON, Ray), `transferqueue` (TransferQueue's
  SimpleStorage and our backend), `servers` (the worker app on other WSGI servers), `same_host`
  (shared memory next to Ray's same-node put/get and a memcpy);
- `scaling` (1k-100k tasks), `control_plane` (hundreds of ranks polling one controller),
  `soak` (load, every byte checked);
- simulated hosts (network namespaces): `cluster` (bringing them up and down, shaping links),
  `cluster_job` (the main job across them), `cluster_tcp` (plain TCP on the same links),
  `cluster_ray` (Ray's object store there), `cluster_tq` (TransferQueue's SimpleStorage there).
"""
