"""hasten.vllm's proposers, as vLLM calls them (no vLLM needed): each request sized from its own
history, vLLM's step cost fitted from the time between calls, lookahead's chain.
The real-vLLM round trips are in tests/test_vllm_baseline.py (``-m vllm``)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from hasten.vllm import FixedLookahead, FixedPromptLookup, FixedSuffix, Lookahead, PromptLookup, StepCost

CONTEXT = 1000


class Clock:
    """The proposer's clock: time passes only when the test says a step ran."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def copying_story(length: int) -> list[int]:
    """A text whose second half repeats its first: once the copy starts, prompt lookup is right."""
    rng = random.Random(1)
    half = [rng.randrange(100, 5000) for _ in range(length // 2)]
    return half + half


def noisy_story(length: int) -> list[int]:
    """A small alphabet drawn at random: suffixes recur (so lookup drafts) but their
    continuations are right one time in 12, too rarely to pay for the positions they add."""
    rng = random.Random(2)
    return [rng.randrange(10, 22) for _ in range(length)]


def run(proposer, stories: list[list[int]], prompt_lengths: list[int], steps: int,
        seconds=lambda positions: 0.05 + 0.01 * positions) -> list[list[tuple[int, int]]]:
    """Decode every row of ``stories`` (the true continuations) for ``steps`` steps as vLLM
    would: each row's draft verified against its story (the longest agreeing prefix, then the
    story's next token), the clock advanced by ``seconds(positions verified)``. Returns, per
    row, (drafted, accepted) for each step."""
    clock = proposer.clock = Clock()
    table = np.zeros((len(stories), CONTEXT), dtype=np.int64)
    lengths = list(prompt_lengths)
    for row, story in enumerate(stories):
        table[row, : len(story)] = story
    sampled = [[story[n - 1]] for story, n in zip(stories, lengths)]  # each prompt's prefill gave a token
    history: list[list[tuple[int, int]]] = [[] for _ in stories]
    for _ in range(steps):
        drafts = proposer.propose(sampled, np.array(lengths), table)
        clock.now += seconds(sum(1 + len(d) for d in drafts))
        for row, (story, draft) in enumerate(zip(stories, drafts)):
            n = lengths[row]
            accepted = 0
            while accepted < len(draft) and draft[accepted] == story[n + accepted]:
                accepted += 1
            sampled[row] = story[n: n + accepted + 1]
            lengths[row] = n + accepted + 1
            history[row].append((len(draft), accepted))
    return history


def test_each_request_is_sized_from_its_own_history():
    """Two requests in one batch: one copies its prompt (drafts accepted), one does not (drafts
    rejected). Sized by hasten's rule, the first drafts deep and the second shallow or not at
    all; at a fixed depth, both draft 10 deep every step."""
    stories, prompts = [copying_story(1000), noisy_story(1000)], [520, 60]
    sized = run(PromptLookup(depth=10, max_model_len=CONTEXT), stories, prompts, 40)
    copying, noisy = sized[0][-20:], sized[1][-20:]
    assert sum(d for d, _ in copying) / len(copying) >= 8  # deep drafts where they pay
    assert sum(a for _, a in copying) >= 0.9 * sum(d for d, _ in copying)
    assert sum(d for d, _ in noisy) / len(noisy) <= 3  # few positions where they do not pay
    fixed = run(FixedPromptLookup(depth=10, max_model_len=CONTEXT), stories, prompts, 40)
    assert all(d == 10 for d, _ in fixed[1][-20:])


def test_a_new_request_in_a_row_starts_from_no_history():
    """A row whose request stopped drafting (its drafts were rejected) is taken over by a
    request that copies: the newcomer drafts at once, from the prior, not the old history."""
    proposer = PromptLookup(depth=10, max_model_len=CONTEXT)
    old = run(proposer, [noisy_story(1000)], [60], 30)[0]
    assert sum(d for d, _ in old[-10:]) <= 30
    new = run(proposer, [copying_story(1000)], [520], 3)[0]
    assert new[0][0] > 0 and new[0][1] == new[0][0]


def test_the_step_cost_is_fitted_from_the_steps_times():
    """Steps timed at 40 ms + 2 ms per verified position: the fit finds the line (the prior
    fades), so one more position prices at about 2 ms, not at the prior's 2.5% of a step."""
    cost = StepCost()
    for _ in range(200):
        for positions in (1, 4, 8, 11):
            cost.add(positions, 0.040 + 0.002 * positions)
    curve = cost.curve()
    assert curve(1) == pytest.approx(0.042, rel=0.05)
    assert curve(11) == pytest.approx(0.062, rel=0.05)
    first = StepCost()
    first.add(6, 0.1)  # one step: the prior's slope, scaled to the time seen
    assert first.curve()(6) == pytest.approx(0.1, rel=0.05)
    assert first.curve()(17) / first.curve()(1) == pytest.approx(1 + 16 * 0.025, rel=0.05)


def test_only_steps_where_every_row_decoded_are_timed():
    """A step in which a row was prefilling, or was a request's first (its prompt's prefill ran
    in it), says nothing about verification: it is left out of the fit; the next is counted,
    with each row's sampled token and its draft."""
    proposer = FixedPromptLookup(depth=4, max_model_len=CONTEXT)
    clock = proposer.clock = Clock()
    story = copying_story(200)
    table = np.zeros((2, CONTEXT), dtype=np.int64)
    table[0, :200] = story
    table[1, :200] = story
    first = proposer.propose([[story[119]], []], np.array([120, 50]), table)  # row 1 still prefills
    assert first[1] == [] and len(first[0]) == 4
    clock.now += 1.0
    second = proposer.propose([story[120:125], [story[59]]], np.array([125, 60]), table)  # row 1's first step
    assert proposer.cost.sums[0] == 0  # neither step timed
    clock.now += 0.5
    proposer.propose([story[125:130], story[60:61]], np.array([130, 61]), table)
    weight, positions, _, seconds, _ = proposer.cost.sums
    assert len(second[0]) == 4
    assert (weight, positions, seconds) == (1.0, sum(1 + len(d) for d in second), 0.5)


@pytest.mark.parametrize("proposer_class", [FixedPromptLookup, FixedLookahead, FixedSuffix])
def test_each_proposer_drafts_the_main_chain_of_the_real_drafter(proposer_class):
    """No copy: a proposer hands vLLM the main chain of what its hasten drafter (the very class
    hasten's loop runs) proposes for the same request driven step by step by hasten's loop."""
    from hasten.core.sampling import Sampling
    from hasten.drafters.base import DraftContext, TargetView
    from test_lookahead import Row

    proposer = proposer_class(depth=5, max_model_len=CONTEXT)
    drafter = proposer.drafter_class(**proposer.settings(5))
    rng = random.Random(3)
    story = [rng.randrange(20, 26) for _ in range(120)]
    table = np.zeros((1, CONTEXT), dtype=np.int64)
    table[0, :120] = story
    ctx = DraftContext(story[:40], 5, Sampling(), None, TargetView(Row(), frozenset()))
    ctx.state = drafter.begin(ctx)
    length, sampled, compared = 41, [story[40]], 0
    while length < 110:
        ours = proposer.propose([sampled], np.array([length]), table)[0]
        ctx.tokens = story[:length]
        drafter.evidence(ctx)
        ctx.max_depth = 5
        assert ours == list(drafter.propose(ctx).main_chain(5).tokens)
        compared += bool(ours)
        accepted = 0
        while accepted < len(ours) and ours[accepted] == story[length + accepted]:
            accepted += 1
        sampled = story[length: length + accepted + 1]
        length += accepted + 1
    assert compared > 5


def test_a_pooled_proposer_learns_each_finished_request_once_across_reused_rows():
    """vLLM reuses rows and moves requests between them: the lookahead pool sees each request's
    output once, and a later request drafts it from the first step."""
    proposer = FixedLookahead(depth=4, max_model_len=CONTEXT)
    answer = [300 + i for i in range(30)]
    first = [1, 2, 3] + answer
    table = np.zeros((2, CONTEXT), dtype=np.int64)
    table[0, : len(first)] = first
    table[1, :3] = [7, 8, 9]
    for length in range(4, len(first) + 1):  # row 0 decodes one token a step; row 1 prefills
        proposer.propose([[first[length - 1]], []], np.array([length, 3]), table)
    # row 0 leaves; the request in row 1 moves to row 0 and samples its first token
    table[0, :4] = [7, 8, 9, 300]
    drafts = proposer.propose([[300]], np.array([4]), table)
    assert drafts[0] == answer[1:5]  # the first request's output, drafted for another prompt
    assert proposer.drafter.pool.stats().requests == 1  # the first request ended once
    assert len(proposer.rows) == 1


def test_sized_lookahead_drafts_where_its_chains_are_accepted():
    stories, prompts = [copying_story(1000), noisy_story(1000)], [520, 60]
    sized = run(Lookahead(depth=10, max_model_len=CONTEXT), stories, prompts, 40)
    assert sum(a for _, a in sized[0][-20:]) >= 100  # the copy is drafted deep and accepted
    assert sum(d for d, _ in sized[1][-20:]) <= 60
