"""Names both ends of the worker protocol share (headers), with no dependencies of their own,
so the worker's data path can use them without importing the client (and aiohttp)."""

MAX_LIST_LIMIT = 10_000
"""The most task ids one ``GET /v1/tasks`` page may ask for (``limit``)."""

CALL_ID_HEADER = "X-Distbatch-Call-Id"
"""The request header naming an engine call, so the client can abandon it on the worker."""

# How long a worker keeps an idle HTTP/1.1 connection open for its next request, and how long
# clients reuse one: less, so no request goes out on a connection the server is closing.
SERVER_IDLE_SECONDS = 30.0
CLIENT_KEEPALIVE_SECONDS = SERVER_IDLE_SECONDS / 2

# A server's defaults that the worker's command line offers too (`distbatch.launch.flags`): the
# threads serving requests at once, and how long a request may take to arrive.
DEFAULT_MAX_THREADS = 256
DEFAULT_READ_TIMEOUT = 60.0
