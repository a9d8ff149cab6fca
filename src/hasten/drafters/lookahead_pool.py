"""Lookahead's pool (Zhao et al. 2023), as its reference builds it (alipay/PainlessInferenceAcceleration,
``lookahead/common/lookahead_cache.py``), with no torch and no model: one tree per token of what
followed that token, shared by every generation that drafts from the pool.

* **Two frequencies per node.** A generation's prompt is inserted with a *prompt* frequency kept
  apart per generation (keyed by its request number) and dropped when it ends; generated text
  with an *output* frequency that persists, for every later generation. Ranking mixes them:
  ``(1 - w) * prompt + w * output`` with ``w = output_weight`` (1e-4: the prompt first, output
  frequency breaking ties). A node neither frequency makes live for a generation is invisible
  to it, so one generation never drafts another's prompt.
* **Windows.** After each occurrence of a token ``t``, the next ``window`` tokens form a branch
  of ``t``'s tree; every node on it counts the branches through it. A draft matches the newest
  ``max_prefix`` tokens (the tree of the oldest, the rest walked down it), the longest first,
  and keeps the first query whose draft reaches ``branch_length`` tokens, else the last one tried.
* **Hierarchical multi-branch drafts.** From the matched node, a depth-first walk takes children
  by mixed frequency, up to ``draft_tokens`` nodes and ``depth`` deep: the likeliest branch is
  taken first and whole, then the next. When the subtree holds more live nodes than the draft
  may, only nodes whose output frequency reaches the ``(draft_tokens + 1) // 2``-th largest are
  eligible (the reference's ``min_output_size`` threshold in its ``mix`` mode).
* **Pruning.** ``squeeze`` halves every output frequency of a tree and drops the nodes at 1 or
  below; the reference squeezes a tree once it passes ``max_tree_nodes`` nodes or
  ``max_output_nodes`` output nodes, checked when 1,024 trees have been updated. hasten also
  squeezes every tree while the whole pool holds more than ``max_nodes`` nodes, so memory is
  bounded by a setting.

Counts never grow down a branch (a node's frequency is at least its children's), so dropping a
node with its subtree never strands a live node, and a walk that stops at a dead node misses
nothing below it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..core.pool import Pool, PoolStats, check_saved

SQUEEZE_AFTER = 1024  # updated trees that trigger the reference's per-tree squeeze check (squeeze_branch_counts)


class Node:
    __slots__ = ("output", "prompt", "children")

    def __init__(self) -> None:
        self.output = 0.0  # persistent: generated text and corpora
        self.prompt: dict[int, float] | None = None  # request number -> its prompt's frequency, while it runs
        self.children: dict[int, Node] = {}


class Tree:
    """What followed one token: ``children`` holds the first tokens after it."""

    __slots__ = ("children", "nodes", "output_nodes")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.nodes = 0  # live nodes
        self.output_nodes = 0  # nodes created by output since the last squeeze (the reference's n_output_node)


@dataclass(frozen=True)
class PoolDraft:
    tokens: list[int]  # one per tree node, depth-first, each node's likeliest child first
    parents: list[int]  # each node's parent index (-1: a child of the root)
    query: int  # tokens of the newest ones the draft was found after (0: none)
    top: float  # the likeliest first node's frequency (prompt + output): 1, it followed the query once
    learned: bool  # some node came from generated text or a corpus, not only from the prompt


NO_DRAFT = PoolDraft([], [], 0, 0.0, False)


@dataclass
class Stream:
    """One generation's place in the pool: its request number, the output branches still
    growing, and the trees its prompt touched (to drop its prompt frequency at the end)."""

    key: int
    open: list[tuple[Tree, Node | Tree, int]] = field(default_factory=list)  # (tree, end node, depth) per growing branch
    prompt_trees: set[int] = field(default_factory=set)
    fed: int = 0  # tokens of the generation's sequence fed so far (the prompt included)
    found: tuple | None = None  # (len(tokens), depth limit, draft, query length, top frequency) last drafted


class LookaheadPool(Pool):
    kind = "lookahead"

    def __init__(self, window: int, max_prefix: int = 2, min_prefix: int = 1, output_weight: float = 1e-4,
                 max_tree_nodes: int = 65536, max_output_nodes: int = 512, max_nodes: int = 1 << 20):
        super().__init__()
        self.window = window  # tokens after a tree's token on one branch
        self.max_prefix, self.min_prefix = max_prefix, min_prefix
        self.output_weight = output_weight
        self.max_tree_nodes, self.max_output_nodes, self.max_nodes = max_tree_nodes, max_output_nodes, max_nodes
        self.trees: dict[int, Tree] = {}
        self.size = 0  # live nodes in every tree
        self.active: dict[int, Stream] = {}
        self.updated: set[int] = set()  # trees grown since the last squeeze check (the reference's _update_trees)
        self.finished = 0  # generations ended, whose output the pool took
        self._next_key = 0

    # ---- generations -----------------------------------------------------------------------
    def start(self, prompt: list[int], fed: int) -> Stream:
        """A generation begins: its prompt's branches get its own prompt frequency (its first
        token is left out, as the reference leaves out BOS); ``fed``: tokens of its sequence
        already accounted for (the prompt, for a causal LM)."""
        with self.lock:
            stream = Stream(self._next_key, fed=fed)
            self._next_key += 1
            self.active[stream.key] = stream
            prompt = list(prompt[1:])
            for i in range(len(prompt) - 1):
                if prompt[i] in self.trees and self.trees[prompt[i]].children:  # the reference counts a prompt's
                    self.updated.add(prompt[i])  # branch into a tree it holds as an update (into a new one, not)
                tree = self._tree(prompt[i])
                self._put(tree, prompt[i + 1 : i + 1 + self.window], stream.key)
                stream.prompt_trees.add(prompt[i])
            self._bound()
            return stream

    def extend(self, stream: Stream, tokens: list[int]) -> None:
        """The generation's sequence is now ``tokens``: the new ones grow its output branches
        (each branch +1 on every node it passes, as the reference's stream_put, but visible as
        it grows rather than once ``window`` tokens long)."""
        with self.lock:
            if stream.fed >= len(tokens):
                return
            previous = tokens[stream.fed - 1] if stream.fed else None
            for token in tokens[stream.fed :]:
                if stream.open:  # the previous token's branch (open's last entry) takes its first node: its tree
                    self.updated.add(previous)  # is updated (the reference's stream_put counts no tree before that)
                grown = []
                for tree, node, depth in stream.open:
                    child = node.children.get(token)
                    if child is None:
                        child = node.children[token] = Node()
                        tree.nodes += 1
                        tree.output_nodes += 1
                        self.size += 1
                    child.output += 1.0
                    if depth + 1 < self.window:
                        grown.append((tree, child, depth + 1))
                tree = self._tree(token)
                grown.append((tree, tree, 0))
                stream.open = grown
                previous = token
            stream.fed = len(tokens)
            self._bound()

    def feed(self, tokens: list[int]) -> None:
        """A document of text to learn, as if generated (a corpus): persistent output frequency."""
        with self.lock:
            stream = Stream(-1)
            self.active[-1] = stream
            try:
                self.extend(stream, list(tokens))
            finally:
                self.active.pop(-1, None)

    def learn(self, output: list[int]) -> None:
        """A finished generation's output, from a generation that drafted from a pool of its own."""
        with self.lock:
            self.feed(output)
            self.finished += 1

    def end(self, stream: Stream) -> None:
        """The generation ended: its prompt frequency goes (nodes it alone kept alive with it);
        its output stays. Then the reference's squeeze check, and the pool's bound."""
        with self.lock:
            if self.active.pop(stream.key, None) is None:
                return
            stream.open = []
            for token in stream.prompt_trees:
                tree = self.trees.get(token)
                if tree is not None:
                    self._drop_prompt(tree, tree.children, stream.key)
                    if not tree.children and not self._opened(tree):
                        del self.trees[token]
            self.finished += 1
            if len(self.updated) >= SQUEEZE_AFTER:  # the reference's squeeze_branch_counts
                for token in self.updated:
                    tree = self.trees.get(token)
                    if tree is not None and (tree.nodes > self.max_tree_nodes
                                             or tree.output_nodes > self.max_output_nodes):
                        self._squeeze(token)
                self.updated.clear()
                self._close_branches()
            self._bound()

    # ---- drafting --------------------------------------------------------------------------
    def draft(self, stream: Stream, tokens: list[int], budget: int, depth: int) -> PoolDraft:
        """The draft after ``tokens`` (the generation's sequence, which the pool learns first):
        at most ``budget`` nodes, ``depth`` deep."""
        with self.lock:
            self.extend(stream, tokens)
            if stream.found is not None and stream.found[:2] == (len(tokens), depth):
                return stream.found[2]
            result = NO_DRAFT
            queries = tokens[-self.max_prefix :] if self.max_prefix else []
            for i, token in enumerate(queries):
                length = len(queries) - i
                if length < self.min_prefix:
                    break
                tree = self.trees.get(token)
                if tree is None:
                    continue
                nodes = self._match(tree, queries[i + 1 :], stream.key)
                if nodes is None:
                    result = NO_DRAFT  # the reference's draft of a query its tree does not hold: none
                    continue
                drafted, parents, learned = self._ravel(nodes, stream.key, budget, depth)
                top = max((self._live(node, stream.key) for node in nodes.values()), default=0.0)
                result = PoolDraft(drafted, parents, length if drafted else 0, top, learned)
                if len(drafted) + 1 >= depth:  # long enough (the reference counts the matched token too)
                    break
            stream.found = (len(tokens), depth, result)
            return result

    def _match(self, tree: Tree, query: list[int], key: int) -> dict[int, Node] | None:
        """The children of the node ``query`` leads to in ``tree`` (the tree's first tokens for
        an empty query), or None where a token is missing or not live for this generation."""
        nodes = tree.children
        for token in query:
            node = nodes.get(token)
            if node is None or not self._live(node, key):
                return None
            nodes = node.children
        return nodes

    def _live(self, node: Node, key: int) -> float:
        """The frequency that makes ``node`` visible to generation ``key`` (0: invisible)."""
        return node.output + (node.prompt.get(key, 0.0) if node.prompt else 0.0)

    def _mixed(self, node: Node, key: int) -> float:
        prompt = node.prompt.get(key, 0.0) if node.prompt else 0.0
        return (1.0 - self.output_weight) * prompt + self.output_weight * node.output

    def _ravel(self, nodes: dict[int, Node], key: int, budget: int, depth: int) -> tuple[list[int], list[int], bool]:
        """The reference's ``Tree.get`` in ``mix`` mode with ``min_input_size`` 0: the eligible
        nodes under ``nodes``, depth-first by mixed frequency (ties: the order they were first
        inserted), at most ``budget`` of them and ``depth`` deep; and whether any has output
        frequency (was learned from generated text or a corpus, not only from the prompt)."""
        threshold = self._output_threshold(nodes, key, budget)
        drafted: list[int] = []
        parents: list[int] = []
        learned = False

        def walk(children: dict[int, Node], parent: int, room: int) -> None:
            nonlocal learned
            if len(drafted) >= budget or room <= 0:
                return
            ranked = sorted(children.items(), key=lambda item: self._mixed(item[1], key), reverse=True)
            for token, node in ranked:
                if len(drafted) >= budget:
                    return
                if not self._live(node, key) or node.output < threshold:
                    continue
                drafted.append(token)
                parents.append(parent)
                learned = learned or node.output > 0.0
                if node.children:
                    walk(node.children, len(drafted) - 1, room - 1)

        walk(nodes, -1, depth)
        return drafted, parents, learned

    def _output_threshold(self, nodes: dict[int, Node], key: int, budget: int) -> float:
        """0 when the live subtree fits the draft (``budget + 1`` nodes with the matched token,
        the reference's ``decoding_length``); else the ``(budget + 1) // 2``-th largest output
        frequency in it (the reference's ``min_output_size``), which a node must reach."""
        outputs: list[float] = []
        stack = [nodes]
        while stack:
            for node in stack.pop().values():
                if self._live(node, key):
                    outputs.append(node.output)
                    if node.children:
                        stack.append(node.children)
        size = budget + 1
        if len(outputs) <= size:
            return 0.0
        keep = max(size // 2, 1)
        return heapq.nlargest(keep, outputs)[-1]

    # ---- upkeep -----------------------------------------------------------------------------
    def _tree(self, token: int) -> Tree:
        tree = self.trees.get(token)
        if tree is None:
            tree = self.trees[token] = Tree()
        return tree

    def _put(self, tree: Tree, branch: list[int], key: int) -> None:
        """One prompt branch: +1 prompt frequency for generation ``key`` on every node."""
        nodes = tree.children
        for token in branch:
            node = nodes.get(token)
            if node is None:
                node = nodes[token] = Node()
                tree.nodes += 1
                self.size += 1
            if node.prompt is None:
                node.prompt = {}
            node.prompt[key] = node.prompt.get(key, 0.0) + 1.0
            nodes = node.children

    def _drop_prompt(self, tree: Tree, nodes: dict[int, Node], key: int) -> None:
        for token, node in list(nodes.items()):
            if not node.prompt or key not in node.prompt:
                continue
            del node.prompt[key]
            if not node.prompt:
                node.prompt = None
            if node.output <= 0.0 and node.prompt is None:  # kept alive by this prompt only: so is its subtree
                removed = _count(node)
                del nodes[token]
                tree.nodes -= removed
                self.size -= removed
            else:
                self._drop_prompt(tree, node.children, key)

    def _opened(self, tree: Tree) -> bool:
        """Whether a running generation's branch grows in ``tree`` (its newest token's, still
        empty): deleting it would lose what that branch takes next, and the pool's count of it."""
        return any(entry[0] is tree for other in self.active.values() for entry in other.open)

    def _squeeze(self, token: int) -> None:
        """The reference's ``Tree.squeeze``: halve output frequencies above 1, drop the rest
        (prompt-only nodes of running generations too, as the reference does)."""
        tree = self.trees[token]
        _halve(tree.children)
        live = _count_all(tree.children)
        self.size += live - tree.nodes
        tree.nodes = tree.output_nodes = live
        if not tree.children:
            del self.trees[token]

    def _bound(self) -> None:
        """Squeeze every tree while the pool holds more than ``max_nodes`` nodes (hasten's
        bound: the reference bounds each tree, not the pool)."""
        if self.size <= self.max_nodes:
            return
        while self.size > self.max_nodes:
            for token in list(self.trees):
                self._squeeze(token)
        self.updated.clear()
        self._close_branches()

    def _close_branches(self) -> None:
        """After a squeeze, growing branches may end on dropped nodes: they restart at the next token."""
        for stream in self.active.values():
            stream.open = []
            stream.found = None

    # ---- reporting and files ---------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self.lock:
            return PoolStats(self.size, self.finished, self.lookups, self.hits)

    def settings_key(self) -> dict:
        return {"window": self.window}

    def to_json(self) -> dict:
        """Output frequencies only: prompts are never saved."""
        def nodes_of(children: dict[int, Node]) -> list:
            return [[token, node.output, nodes_of(node.children)] for token, node in children.items()
                    if node.output > 0.0]

        trees = [[token, nodes_of(tree.children)] for token, tree in self.trees.items()]
        return {"settings": self.settings_key(), "finished": self.finished, "trees": [t for t in trees if t[1]]}

    def from_json(self, data: dict) -> None:
        check_saved(data, self.settings_key())

        def build(items: list) -> dict[int, Node]:
            children = {}
            for token, output, below in items:
                node = children[int(token)] = Node()
                node.output = float(output)
                node.children = build(below)
            return children

        self.trees, self.size, self.updated = {}, 0, set()
        for token, items in data.get("trees", []):
            tree = self.trees[int(token)] = Tree()
            tree.children = build(items)
            tree.nodes = tree.output_nodes = _count_all(tree.children)
            self.size += tree.nodes
        self.finished = int(data.get("finished", 0))
        self._close_branches()
        self._bound()


def _count(node: Node) -> int:
    return 1 + _count_all(node.children)


def _count_all(children: dict[int, Node]) -> int:
    total, stack = 0, [children]
    while stack:
        level = stack.pop()
        total += len(level)
        stack.extend(node.children for node in level.values() if node.children)
    return total


def _halve(children: dict[int, Node]) -> None:
    for token, node in list(children.items()):
        if node.output > 1.0:
            node.output *= 0.5
            if node.children:
                _halve(node.children)
        else:
            del children[token]
