"""HTTP serving shared by the worker and the controller's HTTP face; it knows no shards.

Owns the threaded WSGI server with keep-alive and bounds (`server`: thread slots and
`HttpServer`), over its request handler (`handler`: keep-alive, turns, parking, reserve
refusals), its response writer (`response`) and the socket adapters both use (`sockets`); where
a server listens (`addresses`); idle connections parked without a thread (`parking`), request
turns (`turns`), the JSON error answers (`errors`), per-app Prometheus request metrics
(`metrics`) and the process's open-file limit (`open_files`). The HTTP modules import one way:
`server` -> `handler` -> `response` -> `sockets`. `rpc_server` and `distbatch.controller`
build on it. May import `distbatch.errors`, `distbatch.protocol`, `distbatch.wire.container`
(flat byte views) and third-party servers (werkzeug, Flask, prometheus_client); nothing else of
distbatch.
"""
