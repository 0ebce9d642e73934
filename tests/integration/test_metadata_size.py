"""What the README and the Batches guide say a REMOTE batch's metadata costs, measured.

The measured batch is the traffic job's (examples/grpo_pipeline.py, default sizes) step-0 batch, as
its controller gets it: 512 GRPO tasks x 5 fields (ragged `input_ids` / `logprobs` /
`loss_mask`, scalar `rewards`, string `uid`) that two rollout workers generated and hold, with
ids such as `s0-p12-r3`. Sizes: `len(batch.to_json())` and `len(pickle.dumps(batch))`, in bytes.
The same data under `from_dict`'s default ids (16 characters) and with 16x longer sequences, and
the guide's own 8-task batch, are measured as the pages say.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from docs_support import GUIDE, README, python_blocks, run_blocks

from distbatch import DistributedBatchMemory, WorkerGroup

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
BATCHES = GUIDE / "batches.md"
DBM = DistributedBatchMemory


def number(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.fixture(scope="module")
def rollout(grpo: ModuleType) -> Iterator[WorkerGroup]:
    with WorkerGroup.local(2, f"{grpo.ENGINE_MODULE}:RolloutEngine", env={"PYTHONPATH": grpo.HERE}) as group:
        yield group


def generated(grpo: ModuleType, rollout: WorkerGroup, **sizes: int) -> DBM:
    """The traffic job's step-0 batch (what its controller gets from the rollout workers)."""
    args = grpo.parse_args([])
    prompts = list(range(args.prompts))
    kwargs = {"n": args.n, "mean_len": args.mean_len, "max_len": args.max_len, **sizes}
    parts = rollout.call("generate", [prompts[i::2] for i in range(2)], step=0, seed=args.seed, **kwargs)
    return DBM.concat(parts)


def test_the_main_jobs_batch_costs_what_the_pages_say(grpo: ModuleType, rollout: WorkerGroup) -> None:
    batch = generated(grpo, rollout)
    try:
        assert (len(batch), batch.fields) == (512, ["input_ids", "logprobs", "loss_mask", "rewards", "uid"])
        shards = len(batch) * len(batch.fields)
        text, pickled = batch.to_json(), pickle.dumps(batch)
        ids = len(json.dumps(batch.task_ids, separators=(",", ":")))  # the ids as the JSON holds them
        guide = " ".join(BATCHES.read_text().split())
        said = re.search(
            r"`len\(batch\.to_json\(\)\)` is ([\d,]+) bytes, ([\d,]+) of them the ids and ([\d,]+) the rest "
            r"\(([\d.]+) per shard\); the same tasks under `from_dict`'s default ids \(16 characters\) take "
            r"([\d,]+) bytes .*?`len\(pickle\.dumps\(batch\)\)` is ([\d,]+) bytes "
            r"\(([\d,]+) with default ids\)",
            guide,
        )
        assert said, "the Batches guide's measurement is not where this test looks"
        assert number(said[1]) == len(text) and number(said[2]) == ids
        assert number(said[3]) == len(text) - ids and float(said[4]) == round((len(text) - ids) / shards, 2)
        assert number(said[6]) == len(pickled)
        readme = " ".join(README.read_text().split())
        assert f"{len(text):,} bytes, {ids:,} of them its ids" in readme
        assert "about 1 byte of JSON per shard plus its task ids" in readme
        assert 1.0 <= (len(text) - ids) / shards < 1.5  # "about 1 byte per shard"

        # The same tasks under from_dict's default ids (16 characters), on the same two workers.
        local = batch.to_local()
        fresh = DBM.from_dict({name: local[name] for name in local.fields})
        half = len(fresh) // 2
        parts = [fresh[:half].to_remote(rollout.nodes[0]), fresh[half:].to_remote(rollout.nodes[1])]
        renamed = DBM.concat(parts)
        try:
            assert len(fresh.task_ids[0]) == 14 and len(fresh.task_ids[-1]) == 16  # "<12 hex>-<index>"
            assert abs(len(renamed.to_json()) - number(said[5])) <= 60  # the indexes' digits vary by a few
            assert len(pickle.dumps(renamed)) - len(pickled) == number(said[7]) - number(said[6])
        finally:
            renamed.clear()
    finally:
        batch.clear()


def test_longer_sequences_pickle_to_the_same_size(grpo: ModuleType, rollout: WorkerGroup) -> None:
    """"A batch of 32k-token sequences pickles to the same size as one of 1k-token sequences";
    its JSON grows only by the lengths' extra digits."""
    sizes = []
    for lengths in ({}, {"mean_len": 16384, "max_len": 32768}):  # the same task ids: one at a time
        batch = generated(grpo, rollout, **lengths)
        try:
            tokens = sum(batch.lengths("input_ids"))
            sizes.append((tokens, len(pickle.dumps(batch)), len(batch.to_json())))
        finally:
            batch.clear()
    (short_tokens, short_pickle, short_json), (long_tokens, long_pickle, long_json) = sizes
    assert long_tokens > 8 * short_tokens
    assert long_pickle == short_pickle
    assert short_json < long_json < 1.1 * short_json
    guide = " ".join(BATCHES.read_text().split())
    assert f"its JSON grows only by the lengths' extra digits ({long_json / short_json - 1:.0%}" in guide


def test_the_guides_8_task_batch_prints_the_sizes_its_comment_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocks = python_blocks(BATCHES)
    index = next(i for i, block in enumerate(blocks) if "print(len(text), len(pickle.dumps(batch)))" in block)
    comment = re.search(r"len\(pickle\.dumps\(batch\)\)\)  # ([\d,]+) ([\d,]+)", blocks[index])
    assert comment, "the comment should say the two sizes"
    namespace = run_blocks(BATCHES, blocks[: index + 1])
    try:
        printed = [line for line in capsys.readouterr().out.splitlines() if re.fullmatch(r"\d+ \d+", line)]
        assert printed[-1] == f"{number(comment[1])} {number(comment[2])}"
    finally:
        namespace["workers"].shutdown()
