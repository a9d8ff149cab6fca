"""Exactness at every depth: the law of the first committed tokens, enumerated exactly,
against samples of the (vectorised) verifier.

A toy "model" gives the target ``p`` and the draft ``q`` as tables indexed by the whole
prefix, so the target's law of the first L tokens is a product of table rows and can be
enumerated. One sample is one verification step (chains drawn from ``q`` token by token, as
a draft model draws them, with ``q`` depending on the earlier draft tokens; trees of
deterministic siblings; a mix), then, if the step committed fewer than L tokens, plain
sampling from ``p``: an exact completion, so any deviation from the law comes from the step.

The bound is computed from the sample size: E[TV] <= 1/2 sum_k sqrt(P_k (1 - P_k) / N)
(Jensen) and one sample moves TV by at most 1/N, so P(TV > E[TV] + t) <= exp(-2 N t^2)
(McDiarmid); t is taken for a false alarm rate of 1e-4. Two broken verifiers (p instead of
the residual max(p - q, 0) at depth 2; rejected siblings below depth 1 not zeroed out) must
exceed the same bound.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from hasten.core.tree import TokenTree
from hasten.engine import verify
from hasten.engine.verify import accept_sampling

VOCAB = 3
TOKENS = range(VOCAB)
SAMPLES = 12000
FALSE_ALARM = 1e-4


def prefix_table(seed: int, longest: int = 4) -> dict[tuple[int, ...], torch.Tensor]:
    """prefix -> [VOCAB] distribution of the next token, for every prefix up to ``longest``:
    a random ordering of a middling-entropy shape, slightly perturbed (neither flat nor peaked,
    so that drafts are neither always accepted nor always rejected)."""
    g = torch.Generator().manual_seed(seed)
    shapes = list(itertools.permutations([0.55, 0.3, 0.15]))
    table = {}
    for length in range(longest + 1):
        for prefix in itertools.product(TOKENS, repeat=length):
            row = torch.tensor(shapes[int(torch.randint(len(shapes), (), generator=g))])
            row = row + 0.05 * torch.rand(VOCAB, generator=g)
            table[prefix] = row / row.sum()
    return table


def draft_table(target: dict) -> dict[tuple[int, ...], torch.Tensor]:
    """A draft that depends on the prefix and disagrees with the target where it hurts: its
    first token is mostly right (so depth 2 is reached), its later ones swap the target's
    likeliest and least likely tokens (so the residual max(p - q, 0) is far from p)."""
    table = {}
    for prefix, row in target.items():
        high, low = int(row.argmax()), int(row.argmin())
        swapped = row.clone()
        swapped[high], swapped[low] = row[low], row[high]
        table[prefix] = swapped
    table[()] = 0.6 * target[()] + 0.4 * table[()]
    return table


P = prefix_table(seed=11)  # the target
Q = draft_table(P)


def pick(table, prefix, rng: random.Random) -> int:
    return rng.choices(TOKENS, weights=table[prefix].tolist())[0]


def exact_law(length: int) -> dict[tuple[int, ...], float]:
    law = {}
    for outcome in itertools.product(TOKENS, repeat=length):
        law[outcome] = math.prod(float(P[outcome[:i]][x]) for i, x in enumerate(outcome))
    return law


def bound(law: dict, samples: int) -> float:
    expected = 0.5 * sum(math.sqrt(p * (1 - p) / samples) for p in law.values())
    return expected + math.sqrt(math.log(1 / FALSE_ALARM) / (2 * samples))


# ---- drafts: each returns (tree, tokens, q or None) -------------------------------------------
def chain_from_q(depth: int):
    tree = TokenTree.chain(depth)

    def propose(rng):
        tokens: list[int] = []
        for _ in range(depth):
            tokens.append(pick(Q, tuple(tokens), rng))
        return tree, tokens, torch.stack([Q[tuple(tokens[:i])] for i in range(depth)])

    return propose


def ranked_tree(ranks: dict[tuple[int, ...], int]):
    """Deterministic siblings (point masses). ``ranks`` maps each Medusa-style path to the
    rank of its token under the target after its parent (0: the most likely), or to -1 for
    a repeat of the previous sibling's token."""
    tree = TokenTree.from_paths(list(ranks))
    order = sorted(ranks, key=lambda path: (len(path), path))  # from_paths' node order
    token_of: dict[tuple[int, ...], int] = {}
    for path in order:
        prefix = tuple(token_of[path[:i]] for i in range(1, len(path)))
        rank = ranks[path]
        if rank < 0:  # the same token as the sibling before
            token_of[path] = token_of[path[:-1] + (path[-1] - 1,)]
        else:
            token_of[path] = int(P[prefix].argsort(descending=True)[rank])
    tokens = [token_of[path] for path in order]
    return lambda rng: (tree, tokens, None)


# siblings at depth 1, 2 (one repeating its earlier sibling's token) and 3, likeliest first
SIBLING_TREE = {(0,): 0, (1,): 1, (0, 0): 0, (0, 1): 1, (0, 2): -1, (0, 0, 0): 0, (0, 0, 1): 1, (1, 0): 0}


def mixed():
    """Point-mass siblings at depth 1; under the first, a chain of two drawn from q (lone
    children); under the second, point-mass siblings at depth 2."""
    tree = TokenTree((-1, -1, 0, 2, 1, 1))

    def propose(rng):
        tokens = [1, 0, 0, 0, 2, 0]
        tokens[2] = pick(Q, (1,), rng)
        tokens[3] = pick(Q, (1, tokens[2]), rng)
        prefixes = [(), (), (1,), (1, tokens[2]), (0,), (0,)]
        return tree, tokens, torch.stack([Q[prefix] for prefix in prefixes])  # rows of siblings are unused

    return propose


def block_prefixes(tree: TokenTree, tokens) -> list[tuple[int, ...]]:
    """The prefix each block index sees: the root's, then each node's path."""
    return [()] + [tuple(tokens[a] for a in tree.ancestors(i)) for i in range(len(tree))]


def empirical_tv(propose, length: int, samples: int = SAMPLES) -> tuple[float, float]:
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    law = exact_law(length)
    counts = dict.fromkeys(law, 0)
    rows: dict[tuple, torch.Tensor] = {}
    for _ in range(samples):
        tree, tokens, q = propose(rng)
        key = (tree, tuple(tokens))
        if key not in rows:
            rows[key] = torch.stack([P[prefix] for prefix in block_prefixes(tree, tokens)])
        verdict = accept_sampling(tree, tokens, rows[key], q, generator)
        out = [tokens[node] for node in verdict.accepted] + [verdict.next_token]
        while len(out) < length:
            out.append(pick(P, tuple(out), rng))
        counts[tuple(out[:length])] += 1
    tv = 0.5 * sum(abs(counts[k] / samples - law[k]) for k in law)
    return tv, bound(law, samples)


# The first 3 tokens show every rejection up to depth 3; a chain of 4 needs the 4th token too.
CASES = {
    "chain_q_depth_2": (chain_from_q(2), 3),
    "chain_q_depth_3": (chain_from_q(3), 3),
    "chain_q_depth_4": (chain_from_q(4), 4),
    "siblings_depth_2_and_3": (ranked_tree(SIBLING_TREE), 3),
    "mixed": (mixed(), 3),
}


@pytest.mark.parametrize("case", CASES)
def test_output_law_is_the_target_law(case):
    propose, length = CASES[case]
    tv, limit = empirical_tv(propose, length)
    assert tv < limit, f"TV {tv:.4f} >= bound {limit:.4f}"


def p_instead_of_the_residual_at_depth_2(right):
    """A broken ``_end_distribution``: after a rejection at depth 2 it draws from ``p``."""

    def broken(index, tokens, p, q, end_block):
        block = int(end_block)
        if block and int(index.depth[block - 1]) == 1:  # the walk ends at depth 1: its child was rejected
            return p[block]
        return right(index, tokens, p, q, end_block)

    return broken


def test_bound_catches_p_instead_of_the_residual_at_depth_2(monkeypatch):
    monkeypatch.setattr(verify, "_end_distribution", p_instead_of_the_residual_at_depth_2(verify._end_distribution))
    tv, limit = empirical_tv(chain_from_q(2), 3)
    assert tv > limit, f"TV {tv:.4f} <= bound {limit:.4f}"


def test_bound_catches_rejected_siblings_left_in_below_depth_1(monkeypatch):
    right_tests, right_end = verify._point_mass_tests, verify._end_distribution

    def tests_without_zeroing(index, tokens, p_draft, tests):
        return torch.where(index.depth >= 2, tests < p_draft, right_tests(index, tokens, p_draft, tests))

    def end_without_zeroing(index, tokens, p, q, end_block):
        block = int(end_block)
        return p[block] if block else right_end(index, tokens, p, q, end_block)

    monkeypatch.setattr(verify, "_point_mass_tests", tests_without_zeroing)
    monkeypatch.setattr(verify, "_end_distribution", end_without_zeroing)
    tv, limit = empirical_tv(ranked_tree(SIBLING_TREE), 3)
    assert tv > limit, f"TV {tv:.4f} <= bound {limit:.4f}"
