"""Acceptance rules: properties (hypothesis) of greedy and speculative sampling, and draft-id checks.

The exact output law at every depth is proven in test_verify_law.py.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hasten.approx import TypicalAcceptance
from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from hasten.engine.verify import (GreedyAcceptance, SpeculativeSampling, Verdict, _end_distribution, accept_greedy,
                                  accept_sampling, tree_index)

VOCAB = 10  # > the most siblings a drawn tree can have, so sibling tokens can be distinct


@st.composite
def trees(draw, max_nodes=8, distinct_siblings=True):
    n = draw(st.integers(0, max_nodes))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tree = TokenTree(parents)
    tokens = [0] * n
    for kids in tree.children:
        size = len(kids)
        picks = draw(st.lists(st.integers(0, VOCAB - 1), min_size=size, max_size=size, unique=distinct_siblings))
        for kid, token in zip(kids, picks):
            tokens[kid] = token
    return tree, tokens


def is_path(tree: TokenTree, path) -> bool:
    return all(tree.parents[node] == (path[i - 1] if i else -1) for i, node in enumerate(path))


@given(trees(), st.data())
def test_greedy_accepts_the_longest_matching_path(tree_tokens, data):
    tree, tokens = tree_tokens
    argmax = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(tree) + 1, max_size=len(tree) + 1))
    verdict = accept_greedy(tree, tokens, argmax)
    assert 0 <= len(verdict.accepted) <= max(tree.depths, default=0)
    assert is_path(tree, verdict.accepted)
    parent = -1
    for node in verdict.accepted:  # every accepted token is the target's argmax after its parent
        assert tokens[node] == argmax[parent + 1]
        parent = node
    assert verdict.next_token == argmax[parent + 1]  # the bonus token
    assert all(tokens[kid] != verdict.next_token for kid in tree.children[parent + 1])  # path is maximal


def random_logits(generator, rows):
    return torch.randn(rows, VOCAB, generator=generator) * 2


@settings(max_examples=80, deadline=None)
@given(trees(distinct_siblings=False), st.integers(0, 2**31 - 1), st.booleans(),
       st.sampled_from([Sampling(1.0), Sampling(0.7, top_k=4), Sampling(1.2, top_p=0.8)]))
def test_sampling_output_is_a_path_plus_one_token_and_reproducible(tree_tokens, seed, with_q, sampling):
    tree, tokens = tree_tokens
    g = torch.Generator().manual_seed(seed)
    logits = random_logits(g, len(tree) + 1)
    q = torch.softmax(random_logits(g, len(tree)), -1) if with_q else None
    rule = SpeculativeSampling()
    first = rule.verify(tree, tuple(tokens), logits, q, sampling, torch.Generator().manual_seed(seed))
    again = rule.verify(tree, tuple(tokens), logits, q, sampling, torch.Generator().manual_seed(seed))
    assert first == again
    assert 0 <= len(first.accepted) <= max(tree.depths, default=0)
    assert is_path(tree, first.accepted)
    p = sampling.probs(logits)
    end = first.accepted[-1] + 1 if first.accepted else 0
    assert p[end, first.next_token] > 0  # the next token is possible under p after the path
    for depth, node in enumerate(first.accepted):  # accepted tokens are possible under p, after their parent
        parent_block = first.accepted[depth - 1] + 1 if depth else 0
        assert p[parent_block, tokens[node]] > 0
    # a repeat of an earlier sibling's token was zeroed out of the residual: never accepted
    repeats = {kid for kids in tree.children for i, kid in enumerate(kids)
               if tokens[kid] in [tokens[k] for k in kids[:i]]}
    assert not repeats & set(first.accepted)


@settings(max_examples=60, deadline=None)
@given(trees(max_nodes=6), st.data())
def test_draft_ids_outside_the_vocabulary_raise_in_every_rule(tree_tokens, data):
    tree, tokens = tree_tokens
    if not tokens:
        tokens, tree = [0], TokenTree.chain(1)
    bad = data.draw(st.sampled_from([-1, -VOCAB, VOCAB, VOCAB + 7]))
    tokens[data.draw(st.integers(0, len(tokens) - 1))] = bad
    logits = torch.zeros(len(tree) + 1, VOCAB)
    g = torch.Generator().manual_seed(0)
    for rule, sampling in [(GreedyAcceptance(), Sampling()), (SpeculativeSampling(), Sampling(1.0)),
                           (TypicalAcceptance(), Sampling(1.0))]:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            rule.verify(tree, tuple(tokens), logits, None, sampling, g)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        accept_sampling(tree, tokens, torch.softmax(logits, -1), None, g)


def test_a_negative_draft_id_is_never_accepted():
    """Found by porting vLLM's rejection-sampler tests: -1 used to be read as the last token."""
    p = torch.tensor([[0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]])
    with pytest.raises(ValueError, match="draft token id -1"):
        accept_sampling(TokenTree.chain(1), [-1], p, None, torch.Generator().manual_seed(0))


def test_point_mass_rejection_never_returns_the_rejected_token():
    tree = TokenTree.chain(1)
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    for seed in range(200):
        verdict = accept_sampling(tree, [0], p, None, torch.Generator().manual_seed(seed))
        assert verdict.accepted == (0,) or verdict.next_token == 1


def test_rejection_with_q_never_returns_a_token_the_residual_lacks():
    tree = TokenTree.chain(1)
    p = torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.2, 0.8, 0.0]])  # residual max(p - q, 0) = token 0 only
    for seed in range(200):
        verdict = accept_sampling(tree, [1], p, q, torch.Generator().manual_seed(seed))
        assert verdict in (Verdict((0,), 2), Verdict((), 0))


def test_a_residual_of_zero_falls_back_to_p():
    tree = TokenTree.chain(1)
    index = tree_index(tree, torch.device("cpu"))
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    root = torch.tensor(0)
    tokens = torch.tensor([1])
    q = torch.tensor([[0.25 - 1e-9, 0.75 + 1e-9]])  # p == q up to rounding: max(p - q, 0) is noise
    assert torch.equal(_end_distribution(index, tokens, p, q, root), p[0])
    q = torch.tensor([[0.05, 0.95]])  # a real residual: max(p - q, 0) = [0.2, 0]
    torch.testing.assert_close(_end_distribution(index, tokens, p, q, root), torch.tensor([0.2, 0.0]))
    assert torch.equal(_end_distribution(index, tokens, p, None, root), torch.tensor([0.25, 0.0]))  # point mass zeroed


def test_q_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="q must be"):
        accept_sampling(TokenTree.chain(2), [0, 1], torch.full((3, 4), 0.25), torch.full((1, 4), 0.25), None)


def test_greedy_ids_take_the_first_maximum_like_torch():
    from hasten.engine.verify import greedy_ids

    logits = torch.tensor([[1.0, 3.0, 3.0], [5.0, 5.0, 0.0], [0.0, -1.0, 2.0]])  # [3, vocab 3], with ties
    assert greedy_ids(logits) == logits.argmax(-1).tolist() == [1, 0, 2]
    assert greedy_ids(logits.double()) == [1, 0, 2]  # other dtypes go through torch
