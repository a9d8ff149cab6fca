"""Lookahead's pool as the reference builds it: trees per token, prompt and output frequencies
apart and mixed, hierarchical multi-branch drafts, squeeze, a bound, save and load, one pool for
every generation of a drafter (and none for a generation that opts out)."""
import random
import threading

import pytest

from hasten.drafters.lookahead_pool import LookaheadPool, _count_all
from hasten.core.sampling import Sampling
from hasten.drafters import Lookahead, create
from hasten.drafters.base import DraftContext, TargetView


class Row:
    """What a TargetView reads of a row: a drafter that needs nothing sees no more."""

    vocab_size, encoder_decoder, kv_readable, cache_length = 1000, False, False, 0


def context(tokens, max_depth=10, use_pool=True, source=None):
    return DraftContext(list(tokens), max_depth, Sampling(), None, TargetView(Row(), frozenset()), source,
                        use_pool=use_pool)


def generation(drafter, prompt, output, max_depth=10):
    """One generation as the loop runs it, a token committed per step: each step's draft."""
    ctx = context(prompt, max_depth)
    ctx.state = drafter.begin(ctx)
    drafts = []
    for token in output:
        drafter.evidence(ctx)
        drafts.append(drafter.propose(ctx))
        ctx.tokens.append(token)
    drafter.end(ctx)
    return drafts


def test_branches_count_what_followed_each_token_with_prompt_and_output_apart():
    pool = LookaheadPool(window=3)
    stream = pool.start([0, 1, 2, 3, 1, 2, 4], fed=7)  # the first token is left out, as the reference leaves out BOS
    tree = pool.trees[1]
    assert tree.children[2].prompt == {stream.key: 2.0} and tree.children[2].output == 0.0
    assert {t: n.prompt[stream.key] for t, n in tree.children[2].children.items()} == {3: 1.0, 4: 1.0}
    pool.extend(stream, [0, 1, 2, 3, 1, 2, 4, 1, 2, 3])  # generated: 1 2 3
    assert tree.children[2].output == 1.0 and tree.children[2].children[3].output == 1.0
    assert tree.children[2].prompt == {stream.key: 2.0}  # the output counts apart
    pool.end(stream)
    assert tree.children[2].prompt is None and tree.children[2].output == 1.0  # the prompt's frequency is gone
    assert 4 not in tree.children[2].children  # kept alive by the prompt alone: gone with it
    assert pool.size == _count_all(tree.children) + sum(
        _count_all(t.children) for k, t in pool.trees.items() if k != 1)


def test_draft_is_the_hierarchy_of_mixed_frequencies_best_branch_first():
    drafter = Lookahead(draft_tokens=4, branch_length=3, max_prefix=1, shared=False)
    ctx = context([0, 7, 8, 9, 7, 8, 9, 7, 8, 5, 7])
    ctx.state = drafter.begin(ctx)
    draft = drafter.propose(ctx)
    # after "7": "8" three times, then "9" (twice) and its "7", then the sibling "5"
    assert draft.tokens == (8, 9, 7, 5) and draft.tree.parents == (-1, 0, 1, 0)


def test_the_prompt_ranks_first_and_output_breaks_ties():
    drafter = Lookahead(draft_tokens=1, branch_length=1, max_prefix=1)
    generation(drafter, [0, 1], [5, 6, 5, 6, 5, 6, 5, 6])  # the pool learns "5 -> 6" four times, as output
    ctx = context([0, 5, 9, 5])  # this prompt says "5 -> 9" once
    ctx.state = drafter.begin(ctx)
    assert drafter.propose(ctx).tokens == (9,)  # prompt frequency outranks output (weight 1e-4)
    drafter.end(ctx)
    ctx = context([0, 5])
    ctx.state = drafter.begin(ctx)
    assert drafter.propose(ctx).tokens == (6,)  # the other prompt's "5 -> 9" is not visible


def test_a_pool_warmed_by_one_request_drafts_for_the_next():
    drafter = Lookahead()
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    cold = generation(drafter, [0, 1, 2], answer)
    assert not any(len(d) for d in cold[:4])  # nothing to draft from at first
    warm = generation(drafter, [0, 3, 4, 40], answer[1:])
    assert warm[0].tokens[:3] == (41, 42, 43)  # the first request's output, for another prompt
    assert drafter.pool.stats().hits > 0


def test_a_request_that_opts_out_neither_reads_nor_writes_the_pool():
    drafter = Lookahead()
    generation(drafter, [0, 1, 2], [40, 41, 42, 43, 44])
    before = drafter.pool.to_json()
    ctx = context([0, 9, 40], use_pool=False)
    ctx.state = drafter.begin(ctx)
    assert len(drafter.propose(ctx)) == 0  # what the pool knows after 40 is not read
    for token in [50, 51, 52, 50, 51]:
        ctx.tokens.append(token)
        drafter.propose(ctx)
    drafter.end(ctx)
    assert drafter.pool.to_json() == before  # nor is anything written


def test_interleaved_generations_share_one_pool_and_keep_their_prompts_apart():
    drafter = Lookahead(max_prefix=1)
    a, b = context([0, 7, 8, 1]), context([0, 7, 9, 2])
    a.state, b.state = drafter.begin(a), drafter.begin(b)
    a.tokens.append(7)
    b.tokens.append(7)
    assert drafter.propose(a).tokens[0] == 8 and drafter.propose(b).tokens[0] == 9  # each its own prompt
    for token in [30, 31, 32]:
        a.tokens.append(token)
        drafter.propose(a)
    b.tokens.append(30)
    assert drafter.propose(b).tokens[:2] == (31, 32)  # a's output, while a still runs
    drafter.end(a)
    drafter.end(b)


def test_squeeze_halves_output_frequencies_and_drops_rare_nodes():
    pool = LookaheadPool(window=2)
    pool.feed([1, 2, 3] * 3 + [1, 5])
    tree = pool.trees[1]
    assert tree.children[2].output == 3.0 and tree.children[5].output == 1.0
    pool._squeeze(1)
    assert tree.children[2].output == 1.5 and 5 not in tree.children


def test_a_tree_counts_as_updated_once_a_branch_grows_in_it():
    # the reference's stream_put adds to _update_trees (1,024 of them trigger the squeeze check) the
    # trees it puts a branch into: not the output's last token's, which nothing follows yet
    pool = LookaheadPool(window=3)
    stream = pool.start([0, 1, 2], fed=3)
    pool.extend(stream, [0, 1, 2, 5, 6, 7])
    assert pool.updated == {5, 6}
    pool.extend(stream, [0, 1, 2, 5, 6, 7, 8])
    assert pool.updated == {5, 6, 7}
    pool.end(stream)
    pool.feed([9])
    assert pool.updated == {5, 6, 7}


def test_a_prompt_counts_as_updates_its_branches_into_trees_already_there():
    # the reference's put(mode="input") adds a tree to _update_trees when it held it already
    pool = LookaheadPool(window=3)
    pool.feed([5, 6, 7])
    pool.updated.clear()
    pool.start([0, 5, 8, 9, 8, 4], fed=6)  # 5's tree was there, 8's is made by its first branch
    assert pool.updated == {5, 8}


def test_a_tree_another_generation_grows_in_outlives_the_prompt_that_emptied_it():
    pool = LookaheadPool(window=3)
    a = pool.start([0, 7, 8], fed=3)  # a's prompt: a branch "8" in tree 7
    b = pool.start([0, 1], fed=2)
    pool.extend(b, [0, 1, 7])  # b's newest token is 7: its branch opens at tree 7's root
    pool.end(a)  # a's prompt goes and leaves tree 7 empty ...
    pool.extend(b, [0, 1, 7, 9])  # ... but b's branch grows in it
    assert list(pool.trees[7].children) == [9] and pool.trees[7].children[9].output == 1.0
    assert pool.size == sum(_count_all(tree.children) for tree in pool.trees.values())


def test_memory_stays_under_the_bound_over_a_thousand_requests():
    drafter = Lookahead(max_nodes=3000)
    rng = random.Random(0)
    phrases = [[rng.randrange(100, 400) for _ in range(6)] for _ in range(30)]
    peak = 0
    for _ in range(1000):
        prompt = [0] + [t for _ in range(3) for t in rng.choice(phrases)]
        output = [t for _ in range(4) for t in (rng.choice(phrases) if rng.random() < 0.7 else
                                                 [rng.randrange(100, 5000) for _ in range(6)])]
        ctx = context(prompt)
        ctx.state = drafter.begin(ctx)
        for token in output:
            drafter.propose(ctx)
            ctx.tokens.append(token)
            peak = max(peak, drafter.pool.size)
        drafter.end(ctx)
    pool = drafter.pool
    assert peak <= 3000
    assert pool.size == sum(_count_all(tree.children) for tree in pool.trees.values())  # the count is true
    assert pool.stats().requests == 1000 and not pool.active


def test_save_and_load_round_trip_output_only(tmp_path):
    drafter = Lookahead()
    generation(drafter, [0, 1, 2], [40, 41, 42, 43, 44, 40, 41, 45])
    ctx = context([0, 60, 61, 62, 60])  # still running: its prompt must not be saved
    ctx.state = drafter.begin(ctx)
    path = tmp_path / "pool.json"
    drafter.pool.save(path)
    assert "60" not in path.read_text().replace("[", " ").replace(",", " ").split()
    loaded = Lookahead()
    loaded.pool.load(path)
    probe = [0, 7, 40]
    assert generation(loaded, probe, [41]) == generation(drafter, probe, [41])
    with pytest.raises(ValueError, match="other settings"):
        Lookahead(branch_length=3).pool.load(path)
    (tmp_path / "text.txt").write_text("not a pool")
    with pytest.raises(ValueError, match="not a saved pool"):
        loaded.pool.load(tmp_path / "text.txt")


def test_one_pool_under_many_threads():
    drafter = Lookahead(max_nodes=2000)
    rng = random.Random(1)
    streams = [[rng.randrange(50) for _ in range(200)] for _ in range(8)]
    errors = []

    def run(stream):
        try:
            for start in range(0, 200, 50):
                generation(drafter, [0] + stream[start:start + 20], stream[start + 20:start + 50])
        except Exception as err:  # reported below: a thread's exception would vanish
            errors.append(err)

    threads = [threading.Thread(target=run, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pool = drafter.pool
    assert pool.size == sum(_count_all(tree.children) for tree in pool.trees.values()) and pool.size <= 2000


def test_drafts_hold_only_tokens_of_the_target_vocabulary():
    drafter = Lookahead(max_prefix=1)
    generation(drafter, [0, 1], [5, 2000, 6, 5, 2000, 6])  # a pool warmed with another model's ids
    ctx = context([0, 5])
    ctx.state = drafter.begin(ctx)
    assert all(t < Row.vocab_size for t in drafter.propose(ctx).tokens)


def test_corpus_seeds_the_pool(tmp_path):
    from helpers import save_checkpoint
    from transformers import AutoTokenizer

    path = save_checkpoint(tmp_path / "m")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("for i in range(10):\n    print(i)\n")
    ids = AutoTokenizer.from_pretrained(path)(corpus.read_text(), add_special_tokens=False).input_ids[:5]
    drafter = Lookahead(corpus=str(corpus))
    ctx = context(ids)
    ctx.target = TargetView(Row(), frozenset(), str(path))
    ctx.state = drafter.begin(ctx)
    assert len(drafter.propose(ctx)) > 0  # the prompt alone has no earlier match: the corpus supplies it
    with pytest.raises(ValueError, match="corpus"):
        Lookahead(corpus=str(tmp_path / "missing.txt")).begin(ctx)


def test_defaults_work_and_bad_settings_are_refused():
    assert isinstance(create("lookahead"), Lookahead)
    with pytest.raises(ValueError, match="draft_tokens"):
        Lookahead(draft_tokens=0)
    with pytest.raises(ValueError, match="max_prefix"):
        Lookahead(max_prefix=1, min_prefix=2)
    with pytest.raises(ValueError, match="max_nodes"):
        Lookahead(max_nodes=0)
