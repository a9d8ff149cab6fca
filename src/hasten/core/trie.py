"""The n-gram trie of Lookahead decoding (Zhao et al. 2023), with no torch and no model:
hasten's ``lookahead`` drafter and its vLLM proposer (:mod:`hasten.vllm`) share it.

Every window of ``window`` tokens of a stream is inserted into a trie whose nodes count how
often they were reached; the longest recent suffix found with continuations is the anchor a
draft grows from. Counts never grow down a path, so taking nodes best-first by count always
takes a parent before its children.
"""
from __future__ import annotations


class TrieNode:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, TrieNode] = {}

    def child(self, token: int) -> "TrieNode":
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = TrieNode()
        node.count += 1
        return node


class NgramTrie:
    """Windows of ``window`` tokens, inserted incrementally as a token stream grows."""

    def __init__(self, window: int):
        self.root = TrieNode()
        self.window = window
        self._open: list[tuple[TrieNode, int]] = []  # (end node, depth) of windows still growing
        self.fed = 0  # tokens of the committed sequence fed so far (the corpus and source excluded)
        self.found: tuple[int, TrieNode | None, int] | None = None  # (len(tokens), anchor, suffix length) last found

    def feed(self, tokens) -> None:
        for token in tokens:
            # every open window grows by this token, and a new window starts at it
            grown = [(node.child(token), depth + 1) for node, depth in self._open]
            grown.append((self.root.child(token), 1))
            self._open = [(node, depth) for node, depth in grown if depth < self.window]

    def close(self) -> None:
        """End of a document: no window spans into what is fed next."""
        self._open = []

    def find(self, suffix: list[int]) -> TrieNode | None:
        node = self.root
        for token in suffix:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def anchor(self, tokens: list[int], max_prefix: int, min_prefix: int) -> tuple[TrieNode | None, int]:
        """The node of the longest suffix of ``tokens`` (``max_prefix`` down to ``min_prefix``
        tokens) that has continuations, and its length, after feeding the tokens not fed yet
        (``tokens`` is the committed sequence: it only grows); remembered until it grows."""
        if self.found is not None and self.found[0] == len(tokens):
            return self.found[1:]
        self.feed(tokens[self.fed :])
        self.fed = len(tokens)
        found: tuple[TrieNode | None, int] = (None, 0)
        for length in range(min(max_prefix, len(tokens)), min_prefix - 1, -1):
            node = self.find(tokens[-length:])
            if node is not None and node.children:
                found = (node, length)
                break
        self.found = (len(tokens), *found)
        return found


def evidence(anchor: TrieNode | None, length: int) -> int:
    """A draft's grade from its anchor: 0 without one; else 2 per suffix token, minus 1 when
    the likeliest first token followed the suffix only once (1 .. 2 * max_prefix)."""
    if anchor is None:
        return 0
    return 2 * length - (max(child.count for child in anchor.children.values()) < 2)


def best_chain(anchor: TrieNode, depth: int) -> list[int]:
    """The most frequent child, then its most frequent child, ``depth`` deep at most (ties:
    the first seen): a chain for engines that verify chains only (vLLM)."""
    chain: list[int] = []
    node = anchor
    while len(chain) < depth and node.children:
        token, node = max(node.children.items(), key=lambda item: item[1].count)  # max keeps the first of ties
        chain.append(token)
    return chain
