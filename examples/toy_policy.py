"""The main job's policy and task, in plain torch: nothing here knows about distbatch.

The task: reverse a string of digits. A prompt is 3 to 6 random digits and a separator; the
response is as many digits; the reward is the fraction of positions that hold the prompt's
digit reversed (a reader can check it by eye; chance is 0.1). The policy is a small decoder-only
transformer, randomly initialised from the run's seed, that samples each response digit at a
temperature. Everything is seeded per prompt, so a prompt's responses are the same whichever
worker generates them, and every computation is deterministic on CPU: two runs of one seed
give bit-identical weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIGITS = 10  # tokens 0..9 are digits; the policy only ever emits digits
SEP = 10  # between the prompt and the response
VOCAB = 11
MAX_DIGITS = 6
MAX_LEN = 2 * MAX_DIGITS + 1


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, width))
        return x + self.mlp(self.norm2(x))


class Policy(nn.Module):
    """Token and position embeddings, `layers` blocks, a head over the ten digits."""

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.token, self.position = nn.Embedding(VOCAB, width), nn.Embedding(MAX_LEN, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, DIGITS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits over the next digit at every position of `ids` ([batch, time])."""
        x = self.token(ids) + self.position(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_policy(seed: int) -> Policy:
    """The run's initial policy: the same weights for the same seed, in every process."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Policy()


def prompt_for(seed: int, step: int, prompt: int) -> tuple[torch.Tensor, torch.Generator]:
    """Prompt `prompt` of step `step`: its digits, and the generator its responses sample with."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + prompt)
    length = int(torch.randint(3, MAX_DIGITS + 1, (), generator=gen))
    return torch.randint(0, DIGITS, (length,), generator=gen), gen


def sample(
    policy: Policy, prompts: torch.Tensor, uniforms: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses to `prompts` ([batch, digits], one length), one digit at a time: each digit is
    the inverse of the policy's distribution (at `temperature`) at `uniforms` (same shape, in
    [0, 1)), so a response depends on its own uniforms only. Returns the response digits and
    their log-probabilities under the distribution they were drawn from."""
    batch, digits = prompts.shape
    sequences = torch.cat([prompts, torch.full((batch, 1), SEP)], 1)
    return sample_more(policy, sequences, uniforms, temperature, digits)


@torch.no_grad()
def sample_more(
    policy: Policy, sequences: torch.Tensor, uniforms: torch.Tensor, temperature: float, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` more response digits for `sequences` ([batch, prompt, separator, the response so
    far], one length), drawn as `sample` draws them: a generation interrupted after any digit
    and resumed here (by the same policy) gives what `sample` gives in one go. `uniforms`:
    [batch, digits], the whole response's. Returns the new digits and their log-probabilities."""
    digits = uniforms.shape[1]
    done = sequences.shape[1] - digits - 1
    responses, logprobs = [], []
    for i in range(done, min(done + steps, digits)):
        logp = (policy(sequences)[:, -1] / temperature).log_softmax(-1)
        cdf = logp.exp().cumsum(-1)
        digit = torch.searchsorted(cdf, uniforms[:, i : i + 1].contiguous()).clamp(max=DIGITS - 1)
        responses.append(digit[:, 0])
        logprobs.append(logp.gather(1, digit)[:, 0])
        sequences = torch.cat([sequences, digit], 1)
    if not responses:
        empty = torch.zeros((len(sequences), 0))
        return empty.long(), empty
    return torch.stack(responses, 1), torch.stack(logprobs, 1)


def reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Per response: the fraction of its digits equal to the prompt's, reversed."""
    return (responses == prompts.flip(1)).float().mean(1)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Each reward minus its group's mean, over the group's standard deviation (groups are
    consecutive runs of `group_size`)."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(1, keepdim=True)
    return (centred / (groups.std(1, unbiased=False, keepdim=True) + eps)).flatten()


def grpo_token_loss(
    policy: Policy,
    ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_offsets: torch.Tensor,
    advantages: torch.Tensor,
    temperature: float,
    clip: float = 0.2,
) -> torch.Tensor:
    """The clipped GRPO objective's sum over the response tokens of a packed micro-batch.

    `ids`, `cu_seqlens`: the sequences (prompt, separator, response) packed end to end;
    `old_logprobs`, `response_offsets`: the response tokens' sampling log-probabilities, packed
    (a sample's response is as long as its prompt); `advantages`: one per sample. The caller
    divides by the step's total response tokens, over every rank, so the gradient does not
    depend on how the step was cut into ranks and micro-batches."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    width = int(lengths.max())
    position = torch.arange(width)
    # Padded [batch, width] view of the packed ids (padding follows each sequence: causal
    # attention never lets it change the positions before it).
    valid = position[None] < lengths[:, None]
    where = (cu_seqlens[:-1, None] + position[None]).clamp(max=len(ids) - 1)
    logits = policy((ids[where] * valid).long())
    # Response token j of sample b sits at position digits_b + 1 + j, predicted at digits_b + j.
    digits = response_offsets[1:] - response_offsets[:-1]
    sample = torch.repeat_interleave(torch.arange(len(digits)), digits)
    j = torch.arange(len(old_logprobs)) - response_offsets[:-1][sample]
    at = digits[sample] + j
    target = ids[cu_seqlens[:-1][sample] + at + 1].long()
    new_logprobs = (logits[sample, at] / temperature).log_softmax(-1).gather(1, target[:, None])[:, 0]
    ratio = (new_logprobs - old_logprobs).exp()
    advantage = advantages[sample]
    return -torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage).sum()
