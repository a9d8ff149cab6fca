"""Lossy modes: they must work, be refused where meaningless, and measurably be lossy."""
import pytest
import torch

import hasten
from hasten.approx import TypicalAcceptance
from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from test_sampling_distribution import PROMPT, TARGET, FixedDrafter, exact_law


def test_typical_acceptance_takes_the_longest_plausible_path():
    tree = TokenTree.from_paths([(0,), (1,), (1, 0)])
    logits = torch.log(torch.tensor([[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.05, 0.05, 0.9], [1 / 3] * 3]))
    verdict = TypicalAcceptance(threshold=0.2).verify(tree, (2, 1, 2), logits, None, Sampling(1.0),
                                                      torch.Generator().manual_seed(0))
    assert verdict.accepted == (1, 2)  # token 2 (p=0.1) fails; token 1 (0.4) then token 2 (0.9) pass
    assert verdict.next_token in (0, 1, 2)


def test_typical_acceptance_prefers_the_first_leaf_path_among_equally_long_runs():
    # node 0 (depth 1) has a child that fails; node 1 (depth 1) is a leaf: both runs are 1 long.
    # The first leaf path in the tree's order is node 1's, as Medusa's candidate order has it.
    tree = TokenTree((-1, -1, 0))
    logits = torch.log(torch.tensor([[0.5, 0.5, 1e-6], [0.01, 0.01, 0.98], [1 / 3] * 3, [1 / 3] * 3]))
    verdict = TypicalAcceptance(threshold=0.2).verify(tree, (0, 1, 0), logits, None, Sampling(1.0), None)
    assert verdict.accepted == (1,)


def test_typical_acceptance_checks_draft_ids_and_the_generator_device():
    tree = TokenTree.chain(1)
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TypicalAcceptance().verify(tree, (-1,), logits, None, Sampling(1.0), None)
    with pytest.raises(ValueError, match="generator is on cpu"):
        TypicalAcceptance().verify(tree, (0,), logits.to("meta"), None, Sampling(1.0), torch.Generator())


def test_typical_acceptance_is_refused_for_greedy_and_bad_settings():
    with pytest.raises(ValueError, match="relaxes sampling decoding"):
        hasten.generate(TARGET, PROMPT, max_new_tokens=4, lossy_acceptance=TypicalAcceptance())
    with pytest.raises(ValueError, match="threshold"):
        TypicalAcceptance(threshold=0)
    with pytest.raises(ValueError, match="alpha"):
        TypicalAcceptance(alpha=float("nan"))
    with pytest.raises(TypeError, match="lossy rule"):
        hasten.generate(TARGET, PROMPT, max_new_tokens=4, temperature=1.0, lossy_acceptance=object())


def test_typical_acceptance_is_lossy_and_accepts_more():
    g = torch.Generator().manual_seed(0)
    law = exact_law(TARGET, Sampling(1.0))
    counts = dict.fromkeys(law, 0)
    accepted = 0
    samples = 1500
    for _ in range(samples):
        out = hasten.generate(TARGET, PROMPT, drafter=FixedDrafter([3, 5]), max_new_tokens=2, temperature=1.0,
                              generator=g, lossy_acceptance=TypicalAcceptance(threshold=0.05, alpha=0.5))
        counts[tuple(out.sequences[0, -2:].tolist())] += 1
        accepted += out.stats.accepted_tokens
    tv = 0.5 * sum(abs(counts[k] / samples - law[k]) for k in law)
    assert tv > 0.1, "typical acceptance should visibly move the output distribution on this model"
    assert accepted > 0
