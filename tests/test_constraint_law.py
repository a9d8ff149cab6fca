"""Sampling under a constraint is exact at every depth: the law of the first committed tokens,
enumerated exactly (the target's rows masked and renormalised), against samples of one constrained
verification step (then exact masked sampling), as tests/test_verify_law.py does unconstrained.

The constraint is a toy written against the protocol alone (no grammar engine): no token may
repeat the one before it, and token 3 (the row's EOS) never fits, so drafts drawn from an unmasked
``q`` hold refused tokens often. Drawn drafts are left to the verifier (the refused token stays as a
leaf); a planted bug that cuts them like point masses instead must exceed the bound.
"""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from hasten.drafters.base import Draft
from hasten.engine import constraint as constraint_module
from hasten.engine.constraint import RowConstraint
from hasten.engine.verify import accept_sampling

VOCAB = 4
EOS = 3
SAMPLES = 4000
FALSE_ALARM = 1e-4
LENGTH = 3


class NoRepeat:
    """A matcher of the toy constraint: the tokens it has consumed, in a list."""

    def __init__(self):
        self.tokens: list[int] = []

    def allowed(self) -> list[int]:
        return [t for t in range(VOCAB) if t != EOS and (not self.tokens or t != self.tokens[-1])]

    def consume(self, token: int) -> bool:
        if token not in self.allowed():
            return False
        self.tokens.append(token)
        return True

    def rollback(self, count: int) -> None:
        del self.tokens[len(self.tokens) - count:]

    def fill_bitmask(self, out: np.ndarray) -> None:
        out[:] = sum(1 << t for t in self.allowed())

    def accepting(self) -> bool:
        return False

    def forced_bytes(self) -> bytes:
        return b""


class ToyConstraint:
    vocab_size, description, end_ids = VOCAB, "no repeats", frozenset()

    def matcher(self) -> NoRepeat:
        return NoRepeat()


def table(seed: int, longest: int = 4) -> dict[tuple[int, ...], torch.Tensor]:
    """prefix -> [VOCAB] next-token distribution of the target."""
    g = torch.Generator().manual_seed(seed)
    rows = {}
    for length in range(longest + 1):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            row = 0.2 + torch.rand(VOCAB, generator=g)
            rows[prefix] = row / row.sum()
    return rows


def draft_table(target: dict) -> dict[tuple[int, ...], torch.Tensor]:
    """A draft that ignores the constraint: much of its mass on EOS (always refused), most of the
    rest on the target's likeliest allowed token, so that the residual after a rejection is far
    from the target's row."""
    rows = {}
    for prefix in target:
        row = torch.full((VOCAB,), 0.15 / VOCAB)
        row[EOS] += 0.4
        row[int(masked(prefix).argmax())] += 0.45
        rows[prefix] = row
    return rows


def masked(prefix: tuple[int, ...]) -> torch.Tensor:
    row = P[prefix].clone()
    row[EOS] = 0
    if prefix:
        row[prefix[-1]] = 0
    return row / row.sum()


P = table(5)
Q = draft_table(P)


def exact_law() -> dict[tuple[int, ...], float]:
    return {out: math.prod(float(masked(out[:i])[x]) for i, x in enumerate(out))
            for out in itertools.product(range(VOCAB), repeat=LENGTH)}


def bound(law: dict, samples: int) -> float:
    expected = 0.5 * sum(math.sqrt(p * (1 - p) / samples) for p in law.values())
    return expected + math.sqrt(math.log(1 / FALSE_ALARM) / (2 * samples))


def chain_from_q(depth: int):
    def propose(rng):
        tokens: list[int] = []
        for _ in range(depth):
            tokens.append(rng.choices(range(VOCAB), weights=Q[tuple(tokens)].tolist())[0])
        return Draft(tuple(tokens), TokenTree.chain(depth), torch.stack([Q[tuple(tokens[:i])] for i in range(depth)]))

    return propose


def siblings(rng):
    """Point masses: every token under the root, two under the first."""
    return Draft((0, 1, 2, 3, 1, 0), TokenTree((-1, -1, -1, -1, 0, 0)))


def empirical_tv(propose) -> tuple[float, float]:
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    law = exact_law()
    counts = dict.fromkeys(law, 0)
    sampling = Sampling(temperature=1.0)
    for _ in range(SAMPLES):
        row = RowConstraint(ToyConstraint(), frozenset({EOS}), [])
        draft = row.fit(propose(rng), 0, [], trees_ok=True)
        prefixes = [()] + [tuple(draft.tokens[a] for a in draft.tree.ancestors(i)) for i in range(len(draft))]
        logits = row.mask(torch.stack([P[prefix].log() for prefix in prefixes]), ruled=False)
        verdict = accept_sampling(draft.tree, draft.tokens, sampling.probs(logits), draft.probs, generator)
        out = [draft.tokens[node] for node in verdict.accepted] + [verdict.next_token]
        while len(out) < LENGTH:
            out.append(rng.choices(range(VOCAB), weights=masked(tuple(out)).tolist())[0])
        counts[tuple(out[:LENGTH])] += 1
    return 0.5 * sum(abs(counts[k] / SAMPLES - law[k]) for k in law), bound(law, SAMPLES)


CASES = {"q_chain_depth_2": chain_from_q(2), "q_chain_depth_3": chain_from_q(3), "point_mass_siblings": siblings}


@pytest.mark.parametrize("case", CASES)
def test_constrained_output_law_is_the_masked_target_law(case):
    tv, limit = empirical_tv(CASES[case])
    assert tv < limit, f"TV {tv:.4f} >= bound {limit:.4f}"


def test_the_draft_distribution_refuses_often():
    """The cases mean something only if drawn drafts hold refused tokens."""
    rng = random.Random(1)
    drafts = [chain_from_q(3)(rng) for _ in range(200)]
    cut = [len(RowConstraint(ToyConstraint(), frozenset({EOS}), [])._cut(d)) for d in drafts]
    assert sum(n < 3 for n in cut) > 50


def test_bound_catches_drawn_drafts_cut_like_point_masses(monkeypatch):
    """Dropping a refused token drawn from q (instead of leaving it to the verifier) draws the next
    token from p where the residual max(p - q, 0) belongs: not the target law."""
    monkeypatch.setattr(constraint_module.RowConstraint, "_cut", _drop_refused)
    tv, limit = empirical_tv(chain_from_q(2))
    assert tv > limit, f"TV {tv:.4f} <= bound {limit:.4f}"


def _drop_refused(row: RowConstraint, draft: Draft) -> Draft:
    """The planted bug: a drawn chain cut before its first refused token, q kept for the rest."""
    keep = []
    for node, token in enumerate(draft.tokens):
        if not row.matcher.consume(token):
            break
        keep.append(node)
    row.matcher.rollback(len(keep))
    return draft._subset(keep)
