"""The reference rules of hasten.dlm on hand-worked cases: which positions dKV-Cache recomputes at each
step of a block (decode and greedy, against tables written by hand), and which key blocks a SparseD
step selects from a hand-made attention tile (isolated selection: prompt part and generated part)."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from hasten.dlm import DKVCache, SparseD, generate, policies, sampler
from hasten.dlm.policies import add_window
from hasten.dlm.sparse import generated_split, kept_blocks, pick_patterns

MASK = 95
FULL = "full"


def record_forwards(monkeypatch) -> list:
    """Every forward of a cache policy from now on: FULL, or the sorted positions a partial forward runs."""
    seen = []
    full, partial = policies.full_forward, policies.partial_forward

    def full_spy(model, tokens, *args, **kwargs):
        seen.append(FULL)
        return full(model, tokens, *args, **kwargs)

    def partial_spy(model, tokens, positions, *args, **kwargs):
        seen.append(positions.tolist())
        return partial(model, tokens, positions, *args, **kwargs)
    monkeypatch.setattr(policies, "full_forward", full_spy)
    monkeypatch.setattr(policies, "partial_forward", partial_spy)
    return seen


def run(cache, remasking: str) -> torch.Tensor:
    """4 prompt tokens (positions 0-3), 12 generated in 2 blocks of 6 (4-9, 10-15), 12 steps: one token a step."""
    model = tiny_model("llama")
    ids = torch.randint(3, MASK, (1, 4), generator=torch.Generator().manual_seed(0))
    return generate(model, ids, mask_token_id=MASK, gen_length=12, block_length=6, steps=12, cache=cache,
                    remasking=remasking, shifted_logits=False).sequences


@pytest.fixture
def left_to_right(monkeypatch):
    """A remasking rule that decodes the leftmost masked position of the block first (positions are
    ascending, so a falling confidence), so that step s decodes position 4 + s."""
    monkeypatch.setitem(sampler.REMASKING, "left_to_right",
                        lambda probs, generator: torch.arange(len(probs), 0, -1, dtype=torch.float32))
    return "left_to_right"


def span(first: int) -> list[int]:
    return list(range(first, 16))


def test_dkv_decode_reference_schedule(monkeypatch, left_to_right):
    seen = record_forwards(monkeypatch)
    run(DKVCache(cache_reloading_step=4), left_to_right)
    # each block: steps 0 and 1 full (the reference's step without a cache and the one building it), then a
    # full forward at block step 4 (a multiple of cache_reloading_step); a cached step runs the masked
    # positions and the one decoded at the step before (step s decodes 4 + s)
    assert seen == [FULL, FULL, span(5), span(6), FULL, span(8),  # block 0 (positions 4-9)
                    FULL, FULL, span(11), span(12), FULL, [14, 15]]  # block 1 (10-15): a fresh cache


def test_dkv_decode_hastens_whole_generation_schedule(monkeypatch, left_to_right):
    seen = record_forwards(monkeypatch)
    run(DKVCache(cache_reloading_step=None, schedule="whole_generation"), left_to_right)
    assert seen == [FULL] + [span(3 + step) for step in range(1, 12)]  # one cache, never reloaded
    seen.clear()
    run(DKVCache(cache_reloading_step=4, schedule="whole_generation"), left_to_right)
    assert seen == [FULL if step % 4 == 0 else span(3 + step) for step in range(12)]  # counted over the generation


def test_dkv_decode_fresh_before_block(monkeypatch, left_to_right):
    seen = record_forwards(monkeypatch)
    run(DKVCache(cache_reloading_step=4, fresh_before_block=2), left_to_right)
    # hasten's addition also runs every unmasked position from 2 before the block to its end: block 0 from
    # position 2 (prompt 2-3 and the block's decoded tokens), block 1 from 8 (block 0's last two, 8-9)
    assert seen == [FULL, FULL, span(2), span(2), FULL, span(2),
                    FULL, FULL, span(8), span(8), FULL, span(8)]


def test_dkv_greedy_reference_rule(monkeypatch):
    orders = iter([torch.tensor([6, 9, 4, 7, 5, 8]), torch.tensor([15, 11, 13, 10, 14, 12])])
    monkeypatch.setattr(sampler, "draw_order", lambda positions, generator: next(orders))
    seen = record_forwards(monkeypatch)
    out = run(DKVCache(variant="greedy", cache_reloading_step=3, window=1), "random_order")
    # Block 0 decodes 6, 9, 4, 7, 5, 8; full forwards at its steps 0 and 3. A cached step runs the position it
    # decodes, the one decoded at the step before (once more, with its token) and 1 masked neighbour of the
    # first, looking left then right alternately: step 1 decodes 9 (+6 decoded, +8 left of 9); step 2
    # decodes 4 (+9; 3 is prompt, so 5 on the right); step 4 decodes 5 (+7; 4, 6, 3, 7 taken or decoded,
    # so 8); step 5 decodes 8 (+5; 7, 9, 6 decoded, so 10 past the block).
    # Block 1 (a fresh cache) decodes 15, 11, 13, 10, 14, 12: step 1 decodes 11 (+15, +10); step 2 13
    # (+11, +12); step 4 14 (+10; 13, 15 decoded, so 12); step 5 12 (+14; no masked position is left).
    assert seen == [FULL, [6, 8, 9], [4, 5, 9], FULL, [5, 7, 8], [5, 8, 10],
                    FULL, [10, 11, 15], [11, 12, 13], FULL, [10, 12, 14], [12, 14]]
    assert (out != MASK).all()


def test_dkv_greedy_needs_the_order_before_the_forward():
    with pytest.raises(ValueError, match="random_order"):
        run(DKVCache(variant="greedy"), "low_confidence")


def test_window_looks_left_and_right_alternately():
    masked = [False, True, True, False, True, True, True, False]
    chosen = [False] * 8
    chosen[4] = True
    add_window(chosen, [4], masked, 3)  # left 3 (unmasked), right 5, left 2, right 6: 5, 2, 6
    assert [i for i, c in enumerate(chosen) if c] == [2, 4, 5, 6]
    chosen = [False] * 8
    add_window(chosen, [0, 7], [True] * 8, 2)  # the edge: only right of 0 (1, 2), only left of 7 (6, 5)
    assert [i for i, c in enumerate(chosen) if c] == [1, 2, 5, 6]


# ---------------------------------------------------------------- SparseD


def tile(block_masses: list[list[float]], block: int) -> torch.Tensor:
    """One head; per query, the attention mass of each key block spread evenly over its keys. [1, queries, keys]"""
    rows = torch.tensor(block_masses).repeat_interleave(block, dim=1) / block
    return rows[None]


def kept(pattern: torch.Tensor, query_block: int = 0) -> list[int]:
    return pattern[0, query_block].nonzero().squeeze(1).tolist()


def test_kept_count_and_split_are_the_references():
    assert kept_blocks(0.3, 6) == 2 and kept_blocks(0.3, 12) == 4 and kept_blocks(0.5, 4) == 3
    assert kept_blocks(1.0, 4) == 4  # the reference's int(select * blocks) + 1, capped at the blocks there are
    assert generated_split(40, 4, 12) == 10  # prompt 0-39: block 10 (40-43) is the first wholly generated
    assert generated_split(5, 2, 6) == 3  # block 2 (4-5) holds prompt position 4: it belongs to the prompt part
    assert generated_split(12, 4, 3) == 2  # nothing wholly generated past the blocks: the last block


def test_long_prompt_keeps_the_generated_span_own_blocks():
    # 48 keys in blocks of 4: a 40-token prompt (blocks 0-9), 8 generated (blocks 10-11); select 0.3
    masses = [0.16, 0.15, 0.14, 0.12, 0.10, 0.08, 0.06, 0.04, 0.03, 0.02, 0.06, 0.04]
    probs = tile([masses, masses], 4)  # 2 queries, both in query block 0
    queries = torch.tensor([0, 1])
    single = pick_patterns(probs, 4, 0.3, None, queries)
    assert kept(single) == [0, 1, 2, 3]  # one top-4 over all 12: the generated blocks drop out
    isolated = pick_patterns(probs, 4, 0.3, 10, queries)
    # top-4 over all 12, kept before block 10: 0-3; top-(int(0.3 * 2) + 1 = 1) over blocks 10-11: 10
    assert kept(isolated) == [0, 1, 2, 3, 10]


def test_prompt_part_keeps_only_the_all_block_top_k_picks_before_the_split():
    # 12 keys in blocks of 2, prompt 6 (blocks 0-2), generated blocks 3-5; select 0.3 keeps int(1.8) + 1 = 2
    probs = tile([[0.50, 0.05, 0.03, 0.30, 0.10, 0.02]], 2)
    isolated = pick_patterns(probs, 2, 0.3, 3, torch.tensor([0]))
    # top-2 over all is {0, 3}: block 3 is generated, so the prompt part keeps block 0 alone; the
    # generated part's own top-1 is block 3
    assert kept(isolated) == [0, 3]


def test_generated_part_ranks_by_attention_renormalised_over_its_keys():
    # two queries in one query block; prompt blocks 0-2, generated 3-5; select 0.3
    probs = tile([[0.60, 0.30, 0.08, 0.00, 0.02, 0.00],  # 2% on the generated keys, all of it on block 4
                  [0.30, 0.10, 0.10, 0.30, 0.00, 0.20]], 2)  # 50%: 0.3 on block 3, 0.2 on block 5
    queries = torch.tensor([0, 1])
    # top-2 over all: block 0 (0.90) and block 1 (0.40), both before the split. Raw mass would rank block 3
    # first among the generated (0.30 against 0.02 and 0.20); renormalised per query over the generated
    # keys (the reference's softmax over those keys alone), block 4 sums 1.0, block 3 0.6, block 5 0.4
    assert kept(pick_patterns(probs, 2, 0.3, 3, queries)) == [0, 1, 4]


def test_selection_does_not_depend_on_the_order_keys_arrive_in():
    probs = tile([[0.50, 0.05, 0.03, 0.30, 0.10, 0.02], [0.1, 0.2, 0.3, 0.1, 0.2, 0.1]], 2)  # [1, 2, 12]
    queries = torch.tensor([0, 1])
    order = torch.tensor([5, 2, 11, 0, 7, 1, 3, 9, 4, 10, 6, 8])  # keys as a partial forward might see them
    in_order = pick_patterns(probs, 2, 0.3, 3, queries)
    assert torch.equal(pick_patterns(probs[:, :, order], 2, 0.3, 3, queries, order), in_order)


def test_presets_and_choosing_step():
    assert SparseD().resolved(100) == (0.2, 0.5, 32)  # the reference's short-context command line
    assert SparseD().resolved(4096) == (0.2, 0.3, 128)  # its 4k-and-longer one
    assert SparseD(select=0.4).resolved(4096) == (0.2, 0.4, 128)  # a value given stays
    model = tiny_model("llama")
    ids = torch.randint(3, MASK, (1, 16), generator=torch.Generator().manual_seed(0))
    stats = generate(model, ids, mask_token_id=MASK, gen_length=16, block_length=8, steps=8,
                     cache=SparseD(skip=0.25, select=0.5, block=8)).stats
    # int(0.25 * 8) + 1 = 3: steps 0-3 dense (step 3 picks the patterns), 4-7 sparse
    assert stats.attention_flops_skipped > 0
    dense = generate(model, ids, mask_token_id=MASK, gen_length=16, block_length=8, steps=8,
                     cache=SparseD(skip=0.25, select=1.0, block=8)).stats
    assert dense.attention_flops_skipped == 0
