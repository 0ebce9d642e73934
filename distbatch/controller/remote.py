"""`RemoteController`: the `Controller` API over HTTP, for ranks in other processes or hosts.

Every call is one JSON request to a served controller (`distbatch.controller.server`); a
validated refusal comes back as the same exception type a local `Controller` raises
(`distbatch.controller.http_errors`), anything else as `ServerError`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distbatch.atomic import write_json_atomically
from distbatch.batch.calls import decode_value, encode_value
from distbatch.batch.memory import DistributedBatchMemory
from distbatch.checks import check_int
from distbatch.client.default import default_client
from distbatch.client.shard_client import ShardClient
from distbatch.controller.arguments import (
    check_staleness,
    put_versions,
    refuse_local_batch,
    refuse_one_string,
)
from distbatch.controller.http_errors import BY_CODE, MAX_WAIT_SECONDS
from distbatch.controller.results import ForgottenNode
from distbatch.errors import (
    ClearError,
    InvalidArgumentError,
    RequestError,
    UnknownFieldError,
    UnknownPartitionError,
    WorkerUnavailableError,
)
from distbatch.ids import validate_id, validate_node

logger = logging.getLogger("distbatch.controller")

# RemoteController.get_meta: pause before re-sending a request whose reply was lost (doubles, capped).
GET_META_BACKOFF = 0.05
GET_META_BACKOFF_MAX = 1.0


class RemoteController:
    """The `Controller` API over HTTP, for ranks in other processes or hosts.

    Safe to use from forked DataLoader workers (the client restarts its
    connection pool after a fork).
    """

    process_local = False
    """Every copy talks to the same served controller, so it may cross into other processes."""

    def __init__(self, address: str, *, client: ShardClient | None = None, timeout: float = 60.0) -> None:
        self.address = validate_node(address)
        self._client = client
        self.timeout = timeout

    @property
    def client(self) -> ShardClient:
        return self._client or default_client()

    def _post(
        self,
        path: str,
        body: Any,
        *,
        timeout: float | None = None,
        idempotent: bool = True,
        waits: bool = False,
        keep_alive: bool | None = None,
    ) -> Any:
        try:
            return self.client.request_json(
                self.address,
                "POST",
                path,
                body,
                timeout=timeout or self.timeout,
                idempotent=idempotent,
                waits=waits,
                keep_alive=keep_alive,
            )
        except RequestError as exc:
            raise _local_error(exc) from None

    def put(
        self,
        partition_id: str,
        batch: DistributedBatchMemory,
        *,
        version: Any = None,
        partial: bool | Iterable[str] = False,
    ) -> int:
        refuse_local_batch(batch)
        body: dict[str, Any] = {"partition_id": partition_id, "batch": encode_value(batch)}
        if version is not None:  # checked against the batch's tasks by the controller
            body["version"] = put_versions(version, len(batch))
        if partial is not False:  # checked against the batch's fields by the controller
            body["partial"] = partial if isinstance(partial, bool) else list(partial)
        return self._post("/v1/controller/put", body)["added"]

    def inflight(self, partition_id: str) -> DistributedBatchMemory:
        reply = self._post("/v1/controller/inflight", {"partition_id": partition_id})
        return decode_value(reply["batch"], self._client)

    def reissue(self, partition_id: str) -> DistributedBatchMemory:
        """`Controller.reissue` over HTTP; not sent again after a lost reply (the tasks it handed
        out would not be handed out again): after a connection error, use `inflight`."""
        reply = self._post("/v1/controller/reissue", {"partition_id": partition_id}, idempotent=False)
        return decode_value(reply["batch"], self._client)

    def set_policy_version(self, version: int) -> None:
        self._post("/v1/controller/policy_version", {"version": check_int(version, "version", 0)})

    def policy_version(self) -> int:
        return int(self._get("/v1/controller/policy_version")["version"])

    def policy_versions(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, int]:
        body = {"partition_id": partition_id, "task_ids": list(task_ids)}
        return self._post("/v1/controller/policy_versions", body)["versions"]

    def get_meta(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        max_staleness: int | None = None,
        stale: str = "wait",
        **sampling_config: Any,
    ) -> DistributedBatchMemory:
        """`Controller.get_meta` over HTTP, delivered at least once.

        The call carries a request id (a new one unless `request_id` is given)
        and is sent again with it after a connection error or a lost reply,
        within this controller's timeout (plus the wait) and the client's
        ``retries``: the controller answers a repeated id with the tasks it
        handed out the first time, so none is lost or consumed twice. Pass your
        own `request_id` to re-ask yourself after this raises.
        """
        refuse_one_string(fields, "fields", "field")
        max_staleness = check_staleness(max_staleness, stale)
        request_id = uuid.uuid4().hex if request_id is None else validate_id(request_id, "request_id")
        # The server waits at most MAX_WAIT_SECONDS (and refuses a bad timeout itself).
        wait = min(timeout, MAX_WAIT_SECONDS) if isinstance(timeout, (int, float)) and timeout > 0 else 0
        start = time.monotonic()
        deadline = start + self.timeout + wait
        retries = getattr(self.client, "retries", 3)
        attempt = 0
        while True:
            now = time.monotonic()
            body = {
                "partition_id": partition_id,
                "task_name": task_name,
                "fields": list(fields),
                "batch_size": batch_size,
                # A re-sent request waits only for what is left of the caller's wait.
                "timeout": timeout if attempt == 0 or not wait else max(start + wait - now, 1e-3),
                "request_id": request_id,
                "sampling_config": sampling_config,
                "max_staleness": max_staleness,
                "stale": stale,
            }
            try:
                # Not retried by the client once sent: the loop here re-sends with the same id,
                # so a quick poll may reuse a kept-alive connection (a new one per poll would
                # cost a connection setup each, the most of a poll's time with many pollers).
                reply = self._post(
                    "/v1/controller/get_meta",
                    body,
                    timeout=deadline - now,
                    idempotent=False,
                    waits=wait > 0,
                    keep_alive=wait == 0,
                )
                return decode_value(reply["batch"], self._client)
            except WorkerUnavailableError as exc:
                attempt += 1
                delay = min(GET_META_BACKOFF * 2 ** (attempt - 1), GET_META_BACKOFF_MAX)
                if attempt > retries or time.monotonic() + delay >= deadline:
                    raise
                logger.warning("get_meta %s of %r: %s; asking again", request_id, partition_id, exc.detail)
                time.sleep(delay)

    def create_partition(self, partition_id: str, expected_fields: Iterable[str] = ()) -> None:
        """Create the partition (if new) and declare fields it will get; see `Controller.create_partition`."""
        refuse_one_string(expected_fields, "expected_fields", "field")
        if isinstance(expected_fields, Iterable) and not isinstance(expected_fields, Mapping):
            expected_fields = list(expected_fields)  # else sent as is, for the controller to refuse
        self._post(
            "/v1/controller/create_partition",
            {"partition_id": partition_id, "expected_fields": expected_fields},
        )

    def _get(self, path: str) -> Any:
        try:
            return self.client.request_json(self.address, "GET", path, timeout=self.timeout)
        except RequestError as exc:
            raise _local_error(exc) from None

    def partitions(self) -> list[str]:
        return self._get("/v1/controller/partitions")["partitions"]

    def waiting_consumers(self) -> int:
        """How many `get_meta` calls the served controller has waiting for producers."""
        return self._get("/v1/controller/waiting_consumers")["waiting_consumers"]

    def summary(self) -> dict[str, Any]:
        """Every partition of the served controller at a glance; see `Controller.summary`."""
        return self._get("/v1/controller/summary")

    def production_status(self, partition_id: str, fields: Sequence[str] | None = None) -> dict[str, Any]:
        body = {"partition_id": partition_id, "fields": None if fields is None else list(fields)}
        return self._post("/v1/controller/production_status", body)

    def consumption_status(self, partition_id: str, task_name: str) -> dict[str, int]:
        return self._post(
            "/v1/controller/consumption_status", {"partition_id": partition_id, "task_name": task_name}
        )

    def set_custom_meta(self, partition_id: str, custom_meta: Mapping[str, Mapping[str, Any]]) -> None:
        """See `Controller.set_custom_meta`."""
        if not isinstance(custom_meta, Mapping):
            raise InvalidArgumentError(f"custom_meta must map task ids to objects, got {type(custom_meta)}")
        values = {t: dict(m) if isinstance(m, Mapping) else m for t, m in custom_meta.items()}
        body = {"partition_id": partition_id, "custom_meta": values}  # the server validates the values
        self._post("/v1/controller/custom_meta", body)

    def get_custom_meta(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """See `Controller.get_custom_meta`."""
        refuse_one_string(task_ids, "task_ids", "task_id")
        body = {"partition_id": partition_id, "task_ids": list(task_ids)}
        return self._post("/v1/controller/get_custom_meta", body)["custom_meta"]

    def all_consumed(self, partition_id: str, task_name: str) -> bool:
        status = self.consumption_status(partition_id, task_name)
        return status["tasks"] > 0 and status["consumed"] >= status["tasks"]

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        self._post("/v1/controller/reset_consumption", {"partition_id": partition_id, "task_name": task_name})

    def clear_tasks(self, partition_id: str, task_ids: Iterable[str]) -> int:
        body = {"partition_id": partition_id, "task_ids": list(task_ids)}
        return self._post("/v1/controller/clear_tasks", body)["deleted"]

    def clear_partition(self, partition_id: str) -> int:
        return self._post("/v1/controller/clear_partition", {"partition_id": partition_id})["deleted"]

    def forget_node(self, node: str) -> ForgottenNode:
        """Drop every task with a shard on `node`, gone for good; see `Controller.forget_node`."""
        return ForgottenNode.from_dict(self._post("/v1/controller/forget_node", {"node": node}))

    def move_node(self, old: str, new: str) -> int:
        """`old`'s shards are served at `new` now; see `Controller.move_node`."""
        return int(self._post("/v1/controller/move_node", {"old": old, "new": new})["moved"])

    def state_dict(self) -> dict[str, Any]:
        return self._get("/v1/controller/state")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._post("/v1/controller/state", dict(state), idempotent=True)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Fetch the controller's state and write it here, atomically."""
        return write_json_atomically(path, self.state_dict())

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        with open(path) as handle:
            self.load_state_dict(json.load(handle))

    def __repr__(self) -> str:
        return f"RemoteController({self.address!r})"


def _local_error(exc: RequestError) -> Exception:
    """The controller-side exception a 4xx answer stands for (the RequestError itself if none)."""
    payload = exc.payload
    if exc.code == "unknown_partition":
        return UnknownPartitionError(str(payload.get("partition_id", "?")), payload.get("known") or [])
    if exc.code == "unknown_field":
        return UnknownFieldError(
            str(payload.get("partition_id", "?")), payload.get("fields") or [], payload.get("known") or []
        )
    if exc.code == "clear_incomplete":
        failed = {n: WorkerUnavailableError(n, str(d)) for n, d in payload.get("failed", {}).items()}
        return ClearError(
            failed,
            int(payload.get("deleted", 0)),
            payload.get("undeleted", {}),
            payload.get("deleted_by_node", {}),
        )
    exc_type = BY_CODE.get(exc.code)
    if exc_type is not None:
        return exc_type(exc.message)
    return exc
