"""Cache crop/keep, and tree attention equal to per-branch plain attention."""
import pytest
import torch

from hasten.models import cache as kv
from hasten.core.tree import TokenTree
from hasten.models.adapter import ModelAdapter
from helpers import CAUSAL_CONFIGS, assert_tree_matches_branches, repetitive_prompt, tiny_model

TREE = TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)])
TOKENS = [11, 12, 13, 14, 15, 16, 17]


def _model(arch):
    if arch == "qwen2_mixed_sliding":  # one full-attention layer, one sliding-window layer
        return tiny_model("qwen2", use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    return tiny_model(arch)


@pytest.mark.parametrize("prompt_len", [12, 40])  # 40 outruns the sliding windows (16, 8)
@pytest.mark.parametrize("arch", sorted(CAUSAL_CONFIGS) + ["qwen2_mixed_sliding"])
def test_tree_attention_equals_each_branch_run_alone(arch, prompt_len):
    prompt = repetitive_prompt(prompt_len)[0].tolist()
    assert_tree_matches_branches(_model(arch), prompt, TOKENS, TREE)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_commit_keeps_the_accepted_branch_only(arch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(12)[0].tolist()
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prompt]))
    start = adapter.cache_length
    adapter.forward([prompt[-1], *TOKENS], TREE)
    path = (1, 5)  # root -> node 1 -> node 5: not a prefix of the block
    assert TREE.ancestors(5) == list(path)
    adapter.commit(start, TREE, path)
    assert adapter.cache_length == len(prompt) + len(path)
    # the compacted cache continues exactly like a fresh run over the accepted tokens
    nxt = adapter.forward([99 % model.config.vocab_size], None).logits[-1]
    fresh = model(torch.tensor([prompt + [TOKENS[1], TOKENS[5], 99 % model.config.vocab_size]])).logits[0, -1]
    torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4)


def test_crop_and_keep_on_a_dynamic_cache():
    cache = kv.new_cache(encoder_decoder=False)
    keys = torch.arange(10.0).view(1, 1, 10, 1)  # [batch, heads, seq, head_dim]
    cache.update(keys, keys.clone(), 0)
    kv.crop(cache, 7)
    assert kv.length(cache) == 7
    kv.keep(cache, 3, torch.tensor([0, 2, 3]))
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 5, 6]


def test_encoder_decoder_cache_crops_only_self_attention():
    cache = kv.new_cache(encoder_decoder=True)
    x = torch.zeros(1, 1, 5, 2)
    cache.self_attention_cache.update(x, x, 0)
    cache.cross_attention_cache.update(x, x, 0)
    kv.crop(cache, 2)
    assert kv.length(cache) == 2 and cache.cross_attention_cache.get_seq_length() == 5


def test_growing_cache_appends_in_place_and_matches_transformers_dynamic_cache():
    """hasten's caches grow into spare capacity (no copy of the whole cache per step); the
    logits are bit for bit those of transformers' concatenating DynamicCache, through
    crops (rejected drafts), a tree compaction and a tensor put in from outside."""
    from transformers.cache_utils import DynamicCache

    model = tiny_model("llama")
    prompt = repetitive_prompt(20)[0].tolist()
    growing, dynamic = ModelAdapter(model), ModelAdapter(model)
    dynamic.cache = DynamicCache()
    for adapter in (growing, dynamic):
        adapter.start(torch.tensor([prompt]))
    layer = growing.cache.layers[0]
    assert isinstance(layer, kv.GrowingLayer)
    store = layer._key_store.data_ptr()

    def both(block, tree=None):
        a, b = growing.forward(block, tree).logits, dynamic.forward(block, tree).logits
        assert torch.equal(a, b)

    both([5])
    both([6, 7, 8, 9])
    for adapter in (growing, dynamic):
        adapter.crop(adapter.cache_length - 3)  # three drafts rejected
    both([10, 11])
    assert layer._key_store.data_ptr() == store  # still the first store: nothing was copied
    start = growing.cache_length
    both([12, *TOKENS], TREE)
    for adapter in (growing, dynamic):
        adapter.commit(start, TREE, (1, 5))
    both([13])
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # a tensor from outside (a batch's rows)
    both([14, 15])
    assert growing.cache_length == dynamic.cache_length == len(prompt) - 1 + 10  # prompt minus its root, 10 kept
    for _ in range(300):  # past the first capacity: the store grows, the numbers stay
        both([16])
    assert layer._key_store.shape[-2] >= growing.cache_length
