"""Lossy modes: they must work, be refused where meaningless, and measurably be lossy."""
import pytest
import torch

import hasten
from hasten.approx import TypicalAcceptance
from hasten.engine.sampling import Sampling
from hasten.engine.tree import TokenTree
from test_sampling_distribution import PROMPT, TARGET, FixedDrafter, exact_law


def test_typical_acceptance_takes_the_longest_plausible_path():
    tree = TokenTree.from_paths([(0,), (1,), (1, 0)])
    logits = torch.log(torch.tensor([[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.05, 0.05, 0.9], [1 / 3] * 3]))
    verdict = TypicalAcceptance(threshold=0.2).accept(tree, [2, 1, 2], logits, Sampling(1.0), torch.Generator().manual_seed(0))
    assert verdict.accepted == (1, 2)  # token 2 (p=0.1) fails; token 1 (0.4) then token 2 (0.9) pass


def test_typical_acceptance_is_refused_for_greedy_and_bad_settings():
    with pytest.raises(ValueError, match="sampling mode"):
        hasten.generate(TARGET, PROMPT, max_new_tokens=4, lossy_acceptance=TypicalAcceptance())
    with pytest.raises(ValueError, match="threshold"):
        TypicalAcceptance(threshold=0)
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
