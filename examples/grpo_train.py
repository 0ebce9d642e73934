"""The main job: GRPO that trains a policy, every batch moved by distbatch.

A small transformer learns to reverse digit strings (`toy_policy.py`: the task, the model, the
loss; random init, nothing downloaded). Each step:

1. rollout workers sample n responses per prompt from their copy of the policy and score them
   (reward: the fraction of digits in the right place; chance is 0.1); each keeps its samples;
2. the controller, from metadata alone, keeps each prompt's group whole and balances the batch
   over the train workers by tokens, and works out how many token-budget micro-batches every
   train rank runs (the same count on every rank);
3. each train worker gathers its chunk straight from the rollout workers, computes the GRPO
   loss's gradient micro-batch by micro-batch, and keeps it; every train worker then gathers all
   the gradients from its peers and sums them in rank order, so the replicas stay bit-identical,
   and steps its optimizer;
4. the new weights, one shard per parameter spread over the train workers, are gathered by the
   rollout workers peer to peer.

The controller handles metadata only. `--centralised` runs the same job the old way (every batch,
gradient and weight passes through the controller); for one seed both give the same reward curve
and bit-identical weights, which `--compare` checks.

    python examples/grpo_train.py --compare     # distributed, then centralised (what scripts/demo runs)
    python examples/grpo_train.py --steps 120   # longer
    python examples/grpo_train.py --launcher ray
    python examples/grpo_train.py --kill-rollout 3 --compare   # a rollout worker dies mid-step

With `--data-dir DIR` every worker is durable (`DIR/rollout<i>`, `DIR/train<i>`); with
`--kill-rollout S` (a temporary DIR if none is given), rollout worker 0 is killed with SIGKILL in
the middle of step S, once its samples are made, and started again on its directory: it comes
back holding them, the step's handles follow it to its new address, its engine loads the
current weights, and the step goes on; `--compare` then checks that the run is the run without
the kill. With `--async K`, the kill comes at the start of training step S, with rollout steps
queued in the controller, which is told the worker's new address (`Controller.move_node`).

`python` is one that has distbatch: the venv `scripts/demo` made, `.venv/bin/python`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from toy_policy import (
    SEP,
    grpo_advantages,
    grpo_token_loss,
    make_policy,
    prompt_for,
    reward,
    sample,
    sample_more,
)
from tqdm import tqdm

from distbatch import (
    Controller,
    DistributedBatchMemory,
    ShardClient,
    WorkerGroup,
    default_client,
    set_default_client,
)
from distbatch.samplers import GRPOGroupNSampler

ENGINE_MODULE = "grpo_train"
HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_FIELDS = ["input_ids", "logprobs", "advantages"]


# ----------------------------------------------------------------------------- engines (run on workers)


class Gathered:
    """Bytes an engine's batch arguments gathered from its peers since the last call, by path."""

    def __init__(self, context: Any) -> None:
        self.client = context.client
        self.last = self.client.traffic()

    def take(self) -> dict[str, int]:
        now = self.client.traffic()
        delta, self.last = now - self.last, now
        return {"http_bytes": delta.bytes_received, "shm_bytes": delta.same_host_received}


class Rollout:
    """An inference engine: samples from its copy of the policy and scores what it sampled."""

    def __init__(self, context: Any, seed: int, temperature: float) -> None:
        torch.set_num_threads(1)  # one core each: several workers share the machine
        self.gathered = Gathered(context)
        self.node, self.client = context.node, context.client
        self.policy = make_policy(seed)  # replaced by the trainer's weights before the first step
        self.params = list(self.policy.parameters())
        self.temperature = temperature
        self.version = -1
        self.reward_sum, self.responses = 0.0, 0

    def load_weights(self, weights: DistributedBatchMemory, version: int) -> int:
        """The policy's weights from `weights` (one task per parameter, wherever it is)."""
        values, cu_seqlens = weights.packed("value")
        order = weights["index"].tolist()
        with torch.no_grad():
            for k, i in enumerate(order):
                self.params[i].copy_(values[cu_seqlens[k] : cu_seqlens[k + 1]].view_as(self.params[i]))
        self.version = version
        return version

    def generate(self, prompts: list[int], step: int, n: int, seed: int) -> DistributedBatchMemory:
        """`n` responses to each prompt, scored, with their GRPO advantages (a prompt's group is
        whole here); kept on this worker, the controller gets a REMOTE batch."""
        by_length: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for prompt in prompts:
            digits, gen = prompt_for(seed, step, prompt)
            uniforms = torch.rand((n, len(digits)), generator=gen)
            by_length.setdefault(len(digits), []).append((prompt, digits, uniforms))
        samples: dict[int, dict[str, Any]] = {}
        for group in by_length.values():  # one forward pass per prompt length
            digits = torch.stack([d for _, d, _ in group]).repeat_interleave(n, 0)
            uniforms = torch.cat([u for _, _, u in group])
            responses, logprobs = sample(self.policy, digits, uniforms, self.temperature)
            rewards = reward(digits, responses)
            advantages = grpo_advantages(rewards, n)
            separator = torch.full((len(digits), 1), 10)
            ids = torch.cat([digits, separator, responses], 1).to(torch.int32)
            for g, (prompt, _, _) in enumerate(group):
                rows = range(g * n, (g + 1) * n)
                samples[prompt] = {
                    "input_ids": [ids[r] for r in rows],
                    "logprobs": [logprobs[r] for r in rows],
                    "rewards": rewards[g * n : (g + 1) * n],
                    "advantages": advantages[g * n : (g + 1) * n],
                }
            self.reward_sum += float(rewards.sum())
            self.responses += len(rewards)
        ordered = [samples[p] for p in prompts]
        return DistributedBatchMemory.from_dict(
            {
                "input_ids": [row for s in ordered for row in s["input_ids"]],
                "logprobs": [row for s in ordered for row in s["logprobs"]],
                "rewards": torch.cat([s["rewards"] for s in ordered]) if ordered else torch.zeros(0),
                "advantages": torch.cat([s["advantages"] for s in ordered]) if ordered else torch.zeros(0),
                "uid": [f"s{step}-p{p}" for p in prompts for _ in range(n)],
            },
            task_ids=[f"s{step}-p{p}-r{j}" for p in prompts for j in range(n)],
        )

    # A generation a weight update may interrupt (`--partial T`): `start` samples the first T
    # digits of each response, `resume` the next T, appending them to the task's fields where
    # they are (`extend`: the prefix never moves), until the responses are whole and scored.

    def start(self, prompts: list[int], step: int, n: int, seed: int, max_new: int) -> DistributedBatchMemory:
        """The first `max_new` digits of `n` responses to each prompt: `input_ids` (prompt,
        separator, digits so far), `logprobs` (of those digits), `prompt`; kept here."""
        per_task = [p for p in prompts for _ in range(n)]
        sequences = [torch.cat([prompt_for(seed, step, p)[0], torch.tensor([SEP])]) for p in per_task]
        ids, logprobs = self._advance(sequences, per_task, step, n, seed, max_new)
        return DistributedBatchMemory.from_dict(
            {
                "input_ids": [torch.cat([s, i]).to(torch.int32) for s, i in zip(sequences, ids)],
                "logprobs": logprobs,
                "prompt": torch.tensor(per_task),
            },
            task_ids=[f"s{step}-p{p}-r{j}" for p in prompts for j in range(n)],
        )

    def resume(
        self, batch: DistributedBatchMemory, step: int, n: int, seed: int, max_new: int
    ) -> DistributedBatchMemory:
        """The next `max_new` digits of the responses in `batch` (its tasks are this worker's),
        with this worker's current weights, appended where they are; once the responses are
        whole, their rewards and GRPO advantages join them."""
        if not len(batch):
            return batch
        sequences = list(batch["input_ids"])
        prompts = batch["prompt"].tolist()
        ids, logprobs = self._advance([s.long() for s in sequences], prompts, step, n, seed, max_new)
        grown = batch.extend({"input_ids": [i.to(torch.int32) for i in ids], "logprobs": logprobs})
        lengths = grown.lengths("input_ids")
        wanted = [2 * len(prompt_for(seed, step, p)[0]) + 1 for p in prompts[::n]]
        if [lengths[g * n] for g in range(len(wanted))] != wanted:
            return grown  # not whole yet
        whole = [torch.cat([s.long(), i]) for s, i in zip(sequences, ids)]
        rewards = torch.stack([reward(w[: len(w) // 2][None], w[len(w) // 2 + 1 :][None])[0] for w in whole])
        self.reward_sum += float(rewards.sum())
        self.responses += len(rewards)
        scores = DistributedBatchMemory.from_dict(
            {"rewards": rewards, "advantages": grpo_advantages(rewards, n)}, task_ids=grown.task_ids
        )
        return grown.union(scores.to_remote(self.node, self.client))

    def _advance(
        self, sequences: list[torch.Tensor], prompts: list[int], step: int, n: int, seed: int, max_new: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`max_new` more digits for each task (`sequences[i]`: prompt, separator and digits so
        far, of response `i % n` to prompt `prompts[i]`), tasks of one length in one pass."""
        uniforms = {}
        for p in dict.fromkeys(prompts):
            digits, gen = prompt_for(seed, step, p)
            uniforms[p] = torch.rand((n, len(digits)), generator=gen)  # as `generate` draws them
        by_length: dict[int, list[int]] = {}
        for i, sequence in enumerate(sequences):
            by_length.setdefault(len(sequence), []).append(i)
        ids: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * len(sequences)
        logprobs: list[torch.Tensor] = [torch.zeros(0)] * len(sequences)
        for rows in by_length.values():
            drawn = torch.stack([uniforms[prompts[i]][i % n] for i in rows])
            new, logp = sample_more(
                self.policy, torch.stack([sequences[i] for i in rows]), drawn, self.temperature, max_new
            )
            for k, i in enumerate(rows):
                ids[i], logprobs[i] = new[k], logp[k]
        return ids, logprobs

    def take_metrics(self) -> dict[str, float]:
        """Plain JSON back to the controller: rewards and bytes gathered since the last call."""
        out = {"reward_sum": self.reward_sum, "responses": self.responses, **self.gathered.take()}
        self.reward_sum, self.responses = 0.0, 0
        return out


class Trainer:
    """A training engine: one data-parallel rank of the policy's replicas."""

    def __init__(self, context: Any, seed: int, lr: float, temperature: float) -> None:
        torch.set_num_threads(1)
        self.gathered = Gathered(context)
        self.rank, self.world = context.rank, context.world_size
        self.policy = make_policy(seed)  # every rank starts from the same weights
        self.params = list(self.policy.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.temperature = temperature
        self.loss_sum = 0.0

    def compute_gradients(
        self, batch: DistributedBatchMemory, step: int, total_tokens: int, micro_batches: int, max_tokens: int
    ) -> DistributedBatchMemory:
        """This rank's gradient of the step's loss (the mean over all `total_tokens` response
        tokens of every rank), micro-batch by micro-batch; kept here as one task."""
        self.optimizer.zero_grad(set_to_none=False)
        for part in batch.split_micro_batches(max_tokens, count=micro_batches, length_field="input_ids"):
            if not len(part):
                continue  # an empty micro-batch: this rank had fewer tokens than the others
            ids, cu_seqlens = part.packed("input_ids")
            old_logprobs, response_offsets = part.packed("logprobs")
            loss = (
                grpo_token_loss(
                    self.policy,
                    ids,
                    cu_seqlens.long(),
                    old_logprobs,
                    response_offsets.long(),
                    part["advantages"],
                    self.temperature,
                )
                / total_tokens
            )
            loss.backward()
            self.loss_sum += float(loss)
        flat = torch.cat([p.grad.flatten() for p in self.params])  # type: ignore[union-attr]
        return DistributedBatchMemory.from_dict({"grad": flat[None]}, task_ids=[f"g{step}-r{self.rank}"])

    def apply_gradients(self, gradients: DistributedBatchMemory) -> None:
        """Sum every rank's gradient (gathered from the ranks that hold them) in rank order,
        the same sum on every rank, and step the optimizer."""
        total = gradients["grad"].sum(0)
        offset = 0
        for p in self.params:
            p.grad.copy_(total[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
            offset += p.numel()
        self.optimizer.step()

    def weights(self, version: int) -> DistributedBatchMemory:
        """This rank's share of the parameters (every `world`-th one), kept here as one task each."""
        mine = list(range(self.rank, len(self.params), self.world))
        return DistributedBatchMemory.from_dict(
            {
                "value": [self.params[i].detach().flatten().clone() for i in mine],
                "index": torch.tensor(mine, dtype=torch.int64),
            },
            task_ids=[f"w{version}-{i}" for i in mine],
        )

    def take_metrics(self) -> dict[str, float]:
        """The loss and bytes gathered since the last call."""
        out = {"loss_sum": self.loss_sum, **self.gathered.take()}
        self.loss_sum = 0.0
        return out


# ----------------------------------------------------------------------------- controller


@dataclass
class StepReport:
    step: int
    reward: float  # mean reward of the step's responses (sampled by the policy of version `step`)
    loss: float
    tokens: int
    micro_batches: int
    controller_bytes: (
        int  # bytes the controller itself sent or received (metadata, and data when centralised)
    )
    http_bytes: int  # data the workers gathered from each other over HTTP
    shm_bytes: int  # ... and through shared memory (same host)
    seconds: float


@dataclass
class RunReport:
    mode: str
    steps: list[StepReport] = field(default_factory=list)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # the final policy, by parameter
    shards_left: int = -1
    seconds: float = 0.0  # the whole training loop, wall clock
    staleness: dict[str, Any] = field(default_factory=dict)  # async: the controller's counters
    interrupted: int = 0  # --partial: rollout steps a weight update interrupted (and that resumed)
    restarts: int = 0  # --kill-rollout: rollout workers killed mid-step and started again
    moved_tasks: int = 0  # --async --kill-rollout: tasks the controller moved to the restarted worker

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.steps]


class Job:
    """The controller's side of one run: worker groups, and each step's calls."""

    def __init__(
        self, args: argparse.Namespace, rollout: WorkerGroup, train: WorkerGroup, centralised: bool
    ) -> None:
        self.args, self.rollout, self.train, self.centralised = args, rollout, train, centralised
        self.stored: list[DistributedBatchMemory] = []  # what the step made, cleared at its end
        self.restarts = 0  # rollout workers killed and started again (--kill-rollout)

    def hand_over(self, batch: DistributedBatchMemory, nodes: list[str]) -> list[DistributedBatchMemory]:
        """`batch` for each of `nodes`: itself, gathered by each straight from where it is
        (distributed), or pulled by the controller and pushed to each (centralised)."""
        if not self.centralised:
            return [batch] * len(nodes)
        local = batch.to_local()
        batch.clear()  # before the copies go out: one may land where this was, under its ids
        self.stored.remove(batch)
        copies = [local.to_remote(node) for node in nodes]
        self.stored += copies
        return copies

    def publish_weights(self, version: int) -> None:
        """The trainers' weights (one shard per parameter, spread over them), loaded by every
        rollout worker."""
        weights = DistributedBatchMemory.concat(self.train.call_all("weights", version=version))
        self.stored.append(weights)
        self.rollout.call("load_weights", self.hand_over(weights, self.rollout.nodes), version=version)

    def gradients(
        self, chunks: list[DistributedBatchMemory], step: int
    ) -> tuple[DistributedBatchMemory, int, int]:
        """Each train rank's gradient of the step's loss over its chunk, in token-budget
        micro-batches of one count for all ranks: the gradients (kept on the ranks), the step's
        response tokens, the micro-batch count."""
        args = self.args
        tokens = sum(sum(chunk.lengths("logprobs")) for chunk in chunks)  # response tokens
        count = DistributedBatchMemory.micro_batch_count(chunks, args.max_tokens, length_field="input_ids")
        gradients = DistributedBatchMemory.concat(
            self.train.call(
                "compute_gradients",
                chunks,
                step=step,
                total_tokens=tokens,
                micro_batches=count,
                max_tokens=args.max_tokens,
            )
        )
        self.stored.append(gradients)
        return gradients, tokens, count

    def kill_and_restart_rollout(
        self, rank: int, produced: DistributedBatchMemory, step: int
    ) -> DistributedBatchMemory:
        """SIGKILL rollout worker `rank` while it holds its part of `produced`, start it again on
        its data directory, and point the step's handles at its new address; its engine starts
        afresh and loads the trainers' current weights. `produced`, following it."""
        at = next(i for i, batch in enumerate(self.stored) if batch is produced)
        old = self.rollout.nodes[rank]
        next(p for p in self.rollout.processes if p.node == old).kill(meant=True)
        new = self.rollout.restart(rank)
        self.stored = [batch.moved(old, new) for batch in self.stored]
        self.publish_weights(step)  # the policy that generated this step, on every rollout worker
        self.restarts += 1
        return self.stored[at]

    def clear(self) -> None:
        for batch in self.stored:
            batch.clear()
        self.stored = []

    def step(self, step: int) -> StepReport:
        args, client = self.args, default_client()
        traffic0 = client.traffic()
        started = time.perf_counter()
        prompts = list(range(args.prompts))
        produced = DistributedBatchMemory.concat(
            self.rollout.call(
                "generate",
                [prompts[i :: len(self.rollout)] for i in range(len(self.rollout))],
                step=step,
                n=args.n,
                seed=args.seed,
            )
        )
        self.stored.append(produced)
        # Rewards are counted by the rollout engines: taken now, before one may be killed.
        rewards = self.rollout.call_all("take_metrics")
        if args.kill_rollout == step and not self.centralised:
            produced = self.kill_and_restart_rollout(0, produced, step)
        batch = produced.select_fields(TRAIN_FIELDS)
        if self.centralised:
            batch = batch.to_local()
        chunks = batch.chunk_balanced(len(self.train), group_size=args.n, length_field="input_ids")
        if self.centralised:
            chunks = [chunk.to_remote(node) for chunk, node in zip(chunks, self.train.nodes)]
            self.stored += chunks
        gradients, tokens, count = self.gradients(chunks, step)
        self.train.call("apply_gradients", self.hand_over(gradients, self.train.nodes))
        self.publish_weights(step + 1)
        loads = self.rollout.call_all("take_metrics")  # the bytes gathered loading the weights
        losses = self.train.call_all("take_metrics")
        workers = [*rewards, *loads, *losses]
        self.clear()
        traffic = client.traffic() - traffic0
        return StepReport(
            step=step,
            reward=sum(r["reward_sum"] for r in rewards) / max(sum(r["responses"] for r in rewards), 1),
            loss=sum(m["loss_sum"] for m in losses),
            tokens=tokens,
            micro_batches=count,
            controller_bytes=traffic.total + traffic.same_host_bytes,
            http_bytes=sum(m["http_bytes"] for m in workers),
            shm_bytes=sum(m["shm_bytes"] for m in workers),
            seconds=time.perf_counter() - started,
        )


class AsyncJob:
    """Rollout up to `ahead` steps in front of training (`--async K`), through a distbatch
    `Controller`: a producer thread generates step s as soon as the trainers have finished
    step s - K, and puts it with the policy version that generated it; the training loop takes
    a step's worth of whole groups at most K versions old (`get_meta(max_staleness=K)`), trains,
    publishes the weights, and tells the controller the new version. Generation and weight
    loading take turns on the rollout workers (a generation runs on one version)."""

    def __init__(self, job: Job, ahead: int) -> None:
        self.job, self.ahead = job, ahead
        self.controller = Controller(GRPOGroupNSampler(n_samples_per_prompt=job.args.n))
        # Partial rollouts put their tasks before `advantages` exists: the trainer waits for it.
        self.controller.create_partition("rollout", expected_fields=TRAIN_FIELDS)
        self.turns = threading.Lock()  # generate / load_weights on the rollout workers
        self.progress = threading.Condition()
        self.trained = 0  # steps trained: the trainers' policy version
        self.loaded = 0  # the version the rollout workers hold
        self.rewards: dict[int, float] = {}
        self.interrupted = 0  # --partial: steps whose generation a weight update interrupted
        self.moved_tasks = 0  # --kill-rollout: tasks the controller moved to a restarted worker
        self.failure: BaseException | None = None
        self.stopping = False  # set when training is done or failed: the producer stops
        self.producer = threading.Thread(target=self.produce, name="rollout", daemon=True)

    def queued(self, step: int) -> int:
        """Rollout steps made and not yet trained on nor dropped, were `step` made now."""
        dropped_steps = self.controller.staleness()["dropped"] // (self.job.args.prompts * self.job.args.n)
        return step - self.trained - dropped_steps

    def produce(self) -> None:
        """The producer thread: rollout steps, each at most `ahead` steps in front of training,
        until training is done (more steps than training takes, when stale ones were dropped)."""
        try:
            prompts = list(range(self.job.args.prompts))
            step = 0
            while True:
                with self.progress:
                    # Steps whose tasks were dropped as stale count as not produced.
                    while self.queued(step) > self.ahead and not self.stopping:
                        self.progress.wait()
                    if self.stopping:
                        return
                self.rewards[step] = self.rollout_step(step, prompts)
                step += 1
        except BaseException as exc:  # the training loop raises it
            self.failure = exc

    def rollout_step(self, step: int, prompts: list[int]) -> float:
        """Generate step `step`'s responses and put them in the controller with the policy
        version that began them; their mean reward. With `--partial T`, T digits at a time:
        between two calls the trainers may publish new weights, which the rest is sampled with
        (the generation is interrupted, not thrown away: each task's fields grow where they are,
        put as partial until whole)."""
        args, rollout = self.job.args, self.job.rollout
        chunks = [prompts[i :: len(rollout)] for i in range(len(rollout))]
        common = {"step": step, "n": args.n, "seed": args.seed}
        with self.turns:
            version = self.loaded
            if args.partial is None:  # made, put and counted in one turn (a restart comes between turns)
                parts = rollout.call("generate", chunks, **common)
                self.controller.put(
                    "rollout", DistributedBatchMemory.concat([p for p in parts if len(p)]), version=version
                )
                return _mean_reward(rollout.call_all("take_metrics"))
            parts = rollout.call("start", chunks, max_new=args.partial, **common)
        interrupted = False
        while not all(_whole(p) for p in parts):  # prompts of one length finish together
            growing = DistributedBatchMemory.concat([p for p in parts if not _whole(p)])
            self.controller.put("rollout", growing, version=version, partial=["input_ids", "logprobs"])
            with self.turns:
                interrupted = interrupted or self.loaded != version
                resumed = rollout.call(
                    "resume",
                    [DistributedBatchMemory() if _whole(p) else p for p in parts],
                    max_new=args.partial,
                    **common,
                )
            parts = [p if _whole(p) else r for p, r in zip(parts, resumed)]
        self.interrupted += interrupted
        produced = DistributedBatchMemory.concat([p for p in parts if len(p)])
        self.controller.put("rollout", produced, version=version)
        with self.turns:
            return _mean_reward(rollout.call_all("take_metrics"))

    def kill_and_restart_rollout(self, rank: int) -> None:
        """SIGKILL rollout worker `rank` between two training steps (no gather in flight) and in a
        turn of its own (no generation either), start it again on its data directory, and tell
        the controller where it now is: its tasks are trained on from there. Its engine loads
        the weights the others hold."""
        job = self.job
        with self.turns:
            old = job.rollout.nodes[rank]
            next(p for p in job.rollout.processes if p.node == old).kill(meant=True)
            new = job.rollout.restart(rank)
            self.moved_tasks += self.controller.move_node(old, new)
            job.publish_weights(self.loaded)
            job.restarts += 1

    def next_batch(self, size: int) -> DistributedBatchMemory:
        """A step's worth of whole groups, at most `ahead` versions old (older ones dropped)."""
        while True:
            batch = self.controller.get_meta(
                "rollout", "train", TRAIN_FIELDS, size, timeout=1.0, max_staleness=self.ahead, stale="drop"
            )
            if len(batch):
                return batch
            if self.failure is not None:
                raise RuntimeError("the rollout thread failed") from self.failure
            if not self.producer.is_alive():
                raise RuntimeError("the rollout thread stopped with too few fresh tasks left to train on")

    def train(self, steps: tqdm) -> list[StepReport]:
        """Train `steps` steps while the producer thread runs ahead; stop it at the end, or at
        a failure of either (the producer's raised here)."""
        self.producer.start()
        try:
            return self._train(steps)
        finally:
            with self.progress:
                self.stopping = True
                self.progress.notify_all()
            self.producer.join()
            self.controller.clear_partition("rollout")  # what the producer made past the last step
            if self.failure is not None:
                raise RuntimeError("the rollout thread failed") from self.failure

    def _train(self, steps: tqdm) -> list[StepReport]:
        job, args = self.job, self.job.args
        reports = []
        for step in steps:
            started = time.perf_counter()
            if args.kill_rollout == step:
                self.kill_and_restart_rollout(0)
            batch = self.next_batch(args.prompts * args.n)
            chunks = batch.chunk_balanced(len(job.train), group_size=args.n, length_field="input_ids")
            gradients, tokens, count = job.gradients(chunks, step)
            job.train.call_all("apply_gradients", gradients)
            with self.turns:
                job.publish_weights(step + 1)
                self.loaded = step + 1
            self.controller.set_policy_version(step + 1)
            with self.progress:
                self.trained = step + 1
                self.progress.notify_all()
            losses = job.train.call_all("take_metrics")
            self.controller.clear_tasks("rollout", batch.task_ids)
            job.clear()
            reports.append(
                StepReport(
                    step=step,
                    reward=self.rewards.get(step, float("nan")),
                    loss=sum(m["loss_sum"] for m in losses),
                    tokens=tokens,
                    micro_batches=count,
                    controller_bytes=0,
                    http_bytes=sum(m["http_bytes"] for m in losses),
                    shm_bytes=sum(m["shm_bytes"] for m in losses),
                    seconds=time.perf_counter() - started,
                )
            )
            steps.set_postfix(reward=f"{reports[-1].reward:.3f}")
        return reports


def _mean_reward(metrics: list[dict[str, float]]) -> float:
    return sum(m["reward_sum"] for m in metrics) / max(sum(m["responses"] for m in metrics), 1)


def _whole(part: DistributedBatchMemory) -> bool:
    """Whether a rollout worker's part of a step is whole (scored), or holds no task."""
    return not len(part) or "advantages" in part.fields


def run(args: argparse.Namespace, centralised: bool = False, quiet: bool = False) -> RunReport:
    """Start the workers, train `args.steps` steps, keep the final weights, stop the workers."""
    mode = "centralised" if centralised else "distributed"
    if args.ahead is not None:
        mode = f"async-{args.ahead}" + ("" if args.partial is None else f"-partial-{args.partial}")
    report = RunReport(mode)
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    if args.http:  # every process on HTTP, the workers too (DISTBATCH_SHM=0)
        env["DISTBATCH_SHM"] = "0"
        set_default_client(ShardClient(same_host=False))
    start: Callable[..., WorkerGroup] = WorkerGroup.local
    if args.launcher == "ray":
        import ray

        from distbatch.launch.ray_actors import init_local_ray

        if not ray.is_initialized():
            init_local_ray()
        start = WorkerGroup.ray
    common = {"seed": args.seed, "temperature": args.temperature}
    data_dir, scratch = args.data_dir, None
    if data_dir is None and args.kill_rollout is not None and not centralised:
        scratch = tempfile.TemporaryDirectory(prefix="grpo-train-")  # removed once the workers stop
        data_dir = Path(scratch.name)
    durable = (
        {} if data_dir is None else {"rollout": data_dir / "rollout{rank}", "train": data_dir / "train{rank}"}
    )
    flags = {role: ["--data-dir", str(path)] for role, path in durable.items()}
    with (
        start(
            args.rollout_workers,
            f"{ENGINE_MODULE}:Rollout",
            engine_kwargs=common,
            env=env,
            args=flags.get("rollout", []),
        ) as rollout,
        start(
            args.train_workers,
            f"{ENGINE_MODULE}:Trainer",
            engine_kwargs={**common, "lr": args.lr},
            env=env,
            args=flags.get("train", []),
        ) as train,
    ):
        job = Job(args, rollout, train, centralised)
        job.publish_weights(0)  # the rollout workers start from the trainers' weights
        job.clear()
        steps = tqdm(range(args.steps), desc=f"[{report.mode}]", unit="step", disable=quiet, leave=True)
        started = time.perf_counter()
        if args.ahead is not None:
            asynchronous = AsyncJob(job, args.ahead)
            report.steps = asynchronous.train(steps)
            report.staleness = asynchronous.controller.summary()["staleness"]
            report.interrupted = asynchronous.interrupted
            report.moved_tasks = asynchronous.moved_tasks
        else:
            for step in steps:
                report.steps.append(job.step(step))
                steps.set_postfix(reward=f"{report.steps[-1].reward:.3f}")
        report.seconds = time.perf_counter() - started
        final = DistributedBatchMemory.concat(train.call_all("weights", version=args.steps))
        values, cu_seqlens = final.packed("value")
        for k, i in enumerate(final["index"].tolist()):
            report.weights[i] = values[cu_seqlens[k] : cu_seqlens[k + 1]].clone()
        final.clear()
        report.shards_left = sum(s["shards"] for g in (rollout, train) for s in g.stats())
        report.restarts = job.restarts
    if scratch is not None:
        scratch.cleanup()
    if args.http:
        default_client().close()
        set_default_client(None)
    return report


def identical(a: RunReport, b: RunReport) -> bool:
    """Same rewards at every step, and bit-identical final weights."""
    return (
        a.rewards == b.rewards
        and a.weights.keys() == b.weights.keys()
        and all(torch.equal(a.weights[i], b.weights[i]) for i in a.weights)
    )


def save_curve(reports: list[RunReport], out: Path) -> Path:
    """The reward curves as JSON and as a plot beside it; returns the plot's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    curves = {r.mode: r.rewards for r in reports}
    (out / "reward.json").write_text(json.dumps(curves, indent=1))
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for mode, rewards in curves.items():
        axes.plot(range(len(rewards)), rewards, label=mode, linestyle="-" if mode == "distributed" else "--")
    axes.axhline(0.1, color="grey", linewidth=0.8, linestyle=":", label="chance (0.1)")
    axes.set_xlabel("step")
    axes.set_ylabel("mean reward")
    axes.set_title("GRPO on digit reversal, through distbatch")
    axes.legend()
    figure.tight_layout()
    plot = out / "reward.png"
    figure.savefig(plot, dpi=120)
    plt.close(figure)
    return plot


RAY_MISSING = (
    "grpo_train.py: --launcher ray needs Ray, which this Python does not have:"
    ' pip install -e ".[ray]" (.venv/bin/pip in the venv scripts/demo made)'
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (the GRPO group)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=1024, help="token budget of a train micro-batch")
    parser.add_argument("--rollout-workers", type=int, default=2)
    parser.add_argument("--train-workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/grpo"), help="where the curve and plot go")
    parser.add_argument("--launcher", choices=["local", "ray"], default="local")
    parser.add_argument(
        "--http", action="store_true", help="HTTP only, even between processes on one host (no shared memory)"
    )
    parser.add_argument(
        "--partial",
        type=int,
        metavar="T",
        help="with --async: generate T digits per call; a weight update between calls interrupts "
        "the generation, which resumes with the new weights (partial rollouts)",
    )
    parser.add_argument(
        "--async",
        dest="ahead",
        type=int,
        metavar="K",
        help="asynchronous: rollout runs up to K steps ahead of training, on a policy at most K versions old",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="durable workers: each writes what it stores under DIR (rollout<i>, train<i>)",
    )
    parser.add_argument(
        "--kill-rollout",
        type=int,
        metavar="S",
        help="SIGKILL rollout worker 0 in the middle of step S (with --async: before training step S, the "
        "controller told where it went) and start it again on its data directory (local launcher)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--centralised", action="store_true", help="every batch through the controller")
    mode.add_argument("--compare", action="store_true", help="distributed, then centralised; check identical")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.launcher == "ray" and importlib.util.find_spec("ray") is None:
        print(RAY_MISSING, file=sys.stderr)
        return 2
    if args.ahead is not None and (args.compare or args.centralised or args.ahead < 0):
        print("grpo_train.py: --async K (K >= 0) runs distributed only", file=sys.stderr)
        return 2
    if args.partial is not None and (args.ahead is None or args.partial < 1):
        print("grpo_train.py: --partial T (T >= 1) goes with --async K", file=sys.stderr)
        return 2
    if args.kill_rollout is not None and (args.partial is not None or args.launcher != "local"):
        print(
            "grpo_train.py: --kill-rollout S runs on the local launcher, without --partial", file=sys.stderr
        )
        return 2
    modes = [False, True] if args.compare else [args.centralised]
    reports = [run(args, centralised) for centralised in modes]
    first = reports[0]
    every = max(1, args.steps // 6)
    shown = sorted({*range(0, args.steps, every), args.steps - 1})
    print()
    print("step   " + "  ".join(f"{s:>5}" for s in shown))
    for report in reports:
        print(f"{report.mode[:6]:<7}" + "  ".join(f"{report.rewards[s]:5.3f}" for s in shown))
    start, end = sum(first.rewards[:5]) / 5, sum(first.rewards[-5:]) / 5
    print(f"\nmean reward: {start:.3f} over the first 5 steps (chance is 0.100), {end:.3f} over the last 5")
    for report in reports:
        seconds = sum(s.seconds for s in report.steps)
        moved = sum(s.controller_bytes for s in report.steps)
        http, shm = sum(s.http_bytes for s in report.steps), sum(s.shm_bytes for s in report.steps)
        empty = "yes" if report.shards_left == 0 else f"NO ({report.shards_left} shards)"
        print(
            f"[{report.mode}] {seconds:.1f} s of steps; workers read {http / 1e6:.1f} MB of batches, "
            f"gradients and weights over HTTP and {shm / 1e6:.1f} MB through shared memory; "
            f"the controller moved {moved / 1e6:.2f} MB; stores empty: {empty}"
        )
    for report in reports:
        print(f"[{report.mode}] {args.steps / report.seconds:.2f} steps/s ({report.seconds:.1f} s in all)")
        if report.staleness:
            served = ", ".join(
                f"{n} tasks {age} version(s) old" for age, n in report.staleness["served"].items()
            )
            print(f"[{report.mode}] trained on {served}; dropped as stale: {report.staleness['dropped']}")
        if report.restarts:
            print(
                f"[{report.mode}] rollout worker 0 was killed (SIGKILL) in step {args.kill_rollout} and"
                " started again on its data directory; the step went on with every sample it held"
                + (f" (the controller moved {report.moved_tasks} tasks to it)" if report.moved_tasks else "")
            )
        if args.partial is not None:
            print(
                f"[{report.mode}] {report.interrupted} rollout steps were interrupted by a weight update "
                f"and resumed with the new weights ({args.partial} digits per generation call)"
            )
    ok = all(r.shards_left == 0 for r in reports)
    if len(reports) == 2:
        same = identical(reports[0], reports[1])
        print(
            f"distributed and centralised: {'identical' if same else 'DIFFERENT'} rewards at every step "
            f"and {'bit-identical' if same else 'different'} final weights"
        )
        ok = ok and same
    print(f"reward curve: {save_curve(reports, args.out)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
