"""Lossy KV compression (SpecKV, SnapKV, StreamingLLM) and prompt compression (SpecPC):
what they keep, that decoding from a compressed cache uses the right positions (checked
against a hand-written greedy loop over the same cache), that lossless drafters stay exact
relative to the compressed target, and that nothing lossy runs unless asked for by name."""
import pytest
import torch

import hasten
from hasten.approx import SnapKV, SpecKV, SpecPC, StreamingLLM
from hasten.approx.kv import attention_scores, centred_max_pool, draft_lookahead, keep_entries
from hasten.approx.specpc import select_positions
from hasten.drafters import Lookahead, PromptLookup
from hasten.models.adapter import ModelAdapter
from hasten.models.compat import cache_argument
from transformers.cache_utils import DynamicCache
from helpers import hf_greedy, repetitive_prompt, tiny_model

NEW = 16
PROMPT = repetitive_prompt(60, seed=4)  # 59 cached tokens, well over the budgets below


def policies():
    draft = tiny_model("llama", seed=9)
    return [StreamingLLM(budget=24, window=20), SnapKV(budget=24, window=8, pool=3),
            SpecKV(draft=draft, budget=24, window=8, pool=3, lookahead=4)]


@torch.no_grad()
def by_hand(model, policy, prompt, new):
    """Greedy decoding one token per forward over the policy's compressed cache, with the
    true positions written out: the reference for hasten's decoding with an offset."""
    adapter = ModelAdapter(model)
    tokens, _ = policy.start(adapter, prompt, hidden=False)
    cache, position = adapter.cache, len(tokens) - 1
    for _ in range(new):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), **cache_argument(model, cache), position_ids=torch.tensor([[position]]))
        tokens.append(int(out.logits[0, -1].argmax()))
        position += 1
    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("index", range(3), ids=["streaming_llm", "snapkv", "speckv"])
def test_compressed_decoding_matches_a_hand_loop_and_drafters_stay_exact(arch, index):
    model = tiny_model(arch)
    policy = policies()[index]
    reference = by_hand(model, policy, PROMPT, NEW)
    for drafter in (None, PromptLookup(num_tokens=4), Lookahead()):
        out = hasten.generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW, kv_compression=policy,
                              eos_token_id=[])  # the hand loop knows no EOS
        assert out.sequences[0].tolist() == reference, type(drafter).__name__
        assert out.lossy == (policy.describe(),)
    assert hasten.generate(model, PROMPT, max_new_tokens=2).lossy == ()


def test_a_budget_that_holds_the_prompt_changes_nothing():
    model = tiny_model("llama")
    out = hasten.generate(model, PROMPT, max_new_tokens=NEW, kv_compression=SnapKV(budget=64, window=8))
    assert out.sequences.tolist() == hf_greedy(model, PROMPT, NEW).tolist()


def test_keep_entries_keeps_the_window_and_the_best_in_order():
    keys = torch.arange(20.0).view(1, 1, 20, 1).expand(1, 2, 20, 3).clone()  # each entry holds its position
    cache = DynamicCache()
    cache.update(keys, keys.clone(), 0)
    scores = torch.zeros(2, 18)
    scores[0, [3, 11]] = 1.0
    scores[1, [0, 5]] = 1.0
    kept = keep_entries(cache, {0: scores}, cached=18, budget=6, window=4).layers[0].keys[0, :, :, 0]
    assert kept.tolist() == [[3, 11, 14, 15, 16, 17], [0, 5, 14, 15, 16, 17]]  # entries 18, 19: not the prompt's


def test_attention_scores_follow_the_queries_and_never_look_ahead():
    keys = torch.zeros(1, 10, 4)  # [kv_heads, T, dim]
    keys[0, 2, 0] = 5.0  # what the queries look for
    keys[0, 9, 0] = 9.0  # later than every observed query but the last: seen by that one only
    queries = torch.zeros(2, 2, 4)  # [heads, n, dim]: positions 8 and 9
    queries[..., 0] = 1.0
    scores = attention_scores(queries, keys, cached=8, pool=1)
    assert scores.shape == (1, 8) and int(scores[0].argmax()) == 2
    pooled = attention_scores(queries, keys, cached=8, pool=3)
    assert pooled[0, 1] == pooled[0, 3] == pooled[0, 2]  # neighbours share the peak


def test_specpc_keeps_the_window_and_budget_tokens_in_order():
    draft = tiny_model("llama", seed=9)
    pc = SpecPC(draft, budget=20, window=6, pool=3, lookahead=3)
    short = pc.compress(PROMPT)
    assert short.shape == (1, 20)
    assert short[0, -6:].tolist() == PROMPT[0, -6:].tolist()
    kept = short[0].tolist()
    positions, start = [], 0
    for token in kept[:-6]:  # an ordered subsequence of the prompt's first 54 tokens
        start = PROMPT[0, :54].tolist().index(token, start) + 1
        positions.append(start)
    assert positions == sorted(positions)
    assert pc.compress(PROMPT[:, :15]) is not None and pc.compress(PROMPT[:, :15]).shape == (1, 15)
    out = hasten.generate(tiny_model("llama"), short, drafter=PromptLookup(), max_new_tokens=4)
    assert out.sequences.shape == (1, 24)


def test_query_weights_scale_each_observing_query():
    keys = torch.zeros(1, 10, 2)
    keys[0, 1, 0] = keys[0, 3, 1] = 5.0
    queries = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [1 head, 2 queries, 2]: position 8 seeks key 1, 9 key 3
    plain = attention_scores(queries, keys, cached=8, pool=1)[0]
    assert float(plain[1]) > 0.75 and float(plain[3]) > 0.75
    weighted = attention_scores(queries, keys, cached=8, pool=1, query_weights=torch.tensor([0.0, 1.0]))[0]
    assert weighted[3] == plain[3] and float(weighted[1]) < 0.05  # only the second query still counts


def test_centred_max_pool_of_an_even_kernel_reaches_one_further_after():
    spike = torch.zeros(10)
    spike[5] = 1.0
    assert centred_max_pool(spike, 4).tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]  # entries i-1 .. i+2
    assert centred_max_pool(spike, 3).tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert torch.equal(centred_max_pool(spike, 1), spike)


def test_specpc_selection_by_hand():
    # no pooling, no neighbours: the window (8, 9), then the best others until the budget
    scores = torch.tensor([0, 5, 0, 3, 0, 0, 4, 0, 9, 1.0])
    assert select_positions(scores, budget=5, window=2, pool=1, neighbours=0) == [1, 3, 6, 8, 9]
    # neighbours 4 = offsets 0, -1, 1, 2: the spike at 5 brings 4, 6, 7; the one at 12 brings 11 before the cut
    scores = torch.zeros(20)
    scores[5], scores[12] = 1.0, 0.5
    assert select_positions(scores, budget=8, window=2, pool=1, neighbours=4) == [4, 5, 6, 7, 11, 12, 18, 19]
    # an even pool spreads the spike over 3..6 (ties: earlier first), the cut falls inside it
    scores = torch.zeros(10)
    scores[5] = 1.0
    assert select_positions(scores, budget=4, window=1, pool=4, neighbours=0) == [3, 4, 5, 9]
    # the reference's Llama settings (pool 32, neighbours 32): the spike at 100 pools over 84..115; 84's
    # neighbours (-15..16) are 69..100, then each next pick adds one more token after: 101, 102, ...
    scores = torch.zeros(200)
    scores[100] = 1.0
    assert select_positions(scores, budget=48, window=4, pool=32, neighbours=32) == [*range(69, 113), 196, 197, 198, 199]


def test_specpc_defaults_follow_the_reference_and_start_at_half_depth():
    draft = tiny_model("llama", seed=9)
    pc = SpecPC(draft)
    assert (pc.window, pc.pool, pc.neighbours, pc.lookahead, pc.weighted_query) == (64, 32, 32, 1, True)
    assert pc.first_layer == draft.config.num_hidden_layers // 2
    assert SpecPC(draft, starting_layer=0).first_layer == 0
    with pytest.raises(ValueError, match="starting_layer"):
        SpecPC(draft, starting_layer=draft.config.num_hidden_layers)
    # every layer counting scores at least as high as the top half alone (a max over more layers)
    tokens = PROMPT[0].tolist()
    upper, every = SpecPC(draft, window=6).scores(tokens), SpecPC(draft, window=6, starting_layer=0).scores(tokens)
    assert every.shape == upper.shape == (60,) and (every >= upper).all() and (every > upper).any()


def test_speckv_lookahead_defaults_to_the_answer_length():
    model, draft = tiny_model("llama"), tiny_model("llama", seed=9)
    tokens = PROMPT[0].tolist()
    assert SpecKV(draft=draft, budget=24, window=8).observed(tokens, 5) == [tokens[-1], *draft_lookahead(draft, tokens, 5)]
    caches = []
    for policy, new in ((SpecKV(draft=draft, budget=24, window=8), 5), (SpecKV(draft=draft, budget=24, window=8,
                                                                              lookahead=5), None)):
        adapter = ModelAdapter(model)
        policy.start(adapter, PROMPT, hidden=False, max_new_tokens=new)
        caches.append(torch.cat([layer.keys for layer in adapter.cache.layers]))
    assert torch.equal(*caches)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpecKV(draft=draft, budget=24, window=8).start(ModelAdapter(model), PROMPT, hidden=False)
    # generate() tells the policy the answer's length: the default equals an explicit lookahead of it
    by_default = hasten.generate(model, PROMPT, max_new_tokens=5, eos_token_id=[],
                                 kv_compression=SpecKV(draft=draft, budget=24, window=8))
    explicit = hasten.generate(model, PROMPT, max_new_tokens=5, eos_token_id=[],
                               kv_compression=SpecKV(draft=draft, budget=24, window=8, lookahead=5))
    assert by_default.sequences.tolist() == explicit.sequences.tolist()


def test_lossy_modes_are_refused_unless_asked_for_properly():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="lossy KV policy"):
        hasten.generate(model, PROMPT, max_new_tokens=2, kv_compression="snapkv")
    with pytest.raises(ValueError, match="batch"):
        hasten.generate(model, [PROMPT[0], PROMPT[0, :9]], max_new_tokens=2, kv_compression=SnapKV(budget=24, window=8))
    with pytest.raises(ValueError, match="full-attention"):
        hasten.generate(tiny_model("mistral"), PROMPT, max_new_tokens=2, kv_compression=SnapKV(budget=24, window=8))
    with pytest.raises(ValueError, match="budget"):
        SnapKV(budget=8, window=8)
    with pytest.raises(TypeError, match="draft model"):
        SpecKV(budget=24, window=8)
    with pytest.raises(ValueError, match="vocabulary"):
        hasten.generate(model, PROMPT, max_new_tokens=2,
                        kv_compression=SpecKV(draft=tiny_model("llama", vocab_size=50), budget=24, window=8))
    with pytest.raises(ValueError, match="need the full KV cache"), \
            pytest.warns(hasten.HastenWarning, match="untrained hidden_transfer"):  # a tiny model has no weights
        hasten.generate(model, PROMPT, max_new_tokens=4, drafter=hasten.drafters.create("hidden_transfer"),
                        kv_compression=SnapKV(budget=24, window=8))


def test_kv_compression_refuses_image_inputs():
    with pytest.raises(ValueError, match="pixel_values"):
        hasten.generate(tiny_model("llama"), PROMPT, max_new_tokens=2, kv_compression=SnapKV(budget=24, window=8),
                        pixel_values=torch.zeros(1, 3, 8, 8))
