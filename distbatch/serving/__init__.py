"""HTTP serving shared by the worker and the controller's HTTP face; it knows no shards.

Owns the threaded WSGI server with keep-alive and bounds (`server`), the JSON error answers
(`errors`) and per-app Prometheus request metrics (`metrics`). `rpc_server` and
`distbatch.controller` build on it. May import `distbatch.protocol` and third-party servers
(werkzeug, Flask, prometheus_client); nothing else of distbatch.
"""
