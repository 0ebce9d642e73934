"""The soak's random values: every edge a user meets turns up, at about its stated rate."""

from __future__ import annotations

import random

import torch

from bench.soak import EDGE_RATES, make_bundle

DRAWS = 1500


def test_the_soak_draws_every_edge_at_its_stated_rate() -> None:
    rng = random.Random(3)
    bundles = [make_bundle(rng, f"b{i}", 64) for i in range(DRAWS)]
    tensors = [v for b in bundles for v in b.values() if isinstance(v, torch.Tensor)]
    texts = [v["text"] for b in bundles for v in b.values() if isinstance(v, dict)]

    def rate(hits: int, of: int) -> float:
        return hits / of

    assert abs(rate(sum(not b for b in bundles), DRAWS) - EDGE_RATES["empty_bundle"]) < 0.015
    assert abs(rate(sum(t.dim() == 0 for t in tensors), len(tensors)) - EDGE_RATES["scalar"]) < 0.02
    # Strided among tensors that are not scalars; torch calls a view with a dimension of size 1
    # or no elements contiguous, so fewer test as non-contiguous than were drawn strided.
    strided = rate(sum(not t.is_contiguous() for t in tensors), len(tensors))
    assert 0.5 * EDGE_RATES["strided"] < strided <= EDGE_RATES["strided"]
    assert abs(rate(sum(t == "" for t in texts), len(texts)) - EDGE_RATES["empty_text"]) < 0.02
    zero = [t for t in tensors if t.dim() and 0 in t.shape]
    assert abs(rate(len(zero), len(tensors)) - (1 - EDGE_RATES["scalar"]) * EDGE_RATES["zero_dim"]) < 0.015
    # A zero in every position of 1-, 2- and 3-dim shapes; every dtype; unicode in JSON.
    assert {(t.dim(), t.shape.index(0)) for t in zero} == {(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)}
    assert {torch.bfloat16, torch.bool} <= {t.dtype for t in tensors}
    assert any(t and not t.isascii() for t in texts)
