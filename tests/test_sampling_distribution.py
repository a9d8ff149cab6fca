"""End to end: sampled continuations with a drafter follow the plain model's law.

We enumerate the exact law of the first two new tokens from the target itself, then
compare the empirical law of hasten's samples with a total-variation bound. With 64
outcomes and N samples the expected TV of a correct sampler is about 0.4 * sqrt(64 / N);
the control test shows the bound catches a sampler that trusts its drafts.
"""

import pytest
import torch

import hasten
import hasten.engine.loop as loop
from hasten.drafters import DraftModel, Lookahead, PromptLookup
from hasten.engine.tree import TokenTree
from hasten.engine.sampling import Sampling
from hasten.engine.verify import Verdict
from helpers import ScriptedDrafter, tiny_model

VOCAB = 8
SAMPLES = 2500
BOUND = 0.08


def peaky_model(seed):
    model = tiny_model("llama", seed=seed, vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # a random tiny model is nearly uniform; make it opinionated
    return model


PROMPT = torch.tensor([[1, 3, 5, 1, 3]])


def exact_law(model, sampling: Sampling) -> dict[tuple[int, int], float]:
    first = sampling.probs(model(PROMPT).logits[0, -1])
    law = {}
    for a in range(VOCAB):
        second = sampling.probs(model(torch.cat([PROMPT, torch.tensor([[a]])], 1)).logits[0, -1])
        for b in range(VOCAB):
            law[(a, b)] = float(first[a] * second[b])
    return law


def empirical_tv(model, drafter, sampling: Sampling) -> float:
    law = exact_law(model, sampling)
    g = torch.Generator().manual_seed(1234)
    counts = dict.fromkeys(law, 0)
    for _ in range(SAMPLES):
        out = hasten.generate(
            model, PROMPT, drafter=drafter, max_new_tokens=2, temperature=sampling.temperature,
            top_k=sampling.top_k, top_p=sampling.top_p, generator=g,
        )
        counts[tuple(out.sequences[0, -2:].tolist())] += 1
    return 0.5 * sum(abs(counts[k] / SAMPLES - law[k]) for k in law)


class FixedDrafter(ScriptedDrafter):
    """Always proposes the same two tokens: a deterministic (point-mass) draft."""

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


TARGET = peaky_model(0)
CASES = {
    "plain": (lambda: None, Sampling(1.0)),
    "draft_model": (lambda: DraftModel(peaky_model(5), num_tokens=2), Sampling(1.0)),
    "draft_model_topk_topp": (lambda: DraftModel(peaky_model(5), num_tokens=3), Sampling(0.8, top_k=5, top_p=0.9)),
    "point_mass": (lambda: FixedDrafter([3, 5]), Sampling(1.0)),
    "prompt_lookup": (lambda: PromptLookup(num_tokens=2), Sampling(1.3)),
    "fixed_tree": (FixedTreeDrafter, Sampling(1.0)),
    "lookahead": (lambda: Lookahead(draft_tokens=6, branch_length=2), Sampling(1.0, top_k=6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_continuations_follow_the_target(case):
    make, sampling = CASES[case]
    assert empirical_tv(TARGET, make(), sampling) < BOUND


def test_bound_catches_a_sampler_that_trusts_its_drafts(monkeypatch):
    def accept_everything(tree, draft, p, q, generator):
        return Verdict(tuple(range(len(draft))), int(torch.multinomial(p[len(draft)], 1, generator=generator)))

    monkeypatch.setattr(loop, "accept_sampling", accept_everything)
    assert empirical_tv(TARGET, DraftModel(peaky_model(5), num_tokens=2), Sampling(1.0)) > BOUND


def test_same_seed_same_sample():
    run = lambda: hasten.generate(  # noqa: E731
        TARGET, PROMPT, drafter=PromptLookup(), max_new_tokens=10, temperature=1.0,
        generator=torch.Generator().manual_seed(9),
    ).sequences
    assert torch.equal(run(), run())
