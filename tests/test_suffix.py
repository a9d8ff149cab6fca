"""SuffixDecoding: the port equals its reference on recorded streams; one global tree for every
generation of a drafter, bounded, saved and loaded; a generation that opts out uses none."""
import gzip
import json
import random
import sys
from pathlib import Path

import pytest

from hasten.drafters.suffix_pool import SuffixPool
from hasten.drafters.suffix_tree import SuffixTree, f32
from hasten.drafters import Suffix, create
from test_lookahead import Row, context, generation

REFERENCE = Path(__file__).parent / "data" / "suffix_reference.json.gz"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from suffix_reference import replay  # noqa: E402 - the calls recorded from arctic-inference, through hasten's port


def test_drafts_equal_the_reference_on_recorded_streams():
    cases = json.loads(gzip.decompress(REFERENCE.read_bytes()))["cases"]
    assert sum(replay(case) for case in cases) > 2000  # path and tree drafts, evictions included


def test_counts_are_occurrences_and_the_path_follows_the_likeliest_child():
    tree = SuffixTree(max_depth=8)
    tree.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 3])
    draft = tree.speculate([9, 1, 2], max_spec_tokens=4, max_spec_factor=2.0, max_spec_offset=0.0,
                           min_token_prob=0.1, use_tree_spec=False)
    # "1 2" occurs 3 times: followed by 3 twice (one of them the sequence's end), by 4 once
    assert draft.token_ids[0] == 3 and draft.match_len == 2
    assert draft.probs[0] == f32(2 / 3)


def test_a_response_drafts_for_another_request_and_opting_out_reads_and_writes_nothing():
    drafter = Suffix()
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    generation(drafter, [0, 1, 2], answer)
    warm = generation(drafter, [0, 3, 40, 41], answer[2:])
    assert warm[0].tokens[:2] == (42, 43)
    assert drafter.pool.stats().hits > 0
    before = drafter.pool.to_json()
    private = context([0, 3, 40, 41], use_pool=False)
    private.state = drafter.begin(private)
    assert len(drafter.propose(private)) == 0
    for token in [50, 51, 52]:
        private.tokens.append(token)
        drafter.propose(private)
    drafter.end(private)
    assert drafter.pool.to_json() == before


def test_tree_drafts_branch_and_respect_the_depth():
    drafter = Suffix(shared=False, max_spec_factor=4.0)
    ctx = context([0, 5, 6, 7, 8, 5, 6, 9, 1, 5, 6, 7, 2, 5, 6], max_depth=2)
    ctx.state = drafter.begin(ctx)
    draft = drafter.propose(ctx)
    assert max(draft.tree.depths) <= 2 and {7, 9} <= set(draft.tokens)
    chain = Suffix(shared=False, tree_spec=False, max_spec_factor=4.0)
    ctx = context(ctx.tokens)
    ctx.state = chain.begin(ctx)
    assert chain.propose(ctx).tokens[0] == 7 and len(chain.propose(ctx).tree.children[0]) == 1


def test_the_global_tree_stays_within_its_bounds_over_a_thousand_requests():
    drafter = Suffix(max_cached_requests=50, max_cached_tokens=2000)
    rng = random.Random(0)
    phrases = [[rng.randrange(100, 400) for _ in range(6)] for _ in range(30)]
    peak = 0
    for _ in range(1000):
        prompt = [0] + rng.choice(phrases)
        output = [t for _ in range(4) for t in rng.choice(phrases)]
        ctx = context(prompt)
        ctx.state = drafter.begin(ctx)
        for token in output:
            drafter.propose(ctx)
            ctx.tokens.append(token)
            peak = max(peak, drafter.pool.cached_tokens)
        drafter.end(ctx)
    pool = drafter.pool
    assert peak <= 2000 and len(pool.responses) <= 50
    assert pool.global_tree.tokens() == pool.cached_tokens and not pool.active


def test_save_and_load_round_trip_responses_only(tmp_path):
    drafter = Suffix()
    generation(drafter, [0, 1, 2], [40, 41, 42, 43, 44, 40, 41, 45])
    ctx = context([0, 60, 61, 62, 60])  # running: its prompt is never saved
    ctx.state = drafter.begin(ctx)
    path = tmp_path / "pool.json"
    drafter.pool.save(path)
    assert json.loads(path.read_text())["responses"][0] == [40, 41, 42, 43, 44, 40, 41, 45]
    assert 61 not in sum(json.loads(path.read_text())["responses"], [])
    loaded = Suffix()
    loaded.pool.load(path)
    probe = [0, 7, 40]
    assert generation(loaded, probe, [41, 42]) == generation(drafter, probe, [41, 42])
    with pytest.raises(ValueError, match="other settings"):
        Suffix(max_tree_depth=8).pool.load(path)
    with pytest.raises(ValueError, match="lookahead pool"):
        create("lookahead").pool.save(tmp_path / "la.json") or loaded.pool.load(tmp_path / "la.json")


def test_defaults_work_and_bad_settings_are_refused():
    assert isinstance(create("suffix"), Suffix)
    with pytest.raises(ValueError, match="min_token_prob"):
        Suffix(min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_tree_depth"):
        Suffix(max_tree_depth=0)
    assert Row.vocab_size > 0
