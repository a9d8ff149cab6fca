"""scripts/lookahead_reference.py without the reference: the masks it reads drafts from, and its
hasten side, which must draft without taking the output and learn the output at the end."""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import lookahead_reference as replay  # noqa: E402


def reference_mask(parents):
    """A draft's mask as the reference's ``Tree._ravel`` writes it: the root first, every row
    its parent's row plus itself."""
    mask = np.zeros((len(parents) + 1, len(parents) + 1), dtype=np.int64)
    mask[:, 0] = 1
    for i, parent in enumerate(parents, 1):
        if parent >= 0:
            mask[i] = mask[parent + 1]
        mask[i, i] = 1
    return mask


def test_masks_read_back_as_parents():
    for parents in ([], [-1], [-1, 0, 1, 0, -1, 4], [-1, 0, 1, 2, 1, 0, -1, -1]):
        assert replay.parents_of(reference_mask(parents)) == parents


class Silent:
    """A reference that drafts nothing."""

    def __init__(self, **kwargs):
        self._update_trees = set()
        self.mem = {}

    def put(self, *args, **kwargs):
        pass

    stream_put = put

    def hier_get(self, token_ids, **kwargs):
        return token_ids[-1:], np.ones((1, 1), dtype=np.int64), []


def test_the_pool_drafts_without_the_output_and_learns_it_at_the_end():
    sides = replay.Replay(SimpleNamespace(LookaheadCache=Silent), size=8, branch=4)
    prompt, output = [0, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5]
    drafts = []
    sides.request(prompt, output, lambda history, theirs, mine: drafts.append((list(history), mine)))
    assert [history for history, _ in drafts] == [prompt + output[:i] for i in range(len(output))]
    assert all(not mine[0] for _, mine in drafts)  # "5 6 7" repeats, but the pool has not taken it yet
    drafts.clear()
    sides.request(prompt, output, lambda history, theirs, mine: drafts.append(mine))
    assert drafts[1] == ([6, 7, 5, 6], [-1, 0, 1, 2])  # after "5": the last request's output
    assert not sides.pool.active


def test_streams_are_spec_bench_questions_per_character_and_per_word():
    (prompt, output), = replay.requests(1, "char")
    assert "".join(map(chr, prompt)).startswith("Q: ") and len(output) > 50
    words = replay.requests(2, "word")
    assert len(words[0][1]) < len(output) and words[0][0][0] == words[1][0][0]  # "Q:" is one token, the same in both
