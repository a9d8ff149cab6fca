"""Finished sequences' KV entries kept for the next request that starts the same way.

A position's keys and values depend on the tokens up to it and nothing else, and hasten's
kernels compute every row alone (``kernels/ops.py``), so the entries a finished sequence leaves
are, bit for bit, the ones a new prefill of the same tokens would compute. The packed batch
(``models/packed_batch.py``) hands a finished row's segment here instead of freeing it; a new
row whose prompt starts with tokens kept here copies their entries and prefills only the rest
(a chat's shared system prompt, the turns of a conversation so far, a prompt asked again). Kept
segments give their space back, least recently used first, whenever a running row needs room.

Tokens are indexed by blocks of :data:`BLOCK`: a chain of hashes, each over the previous hash and
one block's tokens (as vLLM's prefix caching), so a lookup walks the prompt once; a hit is then
compared token by token, so a hash collision costs a miss, never a wrong entry.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BLOCK = 16  # tokens per indexed block: prefixes are found in whole blocks


@dataclass(eq=False)
class Kept:
    """A finished sequence's entries: the tokens they stand for (its store segment is owned by this)."""

    tokens: tuple[int, ...]


def chain(tokens, blocks: int) -> list[int]:
    """The hash after each of the first ``blocks`` whole blocks of ``tokens``."""
    hashes, last = [], 0
    for b in range(blocks):
        last = hash((last, *tokens[b * BLOCK:(b + 1) * BLOCK]))
        hashes.append(last)
    return hashes


class PrefixCache:
    def __init__(self):
        self.index: dict[int, tuple[Kept, int]] = {}  # chain hash -> (kept entries, tokens they cover)
        self.kept: OrderedDict[Kept, list[int]] = OrderedDict()  # least recently used first -> its hashes

    def __len__(self) -> int:
        return len(self.kept)

    def keep(self, tokens: list[int]) -> tuple[Kept | None, list[Kept]]:
        """Index a finished sequence's ``tokens`` (its cached entries, in order): the object that
        is to own their segment (None when they hold no whole block), and the kept entries it
        supersedes, dropped from the index here: every prefix they served is now served by it (a
        prompt's entries once its answer's are kept), so their segments are only dead weight that
        would push out entries still in use."""
        blocks = len(tokens) // BLOCK
        if not blocks:
            return None, []
        kept = Kept(tuple(tokens[:blocks * BLOCK]))
        hashes = chain(kept.tokens, blocks)
        displaced: dict[Kept, None] = {}  # earlier holders of these prefixes, in order, once each
        for b, value in enumerate(hashes):
            earlier = self.index.get(value)
            if earlier is not None:
                displaced[earlier[0]] = None
            self.index[value] = (kept, (b + 1) * BLOCK)  # the newest holder of a prefix serves it
        self.kept[kept] = hashes
        superseded = [old for old in displaced
                      if not any(self.index[value][0] is old for value in self.kept[old] if value in self.index)]
        for old in superseded:
            self.forget(old)
        return kept, superseded

    def find(self, tokens: list[int]) -> tuple[Kept | None, int]:
        """The kept entries covering the longest whole-block prefix of ``tokens``, and how many
        tokens they cover ((None, 0): none)."""
        best: tuple[Kept | None, int] = (None, 0)
        for value in chain(tokens, len(tokens) // BLOCK):
            found = self.index.get(value)
            if found is None:
                break
            kept, count = found
            if kept.tokens[:count] != tuple(tokens[:count]):
                break  # a hash collision: no entry for these tokens
            best = found
        if best[0] is not None:
            self.kept.move_to_end(best[0])
        return best

    def forget(self, kept: Kept) -> None:
        """Drop ``kept`` from the index (its segment is about to be freed)."""
        for value in self.kept.pop(kept, ()):
            if self.index.get(value, (None,))[0] is kept:
                del self.index[value]
