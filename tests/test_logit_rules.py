"""The request fields that transform the target distribution (min_p, logit_bias,
allowed_token_ids, min_tokens, presence/frequency/repetition penalties) stay lossless under
speculation: greedy output with drafts accepted two and more deep (prompt lookup, a scripted
chain, a scripted tree with siblings) equals plain decoding under the same transform, token for
token, and both equal a reference written here from the rules' definitions; sampled output
follows the exact law of the transformed target with drafts three deep.

The reference (:func:`ruled`) applies the rules one token at a time to a plain forward of the
whole sequence, counting tokens in Python, so it shares nothing with hasten's LogitRules.
"""
from __future__ import annotations

import pytest
import torch

import hasten
from hasten.core.sampling import Sampling
from hasten.drafters import DraftModel, PromptLookup
from helpers import (
    DEVICE, VOCAB as VOCAB_TINY, ScriptedDrafter, TreeScriptedDrafter, hf_greedy, repetitive_prompt, tiny_model,
)
from test_sampling_distribution import PROMPT, TARGET, RankedTreeDrafter, VOCAB as LAW_VOCAB, peaky_model
from test_verify_law import bound

NEW = 24
DEPTH = 4
EOS = 2  # the tiny models' eos_token_id


def ruled(logits: torch.Tensor, prompt: list[int], out: list[int], eos: set[int], rules: dict) -> torch.Tensor:
    """[vocab] logits after the rules, as their definitions read (vLLM's order)."""
    logits = logits.float().clone()
    if rules.get("allowed_token_ids") is not None:
        banned = torch.ones_like(logits, dtype=torch.bool)
        banned[list(rules["allowed_token_ids"])] = False
        logits[banned] = float("-inf")
    for token, bias in dict(rules.get("logit_bias") or {}).items():
        logits[token] = logits[token] + bias
    if len(out) < rules.get("min_tokens", 0):
        logits[sorted(eos)] = float("-inf")
    r = rules.get("repetition_penalty", 1.0)
    if r != 1:
        for token in set(prompt + out):
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(out):
        logits[token] = (logits[token] - rules.get("frequency_penalty", 0.0) * out.count(token)
                         - rules.get("presence_penalty", 0.0))
    return logits


@torch.no_grad()
def reference_greedy(model, prompt: torch.Tensor, rules: dict, eos: set[int] = frozenset({EOS})) -> list[int]:
    ids, out = prompt[0].tolist(), []
    for _ in range(NEW):
        logits = model(torch.tensor([ids + out], device=DEVICE)).logits[0, -1]
        token = int(ruled(logits, ids, out, eos, rules).argmax())
        out.append(token)
        if token in eos:
            break
    return ids + out


CASES = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence_frequency": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "logit_bias": dict(logit_bias={5: 4.0, 7: -100.0, 11: 2.5}),
    "allowed_token_ids": dict(allowed_token_ids=list(range(3, 40))),
    # EOS pushed up by a bias and held back by min_tokens: the sequence ends at the 10th token
    "min_tokens": dict(min_tokens=9, logit_bias={EOS: 6.0}),
    "all": dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=0.3, logit_bias={9: 1.5},
                allowed_token_ids=list(range(2, 60)), min_tokens=4, min_p=0.3),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompt():
    return repetitive_prompt(24, seed=1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_under_a_transform_is_plain_decoding_under_it(model, prompt, case):
    rules = CASES[case]
    expected = reference_greedy(model, prompt, rules)
    if case == "min_tokens":
        assert len(expected) - prompt.shape[1] == 10 and expected[-1] == EOS

    def run(drafter):
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, draft_size="fixed", **rules)
        assert out.sequences[0].tolist() == expected, drafter
        return out.stats

    assert run(None).mean_accepted == 1.0
    run(PromptLookup(num_tokens=DEPTH))
    # a chain and a tree (the right token after a wrong sibling at every level) that hold the
    # reference: every draft token is accepted, so each position's rules saw the drafted path
    new = len(expected) - prompt.shape[1]
    for drafter in (ScriptedDrafter(expected, DEPTH), TreeScriptedDrafter(expected, depth=DEPTH, right_sibling=1)):
        stats = run(drafter)
        assert stats.steps == -(-new // (DEPTH + 1)), (drafter, stats.steps)
    # a planted error at depth 2: the rejection path keeps the output
    assert run(ScriptedDrafter(expected, DEPTH, 2)).mean_accepted > 1


def test_prompt_lookup_accepts_deep_under_the_rules(model, prompt):
    """The repetitive prompt's continuation repeats: prompt lookup's drafts are accepted two
    and more deep under a logit bias and an allowed set (which keep the repetition)."""
    rules = dict(logit_bias={5: 1.0}, allowed_token_ids=list(range(3, VOCAB_TINY)))
    out = hasten.generate(model, prompt, drafter=PromptLookup(num_tokens=DEPTH), max_new_tokens=NEW,
                          draft_size="fixed", **rules)
    assert out.sequences[0].tolist() == reference_greedy(model, prompt, rules)
    assert len(out.stats.accepted_at_depth) >= 2 and out.stats.accepted_at_depth[1] > 0



def test_repetition_penalty_is_hugging_faces():
    model, prompt = tiny_model("qwen2"), repetitive_prompt(20, seed=2)
    expected = hf_greedy(model, prompt, NEW, repetition_penalty=1.4)[0].tolist()
    out = hasten.generate(model, prompt, drafter=PromptLookup(num_tokens=DEPTH), max_new_tokens=NEW,
                          repetition_penalty=1.4)
    assert out.sequences[0].tolist() == expected


def test_the_engine_and_a_batch_take_the_rules(model, prompt):
    rules = CASES["all"]
    expected = reference_greedy(model, prompt, rules)
    batch = hasten.generate(model, [prompt[0], prompt[0, 2:]], drafter=PromptLookup(), max_new_tokens=NEW, **rules)
    assert batch.rows[0].sequences[0].tolist() == expected
    assert batch.rows[1].sequences[0].tolist() == reference_greedy(model, prompt[:, 2:], rules)


def test_an_integer_logit_bias_adds_as_its_float_does(model, prompt):
    """OpenAI's logit_bias values are often written as integers: through the library they act as
    the same floats (the server's JSON already gave floats)."""
    as_int = hasten.generate(model, prompt, max_new_tokens=NEW, logit_bias={5: 8, 7: -3})
    as_float = hasten.generate(model, prompt, max_new_tokens=NEW, logit_bias={5: 8.0, 7: -3.0})
    assert as_int.sequences.tolist() == as_float.sequences.tolist()
    assert Sampling(logit_bias={5: 8}) == Sampling(logit_bias={5: 8.0})
    with pytest.raises(ValueError, match="logit_bias"):
        Sampling(logit_bias={5: True})


def test_out_of_range_values_are_refused(model, prompt):
    for bad in (dict(repetition_penalty=0.0), dict(min_p=1.5), dict(min_tokens=-1), dict(allowed_token_ids=[]),
                dict(logit_bias={3: float("nan")})):
        with pytest.raises(ValueError):
            hasten.generate(model, prompt, max_new_tokens=2, **bad)
    for bad, name in ((dict(logit_bias={VOCAB_TINY: 1.0}), "logit_bias"),
                      (dict(allowed_token_ids=[-1]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=name):
            hasten.generate(model, prompt, max_new_tokens=2, **bad)


def test_a_request_without_rules_builds_none(model, prompt, monkeypatch):
    from hasten.core import sampling

    def fail(*args, **kwargs):
        raise AssertionError("LogitRules built for a request without rules")

    monkeypatch.setattr(sampling.LogitRules, "__init__", fail)
    hasten.generate(model, prompt, drafter=PromptLookup(), max_new_tokens=8, temperature=0.7, top_k=5, min_p=0.1)


# ---- the sampling law under the rules, drafts three deep --------------------------------------------
LAW_EOS = 7
LAW_RULES = dict(repetition_penalty=2.5, presence_penalty=1.5, frequency_penalty=1.0, logit_bias={2: 1.0, 4: -0.8},
                 min_tokens=2, min_p=0.05)
LAW_SAMPLING = Sampling(1.0, **LAW_RULES)
LAW_SAMPLES = 800


@torch.no_grad()
def law_probs(continuation: tuple[int, ...]) -> torch.Tensor:
    ids = PROMPT[0].tolist() + list(continuation)
    logits = TARGET(torch.tensor([ids], device=DEVICE)).logits[0, -1]
    rules = {**LAW_RULES, "min_p": None}
    return Sampling(1.0, min_p=LAW_RULES["min_p"]).probs(
        ruled(logits, PROMPT[0].tolist(), list(continuation), {LAW_EOS}, rules))


def exact_ruled_law(length: int = 3) -> dict[tuple[int, ...], float]:
    law = {(): 1.0}
    for _ in range(length):
        law = {prefix + (token,): weight * float(probs[token])
               for prefix, weight in law.items() for probs in [law_probs(prefix)] for token in range(LAW_VOCAB)}
    return law


class RuledRankedTree(RankedTreeDrafter):
    """RankedTreeDrafter's tree, ranked under the rules (so that it is accepted deep)."""

    def __init__(self):
        from hasten.core.tree import TokenTree

        self.tree = TokenTree.from_paths(self.PATHS)
        order = sorted(self.PATHS, key=lambda path: (len(path), path))
        token_of: dict[tuple[int, ...], int] = {}
        for path in order:
            prefix = tuple(token_of[path[:i]] for i in range(1, len(path)))
            token_of[path] = int(law_probs(prefix).argsort(descending=True)[path[-1]])
        self.tokens = tuple(token_of[path] for path in order)


def sampled_tv(drafter, samples: int) -> tuple[float, float, int]:
    """(TV of the first 3 tokens against the exact law, its bound, samples with 2+ tokens accepted)."""
    law = exact_ruled_law(3)
    g = torch.Generator(device=DEVICE).manual_seed(4321)
    counts = dict.fromkeys(law, 0)
    deep = 0
    for _ in range(samples):
        out = hasten.generate(TARGET, PROMPT, drafter=drafter, max_new_tokens=4, temperature=1.0,
                              eos_token_id=LAW_EOS, generator=g, draft_size="fixed", **LAW_RULES)
        counts[tuple(out.sequences[0, PROMPT.shape[1]:][:3].tolist())] += 1
        deep += len(out.stats.accepted_at_depth) >= 2  # a step accepted two draft tokens or more
    tv = 0.5 * sum(abs(counts[k] / samples - law[k]) for k in law)
    return tv, bound(law, samples), deep


@pytest.mark.parametrize("drafter", ["tree", pytest.param("draft_model", marks=pytest.mark.heavy)])
def test_sampling_under_the_rules_follows_the_transformed_target(drafter):
    assert law_probs(())[LAW_EOS] == 0 and law_probs((1,))[LAW_EOS] == 0  # min_tokens holds EOS back
    made = RuledRankedTree() if drafter == "tree" else DraftModel(peaky_model(5), num_tokens=3)
    tv, limit, deep = sampled_tv(made, LAW_SAMPLES)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"
    assert deep > LAW_SAMPLES // 10, deep  # drafts were accepted two and more deep often


def test_the_law_check_sees_rules_that_leave_out_the_draft_path(monkeypatch):
    """Rules that count each row as after the committed tokens only (the draft path left out)
    break the law above: the check has the power to see that bug."""
    from hasten.core import sampling

    apply = sampling.LogitRules.apply
    monkeypatch.setattr(sampling.LogitRules, "apply", lambda self, logits, tree, draft: apply(self, logits, tree, ()))
    tv, limit, _ = sampled_tv(RuledRankedTree(), 400)
    assert tv > limit, f"TV {tv:.3f} <= bound {limit:.3f}"
