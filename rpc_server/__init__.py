"""The distbatch worker server: a Flask app that stores shards and serves them to peers."""

from rpc_server.app import create_app
from rpc_server.config import ServerConfig
from rpc_server.serve import WorkerServer
from rpc_server.store.shard_store import ShardStore

__all__ = ["ServerConfig", "ShardStore", "WorkerServer", "create_app"]
