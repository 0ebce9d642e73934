"""Benchmarks: distbatch against the transports and peers users compare it with, measured in one run.

Lives at the repo root, outside the installed package: run `python -m bench` from there
(`scripts/bench` does). Modules:

- `__main__` (the CLI), `workloads` (the batches), `measure` (shared timing and checks), `rss`
  (whether a worker gives memory back over put + clear cycles; the peak RSS of a producer, a
  consumer and the controller against what each must hold);
- `baselines` (raw TCP, pickle/HTTP, base64 JSON, Ray), `transferqueue` (TransferQueue's
  SimpleStorage and our backend), `areal` (AReaL's RTensor: its HTTP backend and ours),
  `servers` (the worker app on other WSGI servers), `same_host` (shared memory next to Ray's
  same-node put/get and a memcpy), `cuda` (a GPU batch's put and gather against the
  host-device copy limit, where there is a GPU);
- `scaling` (1k-100k tasks), `control_plane` (hundreds of ranks polling one controller),
  `partition_scale` (a controller partition's bytes and times per task, in one process),
  `durable` (a worker with `--data-dir` against one in memory; recovery after SIGKILL),
  `shared_fields` (a multimodal GRPO batch: a group's image shared vs n copies vs TransferQueue),
  `soak` (load, every byte checked), `suite_cpu` (where a command's CPU goes, every process
  counted: the test suite's profile);
- `cluster`, a package: the jobs run on simulated hosts (network namespaces, brought up and down
  and their links shaped by `simcluster`, beside `bench/` at the repo root): `cluster.job` (the
  traffic job across them), `cluster.tcp` (plain TCP on the same links), `cluster.ray_peer` (Ray's
  object store there), `cluster.tq_peer` (TransferQueue's SimpleStorage there).
"""
