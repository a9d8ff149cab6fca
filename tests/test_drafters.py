"""What each drafter proposes, tested directly."""
import torch

import hasten
from hasten.drafters import PromptLookup, create
from hasten.drafters.base import Draft, DraftContext, TargetView
from hasten.core.sampling import Sampling
from hasten.models.adapter import ModelAdapter
from helpers import hf_greedy, tiny_model


def context(tokens, source=None, max_depth=10):
    target = TargetView(ModelAdapter(tiny_model("llama")), frozenset())  # what a drafter needing nothing sees
    return DraftContext(list(tokens), max_depth, Sampling(), None, target, source)


def test_prompt_lookup_copies_after_the_latest_longest_match():
    drafter = PromptLookup(max_ngram=3, num_tokens=3)
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 20, 21, 3, 5, 6, 7]
    ctx = context(tokens)
    ctx.state = drafter.begin(ctx)
    assert drafter.propose(ctx).tokens == (20, 21, 3)  # latest earlier "5 6 7"


def test_prompt_lookup_can_copy_after_the_earliest_match():
    drafter = PromptLookup(max_ngram=3, num_tokens=3, match="earliest")
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 20, 21, 3, 5, 6, 7]
    ctx = context(tokens)
    ctx.state = drafter.begin(ctx)
    assert drafter.propose(ctx).tokens == (8, 9, 1)  # the first "5 6 7"
    ctx.tokens.extend([8, 9, 4, 6, 7])  # later occurrences never replace the first
    assert drafter.propose(ctx).tokens == (8, 9, 1)  # "6 7" now: its first occurrence is still the first


def test_prompt_lookup_match_setting_is_checked():
    import pytest

    with pytest.raises(ValueError, match="match must be"):
        PromptLookup(match="closest")


def test_prompt_lookup_falls_back_to_shorter_ngrams_and_respects_depth():
    drafter = PromptLookup(max_ngram=3, min_ngram=1, num_tokens=5)
    ctx = context([4, 9, 8, 7, 6, 1, 2, 4], max_depth=2)
    ctx.state = drafter.begin(ctx)
    assert drafter.propose(ctx).tokens == (9, 8)  # only the unigram "4" matches
    ctx = context([1, 2, 3])
    ctx.state = drafter.begin(ctx)
    assert len(drafter.propose(ctx)) == 0  # nothing to copy


def test_prompt_lookup_tables_grow_with_the_committed_tokens():
    drafter = PromptLookup(max_ngram=2, num_tokens=2)
    ctx = context([1, 2, 3])
    ctx.state = drafter.begin(ctx)
    assert len(drafter.propose(ctx)) == 0
    ctx.tokens.extend([4, 2, 3])
    assert drafter.propose(ctx).tokens == (4, 2)


def test_prompt_lookup_copies_from_the_encoder_input():
    drafter = PromptLookup(max_ngram=2, num_tokens=3)
    ctx = context([0, 31, 32], source=[30, 31, 32, 33, 34, 35])
    ctx.state = drafter.begin(ctx)
    assert drafter.propose(ctx).tokens == (33, 34, 35)


def test_iad_on_an_encoder_decoder_accepts_tokens_copied_from_the_source():
    """A seq2seq model whose output restates its input (here: a decoder that always says
    token 0, fed a source of 0s): drafts copied from the encoder input are accepted."""
    model = tiny_model("t5")
    with torch.no_grad():
        model.lm_head.weight.zero_()  # equal logits: greedy picks token 0
    source = torch.tensor([[10, 0, 0, 0, 0, 0, 0, 0, 0, 2]])
    reference = hf_greedy(model, source, 12, eos_token_id=None)
    out = hasten.generate(model, source, drafter=PromptLookup(num_tokens=4), max_new_tokens=12, eos_token_id=[],
                          draft_size="fixed")  # acceptance counted at the drafter's own depth
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.accepted_tokens > 0 and out.stats.steps < 12


def test_draft_limit_depth_prunes_a_tree():
    tree_draft = Draft((1, 2, 3, 4), hasten.core.tree.TokenTree((-1, 0, -1, 1)))
    pruned = tree_draft.limit_depth(1)
    assert pruned.tokens == (1, 3) and pruned.tree.parents == (-1, -1)


def test_registry_creates_by_name():
    assert isinstance(create("prompt_lookup", num_tokens=2), PromptLookup)


def test_prompt_lookup_continues_a_repeating_stretch_periodically():
    drafter = PromptLookup(max_ngram=2, num_tokens=5)
    ctx = context([9, 1, 2, 3, 1, 2, 3])
    ctx.state = drafter.begin(ctx)
    # the latest "2 3" ends two tokens back; its continuation runs into the end, so it cycles
    assert drafter.propose(ctx).tokens == (1, 2, 3, 1, 2)
