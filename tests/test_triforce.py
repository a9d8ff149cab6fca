"""TriForce (drafters/triforce.py): greedy output equals the plain model's with prompts longer
than the retrieval budget and the small model's window (so the sparse and streaming paths
are used), two levels of speculative sampling keep the target's law, the retrieval cache
keeps what it says, and bad settings or targets are refused."""
import pytest
import torch
from transformers.cache_utils import DynamicCache

import hasten
from hasten.drafters import TriForce
from hasten.drafters.triforce import retrieval_cache
from helpers import CAUSAL_CONFIGS, hf_greedy, repetitive_prompt, tiny_model
from test_sampling_distribution import DEEP_LAW_SAMPLING, PROMPT, TARGET, bound, exact_law, peaky_model

FULL_ATTENTION = sorted(arch for arch in CAUSAL_CONFIGS if arch != "mistral")  # mistral: sliding window
NEW = 24
SMALL = dict(budget=16, chunk_size=4, gamma=5, small_gamma=2, sinks=2, window=8)


@pytest.mark.parametrize("arch", FULL_ATTENTION)
def test_greedy_equals_hf_with_sparse_middle_and_streaming_small_model(arch):
    model = tiny_model(arch)
    small = tiny_model(arch, seed=7)
    prompt = repetitive_prompt(48, seed=3)  # 47 cached tokens > budget 16 > window 8
    reference = hf_greedy(model, prompt, NEW)
    drafter = TriForce(small, **SMALL)
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.drafted_tokens > 0
    # the small model is the target itself: the middle level still differs (sparse), the output never
    self_draft = hasten.generate(model, prompt, drafter=TriForce(model, **SMALL), max_new_tokens=NEW)
    assert self_draft.sequences.tolist() == reference.tolist()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_refreshed_selection_keeps_greedy_output_and_really_changes(arch):
    """refresh=N re-chooses the prompt's chunks every N steps from the loop's full cache: the
    output stays the target's, and the middle level's cache really is rebuilt (a new object
    whose prompt part is a fresh selection) while the generated entries stay."""
    model, small = tiny_model(arch), tiny_model(arch, seed=7)
    prompt = repetitive_prompt(48, seed=3)
    reference = hf_greedy(model, prompt, NEW)
    drafter = TriForce(small, **SMALL, refresh=2)
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()

    from hasten.drafters.base import DraftContext, TargetView
    from hasten.core.sampling import Sampling
    from hasten.engine.verify import GreedyAcceptance
    from hasten.models.adapter import ModelAdapter

    target = ModelAdapter(model)
    tokens = reference[0, :60].tolist()  # 12 tokens past the prompt's 48
    target.start(torch.tensor([tokens]))  # caches all but the root
    view = TargetView(target, TriForce.needs)
    ctx = DraftContext(tokens=tokens, max_depth=5, sampling=Sampling(), generator=None, target=view,
                       acceptance=GreedyAcceptance())
    ctx.state = drafter.begin(DraftContext(tokens=tokens[:48], max_depth=5, sampling=Sampling(), generator=None,
                                           target=TargetView(target, TriForce.needs), acceptance=GreedyAcceptance()))
    before = ctx.state.middle
    before.forward(tokens[47:59])  # the generated tokens' entries, as drafting rounds would feed them
    after = drafter._refreshed(ctx, before)
    assert after is not before and after.prompt == 47 and after.fed == tokens[47:59]
    for old, new in zip(before.cache.layers, after.cache.layers):
        assert new.keys.shape == old.keys.shape  # same budget, same generated entries
        assert torch.equal(new.keys[:, :, after.selected:], old.keys[:, :, before.selected:])
        assert torch.allclose(new.keys[:, :, :4], old.keys[:, :, :4], atol=1e-5)  # the first chunk always stays
    assert any(not torch.allclose(new.keys[:, :, : after.selected], old.keys[:, :, : before.selected], atol=1e-4)
               for old, new in zip(before.cache.layers, after.cache.layers))  # another query, another choice
    with pytest.raises(ValueError, match="refresh"):
        hasten.generate(model, [prompt[0], prompt[0, :20]], drafter=drafter, max_new_tokens=4)


def test_begin_selects_from_the_loops_cache_and_leaves_it_as_it_was():
    """One sequence: the retrieval cache is chosen from the loop's own cache (no second
    prefill) with one root forward that is cropped away: the loop's entries are untouched,
    and the middle level holds a selection within the budget."""
    from hasten.core.sampling import Sampling
    from hasten.drafters.base import DraftContext, TargetView
    from hasten.engine.verify import GreedyAcceptance
    from hasten.models.adapter import ModelAdapter

    model, small = tiny_model("llama"), tiny_model("llama", seed=7)
    tokens = repetitive_prompt(48, seed=3)[0].tolist()
    target = ModelAdapter(model)
    target.start(torch.tensor([tokens]))  # caches all but the root
    before = [(layer.keys.clone(), layer.values.clone()) for layer in target.cache.layers]
    prefills = []
    real_forward = model.forward
    model.forward = lambda *a, **k: prefills.append(k["input_ids"].shape[1]) or real_forward(*a, **k)
    state = TriForce(small, **SMALL).begin(DraftContext(tokens=tokens, max_depth=5, sampling=Sampling(),
                                                        generator=None, target=TargetView(target, TriForce.needs),
                                                        acceptance=GreedyAcceptance()))
    del model.forward
    assert prefills == [1]  # the root alone, no prompt-long prefill
    assert target.cache_length == 47
    for (keys, values), layer in zip(before, target.cache.layers):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    # 47 entries in chunks of 4: the first chunk, the latest 3 and the best 2 whole chunks fit in 16
    assert state.middle.selected == 4 + 2 * 4 + 3 and state.middle.prompt == 47


def test_batched_rows_equal_hf_greedy():
    model, small = tiny_model("llama"), tiny_model("llama", seed=7)
    prompts = [repetitive_prompt(40, seed=1)[0], repetitive_prompt(12, seed=2)[0]]
    references = [hf_greedy(model, p[None], NEW)[0].tolist() for p in prompts]
    out = hasten.generate(model, prompts, drafter=TriForce(small, **SMALL), max_new_tokens=NEW)
    assert [s.tolist() for s in out.sequences] == references


def test_two_levels_of_speculative_sampling_keep_the_target_law():
    """Small model -> retrieval-cache target -> full target, 3 deep: the first 3 tokens'
    law matches the target's (the prompt is longer than a budget of 2 chunks of 1)."""
    drafter = TriForce(peaky_model(5), budget=2, chunk_size=1, gamma=3, small_gamma=2, sinks=1, window=2)
    law = exact_law(TARGET, DEEP_LAW_SAMPLING, 3)
    counts = dict.fromkeys(law, 0)
    g = torch.Generator().manual_seed(5)
    samples = 800  # 27 outcomes; each sample runs about a dozen small forwards
    for _ in range(samples):
        out = hasten.generate(TARGET, PROMPT, drafter=drafter, max_new_tokens=4, temperature=1.0, top_k=3, generator=g)
        counts[tuple(out.sequences[0, PROMPT.shape[1]:][:3].tolist())] += 1
    tv = 0.5 * sum(abs(counts[k] / samples - law[k]) for k in law)
    assert tv < bound(law, samples), f"TV {tv:.3f} >= bound {bound(law, samples):.3f}"


def test_retrieval_cache_keeps_first_latest_and_best_chunks():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 30, 4)  # [1, kv_heads, T, head_dim]
    values = torch.arange(30.0).view(1, 1, 30, 1).expand(1, 2, 30, 4).clone()  # each entry holds its position
    query = torch.zeros(4, 4)  # [heads, head_dim]: heads 0, 1 share KV head 0
    query[:, 0] = 1.0
    keys[:, :, 12:16, 0] += 50.0  # chunk 3 is the one the query looks for, in both KV heads
    full = DynamicCache()
    full.update(keys, values, 0)
    picked = retrieval_cache(full, {0: query[:, None]}, budget=14, chunk_size=4)  # one captured position
    kept = picked.layers[0].values[0, :, :, 0]  # [kv_heads, kept] positions
    assert kept.shape == (2, 14)  # first chunk + 2 middle chunks + the latest 2 tokens (30 = 7 * 4 + 2)
    for head in range(2):
        positions = kept[head].tolist()
        assert positions == sorted(positions)
        assert positions[:4] == [0, 1, 2, 3] and positions[-2:] == [28, 29]
        assert {12, 13, 14, 15} <= set(positions)
    ranked = retrieval_cache(full, {0: query[:, None]}, budget=14, chunk_size=4, ranked=True)
    for head in range(2):  # the first chunk, the latest, then the best chunk first (the reference's order)
        positions = ranked.layers[0].values[0, head, :, 0].tolist()
        assert positions[:6] == [0, 1, 2, 3, 28, 29] and positions[6:10] == [12, 13, 14, 15]
        assert sorted(positions) == kept[head].tolist()  # the same entries
    short = DynamicCache()
    short.update(keys[:, :, :10], values[:, :, :10], 0)
    assert torch.equal(retrieval_cache(short, {0: query[:, None]}, 14, 4).layers[0].keys, keys[:, :, :10])


def test_bad_settings_and_targets_are_refused():
    small = tiny_model("llama", seed=7)
    with pytest.raises(ValueError, match="budget"):
        TriForce(small, budget=8, chunk_size=8)
    with pytest.raises(ValueError, match="gamma"):
        TriForce(small, gamma=0)
    with pytest.raises(ValueError, match="refresh"):
        TriForce(small, refresh=-1)
    with pytest.raises(ValueError, match="sliding-window"):
        hasten.generate(tiny_model("mistral"), repetitive_prompt(10), drafter=TriForce(small), max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        hasten.generate(tiny_model("llama"), repetitive_prompt(10), drafter=TriForce(tiny_model("llama", vocab_size=50)),
                        max_new_tokens=2)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        TriForce("zoo:code-tiny-draft")


@pytest.mark.parametrize("copy", [True, False])
def test_middle_level_holds_the_full_caches_exact_entries_of_committed_tokens(copy):
    """copy_generated (the reference's rule): before a step the middle level's entries of the
    committed generated tokens are the full cache's own, bit for bit, after the selection;
    without it they are the middle level's, computed over its sparse cache, which differ."""
    from hasten.core.sampling import Sampling
    from hasten.drafters.base import DraftContext, TargetView
    from hasten.engine.verify import GreedyAcceptance
    from hasten.models.adapter import ModelAdapter

    model, small = tiny_model("llama"), tiny_model("llama", seed=7)
    tokens = hf_greedy(model, repetitive_prompt(48, seed=3), 12)[0].tolist()  # 12 tokens past the prompt's 48
    drafter = TriForce(small, **SMALL, copy_generated=copy)
    target = ModelAdapter(model)

    def context(length):
        return DraftContext(tokens=tokens[:length], max_depth=5, sampling=Sampling(), generator=None,
                            target=TargetView(target, TriForce.needs), acceptance=GreedyAcceptance())

    target.start(torch.tensor([tokens[:48]]))
    state = drafter.begin(context(48))
    state.middle.forward(tokens[47:59])  # the generated tokens' entries, as drafting rounds would feed them
    target.start(torch.tensor([tokens]))  # the loop's full cache: the 59 committed tokens
    ctx = context(60)
    ctx.state = state
    drafter.propose(ctx)
    middle = state.middle
    assert middle.fed[:12] == tokens[47:59]
    for layer, full in zip(middle.cache.layers, target.cache.layers):
        mine, exact = layer.keys[:, :, middle.selected: middle.selected + 12], full.keys[:, :, 47:59]
        assert torch.equal(mine, exact) == copy
    assert (middle.exact == 12) == copy


def test_fixed_size_lets_generated_tokens_take_the_lowest_scored_places():
    """fixed_size (the default, the reference's retrieval cache of constant size): the selection (15 of
    the 47 prompt entries under a budget of 16) and the 12 copied generated entries hold 16
    entries together, so only the first chunk is left of the selection; the output stays the
    target's."""
    from hasten.core.sampling import Sampling
    from hasten.drafters.base import DraftContext, TargetView
    from hasten.engine.verify import GreedyAcceptance
    from hasten.models.adapter import ModelAdapter

    model, small = tiny_model("llama"), tiny_model("llama", seed=7)
    prompt = repetitive_prompt(48, seed=3)
    reference = hf_greedy(model, prompt, NEW)
    drafter = TriForce(small, **SMALL)
    assert hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW).sequences.tolist() == reference.tolist()

    tokens, target = reference[0, :60].tolist(), ModelAdapter(model)

    def context(length):
        return DraftContext(tokens=tokens[:length], max_depth=5, sampling=Sampling(), generator=None,
                            target=TargetView(target, TriForce.needs), acceptance=GreedyAcceptance())

    target.start(torch.tensor([tokens[:48]]))
    state = drafter.begin(context(48))
    assert state.middle.selected == 15
    target.start(torch.tensor([tokens[:51]]))  # 3 generated tokens committed: 15 + 3 > 16, one selected entry goes
    ctx = context(52)
    ctx.state = state
    state.middle.copy_committed(target.read_all_kv(), tokens[47:50])
    assert state.middle.selected == 13 and state.middle.cache.layers[0].keys.shape[2] == 16
    target.start(torch.tensor([tokens]))  # 12 committed: the first chunk is all that is left of the selection
    ctx = context(60)
    ctx.state = state
    drafter.propose(ctx)
    middle = state.middle
    assert middle.selected == 4 and middle.fed[:12] == tokens[47:59]
    for layer, full in zip(middle.cache.layers, target.cache.layers):
        assert torch.equal(layer.keys[:, :, :4], full.keys[:, :, :4])  # the first chunk
        assert torch.equal(layer.keys[:, :, 4:16], full.keys[:, :, 47:59])  # the generated tokens' exact entries
    whole = TriForce(small, **SMALL, fixed_size=False)  # the selection kept whole: 15 + 12 entries
    target.start(torch.tensor([tokens[:48]]))
    state = whole.begin(context(48))
    target.start(torch.tensor([tokens]))
    ctx = context(60)
    ctx.state = state
    whole.propose(ctx)
    assert state.middle.selected == 15 and state.middle.exact == 12
