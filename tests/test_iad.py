"""``iad``: input-guided aggressive decoding with the reference's rules (microsoft/unilm
decoding/IAD/inference.py, paper_aggressive_generate): the whole rest of the source as the
draft, alignment at the shortest suffix n-gram that occurs once in the source."""
import random

import pytest
import torch

import hasten
from hasten.drafters import IAD
from hasten.drafters.base import DraftContext, TargetView
from hasten.core.sampling import Sampling
from hasten.models.adapter import ModelAdapter

from helpers import hf_greedy, tiny_model


def context(tokens, source=None, max_depth=50):
    target = TargetView(ModelAdapter(tiny_model("llama")), frozenset())
    return DraftContext(list(tokens), max_depth, Sampling(), None, target, source)


def reference_alignment(source, tokens, min_gram=1, max_gram=3):
    """The reference's construct_hash_sets + find_hash_sets, restated: -1 for no alignment."""
    ends = {}
    for i in range(len(source)):
        for n in range(min_gram, max_gram + 1):
            if i + n <= len(source):
                ends.setdefault(tuple(source[i:i + n]), []).append(i + n)
    for n in range(min_gram, max_gram + 1):
        if len(tokens) < n or tuple(tokens[-n:]) not in ends:
            return -1
        if len(ends[tuple(tokens[-n:])]) == 1:
            return ends[tuple(tokens[-n:])][0]
    return -1


def draft(drafter, tokens, source=None, max_depth=50, begin_with=None):
    ctx = context(begin_with if begin_with is not None else tokens, source, max_depth)
    ctx.state = drafter.begin(ctx)
    ctx.tokens = list(tokens)
    return list(drafter.propose(ctx).tokens)


def test_alignment_follows_the_reference_on_random_texts():
    """Small alphabets make repeated n-grams common, so every branch of the rule is taken."""
    rng = random.Random(0)
    drafter, seen = IAD(), set()
    for _ in range(400):
        source = [rng.randrange(6) for _ in range(rng.randrange(1, 15))]
        written = [0] + [rng.randrange(7) for _ in range(rng.randrange(1, 6))]  # the decoder's start, then text
        at = reference_alignment(source, written)
        expected = source[at:] if 0 <= at < len(source) else []
        assert draft(drafter, written, source=source, begin_with=[0]) == expected, (source, written)
        seen.add("none" if at == -1 else "end" if at == len(source) else "copy")
    assert seen == {"none", "end", "copy"}


def test_the_draft_is_the_whole_rest_of_the_source_up_to_the_step_limit():
    source = [5, 6, 7, 8, 5, 6, 9, 10, 11, 12]
    assert draft(IAD(), [1, 8], source=source, begin_with=[1]) == [5, 6, 9, 10, 11, 12]  # "8" is unique
    assert draft(IAD(), [1, 8, 5], source=source, begin_with=[1]) == [6, 9, 10, 11, 12]  # "5" twice, "8 5" once
    assert draft(IAD(), [1, 8], source=source, max_depth=2, begin_with=[1]) == [5, 6]  # the sizing rule's cap
    assert draft(IAD(), [1, 4], source=source, begin_with=[1]) == []  # "4" is not in the source


def test_an_encoder_input_is_copied_from_its_start_before_anything_is_written():
    source = [3, 4, 3, 4]
    assert draft(IAD(), [0], source=source) == [3, 4, 3, 4]  # the decoder holds only its start token
    assert draft(IAD(), [0, 3], source=source, begin_with=[0]) == []  # "3" twice, "0 3" nowhere


def test_a_decoder_only_target_copies_from_its_prompt_alone():
    prompt = [9, 1, 2, 3, 4]
    assert draft(IAD(), prompt + [2], begin_with=prompt) == [3, 4]
    assert draft(IAD(), prompt + [2, 3, 4, 9], begin_with=prompt) == [1, 2, 3, 4]  # never the generated text


@pytest.mark.parametrize("draft_size", ["fixed", "auto"])
def test_iad_decodes_exactly_as_plain_greedy(draft_size):
    """A prompt of distinct tokens, so every generated token found in it aligns uniquely and a
    draft is verified (accepted or not: the tiny model does not restate its prompt)."""
    model = tiny_model("llama")
    prompt = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40][None]
    out = hasten.generate(model, prompt, drafter=IAD(), max_new_tokens=24, eos_token_id=[], draft_size=draft_size)
    assert out.sequences.tolist() == hf_greedy(model, prompt, 24, eos_token_id=None).tolist()
    if draft_size == "fixed":
        assert out.stats.drafted_tokens > 0


def test_iad_on_a_seq2seq_target_accepts_the_source_it_restates():
    """A decoder that always says token 0, fed a source of 0s: the first step copies the whole
    source from its start and the verifier keeps it."""
    model = tiny_model("t5")
    with torch.no_grad():
        model.lm_head.weight.zero_()  # equal logits: greedy picks token 0
    source = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, 2]])
    reference = hf_greedy(model, source, 12, eos_token_id=None)
    out = hasten.generate(model, source, drafter=IAD(), max_new_tokens=12, eos_token_id=[], draft_size="fixed")
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.accepted_tokens >= 8 and out.stats.drafted_at_depth[:9] == [1] * 9  # one copy of 10 tokens
