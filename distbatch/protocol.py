"""Names both ends of the worker protocol share (headers), with no dependencies of their own,
so the worker's data path can use them without importing the client (and aiohttp)."""

CALL_ID_HEADER = "X-Distbatch-Call-Id"
"""The request header naming an engine call, so the client can abandon it on the worker."""
