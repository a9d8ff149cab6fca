"""Gemma 3 mixes sliding-window and full-attention layers in one model (Gemma 3 270M:
five sliding layers to one full one). Verification must give every layer kind its own
mask, also over prompts longer than the window, or greedy output leaves Hugging Face's.

A tiny random ``Gemma3ForCausalLM`` (3 layers: sliding, full, sliding; window 8) with
prompts of 20 and 40 tokens, so that most positions see past the window.
"""
import warnings

import pytest
import torch
import transformers as tf

import hasten
from hasten.core.tree import TokenTree
from hasten.drafters.base import REGISTRY, create
from hasten.models.adapter import ModelAdapter
from helpers import (
    VOCAB, ScriptedDrafter, TreeScriptedDrafter, assert_scripted_stats, assert_tree_matches_branches, hf_greedy,
    repetitive_prompt,
)

WINDOW = 8
LAYER_KINDS = ["sliding_attention", "full_attention", "sliding_attention"]
NEW = 24
DRAFT_LEN = 4
PROMPT_LEN = 20  # > WINDOW: the sliding layers already hide the prompt's start

# Drafters that need no training: each must be exact on Gemma 3 with its default settings.
TRAINING_FREE = sorted(name for name, cls in REGISTRY.items() if cls.Training is None)


def tiny_gemma3(seed: int = 0, layer_kinds: list[str] = LAYER_KINDS, attention: str = "sdpa") -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    config = tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_kinds),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=WINDOW, layer_types=list(layer_kinds), max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


@pytest.fixture(scope="module")
def setup():
    model = tiny_gemma3()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    prompt = repetitive_prompt(PROMPT_LEN, seed=1)
    reference = hf_greedy(model, prompt, NEW)
    assert reference.shape[1] - PROMPT_LEN > WINDOW, "the reference must run past the window"
    return model, prompt, reference


def check(model, prompt, reference, drafter):
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, draft_size="fixed")  # counted below
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.new_tokens == reference.shape[1] - prompt.shape[1]
    return out


def test_the_window_changes_the_output(setup):
    """Guards the tests below: were the sliding layers run as full ones, Gemma 3's greedy
    output would differ, so equality with Hugging Face checks the per-kind masks."""
    model, prompt, reference = setup
    all_full = tiny_gemma3(layer_kinds=["full_attention"] * len(LAYER_KINDS))
    all_full.load_state_dict(model.state_dict())
    long_prompt = repetitive_prompt(40, seed=2)
    assert not torch.allclose(model(long_prompt).logits, all_full(long_prompt).logits, atol=1e-4)


def test_plain_decoding(setup):
    assert check(*setup, None).stats.mean_accepted == 1.0


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
def test_scripted_chains(setup, mode):
    model, prompt, reference = setup
    out = check(model, prompt, reference, ScriptedDrafter(reference[0].tolist(), DRAFT_LEN, mode))
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
@pytest.mark.parametrize("right_sibling", [0, 2])
def test_scripted_trees(setup, mode, right_sibling):
    model, prompt, reference = setup
    error_at = {"oracle": None, "adversarial": 0}.get(mode, mode)
    drafter = TreeScriptedDrafter(reference[0].tolist(), DRAFT_LEN, 3, right_sibling, error_at)
    out = check(model, prompt, reference, drafter)
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)


def test_training_free_drafters_are_the_ones_tested():
    assert {"prompt_lookup", "lookahead", "draft_model"} <= set(TRAINING_FREE)


# Drafters built on a draft model, with the settings under which the target drafting for
# itself gets everything accepted (easyspec's fuzzy groups of 2+ layers would reject some).
DRAFTED_SETTINGS = {"draft_model": {}, "easyspec": {"group_size": 1}}
SLIDING_REFUSED = {"triforce"}  # a per-head retrieval cache cannot follow a sliding window's mask


@pytest.mark.parametrize("name", TRAINING_FREE)
def test_training_free_drafters(setup, name):
    model, prompt, reference = setup
    if name in SLIDING_REFUSED:
        with pytest.raises(ValueError, match="sliding-window"):
            hasten.generate(model, prompt, drafter=create(name, model=tiny_gemma3(seed=7)), max_new_tokens=2)
    elif REGISTRY[name].needs_draft_model:
        for draft in (tiny_gemma3(seed=7), model):  # a stranger, and the target itself (all accepted)
            for adaptive in (False, True):
                drafter = create(name, model=draft, num_tokens=DRAFT_LEN, adaptive=adaptive,
                                 **DRAFTED_SETTINGS[name])
                out = check(model, prompt, reference, drafter)
        assert out.stats.accepted_tokens == out.stats.drafted_tokens  # the last run drafted with the target
    else:
        check(model, prompt, reference, create(name))


@pytest.mark.parametrize("settings", [dict(num_tokens=DRAFT_LEN), dict(num_tokens=8, max_ngram=2)],
                         ids=["short", "long"])
def test_prompt_lookup_on_a_long_copying_prompt(settings):
    """A prompt of 40 tokens that repeats itself: long accepted drafts that cross the window."""
    model = tiny_gemma3(seed=3)
    prompt = repetitive_prompt(40, seed=4)
    reference = hf_greedy(model, prompt, NEW)
    out = hasten.generate(model, prompt, drafter=create("prompt_lookup", **settings), max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()


def test_lookahead_small_tree(setup):
    check(*setup, create("lookahead", draft_tokens=4, branch_length=2))


TRAINED = sorted(name for name, cls in REGISTRY.items() if cls.Training is not None)


@pytest.mark.parametrize("name", TRAINED)
def test_trained_drafters_with_untrained_weights_stay_exact(setup, name):
    """Random weights draft badly but never change the output: features, Medusa heads and
    hidden transfer's riders (placeholders inside the verification forward) on mixed layers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no weights found": untrained on purpose
        check(*setup, create(name))


TREE = TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)])
TREE_TOKENS = [11, 12, 13, 14, 15, 16, 17]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt_len", [6, 12, 40])  # shorter than, near and far past the window
def test_tree_attention_equals_each_branch_run_alone(prompt_len, attention):
    prompt = repetitive_prompt(prompt_len)[0].tolist()
    assert_tree_matches_branches(tiny_gemma3(attention=attention), prompt, TREE_TOKENS, TREE)


def test_commit_keeps_the_accepted_branch_only():
    model = tiny_gemma3()
    prompt = repetitive_prompt(20)[0].tolist()
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prompt]))
    start = adapter.cache_length
    adapter.forward([prompt[-1], *TREE_TOKENS], TREE)
    path = (1, 5)  # root -> node 1 -> node 5: not a prefix of the block
    adapter.commit(start, TREE, path)
    nxt = adapter.forward([9], None).logits[-1]
    fresh = model(torch.tensor([prompt + [TREE_TOKENS[1], TREE_TOKENS[5], 9]])).logits[0, -1]
    torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4)


def test_eager_attention_with_a_tree_drafter():
    """Gemma 3's eager attention path (besides the default sdpa) takes the same masks."""
    model = tiny_gemma3(attention="eager")
    prompt = repetitive_prompt(PROMPT_LEN, seed=1)
    reference = hf_greedy(model, prompt, NEW)
    for drafter in (create("lookahead"), TreeScriptedDrafter(reference[0].tolist(), DRAFT_LEN, 3, 2, 2)):
        check(model, prompt, reference, drafter)


def test_batched_rows_equal_hf_greedy_with_mixed_layer_kinds():
    """Rows of different lengths in one batch: each row's sliding window is measured in its
    own positions, whatever columns the shared cache puts its tokens in."""
    model = tiny_gemma3()
    prompts = [repetitive_prompt(PROMPT_LEN, seed=0)[0], repetitive_prompt(2 * PROMPT_LEN, seed=1)[0],
               repetitive_prompt(6, seed=2)[0]]
    references = [hf_greedy(model, p[None], NEW)[0].tolist() for p in prompts]
    for name in ("prompt_lookup", "lookahead"):
        out = hasten.generate(model, prompts, drafter=create(name), max_new_tokens=NEW)
        assert [s.tolist() for s in out.sequences] == references, name
