"""Hindsight: cost-aware sizing learns a drafter's acceptance on the steps it keeps plain, from a
draft it asks for but does not verify, checked against the tokens committed afterwards
(``Drafter.hindsight_ok``, ``SizingRule.watch``). So where a failed draft costs more than a plain
step (llama.cpp on a CPU) no probe is ever verified to learn that drafting does not pay, and
drafting starts as soon as the watched drafts show it would. Replayed on recorded outputs, the
forwards priced by a given curve; no test times anything."""
import functools

import pytest

import hasten
from hasten.bench.replay import Recorded, Recording, replay
from hasten.core.sampling import Sampling
from hasten.drafters import PromptLookup
from hasten.engine.calibration import CostCurve
from hasten.engine.sizing import CostAwareSize
from helpers import ScriptedDrafter, tiny_model
from test_sampling_distribution import TARGET, bound, exact_law, sampled_law_tv

# llama.cpp's chunked kernels on one CPU thread: a block of 2 costs 2 steps, of 4 only 3
CHUNKED = CostCurve(tuple(range(1, 17)), tuple(3.0 * (n // 4) + (n % 4) for n in range(1, 17)))
VOCAB = 32
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
OUTPUT = [(7 * i + 3) % VOCAB for i in range(60)]


class Watchable(ScriptedDrafter):
    hindsight_ok = True


class Logged(CostAwareSize):
    """Records every watched draft (evidence, drafted) and the depths it showed, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []  # [(evidence, drafted, [accepted at depth 1, 2, ...])]

    def watched(self, state, evidence, drafted, draft_seconds):
        self.seen.append((evidence, drafted, []))
        super().watched(state, evidence, drafted, draft_seconds)

    def observe_hindsight(self, state, evidence, depth, accepted):
        assert self.seen[-1][0] == evidence and len(self.seen[-1][2]) == depth - 1, "depths in order, once each"
        self.seen[-1][2].append(accepted)
        super().observe_hindsight(state, evidence, depth, accepted)


def replayed(drafter, rule, curve=CHUNKED):
    recording = Recording("m", "llama.cpp", VOCAB, False, curve, [Recorded("x", PROMPT, OUTPUT)])
    return replay(recording, recording.entries[0], drafter, rule)  # raises unless it writes OUTPUT


def test_a_drafter_never_right_gets_no_verified_draft_at_all():
    reference = PROMPT + OUTPUT
    watched = Watchable(reference, 8, mode="adversarial")
    done = replayed(watched, CostAwareSize(CHUNKED))
    assert done.stats.drafted_tokens == 0 and done.stats.steps == len(OUTPUT)
    assert watched.calls > 0  # it was asked: its drafts were checked against the commits instead
    probed = replayed(ScriptedDrafter(reference, 8, mode="adversarial"), CostAwareSize(CHUNKED))
    assert probed.stats.drafted_tokens > 0  # without hindsight the rule verifies probes to learn the same


def test_watched_drafts_do_not_overlap_and_count_the_tokens_committed():
    rule = Logged(CHUNKED)
    watched = Watchable(PROMPT + OUTPUT, 5, mode=2)  # right for two tokens, then wrong
    done = replayed(watched, rule)
    # two right tokens accepted then a third that is not: drafting never pays on this curve
    assert done.stats.drafted_tokens == 0
    # the next watched draft starts where the last one left the text: every third token
    assert len(rule.seen) == len(OUTPUT) // 3
    assert rule.seen[:-1] == [(None, 5, [True, True, False])] * (len(rule.seen) - 1)
    assert rule.seen[-1] == (None, 2, [True, True])  # the last, cut to the budget
    assert watched.calls == len(rule.seen)


def test_watched_drafts_that_are_right_start_deep_drafts_without_a_failed_probe():
    rule = Logged(CHUNKED)
    done = replayed(Watchable(PROMPT + OUTPUT, 8), rule)
    stats = done.stats
    assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens  # every draft verified was right
    # one watched draft, right all the way, then drafts verified: no failed probe on the way
    assert rule.seen == [(None, 8, [True] * 8)]
    # blocks of 4 and more, where a token costs 3/4 of a step at most: near that, all told
    assert done.seconds < 0.8 * len(OUTPUT) * CHUNKED(1)


def test_a_step_with_nothing_to_propose_is_plain_and_priced_at_no_depth(monkeypatch):
    rule = CostAwareSize(CHUNKED)
    state = rule.begin(None, hindsight=0)
    monkeypatch.setattr(rule.estimator, "expected", lambda *args: pytest.fail("priced a step with nothing to propose"))
    assert rule.depth(state, 10, evidence=0) == 0 and rule.watch(state, 10) == 0


def test_a_drafter_watched_deeper_than_it_goes_is_priced_only_as_deep_as_it_goes():
    rule = CostAwareSize(CHUNKED)
    state = rule.begin(None, hindsight=0)
    assert rule.depth(state, 40, evidence=1) == 0 and rule.watch(state, 40) == 32  # asked 32 deep
    rule.watched(state, 1, 10, 0.0)  # it gave 10: that is how deep it goes
    assert rule.top(state, 40) == 10
    near_the_end = rule.begin(None, hindsight=0)
    rule.depth(near_the_end, 12, evidence=1)
    assert rule.watch(near_the_end, 12) == 12
    rule.watched(near_the_end, 1, 10, 0.0)  # asked only 12 deep: it may go deeper, as a verified draft may
    assert rule.top(near_the_end, 40) == 21


def test_prompt_lookup_watches_and_greedy_output_is_unchanged():
    assert PromptLookup.hindsight_ok
    rule = Logged(CHUNKED)
    repeated = PROMPT + PROMPT  # copies to find: a lookup after every token
    recording = Recording("m", "llama.cpp", VOCAB, False, CHUNKED,
                          [Recorded("x", repeated, (PROMPT * 4)[:24])])
    done = replay(recording, recording.entries[0], PromptLookup(), rule)  # raises if the tokens differ
    assert rule.seen and done.stats.accepted_tokens == done.stats.drafted_tokens > 0


def test_the_sampled_law_is_unchanged_by_sizing_with_hindsight(monkeypatch):
    sampling = Sampling(1.0, top_k=3)
    rule = CostAwareSize(CHUNKED)
    monkeypatch.setattr(hasten, "generate", functools.partial(hasten.generate, draft_size=rule))
    samples = 600
    tv = sampled_law_tv(TARGET, PromptLookup(num_tokens=4, min_ngram=1), sampling, 2, 4, samples)
    assert tv < bound(exact_law(TARGET, sampling, 2), samples)
    assert rule.estimator.pool_trials  # the rule did measure the drafter (by hindsight or by drafting)


class Captured(Exception):
    pass


@pytest.mark.parametrize("module", ["runner", "stream"])
def test_the_bench_keeps_one_sizing_rule_for_all_of_a_methods_runs(module, monkeypatch):
    import torch

    from hasten.bench import runner, stream

    rules = []

    def generate(model, input_ids, **settings):
        rules.append(settings["draft_size"])
        raise Captured

    where = runner if module == "runner" else stream
    monkeypatch.setattr(where, "generate", generate)
    monkeypatch.setattr(where, "load_or_calibrate", lambda model: None)
    method = (runner.hasten_method if module == "runner" else stream.kept_method)("prompt_lookup", tiny_model("llama"))
    for _ in range(2):
        with pytest.raises(Captured):
            method.run(torch.tensor([[1, 2, 3]]), 4)
    assert len(rules) == 2 and rules[0] is rules[1] and isinstance(rules[0], CostAwareSize)


def test_hindsight_from_a_grade_watches_there_and_probes_below():
    """A drafter whose proposals are cheap lookups only from some grade up (mixed: a copy drafted
    alone) is watched there; below, where a proposal runs its predictor, the rule probes instead."""
    rule = CostAwareSize(CHUNKED)
    state = rule.begin(None, hindsight=3)
    assert rule.depth(state, 40, evidence=3) == 0 and rule.watch(state, 40) == 32  # nothing drafted yet: watch
    below = rule.begin(None, hindsight=3)
    first = rule.depth(below, 40, evidence=1)  # the prior's best, at least a probe's depth: drafted, not watched
    assert first > 0 and rule.watch(below, 40) == 0


def test_mixed_is_watched_where_it_copies_alone():
    from hasten.drafters.mixed import Mixed

    assert PromptLookup().hindsight_from() == 0 and Mixed().hindsight_from() == 3  # prompt lookup's grade 2 and up
    assert Mixed(guess_below=1).hindsight_from() == 2
    assert Mixed(retrieval="suffix").hindsight_from() is None  # suffix decoding's proposals are not lookups alone
