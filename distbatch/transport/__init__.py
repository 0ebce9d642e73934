"""Transport pieces both ends share: same-host shared memory and recycled receive buffers.

Owns `shm`, sealed memfd regions and the Unix-socket messages that hand them over for
same-host reads (the worker's `rpc_server.shm_server` and the client's
`distbatch.client.same_host` both use it), and `recv_pool`, recycled receive buffers (the
client's responses, the worker's put bodies). Importing the package imports neither module.
May import `distbatch.errors` and `distbatch.wire.container` (flat byte views); nothing else
of distbatch.
"""
