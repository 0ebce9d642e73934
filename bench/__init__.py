"""Benchmarks: distbatch against the transports and peers users compare it with, measured in one run.

Lives at the repo root, outside the installed package: run `python -m bench` from there
(`scripts/bench` does). Modules: `__main__` (the CLI), `workloads`, `baselines` (raw TCP,
pickle/HTTP, base64 JSON, Ray), `transferqueue` (TransferQueue's SimpleStorage), `scaling`
(1k-100k tasks), `soak` (load), `measure` (shared timing and checks).
"""
