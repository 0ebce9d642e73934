"""What a controller call returns besides a count: `ForgottenNode`, the answer of
`Controller.forget_node`, and its JSON form (the HTTP face sends it; `RemoteController` reads it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distbatch.errors import InvalidArgumentError
from distbatch.ids import ShardKey, validate_key


@dataclass(frozen=True)
class ForgottenNode:
    """The tasks `Controller.forget_node` dropped because a shard of theirs was on a dead node.

    Attributes:
        node: the dead node.
        lost: partition id -> the task ids it lost, in index order (only partitions that lost some).
        shards_lost: the shards those tasks had on the dead node (their data is gone with it).
        deleted: the lost tasks' other shards, on live nodes, that were deleted.
        undeleted: live node -> the lost tasks' shards still there because the node did not
            answer the delete: delete them yourself (``client.delete(node, keys=...)``) once it does.
        failed: live node -> why its delete failed.
    """

    node: str
    lost: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    shards_lost: int = 0
    deleted: int = 0
    undeleted: Mapping[str, tuple[ShardKey, ...]] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)

    @property
    def tasks(self) -> int:
        """How many tasks were lost, over every partition."""
        return sum(len(ids) for ids in self.lost.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: lists for tuples, ``[task_id, field]`` pairs for shard keys, plus `tasks`."""
        return {
            "node": self.node,
            "lost": {pid: list(ids) for pid, ids in self.lost.items()},
            "tasks": self.tasks,
            "shards_lost": self.shards_lost,
            "deleted": self.deleted,
            "undeleted": {n: [list(k) for k in keys] for n, keys in self.undeleted.items()},
            "failed": dict(self.failed),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ForgottenNode:
        """The result `to_dict` wrote (`InvalidArgumentError` for anything else)."""
        try:
            return cls(
                node=str(data["node"]),
                lost={str(pid): tuple(str(t) for t in ids) for pid, ids in data["lost"].items()},
                shards_lost=int(data["shards_lost"]),
                deleted=int(data["deleted"]),
                undeleted={
                    str(n): tuple(validate_key(k) for k in keys) for n, keys in data["undeleted"].items()
                },
                failed={str(n): str(why) for n, why in data["failed"].items()},
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not a forget_node result: {exc!r}") from None
