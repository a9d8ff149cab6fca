"""hasten.dlm: the masked-diffusion sampler and its cache/attention policies on tiny random models
used bidirectionally (Llama and Qwen2)."""
from __future__ import annotations

import pytest
import torch
from helpers import CAUSAL_CONFIGS, SEQ2SEQ_CONFIGS, tiny_model

from hasten.dlm import DKVCache, FastDLLMDual, FastDLLMPrefix, NoCache, SparseD, describe, generate
from hasten.dlm.forward import (ForwardCounts, KVStore, attention_flops_per_pair, context_positions, full_forward,
                                partial_forward)
from hasten.dlm.sparse import block_mass, block_sparse_attention, pick_patterns

MASK = 95
ARCHS = ["llama", "qwen2"]


def prompt(length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, MASK, (1, length), generator=torch.Generator().manual_seed(seed))  # [1, length]


def reference_sampler(model, input_ids, gen_length, block_length, steps, shift=0):
    """An independent, plain LLaDA-style loop: full forward at every step, greedy, low-confidence remasking."""
    length = input_ids.shape[1] + gen_length
    x = torch.full((1, length), MASK)
    x[:, :input_ids.shape[1]] = input_ids
    blocks = gen_length // block_length
    per_block = steps // blocks
    for b in range(blocks):
        start = input_ids.shape[1] + b * block_length
        counts = [block_length // per_block + (i < block_length % per_block) for i in range(per_block)]
        for count in counts:
            logits = model(input_ids=x, attention_mask=torch.zeros(1, 1, length, length)).logits[0]
            if shift:
                logits = torch.cat([logits[:1], logits[:-1]])  # position i read from output i - 1
            pending = (x[0, start:start + block_length] == MASK).nonzero().squeeze(1) + start
            x0 = logits[pending].argmax(-1)
            confidence = torch.softmax(logits[pending], -1).gather(-1, x0[:, None]).squeeze(1)
            chosen = confidence.topk(count).indices
            x[0, pending[chosen]] = x0[chosen]
    return x


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shift", [0, 1])
def test_nocache_matches_a_plain_loop(arch, shift):
    model = tiny_model(arch)
    expected = reference_sampler(model, prompt(), 16, 8, 8, shift)
    for cache in (None, NoCache()):
        out = generate(model, prompt(), mask_token_id=MASK, gen_length=16, block_length=8, steps=8, cache=cache,
                       shifted_logits=bool(shift))
        assert torch.equal(out.sequences, expected)
        assert torch.equal(out.sequences[:, :12], prompt())
        assert (out.sequences != MASK).all()
        assert out.stats.forwards == 8 and out.stats.tokens_recomputed == 8 * 28
        assert out.stats.attention_flops_skipped == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_partial_forward_equals_full_forward_when_cached_kv_are_fresh(arch):
    model = tiny_model(arch)
    tokens = torch.randint(3, MASK, (24,), generator=torch.Generator().manual_seed(1))
    per_pair = attention_flops_per_pair(model.config)
    store, counts = KVStore(24, "cpu"), ForwardCounts()
    with torch.no_grad():
        full = full_forward(model, tokens, torch.arange(24), counts, per_pair, store=store)  # [24, vocab]
        keys_before = [k.clone() for k in store.keys]
        positions = torch.tensor([0, 5, 6, 13, 23])
        partial = partial_forward(model, tokens, positions, positions[1:4], store, counts, per_pair)
    torch.testing.assert_close(partial, full[positions[1:4]], atol=1e-5, rtol=1e-5)
    for before, after in zip(keys_before, store.keys):  # re-running fresh positions rewrites the same K/V
        torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert counts.tokens_recomputed == 24 + 5
    assert counts.attention_flops == per_pair * (24 * 24 + 5 * 24)


def two_blocks_of_8(model):
    """cache -> the generation of 16 tokens after a 16-token prompt, in 2 blocks of 8, 16 steps."""
    return lambda cache, remasking="low_confidence": generate(model, prompt(16), mask_token_id=MASK, gen_length=16,
                                                              block_length=8, steps=16, cache=cache,
                                                              remasking=remasking)


@pytest.mark.parametrize("arch", ARCHS)
def test_dkv_cache_runs_fewer_tokens_and_reloading_every_step_is_exact(arch):
    model = tiny_model(arch)
    run = two_blocks_of_8(model)
    reference = run(NoCache())
    assert torch.equal(run(DKVCache(cache_reloading_step=1)).sequences, reference.sequences)
    for cache, remasking in ((DKVCache(), "low_confidence"), (DKVCache(variant="prefill"), "low_confidence"),
                             (DKVCache(variant="greedy"), "random_order")):
        out = run(cache, remasking)
        assert out.stats.forwards == reference.stats.forwards == 16
        assert out.stats.tokens_recomputed < reference.stats.tokens_recomputed
        assert out.stats.attention_flops_skipped > 0
        assert (out.sequences != MASK).all()
    # decode, the reference's schedule: each block's steps 0 and 1 run all 32 positions; its steps 2-7 every
    # masked position (block 0: 16 - s, block 1: 8 - s) and the token decoded the step before
    decode = run(DKVCache())
    assert decode.stats.tokens_recomputed == 4 * 32 + sum(16 - s + 1 for s in range(2, 8)) \
        + sum(8 - s + 1 for s in range(2, 8))
    # hasten's whole-generation schedule without reloading: only the generation's first step in full
    once = run(DKVCache(schedule="whole_generation", cache_reloading_step=None))
    assert once.stats.tokens_recomputed == 32 + sum(16 - s + 1 for s in range(1, 16))


@pytest.mark.parametrize("arch", ARCHS)
def test_dkv_cache_fresh_before_block_recomputes_the_neighbourhood_and_at_its_extreme_is_nocache(arch):
    model = tiny_model(arch)
    run = two_blocks_of_8(model)
    reference = run(NoCache())
    # reaching back to position 0 from the last block's start (24), every position runs at every step:
    # NoCache's work and output
    everything = run(DKVCache(fresh_before_block=24))
    assert torch.equal(everything.sequences, reference.sequences)
    assert everything.stats.tokens_recomputed == reference.stats.tokens_recomputed == 16 * 32
    # 8 back: each block's steps 0-1 run all 32; block 0's steps 2-7 run prompt positions 8-15, the block's
    # decoded tokens and every masked position (8 + s + 16 - s = 24); block 1's steps 2-7 run positions 16-31
    near = run(DKVCache(fresh_before_block=8))
    assert near.stats.tokens_recomputed == 4 * 32 + 6 * 24 + 6 * 16
    assert (near.sequences != MASK).all()
    # None is the reference's rule
    assert run(DKVCache(fresh_before_block=None)).stats.tokens_recomputed == run(DKVCache()).stats.tokens_recomputed


def test_fast_dllm_caches_count_exactly():
    model = tiny_model("llama")
    run = lambda cache: generate(model, prompt(16), mask_token_id=MASK, gen_length=16, block_length=8,  # noqa: E731
                                 steps=8, cache=cache, shifted_logits=False)
    # 2 blocks x 4 steps; a full forward (32 positions) opens each block
    prefix = run(FastDLLMPrefix())
    assert prefix.stats.tokens_recomputed == 2 * 32 + 3 * (32 - 16) + 3 * (32 - 24)
    dual = run(FastDLLMDual())
    assert dual.stats.tokens_recomputed == 2 * 32 + 6 * 8
    assert (prefix.sequences != MASK).all() and (dual.sequences != MASK).all()


@pytest.mark.parametrize("block", [4, 5, 7])
def test_block_sparse_attention_keeping_every_block_is_full_attention(block):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(4, 30, 8, generator=g)  # [heads, length, dim]
    key, value = torch.randn(2, 30, 8, generator=g), torch.randn(2, 30, 8, generator=g)  # [kv_heads, length, dim]
    full_keys, full_values = key.repeat_interleave(2, 0), value.repeat_interleave(2, 0)
    probs = torch.softmax(query @ full_keys.transpose(1, 2) * 0.3, -1)  # [4, 30, 30]
    pattern = pick_patterns(probs, block, 1.0)
    torch.testing.assert_close(block_sparse_attention(query, key, value, pattern, block, 0.3), probs @ full_values)


@pytest.mark.parametrize("arch", ARCHS)
def test_sparsed_with_select_one_equals_full_attention(arch):
    model = tiny_model(arch)
    run = lambda cache: generate(model, prompt(20), mask_token_id=MASK, gen_length=16, block_length=8,  # noqa: E731
                                 steps=8, cache=cache)
    reference = run(NoCache())
    dense = run(SparseD(skip=0.25, select=1.0, block=6))
    assert torch.equal(dense.sequences, reference.sequences)
    sparse = run(SparseD(skip=0.25, select=0.4, block=6))
    assert sparse.stats.attention_flops_skipped > 0 and (sparse.sequences != MASK).all()
    assert model.config._attn_implementation == "sdpa"  # put back after the generation


def tiny_stablelm(vocab: int = 96):
    """A StableLM-family model: its decoder layers do not pass the forward's keyword arguments on
    to their attention."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.StableLmConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def test_sparsed_on_stablelm_as_reported():
    """The report's case (issue 44): a random StableLM, vocabulary 61, a 40-token prompt. It ended in
    ZeroDivisionError (no pattern recorded); at full selection it is full attention."""
    model = tiny_stablelm(61)
    ids = torch.randint(0, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    run = lambda cache: generate(model, ids, cache=cache, mask_token_id=60, gen_length=32, block_length=8,  # noqa: E731
                                 steps=16)
    assert torch.equal(run(SparseD(select=1.0)).sequences, run(None).sequences)


SPARSED_ARCHS = sorted(CAUSAL_CONFIGS) + ["stablelm"]


def causal_model(arch: str):
    return tiny_stablelm() if arch == "stablelm" else tiny_model(arch)


@pytest.mark.parametrize("arch", SPARSED_ARCHS)
def test_sparsed_routes_the_attention_of_every_tested_causal_architecture(arch):
    """Every causal architecture of the greedy-equality tests (and StableLM): full selection is full
    attention, and a partial one computes fewer attention pairs."""
    model = causal_model(arch)
    run = lambda cache: generate(model, prompt(20), mask_token_id=MASK, gen_length=16, block_length=8,  # noqa: E731
                                 steps=8, cache=cache)
    assert torch.equal(run(SparseD(skip=0.25, select=1.0, block=6)).sequences, run(None).sequences)
    assert run(SparseD(skip=0.25, select=0.4, block=6)).stats.attention_flops_skipped > 0


@pytest.mark.parametrize("arch", sorted(SEQ2SEQ_CONFIGS))
def test_encoder_decoders_are_refused_in_one_line_before_any_forward(arch):
    model = tiny_model(arch)
    model.register_forward_pre_hook(lambda *_: pytest.fail("a forward ran"))
    for cache in (None, SparseD(select=1.0)):
        with pytest.raises(ValueError, match=f"causal LM bidirectionally; {type(model).__name__} is an encoder-"):
            generate(model, prompt(20), mask_token_id=MASK, gen_length=16, block_length=8, steps=8, cache=cache)


def test_sparsed_refuses_a_model_whose_attention_it_cannot_route_before_the_first_step(monkeypatch):
    """A model whose attention does not go through transformers' AttentionInterface (here: one that
    cannot switch its implementation) would run full attention and pick no pattern."""
    model = tiny_model("llama")
    monkeypatch.setattr(type(model), "_can_set_attn_implementation", classmethod(lambda cls: False))
    steps = []
    monkeypatch.setattr(SparseD, "start", lambda self, *a, _start=SparseD.start: steps.append("start") or _start(
        self, *a))
    with pytest.raises(ValueError, match=r"SparseD cannot route the attention of LlamaForCausalLM: .* \(reached in "
                                         r"layers \[\] of 2\)") as err:
        generate(model, prompt(20), mask_token_id=MASK, gen_length=16, block_length=8, steps=8,
                 cache=SparseD(select=1.0))
    assert "\n" not in str(err.value) and steps == ["start"]
    assert model.config._attn_implementation == "sdpa"


def test_partial_block_sparse_attention_equals_the_full_one_at_its_rows():
    # A partial forward sees a subset of queries and the keys in cache order (context, then queries).
    g = torch.Generator().manual_seed(1)
    query = torch.randn(4, 30, 8, generator=g)  # [heads, length, dim]
    key, value = torch.randn(2, 30, 8, generator=g), torch.randn(2, 30, 8, generator=g)  # [kv_heads, length, dim]
    probs = torch.softmax(query @ key.repeat_interleave(2, 0).transpose(1, 2) * 0.3, -1)  # [4, 30, 30]
    pattern = pick_patterns(probs, 7, 0.5, 3)  # [4, 5, 5] bool, rows of 3 to 5 kept blocks
    full = block_sparse_attention(query, key, value, pattern, 7, 0.3)  # [4, 30, 8]
    rows = torch.tensor([2, 3, 9, 20, 29])
    order = torch.cat([context_positions(rows, 30), rows])  # [30] key positions as the partial forward sees them
    partial = block_sparse_attention(query[:, rows], key[:, order], value[:, order], pattern, 7, 0.3, rows, order)
    torch.testing.assert_close(partial, full[:, rows])
    # the mass of a partial select counts only the rows that ran, each key in its own position's block
    only_rows = torch.zeros_like(probs)
    only_rows[:, rows] = probs[:, rows]
    torch.testing.assert_close(block_mass(probs[:, rows][:, :, order], 7, rows, order), block_mass(only_rows, 7))


CACHES = [DKVCache(), DKVCache(variant="prefill"), DKVCache(variant="greedy", cache_reloading_step=4),
          DKVCache(fresh_before_block=4), DKVCache(schedule="whole_generation"), FastDLLMPrefix(), FastDLLMDual()]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", CACHES, ids=describe)
def test_sparsed_on_a_cache_with_select_one_equals_the_cache_alone(arch, cache):
    model = tiny_model(arch)
    remasking = "random_order" if getattr(cache, "variant", None) == "greedy" else "low_confidence"
    run = lambda policy: generate(model, prompt(20), mask_token_id=MASK, gen_length=16, block_length=8,  # noqa: E731
                                  steps=16, cache=policy, remasking=remasking, generator=torch.Generator())
    alone = run(cache)
    dense = run(SparseD(skip=0.25, select=1.0, block=6, cache=cache))
    assert torch.equal(dense.sequences, alone.sequences)
    for name in ("forwards", "tokens_recomputed", "attention_flops", "attention_flops_skipped"):
        assert getattr(dense.stats, name) == getattr(alone.stats, name), name
    sparse = run(SparseD(skip=0.25, select=0.4, block=6, cache=cache))
    assert sparse.stats.forwards == alone.stats.forwards  # (which positions run can follow the decoded tokens)
    assert sparse.stats.attention_flops_skipped > alone.stats.attention_flops_skipped
    assert (sparse.sequences != MASK).all()
    assert model.config._attn_implementation == "sdpa"  # put back after the generation


def test_sparsed_counts_follow_the_rule_alone_and_on_the_dual_cache(monkeypatch):
    from hasten.dlm import sparse

    picked = []  # every pattern pick, in call order (one per layer and choosing forward)
    pick = sparse.pick_patterns
    monkeypatch.setattr(sparse, "pick_patterns", lambda *args: picked.append(pick(*args)) or picked[-1])
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    per_pair = attention_flops_per_pair(model.config)
    run = lambda policy: generate(model, prompt(16), mask_token_id=MASK, gen_length=16, block_length=8,  # noqa: E731
                                  steps=8, cache=policy).stats
    # 32 positions in 4 query blocks of 8, key blocks 0-1 prompt, 2-3 generated; skip 0.25 of 8 steps chooses
    # at step int(2) + 1 = 3: steps 0-3 dense (step 3 picks), 4-7 sparse, keeping the picked blocks of 4
    alone = run(SparseD(skip=0.25, select=0.5, block=8))
    fraction = sum(float(p.sum(-1).float().mean()) / 4 for p in picked) / layers  # p: [heads, 4, 4] per layer
    assert len(picked) == layers
    assert all(bool(p[..., 2:].sum(-1).ge(1).all()) for p in picked)  # every row keeps a generated block
    assert alone.attention_flops == pytest.approx(per_pair * 32 * 32 * (4 + 4 * fraction), abs=4)
    picked.clear()
    dual = run(SparseD(skip=0.25, select=0.5, block=8, cache=FastDLLMDual()))
    # block 0 (positions 16-23, query block 2): full forward, then 3 forwards of its 8 positions, dense up to
    # step 3, which picks query block 2; step 4, block 1's full forward, meets query blocks 0, 1 and 3 for the
    # first time (dense, picks them); steps 5-7 run query block 3 (positions 24-31) sparse
    assert len(picked) == 2 * layers
    fraction = sum(float(p[:, 3].sum(-1).float().mean()) / 4 for p in picked[layers:]) / layers
    assert dual.attention_flops == pytest.approx(per_pair * (32 * 32 + 3 * 8 * 32 + 32 * 32 + 3 * 8 * 32 * fraction),
                                                 abs=4)
    assert dual.tokens_recomputed == run(FastDLLMDual()).tokens_recomputed == 2 * 32 + 6 * 8


def test_threshold_decodes_confident_tokens_in_parallel():
    model = tiny_model("llama")
    run = lambda threshold: generate(model, prompt(), mask_token_id=MASK, gen_length=16, block_length=8,  # noqa: E731
                                     steps=16, threshold=threshold)
    assert run(1e-9).stats.steps == 2  # everything passes: one step per block
    assert torch.equal(run(1.0).sequences, run(None).sequences)  # nothing passes: the schedule alone


def test_sampling_and_random_remasking_are_reproducible_and_cache_independent():
    model = tiny_model("qwen2")
    run = lambda cache, **kw: generate(model, prompt(), mask_token_id=MASK, gen_length=8, block_length=4,  # noqa: E731
                                       steps=8, cache=cache, generator=torch.Generator().manual_seed(3), **kw)
    for kw in ({"temperature": 1.0}, {"remasking": "random"}, {"remasking": "random_order"}):
        first = run(None, **kw).sequences
        assert torch.equal(first, run(None, **kw).sequences)
        assert torch.equal(first, run(DKVCache(cache_reloading_step=1), **kw).sequences)


def test_mask_token_comes_from_the_config():
    model = tiny_model("llama", mask_token_id=MASK)
    out = generate(model, prompt(), gen_length=4, block_length=4, steps=4)
    assert torch.equal(out.sequences, generate(model, prompt(), mask_token_id=MASK, gen_length=4, block_length=4,
                                               steps=4).sequences)


@pytest.mark.parametrize("kwargs, word", [
    ({"gen_length": 8, "block_length": 4, "steps": 4}, "mask_token_id"),
    ({"mask_token_id": MASK, "gen_length": 10, "block_length": 4, "steps": 4}, "block_length"),
    ({"mask_token_id": MASK, "gen_length": 8, "block_length": 2, "steps": 3}, "steps"),
    ({"mask_token_id": MASK, "gen_length": 8, "block_length": 4, "steps": 4, "remasking": "lowest"}, "remasking"),
    ({"mask_token_id": MASK, "gen_length": 8, "block_length": 4, "steps": 4, "threshold": 1.5}, "threshold"),
])
def test_errors_name_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        generate(tiny_model("llama"), prompt(), **kwargs)


def test_policy_settings_are_checked():
    with pytest.raises(ValueError, match="variant"):
        DKVCache(variant="lazy")
    with pytest.raises(ValueError, match="schedule"):
        DKVCache(schedule="never")
    with pytest.raises(ValueError, match="cache_reloading_step"):
        DKVCache(cache_reloading_step=0)
    with pytest.raises(ValueError, match="fresh_before_block"):
        DKVCache(fresh_before_block=-1)
    with pytest.raises(ValueError, match="fresh_before_block"):
        DKVCache(fresh_before_block=True)
    assert describe(DKVCache()) == "DKVCache(variant=decode, cache_reloading_step=8, window=4, schedule=reference)"
    assert describe(DKVCache(cache_reloading_step=None, fresh_before_block=16)) == \
        "DKVCache(variant=decode, cache_reloading_step=None, window=4, schedule=reference, fresh_before_block=16)"
    assert "fresh_before_block" not in describe(DKVCache())  # a knob off by default is left out
    with pytest.raises(ValueError, match="select"):
        SparseD(select=0.0)
    with pytest.raises(ValueError, match="block"):
        SparseD(block=True)
    with pytest.raises(ValueError, match="selection"):
        SparseD(selection="top")
    with pytest.raises(ValueError, match="cache"):
        SparseD(cache=SparseD())
    assert describe(SparseD(cache=FastDLLMDual())) == "SparseD(skip=0.2, selection=isolated, cache=FastDLLMDual())"
    assert describe(SparseD(select=0.3, block=32)) == "SparseD(skip=0.2, select=0.3, block=32, selection=isolated)"
    with pytest.raises(ValueError, match="threshold"):
        generate(tiny_model("llama"), prompt(), mask_token_id=MASK, gen_length=4, block_length=4, steps=4,
                 remasking="random_order", threshold=0.5)


@pytest.mark.parametrize("body, parses", [("\n    return 1\n", 1.0), ("\n    return (\n", 0.0)])
def test_bench_compares_every_setting_with_nocache_on_the_same_prompts(tmp_path, body, parses):
    from hasten.dlm import bench

    model, judge = tiny_model("llama", mask_token_id=MASK), tiny_model("qwen2")
    tasks = [{"file": "x.py", "prompt": prompt(10, seed), "reference": prompt(8, seed + 9)[0],
              "head": "def f():\n    \"\"\"One.\"\"\"", "reference_text": "\n    return 1"} for seed in (0, 1)]
    settings = [bench.Setting(NoCache()), bench.Setting(FastDLLMDual()), bench.Setting(NoCache(), threshold=1e-9),
                bench.Setting(SparseD(skip=0.0, select=0.5, block=4, cache=FastDLLMDual()))]
    decode = lambda ids: body + "def g():\n"  # noqa: E731  (every completion reads the same; the next def ends it)
    section = bench.run_settings(model, judge, tasks, settings, gen_length=8, block_length=4, steps=8, decode=decode,
                                 progress=False)
    nocache, dual, parallel, sparse_dual = section["results"]
    assert nocache["agreement"] == 1.0 and nocache["token_forward_ratio"] == 1.0
    assert dual["token_forward_ratio"] < 1.0
    assert sparse_dual["token_forward_ratio"] == dual["token_forward_ratio"]
    assert sparse_dual["attention_flops_skipped_fraction"] > dual["attention_flops_skipped_fraction"]
    assert parallel["steps"] == 2 * 2 and nocache["steps"] == 2 * 8  # one step per block when everything passes
    assert 0.0 <= dual["agreement"] <= 1.0 and nocache["judge_nll"] > 0
    for result in section["results"]:  # the task metrics read the decoded completion, for every setting
        assert result["parses"] == parses and result["exact"] == parses
        assert 0.0 <= result["reference_match"] <= 1.0
    report = {"main": section}
    assert "FastDLLMDual()" in bench.markdown(report) and "threshold 1e-09" in bench.markdown(report)
    bench.chart(report, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 0
