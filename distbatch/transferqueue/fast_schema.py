"""TransferQueue's *BatchMeta.add_fields* without one tensor per sample: the field schema of a
put computed from a nested tensor's offsets instead of `unbind()`.

TransferQueue's client calls `add_fields` after every put, which calls its module-level
*extract_field_schema*; that splits every jagged field into one tensor per sample, twice (the
first sample's shape, then every sample's), about 0.2 s of a ragged 5,120-sample put on this
machine, more than our whole data path. TransferQueue offers no hook for it, so `install()`
points `transfer_queue.metadata.extract_field_schema` (the name `add_fields` looks up; the
storage managers hold their own reference and are untouched) at `layout.field_schema`, whose
result is equal (tests/integration/test_transferqueue_layout.py). Anything ours does not take
goes to TransferQueue's own function, so its errors stay its own. `backend.Distbatch.fast_schema:
false` leaves TransferQueue as it is; `uninstall()` (called by `close()`) puts it back.
"""

from __future__ import annotations

from typing import Any

import transfer_queue.metadata as tq_metadata
from tensordict import TensorDict

from distbatch.transferqueue.layout import field_schema

TQ_EXTRACT_FIELD_SCHEMA = tq_metadata.extract_field_schema  # TransferQueue's own, as imported


def extract_field_schema(data: TensorDict) -> dict[str, dict[str, Any]]:
    """TransferQueue's field schema of `data`, from offsets; TransferQueue's function for anything
    else (its result and its errors)."""
    try:
        return field_schema(data)
    except Exception:
        return TQ_EXTRACT_FIELD_SCHEMA(data)


def install() -> bool:
    """Make *BatchMeta.add_fields* use ours; False if it already did."""
    if tq_metadata.extract_field_schema is extract_field_schema:
        return False
    tq_metadata.extract_field_schema = extract_field_schema
    return True


def uninstall() -> bool:
    """Give *BatchMeta.add_fields* TransferQueue's own back; False if ours was not in place."""
    if tq_metadata.extract_field_schema is not extract_field_schema:
        return False
    tq_metadata.extract_field_schema = TQ_EXTRACT_FIELD_SCHEMA
    return True
