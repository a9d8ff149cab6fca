"""The Lookahead trie and its multi-branch drafts."""
import pytest

from hasten.drafters import Lookahead, create
from hasten.drafters.base import TargetView
from hasten.drafters.lookahead import NgramTrie
from test_drafters import context


def test_trie_counts_windows_fed_incrementally():
    whole, pieces = NgramTrie(3), NgramTrie(3)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    whole.feed(tokens)
    for i in range(0, len(tokens), 2):
        pieces.feed(tokens[i : i + 2])
    for trie in (whole, pieces):
        node = trie.find([1, 2])
        assert node.count == 3
        assert {t: n.count for t, n in node.children.items()} == {3: 2, 4: 1}
        assert trie.find([2, 3, 1]).count == 1 and trie.find([1, 2, 3, 1]) is None  # windows are 3 long


def test_draft_is_the_most_frequent_subtree_as_one_tree():
    drafter = Lookahead(draft_tokens=3, branch_length=2, max_prefix=2)
    ctx = context([7, 8, 9, 7, 8, 9, 7, 8, 5, 7, 8])
    ctx.state = drafter.begin(ctx)
    draft = drafter.propose(ctx)
    # after "7 8": "9" (twice), then its child "7" (twice), then the sibling "5" (once)
    assert draft.tokens == (9, 7, 5) and draft.tree.parents == (-1, 0, -1)


def test_draft_respects_depth_and_budget():
    drafter = Lookahead(draft_tokens=20, branch_length=5)
    ctx = context(list(range(10, 30)) * 2, max_depth=3)
    ctx.state = drafter.begin(ctx)
    draft = drafter.propose(ctx)
    assert 0 < len(draft) <= 20 and max(draft.tree.depths) <= 3


def test_corpus_seeds_the_trie(tmp_path):
    from helpers import save_checkpoint
    import hasten
    from transformers import AutoTokenizer

    path = save_checkpoint(tmp_path / "m")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("for i in range(10):\n    print(i)\n")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(corpus.read_text(), add_special_tokens=False).input_ids[:5]  # the corpus's opening tokens
    model = hasten.loading.load_model(path)
    drafter = Lookahead(corpus=str(corpus))
    ctx = context(ids)
    ctx.target = TargetView(hasten.models.ModelAdapter(model), Lookahead.needs, str(path))
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
