"""Hybrid tree attention (models/attention.py): the cached prefix through the fused kernel,
the tree part masked, merged by log-sum-exp, equals the plain tree mask to float tolerance
on every architecture of the suite (sliding windows included, where it falls back), and
greedy decoding with a tree drafter stays identical to Hugging Face's."""
import pytest
import torch

import hasten
from hasten.core.tree import TokenTree
from hasten.drafters import Lookahead
from hasten.models import attention
from hasten.models.adapter import ModelAdapter
from hasten.models.attention import HybridTree, MaskedTree, attention_path
from helpers import CAUSAL_CONFIGS, TreeScriptedDrafter, hf_greedy, repetitive_prompt, tiny_model
from test_gemma3 import tiny_gemma3

TREE = TokenTree((-1, 0, 0, 1, -1, 4, 2))  # two roots' children, siblings, depths 1-4
ARCHS = sorted(CAUSAL_CONFIGS) + ["gemma3"]


def build(arch):
    return tiny_gemma3() if arch == "gemma3" else tiny_model(arch)


def tree_logits(model, path, prompt, tokens):
    adapter = ModelAdapter(model, path)
    adapter.start(torch.tensor([prompt]))
    return adapter.forward([prompt[-1], *tokens], TREE).logits  # [1 + nodes, vocab]


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_equals_the_masked_tree(arch, monkeypatch):
    model = build(arch)
    prompt = repetitive_prompt(30, seed=2)[0].tolist()
    tokens = [5, 9, 11, 7, 3, 12, 40]
    masked = tree_logits(model, MaskedTree(), prompt, tokens)
    merged = []
    real = attention.prefix_attention
    monkeypatch.setattr(attention, "prefix_attention", lambda *a: merged.append(1) or real(*a))
    hybrid = tree_logits(model, HybridTree(), prompt, tokens)
    torch.testing.assert_close(hybrid, masked, rtol=1e-4, atol=1e-4)
    sliding_everywhere = arch == "mistral"  # window 16 < 30 cached: every layer's prefix is partly hidden
    assert (len(merged) == 0) == sliding_everywhere, "full-attention layers must take the merged path"
    assert model.config._attn_implementation == "sdpa", "the model's own attention is put back"


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_greedy_decoding_with_hybrid_tree_attention_equals_hf(arch):
    model = build(arch)
    prompt = repetitive_prompt(24, seed=5)
    out = hasten.generate(model, prompt, drafter=Lookahead(), max_new_tokens=20, tree_attention="hybrid")
    assert out.sequences.tolist() == hf_greedy(model, prompt, 20).tolist()


def test_unknown_attention_path_is_refused():
    with pytest.raises(ValueError, match="tree_attention"):
        attention_path("flash")
    with pytest.raises(ValueError, match="tree_attention"):
        hasten.generate(tiny_model("llama"), repetitive_prompt(8), max_new_tokens=2, tree_attention="flash")


@pytest.mark.parametrize("mode", ["oracle", "adversarial", 0, 1, 2])
@pytest.mark.parametrize("right_sibling", [0, 2])
def test_scripted_trees_through_the_hybrid_path_equal_hf(mode, right_sibling):
    """Trees whose right token sits among siblings, with everything right, everything wrong
    or an error planted at depth 1-3: the hybrid path accepts exactly what HF would write."""
    model = tiny_model("qwen2", eos_token_id=None)  # no EOS: every step drafts the whole tree
    prompt = repetitive_prompt(24, seed=6)
    reference = hf_greedy(model, prompt, 20)
    assert reference.shape[1] == 24 + 20
    error_at = None if mode == "oracle" else (0 if mode == "adversarial" else mode + 1)
    drafter = TreeScriptedDrafter(reference[0].tolist(), depth=4, width=3, right_sibling=right_sibling,
                                  error_at=error_at)
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=20, tree_attention="hybrid")
    assert out.sequences.tolist() == reference.tolist()
    if mode == "adversarial":
        assert out.stats.accepted_tokens == 0
    if mode == "oracle":
        assert out.stats.steps == -(-20 // 5)
