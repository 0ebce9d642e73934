"""Group-shared fields: the n responses of a GRPO group share one prompt (and, in multimodal RL,
one set of `pixel_values`); distbatch stores and moves it once.

`to_remote(node, share={field: n})` (each run of n tasks has one value, checked equal), or tasks
of a ragged field holding the very same tensor, put the value once with the other tasks naming
it; the worker counts each stored row's tasks, so a delete of any of them is exact. A gather
moves each shared value once per reader, and the tasks of a ragged field get views of it. Real
workers on loopback, over HTTP (the module's shared workers) and the same-host path.
"""

from __future__ import annotations

import json
import pickle
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from distbatch import DistributedBatchMemory, InvalidArgumentError, ShardClient
from distbatch.controller import Controller
from distbatch.samplers import GRPOGroupNSampler

DBM = DistributedBatchMemory
N = 4  # responses per prompt
PROMPTS = 3


def groups(tag: str = "") -> tuple[DBM, list[torch.Tensor]]:
    """PROMPTS groups of N tasks: `pixel_values` (ragged: one image per prompt, its rows the
    patches, the very same tensor for the group's N tasks), `prompt` (JSON, equal within a
    group), `image_id` (fixed shape, equal within a group), `response` (the task's own)."""
    tag = tag or uuid.uuid4().hex[:6]
    images = [torch.randn(10 + 5 * g, 32) for g in range(PROMPTS)]
    data = {
        "pixel_values": [images[g] for g in range(PROMPTS) for _ in range(N)],
        "prompt": [f"describe image {g}" for g in range(PROMPTS) for _ in range(N)],
        "image_id": torch.tensor([[g, 7] for g in range(PROMPTS) for _ in range(N)]),
        "response": [torch.arange(1 + i % 5) for i in range(PROMPTS * N)],
    }
    ids = [f"{tag}-g{g}-r{j}" for g in range(PROMPTS) for j in range(N)]
    return DBM.from_dict(data, task_ids=ids), images


SHARE = {"prompt": N, "image_id": N}


def stored_bytes(client: ShardClient, nodes: list[str]) -> int:
    return sum(int(client.stats(node)["bytes"]) for node in nodes)


def test_a_shared_value_is_stored_and_moved_once_and_read_as_views(
    nodes: list[str], module_client: ShardClient
) -> None:
    local, images = groups()
    image_bytes = sum(im.numel() * 4 for im in images)
    before_stored = stored_bytes(module_client, nodes)
    sent = module_client.traffic()
    # Group 1 (tasks 4-7) is split over the two nodes: its image is stored (and sent) twice, not
    # N times. `share=` needs whole groups in each put; the same tensor object shares anywhere.
    batch = DBM.concat(
        [local[:6].to_remote(nodes[0], module_client), local[6:].to_remote(nodes[1], module_client)]
    )
    put_bytes = (module_client.traffic() - sent).bytes_sent
    try:
        twice = image_bytes + images[1].numel() * 4
        assert twice < put_bytes < twice + 16_000
        stored = stored_bytes(module_client, nodes) - before_stored
        assert twice <= stored < twice + 2_000
        assert batch.meta.fields["pixel_values"].has_shared
        assert not any(batch.meta.fields[f].has_shared for f in ("prompt", "image_id", "response"))
        received = module_client.traffic()
        pixels = batch["pixel_values"]
        moved = (module_client.traffic() - received).bytes_received
        assert twice < moved < twice + 16_000  # once per value and node
        assert all(torch.equal(p, images[i // N]) for i, p in enumerate(pixels))
        assert pixels[0].data_ptr() == pixels[N - 1].data_ptr()  # views of one tensor, not copies
        assert batch["prompt"] == local["prompt"]
        assert torch.equal(batch["image_id"], local["image_id"])
        assert batch.lengths("pixel_values") == [len(images[i // N]) for i in range(PROMPTS * N)]
    finally:
        batch.clear()
    assert stored_bytes(module_client, nodes) == before_stored


def test_chunks_slices_unions_and_metadata_copies_keep_shared_values_exact(
    nodes: list[str], module_client: ShardClient
) -> None:
    local, images = groups()
    batch = local.to_remote(nodes[2], module_client, share=SHARE)
    joined = batch
    try:
        chunks = batch.chunk_balanced(2, group_size=N, length_field="response")
        assert sorted(t for c in chunks for t in c.task_ids) == sorted(batch.task_ids)
        for chunk in chunks:
            rows = [local.task_ids.index(t) for t in chunk.task_ids]
            assert all(torch.equal(p, images[r // N]) for p, r in zip(chunk["pixel_values"], rows))
        odd = batch[1::3]  # every group cut apart
        copies = [DBM.from_json(odd.to_json()), pickle.loads(pickle.dumps(odd))]
        for copy in copies:
            assert copy.meta.fields["pixel_values"].has_shared
            assert [p.shape for p in copy["pixel_values"]] == [p.shape for p in odd["pixel_values"]]
        rewards = DBM.from_dict({"reward": torch.arange(PROMPTS * N) * 1.0}, task_ids=batch.task_ids)
        joined = batch.union(rewards.to_remote(nodes[2], module_client))
        assert joined.meta.fields["prompt"].has_shared and joined["prompt"] == local["prompt"]
    finally:
        joined.clear()
        batch.clear()


def test_deleting_some_tasks_of_a_group_keeps_the_others_value(
    nodes: list[str], module_client: ShardClient
) -> None:
    local, images = groups()
    before = stored_bytes(module_client, nodes[:1])
    batch = local.to_remote(nodes[0], module_client, share=SHARE)
    full = stored_bytes(module_client, nodes[:1]) - before
    assert batch[: N - 1].clear() == 4 * (N - 1)  # three of group 0's four tasks
    assert stored_bytes(module_client, nodes[:1]) - before > full - 100  # its image still held
    rest = batch[N - 1 :]
    assert torch.equal(rest["pixel_values"][0], images[0])
    assert rest[0]["prompt"] == "describe image 0"
    rest.clear()
    assert stored_bytes(module_client, nodes[:1]) == before


def test_share_refuses_groups_that_are_not_equal_or_not_whole(
    nodes: list[str], module_client: ShardClient
) -> None:
    local, _ = groups()
    before = module_client.traffic()
    with pytest.raises(InvalidArgumentError, match=r"share\['response'\]: task 1 differs"):
        local.to_remote(nodes[0], module_client, share={"response": N})
    with pytest.raises(InvalidArgumentError, match="divide"):
        local.to_remote(nodes[0], module_client, share={"prompt": 5})
    with pytest.raises(InvalidArgumentError, match="does not have"):
        local.to_remote(nodes[0], module_client, share={"nope": N})
    assert (module_client.traffic() - before).bytes_sent == 0


def test_the_controller_hands_out_and_checkpoints_shared_values(
    nodes: list[str], serve: Callable[..., Any], module_client: ShardClient
) -> None:
    local, images = groups()
    ctl = Controller(GRPOGroupNSampler(n_samples_per_prompt=N), client=module_client)
    ctl.put("mm", local.to_remote(nodes[1], module_client, share=SHARE))
    restored = Controller(GRPOGroupNSampler(n_samples_per_prompt=N), client=module_client)
    restored.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    for controller in (ctl, restored):
        batch = controller.get_meta("mm", f"train-{id(controller)}", ["pixel_values", "prompt"], PROMPTS * N)
        assert batch.meta.fields["pixel_values"].has_shared
        received = module_client.traffic()
        pixels = batch["pixel_values"]
        assert (module_client.traffic() - received).bytes_received < sum(
            im.numel() * 4 for im in images
        ) + 8_000
        rows = [local.task_ids.index(t) for t in batch.task_ids]
        assert all(torch.equal(p, images[r // N]) for p, r in zip(pixels, rows))
    assert ctl.clear_partition("mm") == PROMPTS * N * 4


def test_extending_a_shared_value_gives_the_task_its_own(
    nodes: list[str], module_client: ShardClient
) -> None:
    local, images = groups()
    batch = local.to_remote(nodes[2], module_client, share=SHARE)
    one = batch[:1].extend({"pixel_values": [torch.zeros(1, 32)]})
    assert not one.meta.fields["pixel_values"].has_shared
    assert torch.equal(one["pixel_values"][0], torch.cat([images[0], torch.zeros(1, 32)]))
    assert torch.equal(batch[1:N]["pixel_values"][0], images[0])  # the others keep the shared one
    one.clear()
    batch[1:].clear()


def test_shared_values_over_the_same_host_path(same_host: tuple[str, ShardClient]) -> None:
    node, client = same_host
    local, images = groups()
    batch = local.to_remote(node, client, share=SHARE)
    assert client.stats(node)["bytes"] < sum(im.numel() * 4 for im in images) + 4_000
    pixels = batch["pixel_values"]
    assert all(torch.equal(p, images[i // N]) for i, p in enumerate(pixels))
    batch.clear()


def test_a_put_split_into_staged_parts_shares_across_them(nodes: list[str]) -> None:
    """Three tasks a request: every group is cut over two or three staged parts, sent at once and
    arriving in any order; the worker applies every part's values before any sharing, so each
    group's image is stored once and every task reads it (the review found the order mattered)."""
    local, images = groups()
    with ShardClient(max_keys_per_request=3) as client:
        before = stored_bytes(client, nodes[1:2])
        batch = local.to_remote(nodes[1], client, share=SHARE)
        try:
            stored = stored_bytes(client, nodes[1:2]) - before
            image_bytes = sum(im.numel() * 4 for im in images)
            assert image_bytes <= stored < image_bytes + 2_000
            assert all(torch.equal(p, images[i // N]) for i, p in enumerate(batch["pixel_values"]))
            assert batch["prompt"] == local["prompt"]
        finally:
            batch.clear()
        assert stored_bytes(client, nodes[1:2]) == before


def test_fields_shared_alike_are_gathered_in_one_request_per_node(
    nodes: list[str], module_client: ShardClient
) -> None:
    """`prompt` and `image_id` share by the same groups (one put's `share=`): one fetch request
    for both, not one per field."""
    local, _ = groups()
    batch = local.select_fields(["prompt", "image_id"]).to_remote(nodes[0], module_client, share=SHARE)
    before = module_client.traffic()
    got = batch.to_local()
    assert (module_client.traffic() - before).requests == 1
    assert got["prompt"] == local["prompt"] and torch.equal(got["image_id"], local["image_id"])
    batch.clear()
