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


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_kv_heads_read_in_place_equal_the_copied_ones(arch, monkeypatch):
    """A long block's forward on the CPU reads grouped KV heads in place (enable_gqa) instead of
    transformers' per-group copy: tree and chain logits equal the copying path's, the grouped
    function really runs on grouped-query models, and the model's attention is put back. (The
    model's own forward: models/lean.py's reads grouped heads in place always.)"""
    monkeypatch.setenv("HASTEN_LEAN_FORWARD", "0")
    model = build(arch)
    prompt = repetitive_prompt(30, seed=2)[0].tolist()
    tokens = [5, 9, 11, 7, 3, 12, 40]
    copied = tree_logits(model, MaskedTree(), prompt, tokens)
    chain = TokenTree.chain(len(tokens))
    copied_chain = ModelAdapter(model)
    copied_chain.start(torch.tensor([prompt]))
    copied_chain = copied_chain.forward([prompt[-1], *tokens], chain).logits
    calls = []
    real = attention.grouped_attention
    monkeypatch.setattr(attention, "IN_PLACE_FROM", 8)  # the tiny prompt counts as long
    monkeypatch.setattr(attention, "grouped_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    in_place = tree_logits(model, MaskedTree(), prompt, tokens)
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prompt]))
    in_place_chain = adapter.forward([prompt[-1], *tokens], chain).logits
    torch.testing.assert_close(in_place, copied, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(in_place_chain, copied_chain, rtol=1e-5, atol=1e-5)
    config = model.config.get_text_config()
    grouped = getattr(config, "num_key_value_heads", None) not in (None, config.num_attention_heads)
    assert bool(calls) == grouped
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    prompt_tensor = torch.tensor([prompt])
    monkeypatch.setattr(attention, "IN_PLACE_FROM", 8)
    out = hasten.generate(model, prompt_tensor, drafter=Lookahead(), max_new_tokens=16)
    assert out.sequences.tolist() == hf_greedy(model, prompt_tensor, 16).tolist()


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
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=20, tree_attention="hybrid",
                          draft_size="fixed")  # steps counted at the script's depth
    assert out.sequences.tolist() == reference.tolist()
    if mode == "adversarial":
        assert out.stats.accepted_tokens == 0
    if mode == "oracle":
        assert out.stats.steps == -(-20 // 5)
