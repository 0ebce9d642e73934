"""What a failed TransferQueue put leaves behind: nothing that the call registered.

TransferQueue registers a `kv_put` / `kv_batch_put`'s new keys with its controller before the
storage put (`kv_retrieve_meta(create=True)`), and `put(data, partition_id=...)` allocates its
samples (`get_meta(mode="insert")`) before it. When the put then fails (refused by the wire
checks or the worker's capacity, or a worker gone), those keys and samples would stay with no
field and no tag: listed by `kv_list` as `{}`, never produced, read back as "Some fields are not
ready", counted against `check_production_status` for ever. The hooks here (installed by
`provider.hook_interface`, acting only on a put our storage manager failed: its error carries
`manager.FAILED_PUT`) release exactly what the call registered, then raise the put's own error:

- a kv put: those of its keys that, after the failure, hold no tag and no field on any worker.
  Its own tags were not set (TransferQueue sets them only once the data is stored); a key that
  held a field or a tag before keeps them, as a refused put changes no stored data.
- `put` without metadata: every sample it allocated.

A put handed metadata by its caller (`get_meta(mode="insert")`, then `put`) keeps those samples:
the caller allocated them and may put to them again.

A kv put racing another put of the same new key from another process may release it just
before the other's data lands; TransferQueue's own kv API has the same window between two
writers of one key.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from distbatch.transferqueue.options import FAILED_PUT

logger = logging.getLogger("distbatch.transferqueue")


def releasing_keys(interface: Any, original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`original` (`async_kv_put` or `async_kv_batch_put`), releasing the keys a failed put
    registered (see the module's docstring)."""
    signature = inspect.signature(original)

    async def kv_put(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        except Exception as error:
            if getattr(error, FAILED_PUT, None) is not None:
                bound = signature.bind(*args, **kwargs)
                keys = list(bound.arguments.get("keys") or [bound.arguments["key"]])
                await _quietly(release_keys(interface._TQ_CLIENT, keys, bound.arguments["partition_id"]))
            raise

    return kv_put


def releasing_samples(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """TransferQueue's ``AsyncTransferQueueClient.async_put``, releasing the samples a failed
    put without metadata allocated (see the module's docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    async def async_put(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        except Exception as error:
            allocated = getattr(error, FAILED_PUT, None)
            bound = signature.bind(*args, **kwargs)
            if allocated is not None and bound.arguments.get("metadata") is None:
                await _quietly(bound.arguments["self"].async_clear_samples(allocated))
            raise

    return async_put


async def release_keys(client: Any, keys: list[str], partition_id: str) -> int:
    """Clear those of `keys` that hold no tag and no field (after a failed put); how many."""
    # Our storage manager (`manager.DistbatchStorageManager`, which imports this module): only it
    # can say which samples its workers hold.
    held_by = getattr(getattr(client, "storage_manager", None), "samples_holding_fields", None)
    if held_by is None:
        return 0
    after = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
    if after.size == 0 or after.field_names:  # every key holds a field: none is new
        return 0
    untagged = [i for i, tags in enumerate(after.custom_meta) if not tags]
    held = await held_by([after.global_indexes[i] for i in untagged])
    empty = [i for i in untagged if after.global_indexes[i] not in held]
    if empty:
        await client.async_clear_samples(after.select_samples(empty))
    return len(empty)


async def _quietly(release: Awaitable[Any]) -> None:
    """Run a release; one that fails is logged, not raised: the put's own error says what went
    wrong, and is what the caller must see."""
    try:
        await release
    except Exception:
        logger.warning("what a failed put registered with TransferQueue could not be released", exc_info=True)
