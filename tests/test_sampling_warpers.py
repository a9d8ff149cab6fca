"""Sampling.probs keeps Hugging Face's law; draw() is exact and never picks a
zero-probability token; bad settings are refused with a clear message.

Two things Hugging Face's top-p leaves to chance, which the comparison allows for and
nothing else: (1) when the cut falls inside a group of tokens with equal scores, which of
them stay depends on the order torch.sort's unstable kernel leaves ties in (we break ties as
a stable sort does: the higher token id stays); (2) its softmax sums the sorted row in
float32, so its cumulative masses carry rounding noise (about 1e-5 relative at a 32k
vocabulary) and a token whose mass-at-or-below lies within that noise of ``1 - top_p`` may
fall either way. Our own two nucleus searches (CPU and accelerator) must agree exactly.
"""
import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hasten.core import sampling as sampling_module
from hasten.core.sampling import Sampling, draw, sample

ROWS = 6


def hf_probs(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """What model.generate(do_sample=True) samples from (its warpers, in its order), and
    the scores the top-p warper saw."""
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(sampling.temperature)(ids, logits.float())
    if sampling.top_k is not None:
        scores = TopKLogitsWarper(sampling.top_k)(ids, scores)
    before_top_p = scores
    if sampling.top_p is not None and sampling.top_p < 1:
        scores = TopPLogitsWarper(sampling.top_p)(ids, scores)
    return scores.softmax(-1), before_top_p


def logit_rows(vocab: int, seed: int) -> torch.Tensor:
    """[ROWS, vocab]: spread, tied (a coarse grid), peaked, flat, two-level and narrow rows."""
    g = torch.Generator().manual_seed(seed)
    normal = lambda scale: torch.randn(vocab, generator=g) * scale  # noqa: E731
    peaked = normal(1.0)
    peaked[int(torch.randint(vocab, (1,), generator=g))] += 12
    two_level = torch.zeros(vocab)
    two_level[torch.randperm(vocab, generator=g)[: max(1, vocab // 7)]] = 3.0
    return torch.stack([
        normal(3.0),
        torch.round(normal(2.0) * 2) / 2,  # many ties, at every cut
        peaked,
        torch.zeros(vocab),  # flat: all tied
        two_level,
        normal(0.3),  # nearly flat: a wide nucleus
    ])


ROUNDING = 5e-5  # bound on the float32 noise of Hugging Face's cumulative masses at these vocabularies


def at_the_cut(scores: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """[rows, vocab] bool: tokens whose fate under top-p is left to tie order or rounding:
    the range of masses-at-or-below their tie group can take (computed in float64) comes
    within ROUNDING of 1 - top_p."""
    if top_p is None or top_p >= 1:
        return torch.zeros_like(scores, dtype=torch.bool)
    ascending = scores.sort(-1).values
    cumulative = ascending.double().softmax(-1).cumsum(-1)  # [rows, vocab]
    first = torch.searchsorted(ascending, scores)  # first rank of each token's tie group
    last = torch.searchsorted(ascending, scores, right=True) - 1
    lowest, highest = cumulative.gather(-1, first), cumulative.gather(-1, last)
    return (lowest - ROUNDING <= 1 - top_p) & (highest + ROUNDING > 1 - top_p)


def assert_same_law(ours: torch.Tensor, theirs: torch.Tensor, before_top_p: torch.Tensor, top_p) -> None:
    """Same kept tokens but where top-p's cut is left to chance; same probabilities."""
    kept, wanted = ours > 0, theirs > 0
    assert not ((kept ^ wanted) & ~at_the_cut(before_top_p, top_p)).any(), "kept tokens differ away from the cut"
    both = kept & wanted
    torch.testing.assert_close(ours[both], theirs[both], rtol=2e-4, atol=1e-7)


CASES = [(vocab, top_p, top_k) for vocab in (8, 50, 1000, 4096, 32000)
         for top_p in (0.1, 0.5, 0.9, 0.99, 1.0) for top_k in (None, 5, 40)]


@pytest.mark.parametrize("vocab, top_p, top_k", CASES)
def test_probs_match_hugging_face_warpers(vocab, top_p, top_k):
    logits = logit_rows(vocab, seed=vocab + int(100 * top_p))
    for temperature in (0.7, 1.6):
        sampling = Sampling(temperature, top_k=top_k, top_p=top_p)
        theirs, before_top_p = hf_probs(logits, sampling)
        assert_same_law(sampling.probs(logits), theirs, before_top_p, top_p)


@pytest.mark.parametrize("vocab", [8, 1000, 32000])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_both_nucleus_searches_keep_the_same_tokens(vocab, top_p):
    """The CPU search (growing top-k) and the accelerator one (a stable sort), run here on
    the CPU: the identical set, and Hugging Face's law."""
    scores = logit_rows(vocab, seed=7 * vocab)
    ids = torch.zeros(ROWS, 1, dtype=torch.long)
    theirs = TopPLogitsWarper(top_p)(ids, scores).softmax(-1)
    by_topk = sampling_module._nucleus_by_topk(scores, top_p)
    assert torch.equal(sampling_module._nucleus_by_sort(scores, top_p), by_topk)
    assert_same_law(scores.masked_fill(~by_topk, float("-inf")).softmax(-1), theirs, scores, top_p)


def test_the_nucleus_search_grows_past_its_first_candidates():
    vocab = 5000
    scores = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 0.1  # nucleus of thousands
    kept = sampling_module._nucleus_by_topk(scores, 0.9)
    assert kept.sum(-1).min() > 4 * sampling_module._FIRST_CANDIDATES
    assert torch.equal(kept, sampling_module._nucleus_by_sort(scores, 0.9))
    theirs = TopPLogitsWarper(0.9)(torch.zeros(2, 1, dtype=torch.long), scores).softmax(-1)
    assert_same_law(scores.masked_fill(~kept, float("-inf")).softmax(-1), theirs, scores, 0.9)


@pytest.mark.parametrize("vocab", [40, 100, 3000])
def test_both_searches_agree_on_rows_full_of_ties(vocab):
    g = torch.Generator().manual_seed(vocab)
    for _ in range(30):
        levels = int(torch.randint(2, 12, (), generator=g))
        scores = torch.randint(levels, (4, vocab), generator=g).float() * float(torch.rand((), generator=g) * 3)
        top_p = float(torch.rand((), generator=g)) * 0.98 + 0.01
        by_topk = sampling_module._nucleus_by_topk(scores, top_p)
        assert torch.equal(by_topk, sampling_module._nucleus_by_sort(scores, top_p)), (levels, top_p)


@pytest.mark.parametrize("search", ["_nucleus_by_topk", "_nucleus_by_sort"])
def test_ties_at_the_cut_keep_the_higher_token_ids(search):
    scores = torch.tensor([[0.0] * 8, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]])
    kept = getattr(sampling_module, search)(scores, 0.5)
    assert kept[0].nonzero().flatten().tolist() == [4, 5, 6, 7]  # 4 of 8 equal tokens reach half the mass
    assert kept[1].nonzero().flatten().tolist() == [2, 4, 6]  # 3 of the 4 best (0.18 each; the rest 0.27)


def test_draw_never_returns_a_zero_probability_token():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0]] * 5)
    extremes = torch.tensor([0.0, 0.5, 0.5 - 1e-12, 1 - 2**-53, 1 - 2**-24], dtype=torch.float64)
    assert set(draw(weights, extremes).tolist()) <= {1, 4}
    assert draw(weights, extremes).tolist() == [4, 1, 4, 1, 1]  # inverse CDF of (1 - u)


def test_draw_follows_the_law():
    probs = torch.softmax(torch.randn(300, generator=torch.Generator().manual_seed(0)) * 2, -1)
    probs[probs < 1e-3] = 0  # some holes
    n = 40000
    picks = draw(probs.expand(n, -1), torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    law = probs / probs.sum()
    empirical = torch.bincount(picks, minlength=300) / n
    assert (empirical[law == 0] == 0).all()
    bound = 0.5 * float(torch.sqrt(law * (1 - law) / n).sum()) + math.sqrt(math.log(1e4) / (2 * n))
    assert 0.5 * float((empirical - law).abs().sum()) < bound


def test_sample_is_reproducible_and_checks_the_generator_device():
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    first = [sample(probs, torch.Generator().manual_seed(s)) for s in range(20)]
    assert first == [sample(probs, torch.Generator().manual_seed(s)) for s in range(20)]
    assert len(set(first)) > 3
    with pytest.raises(ValueError, match="generator is on cpu"):
        sample(torch.empty(50, device="meta"), torch.Generator())


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -float("inf"), -0.5, True, "1"])
def test_bad_temperature_is_refused_clearly(temperature):
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature)


@pytest.mark.parametrize("kwargs", [dict(top_k=0), dict(top_k=True), dict(top_k=2.0), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_p=float("nan")), dict(top_p=False)])
def test_bad_top_k_and_top_p_are_refused(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        Sampling(1.0, **kwargs)


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324])
def test_a_vanishing_temperature_gives_the_limit_law_not_nans(temperature):
    """Below float32's range the law is the limit one: the best tokens share the mass (a
    server once raised IndexError for every row of a batch on temperature 1e-38)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.5, 0.1, 0.2, 0.0]])
    probs = Sampling(temperature).probs(logits)
    assert torch.equal(probs, torch.tensor([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]]))
    generator = torch.Generator().manual_seed(0)
    assert {sample(probs[1], generator) for _ in range(20)} == {0}


def test_a_vanishing_temperature_decodes_as_greedy_beside_other_rows():
    from hasten.engine.batch import Request, Scheduler
    from helpers import repetitive_prompt, tiny_model

    model = tiny_model("llama")
    prompts = [repetitive_prompt(12, seed)[0].tolist() for seed in range(3)]
    scheduler = Scheduler(model, max_batch=3)
    no_eos = frozenset()
    rows = [scheduler.submit(Request(prompts[0], 10, Sampling(1e-38), seed=1, eos_token_ids=no_eos)),
            scheduler.submit(Request(prompts[1], 10, Sampling(0.8), seed=2, eos_token_ids=no_eos)),
            scheduler.submit(Request(prompts[2], 10, Sampling(0.0), eos_token_ids=no_eos))]
    results = scheduler.run()
    greedy = Scheduler(model, max_batch=1)
    alone = greedy.submit(Request(prompts[0], 10, Sampling(0.0), eos_token_ids=no_eos))
    assert results[rows[0]].tokens == greedy.run()[alone].tokens
    assert all(len(results[row].tokens) == 10 for row in rows)


@pytest.mark.parametrize("sampling", [Sampling(0.7, min_p=0.1), Sampling(1.3, top_k=20, min_p=0.05),
                                      Sampling(1.0, min_p=1.0), Sampling(0.9, min_p=0.0)])
def test_min_p_is_hugging_faces(sampling):
    """min_p after temperature and top-k, as Hugging Face's MinPLogitsWarper in generate's order."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = logit_rows(500, seed=3)
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(sampling.temperature)(ids, logits.float())
    if sampling.top_k is not None:
        scores = TopKLogitsWarper(sampling.top_k)(ids, scores)
    if sampling.min_p:
        scores = MinPLogitsWarper(sampling.min_p)(ids, scores)
    torch.testing.assert_close(sampling.probs(logits), scores.softmax(-1), rtol=1e-5, atol=1e-7)
