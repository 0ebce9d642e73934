"""TransferQueue checkpoints of the Distbatch backend: every sample it holds, per worker slot.

`tq.save_checkpoint` asks the storage manager to save next to the controller's state; we write
each worker's TransferQueue samples as safetensors bundles (our wire format: one file per set of
fields, every field a column) plus an index naming each file's worker slot. Loading puts each
file back on the worker in the same slot (modulo the workers there are now), which is where the
controller's restored metadata looks for it. Nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distbatch import wire
from distbatch.atomic import write_json_atomically
from distbatch.client.shard_client import ShardClient
from distbatch.errors import InvalidArgumentError
from distbatch.transferqueue.layout import TASK_PREFIX

CHECKPOINT_DIR = "distbatch"
INDEX = "index.json"
FORMAT_VERSION = 1
PAGE = 10_000


def save_shards(client: ShardClient, endpoints: Sequence[str], directory: Path) -> dict[str, Any]:
    """Write every TransferQueue sample the workers hold under `directory`; returns the index."""
    directory.mkdir(parents=True, exist_ok=True)
    files: list[dict[str, Any]] = []
    for slot, node in enumerate(endpoints):
        for k, (fields, ids) in enumerate(_samples_by_fields(client, node).items()):
            (bundle,) = client.fetch_products([(node, ids, list(fields))])
            name = f"slot{slot}-{k}.safetensors"
            with open(directory / name, "wb") as handle:
                for part in wire.build_bundle(bundle):
                    handle.write(wire.byte_view(part))
            files.append({"slot": slot, "file": name, "tasks": len(ids), "fields": list(fields)})
    index = {"version": FORMAT_VERSION, "workers": len(endpoints), "files": files}
    write_json_atomically(directory / INDEX, index)
    return index


def load_shards(client: ShardClient, endpoints: Sequence[str], directory: Path) -> int:
    """Put every file `save_shards` wrote back on the worker in its slot; returns the tasks put."""
    index = json.loads((directory / INDEX).read_text())
    if not isinstance(index, dict) or index.get("version") != FORMAT_VERSION:
        raise InvalidArgumentError(
            f"{directory / INDEX}: not a Distbatch checkpoint index (version {FORMAT_VERSION})"
        )
    tasks = 0
    for entry in index["files"]:
        name, slot = entry.get("file"), entry.get("slot")
        if not isinstance(name, str) or Path(name).name != name or type(slot) is not int or slot < 0:
            raise InvalidArgumentError(f"{directory / INDEX}: bad entry {entry!r}")
        bundle = wire.parse_bundle(bytearray((directory / name).read_bytes()))
        client.put_bundle(endpoints[slot % len(endpoints)], bundle)
        tasks += len(bundle.task_ids)
    return tasks


def _samples_by_fields(client: ShardClient, node: str) -> dict[tuple[str, ...], list[str]]:
    """The TransferQueue samples `node` holds, grouped by their set of fields."""
    groups: dict[tuple[str, ...], list[str]] = {}
    after: str | None = None
    while True:
        page = client.list_tasks(node, after=after, limit=PAGE)
        for task_id, fields in page["tasks"]:
            if task_id.startswith(TASK_PREFIX) and task_id[len(TASK_PREFIX) :].isdigit():
                groups.setdefault(tuple(fields), []).append(task_id)
        after = page["next"]
        if after is None:
            return groups
