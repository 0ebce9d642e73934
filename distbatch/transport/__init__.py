"""Transport pieces both ends share: same-host shared memory and recycled receive buffers.

Owns `shm`, sealed memfd regions and the Unix-socket messages that hand them over for
same-host reads (the worker's `rpc_server.shm_server` and the client's
`distbatch.client.same_host` both use it), `recv_pool`, recycled receive buffers (the client's
responses, the worker's put bodies), and `gather`, gathering writes of a body's parts (a ragged
column's per-task tensors from where they lie). Importing the package imports none of them.
May import `distbatch.errors` and `distbatch.wire.container` (flat byte views); nothing else
of distbatch.
"""
