"""Acceptance rules: pure-function properties (hypothesis) and exactness of the residual."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hasten.engine.tree import TokenTree
from hasten.engine.verify import accept_greedy, accept_sampling

VOCAB = 10  # > the most siblings a drawn tree can have, so sibling tokens can be distinct


@st.composite
def trees(draw, max_nodes=8):
    n = draw(st.integers(0, max_nodes))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tree = TokenTree(parents)
    # siblings hold distinct tokens, as every drafter proposes them
    tokens = [0] * n
    for kids in tree.children:
        picks = draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(kids), max_size=len(kids), unique=True))
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


def random_dist(generator, rows):
    return torch.softmax(torch.randn(rows, VOCAB, generator=generator) * 2, dim=-1)


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1), st.booleans())
def test_sampling_output_is_a_path_plus_one_token_and_reproducible(tree_tokens, seed, with_q):
    tree, tokens = tree_tokens
    g = torch.Generator().manual_seed(seed)
    p = random_dist(g, len(tree) + 1)
    q = random_dist(g, len(tree)) if with_q else None
    first = accept_sampling(tree, tokens, p, q, torch.Generator().manual_seed(seed))
    again = accept_sampling(tree, tokens, p, q, torch.Generator().manual_seed(seed))
    assert first == again
    assert is_path(tree, first.accepted)
    assert 0 <= first.next_token < VOCAB


def test_point_mass_rejection_never_returns_the_rejected_token():
    tree = TokenTree.chain(1)
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    for seed in range(200):
        verdict = accept_sampling(tree, [0], p, None, torch.Generator().manual_seed(seed))
        assert verdict.accepted == (0,) or verdict.next_token == 1


def _first_token_law(tree, tokens, p, q, samples=20000):
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB)
    for _ in range(samples):
        verdict = accept_sampling(tree, tokens, p, q, g)
        first = tokens[verdict.accepted[0]] if verdict.accepted else verdict.next_token
        counts[first] += 1
    return counts / samples


def test_first_token_is_distributed_as_p_for_a_sampled_draft():
    g = torch.Generator().manual_seed(1)
    p, q = random_dist(g, 2), random_dist(g, 1)
    tree = TokenTree.chain(1)
    # draw the draft token from q, as a draft model does, then verify
    counts = torch.zeros(VOCAB)
    for _ in range(20000):
        token = int(torch.multinomial(q[0], 1, generator=g))
        verdict = accept_sampling(tree, [token], p, q, g)
        counts[token if verdict.accepted else verdict.next_token] += 1
    assert 0.5 * (counts / 20000 - p[0]).abs().sum() < 0.02


def test_first_token_is_distributed_as_p_over_siblings():
    g = torch.Generator().manual_seed(2)
    p = random_dist(g, 4)
    tree = TokenTree.from_paths([(0,), (1,), (2,)])  # three deterministic siblings
    law = _first_token_law(tree, [3, 0, 5], p, None)
    assert 0.5 * (law - p[0]).abs().sum() < 0.02
