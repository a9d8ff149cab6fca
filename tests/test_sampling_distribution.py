"""End to end: sampled continuations with a drafter follow the plain model's law.

We enumerate the exact law of the first new tokens from the target itself, then compare
the empirical law of hasten's samples with a total-variation bound. The main tests draw
4 new tokens with drafters proposing 3 deep (a draft model with ``q``; a fixed tree with
siblings at depths 1-3), so rejections at depths 2 and 3 shape the first 3 tokens, whose
law (over a vocabulary of 8) is compared. Their bound comes from the sample size (see
test_verify_law.bound: Jensen for the expected TV, McDiarmid for the margin), and two broken
verifiers must exceed it: one that trusts its drafts, one that draws from ``p`` instead of
the residual ``max(p - q, 0)`` after a rejection at depth 2.

``empirical_tv``/``BOUND`` (two tokens, 2500 samples; the expected TV of a correct sampler
is about 0.4 * sqrt(64 / N)) serve the drafter tests of other files.
"""
import sys

import pytest
import torch

import hasten
from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from hasten.drafters import DraftModel, Lookahead, PromptLookup, Suffix
from hasten.engine import verify
from hasten.engine.verify import SpeculativeSampling, Verdict
from hasten.models import forwards
from helpers import DEVICE, ScriptedDrafter, tiny_model
from test_verify_law import bound, p_instead_of_the_residual_at_depth_2

VOCAB = 8
SAMPLES = 2500
BOUND = 0.08


def peaky_model(seed):
    model = tiny_model("llama", seed=seed, vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # a random tiny model is nearly uniform; make it opinionated
    return model


PROMPT = torch.tensor([[1, 3, 5, 1, 3]], device=DEVICE)
TARGET = peaky_model(0)


@torch.no_grad()
def next_probs(model, sampling: Sampling, continuation: tuple[int, ...]) -> torch.Tensor:
    """The target's next-token law as hasten's forwards compute it (a half-precision model runs
    its invariant kernels there: models/invariant.py)."""
    ids = PROMPT if not continuation else torch.cat(
        [PROMPT, torch.tensor([continuation], dtype=torch.long, device=DEVICE)], 1)
    with forwards.active():
        return sampling.probs(model(ids).logits[0, -1].float())


def exact_law(model, sampling: Sampling, length: int = 2) -> dict[tuple[int, ...], float]:
    """The target's law of its first ``length`` new tokens, every outcome listed."""
    law = {(): 1.0}
    for _ in range(length):
        law = {prefix + (token,): weight * float(probs[token])
               for prefix, weight in law.items()
               for probs in [next_probs(model, sampling, prefix)] for token in range(VOCAB)}
    return law


def sampled_law_tv(model, drafter, sampling: Sampling, length: int, max_new_tokens: int, samples: int,
                   own_generator: bool = True) -> float:
    """``own_generator`` False: every sample draws from torch's global generator (seeded here), as
    an unseeded request does; a pooled drafter reads its shared pool only then (DraftContext.reads_pool)."""
    law = exact_law(model, sampling, length)
    g = torch.Generator(device=DEVICE).manual_seed(1234) if own_generator else None
    if g is None:
        torch.manual_seed(1234)
    counts = dict.fromkeys(law, 0)
    for _ in range(samples):
        out = hasten.generate(
            model, PROMPT, drafter=drafter, max_new_tokens=max_new_tokens, temperature=sampling.temperature,
            top_k=sampling.top_k, top_p=sampling.top_p, generator=g,
        )
        counts[tuple(out.sequences[0, PROMPT.shape[1]:][:length].tolist())] += 1
    return 0.5 * sum(abs(counts[k] / samples - law[k]) for k in law)


def empirical_tv(model, drafter, sampling: Sampling) -> float:
    """TV of the first two new tokens over SAMPLES samples (compare with BOUND)."""
    return sampled_law_tv(model, drafter, sampling, 2, 2, SAMPLES)


class FixedDrafter(ScriptedDrafter):
    """Always proposes the same tokens: a deterministic (point-mass) draft."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, ctx):
        return hasten.drafters.Draft.chain(self.tokens[: ctx.max_depth])


class FixedTreeDrafter(ScriptedDrafter):
    """Always proposes the same tree of distinct siblings (point masses)."""

    TREE = TokenTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])

    def propose(self, ctx):
        return hasten.drafters.Draft((3, 5, 1, 5, 6, 2), self.TREE).limit_depth(ctx.max_depth)

    def __init__(self):
        pass


class RankedTreeDrafter(ScriptedDrafter):
    """Always proposes one fixed tree, siblings at depths 1, 2 and 3: each node holds the
    token its rank names under the target after the prompt and the node's path (0: the
    likeliest), so that drafts are accepted deep often enough to matter."""

    PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 0, 1)]

    def __init__(self, model, sampling: Sampling):
        self.tree = TokenTree.from_paths(self.PATHS)
        token_of: dict[tuple[int, ...], int] = {}
        for path in sorted(self.PATHS, key=lambda path: (len(path), path)):  # the tree's node order
            prefix = tuple(token_of[path[:i]] for i in range(1, len(path)))
            token_of[path] = int(next_probs(model, sampling, prefix).argsort(descending=True)[path[-1]])
        self.tokens = tuple(token_of[path] for path in sorted(self.PATHS, key=lambda path: (len(path), path)))

    def propose(self, ctx):
        return hasten.drafters.Draft(self.tokens, self.tree).limit_depth(ctx.max_depth)


# ---- the first 3 tokens, drafts 3 deep -----------------------------------------------------------
DEEP_SAMPLES = 1500
DEEP_LAW_SAMPLING = Sampling(1.0, top_k=3)  # 27 outcomes, so a bound from 1500 samples is tight
TREE_SAMPLING = Sampling(0.8, top_k=4, top_p=0.9)


def deep_tv(drafter, sampling: Sampling, samples: int = DEEP_SAMPLES, own_generator: bool = True) -> tuple[float, float]:
    tv = sampled_law_tv(TARGET, drafter, sampling, 3, 4, samples, own_generator)
    return tv, bound(exact_law(TARGET, sampling, 3), samples)


def draft_model_3_deep():
    return DraftModel(peaky_model(5), num_tokens=3)


def test_draft_model_3_deep_follows_the_target():
    tv, limit = deep_tv(draft_model_3_deep(), DEEP_LAW_SAMPLING)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


def test_tree_with_siblings_at_depths_1_to_3_follows_the_target():
    tv, limit = deep_tv(RankedTreeDrafter(TARGET, TREE_SAMPLING), TREE_SAMPLING)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


# a prompt that holds, once each, the target's likely continuations: iad (which copies the rest of
# the prompt after a token found once in it) drafts 2 deep there, accepted and rejected at both depths
IAD_PROMPT = [[4, 3, 0, 5, 3, 2, 7]]


def test_iad_drafts_accepted_and_rejected_two_deep_follow_the_target(monkeypatch):
    from hasten.core.stats import DecodeStats
    from hasten.drafters import IAD

    monkeypatch.setattr(sys.modules[__name__], "PROMPT", torch.tensor(IAD_PROMPT, device=DEVICE))
    g, total = torch.Generator(device=DEVICE).manual_seed(1), DecodeStats()
    for _ in range(100):
        total = total + hasten.generate(TARGET, PROMPT, drafter=IAD(), max_new_tokens=4, temperature=1.0, top_k=3,
                                        generator=g).stats
    drafted, accepted = total.drafted_at_depth, total.accepted_at_depth
    assert len(accepted) >= 2 and all(0 < accepted[d] < drafted[d] for d in (0, 1))  # both fates at depths 1, 2
    tv, limit = deep_tv(IAD(), DEEP_LAW_SAMPLING)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


@pytest.mark.parametrize("make", [lambda: Lookahead(draft_tokens=6, branch_length=3),
                                  lambda: Suffix(max_spec_factor=3.0, min_token_prob=0.05)],
                         ids=["lookahead_pooled", "suffix_pooled"])
def test_pooled_drafters_three_deep_follow_the_target(make):
    """One drafter for every sample, so its pool learns from the samples before (unseeded ones:
    a generation with a generator of its own does not read the pool): its drafts, trees up to
    3 deep, are accepted and rejected at depths 1 and 2, and the law holds."""
    from hasten.core.stats import DecodeStats

    drafter, total = make(), DecodeStats()
    torch.manual_seed(1)
    for _ in range(100):
        total = total + hasten.generate(TARGET, PROMPT, drafter=drafter, max_new_tokens=4, temperature=1.0, top_k=3,
                                        draft_size="fixed").stats
    drafted, accepted = total.drafted_at_depth, total.accepted_at_depth
    assert len(accepted) >= 2 and all(0 < accepted[d] < drafted[d] for d in (0, 1))  # both fates at depths 1, 2
    assert drafter.pool.stats().hits > 0  # drafts came from the samples before
    tv, limit = deep_tv(drafter, DEEP_LAW_SAMPLING, own_generator=False)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


def test_bound_catches_a_sampler_that_trusts_its_drafts(monkeypatch):
    def accept_everything(self, tree, tokens, logits, q, sampling, generator):
        path = tuple(tree.leaf_paths[0]) if len(tree) else ()  # a whole branch, always
        p = sampling.probs(logits[path[-1] + 1 if path else 0])
        return Verdict(path, int(torch.multinomial(p, 1, generator=generator)))

    monkeypatch.setattr(SpeculativeSampling, "verify", accept_everything)
    monkeypatch.setattr(SpeculativeSampling, "verify_rows", lambda self, rows: [  # a step verifies its rows at once
        accept_everything(self, r.tree, r.tokens, r.logits, r.q, r.sampling, r.generator) for r in rows])
    tv, limit = deep_tv(draft_model_3_deep(), DEEP_LAW_SAMPLING, samples=400)
    assert tv > limit, f"TV {tv:.3f} <= bound {limit:.3f}"


@pytest.mark.heavy  # 22 s; test_verify_law.py catches the same bug at the verifier in 3 s
def test_bound_catches_p_instead_of_the_residual_at_depth_2(monkeypatch):
    monkeypatch.setattr(verify, "_end_distribution", p_instead_of_the_residual_at_depth_2(verify._end_distribution))
    tv, limit = deep_tv(draft_model_3_deep(), DEEP_LAW_SAMPLING)
    assert tv > limit, f"TV {tv:.3f} <= bound {limit:.3f}"


# ---- plain decoding and input-guided drafters, first 2 tokens ---------------------------------------
SHALLOW_SAMPLES = 1200
SHALLOW_CASES = {
    "plain": (lambda: None, Sampling(0.9, top_p=0.8)),  # the sampler itself (warping, drawing) against the exact law
    "prompt_lookup": (lambda: PromptLookup(num_tokens=2), Sampling(1.3, top_k=5)),
    "lookahead": (lambda: Lookahead(draft_tokens=6, branch_length=2), Sampling(1.0, top_k=6)),
}


@pytest.mark.parametrize("case", sorted(SHALLOW_CASES))
def test_plain_and_input_guided_sampling_follow_the_target(case):
    make, sampling = SHALLOW_CASES[case]
    tv = sampled_law_tv(TARGET, make(), sampling, 2, 2, SHALLOW_SAMPLES)
    limit = bound(exact_law(TARGET, sampling, 2), SHALLOW_SAMPLES)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


def test_same_seed_same_sample():
    run = lambda: hasten.generate(  # noqa: E731
        TARGET, PROMPT, drafter=PromptLookup(), max_new_tokens=10, temperature=1.0,
        generator=torch.Generator(device=DEVICE).manual_seed(9),
    ).sequences
    assert torch.equal(run(), run())
