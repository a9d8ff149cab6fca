"""The suffix tree of SuffixDecoding (Oliaro et al., arXiv 2411.04975), ported from its reference,
``arctic-inference`` 0.3.0 (``csrc/suffix_decoding/suffix_tree.cc``), step for step, with no torch
and no model.

The tree holds every suffix of every sequence, truncated at ``max_depth`` tokens, path-compressed
(a node spans a run of tokens, read from a reference sequence). A node's ``count`` is how many
suffixes pass through it: how often its path occurs. Each node keeps its children in a list of
non-increasing count (ties in the order the reference's linked lists leave them), so the likeliest
continuation is the head child. :meth:`SuffixTree.speculate` matches the newest tokens, every
match length in turn, and keeps the draft of highest score, the sum of its tokens' estimated
probabilities (each a product of count ratios down the path).

The port keeps the reference's arithmetic: probabilities and scores are float32 (:func:`f32`),
and the token tree is grown with the C++ standard library's binary heap (:class:`_StdHeap`), so
drafts equal the reference's token for token, ties included (tests/test_suffix.py replays
streams recorded from the reference).
"""
from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

_FLOAT = struct.Struct("f")


def f32(value: float) -> float:
    """``value`` rounded to float32: float64 arithmetic on float32 operands, then this, gives
    float32 arithmetic's result exactly (53 >= 2 x 24 + 2 bits)."""
    return _FLOAT.unpack(_FLOAT.pack(value))[0]


class Group:
    """Siblings of equal count, consecutive in their parent's list: ``head`` is the first."""

    __slots__ = ("head", "next", "prev")

    def __init__(self, head: "Node"):
        self.head = head
        self.next: Group | None = None
        self.prev: Group | None = None


class Node:
    __slots__ = ("count", "token", "length", "ref_seq", "ref_idx", "endpoints", "parent", "children",
                 "head_child", "tail_child", "next_sibling", "prev_sibling", "group")

    def __init__(self, count: int = 0, token: int = 0, length: int = 0, ref_seq: int = 0, ref_idx: int = -1):
        self.count = count  # suffixes that end at or pass through this node
        self.token = token  # the first of its tokens
        self.length = length  # tokens it spans
        self.ref_seq, self.ref_idx = ref_seq, ref_idx  # where its tokens are read: seqs[ref_seq][ref_idx:]
        self.endpoints: dict[int, int] = {}  # sequence -> end index of its suffix that ends here
        self.parent: Node | None = None
        self.children: dict[int, Node] = {}  # first token -> child
        # children in non-increasing count, as a doubly linked list; equal counts share a Group
        self.head_child: Node | None = None
        self.tail_child: Node | None = None
        self.next_sibling: Node | None = None
        self.prev_sibling: Node | None = None
        self.group: Group | None = None


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # each token's parent index (-1: none)
    probs: list[float] = field(default_factory=list)  # each token's estimated probability (float32)
    score: float = 0.0  # the sum of probs (float32)
    match_len: int = 0  # newest tokens matched


# ---- sibling lists (the reference's _remove_from_siblings ... _decrement_count) -----------------
def _remove_from_siblings(node: Node) -> None:
    group = node.group
    if group.head is node:
        if node.next_sibling is not None and node.next_sibling.count == node.count:
            group.head = node.next_sibling
            node.group = None
        else:
            if group.prev is not None:
                group.prev.next = group.next
            if group.next is not None:
                group.next.prev = group.prev
            group.prev = group.next = None
    else:
        node.group = None
    if node.next_sibling is not None:
        node.next_sibling.prev_sibling = node.prev_sibling
    else:
        node.parent.tail_child = node.prev_sibling
    if node.prev_sibling is not None:
        node.prev_sibling.next_sibling = node.next_sibling
    else:
        node.parent.head_child = node.next_sibling
    node.prev_sibling = node.next_sibling = None


def _insert_into_siblings_before(node: Node, other: Node) -> None:
    if other.prev_sibling is not None:
        other.prev_sibling.next_sibling = node
    else:
        node.parent.head_child = node
    node.next_sibling = other
    node.prev_sibling = other.prev_sibling
    other.prev_sibling = node
    prev_sibling = node.prev_sibling
    if prev_sibling is not None and node.count == prev_sibling.count:
        node.group = prev_sibling.group
    elif node.count == other.count:
        node.group = other.group
        node.group.head = node
    else:
        group = node.group
        if group is None:
            group = node.group = Group(node)
        if prev_sibling is not None:
            group.prev = prev_sibling.group
            group.prev.next = group
        group.next = other.group
        group.next.prev = group


def _insert_into_siblings_after(node: Node, other: Node) -> None:
    if other.next_sibling is not None:
        other.next_sibling.prev_sibling = node
    else:
        node.parent.tail_child = node
    node.prev_sibling = other
    node.next_sibling = other.next_sibling
    other.next_sibling = node
    next_sibling = node.next_sibling
    if next_sibling is not None and node.count == next_sibling.count:
        node.group = next_sibling.group
        if node.group.head is next_sibling:
            node.group.head = node
    elif node.count == other.count:
        node.group = other.group
    else:
        group = node.group
        if group is None:
            group = node.group = Group(node)
        if next_sibling is not None:
            group.next = next_sibling.group
            group.next.prev = group
        group.prev = other.group
        group.prev.next = group


def _replace_in_siblings(old: Node, new: Node) -> None:
    if old.next_sibling is not None:
        old.next_sibling.prev_sibling = new
    else:
        old.parent.tail_child = new
    if old.prev_sibling is not None:
        old.prev_sibling.next_sibling = new
    else:
        old.parent.head_child = new
    new.prev_sibling = old.prev_sibling
    new.next_sibling = old.next_sibling
    old.prev_sibling = old.next_sibling = None
    group = old.group
    if group.head is old:
        group.head = new
    new.group = group
    old.group = None


def _increment_count(node: Node) -> None:
    if node.parent is None:
        node.count += 1
        return
    if node.prev_sibling is None or node.prev_sibling.count > node.count + 1:
        if node.next_sibling is None or node.next_sibling.count < node.count:
            node.count += 1
        else:  # split off from its group into a new one
            original = node.group
            original.head = node.next_sibling
            group = Group(node)
            group.next = original
            if original.prev is not None:
                group.prev = original.prev
                group.prev.next = group
            original.prev = group
            node.group = group
            node.count += 1
    else:
        other = node.prev_sibling.group.head
        _remove_from_siblings(node)
        node.count += 1
        _insert_into_siblings_before(node, other)


def _decrement_count(node: Node) -> None:
    if node.parent is None:
        node.count -= 1
        return
    if node.next_sibling is None or node.next_sibling.count < node.count - 1:
        if node.prev_sibling is None or node.prev_sibling.count > node.count:
            node.count -= 1
        else:  # split off from its group into a new one
            original = node.group
            group = Group(node)
            group.prev = original
            if original.next is not None:
                group.next = original.next
                group.next.prev = group
            original.next = group
            node.group = group
            node.count -= 1
    elif node.next_sibling.count == node.count - 1:
        node.next_sibling.group.head = node
        if node.group.head is node:  # it led its group alone: the group goes
            group = node.group
            if group.prev is not None:
                group.prev.next = group.next
            group.next.prev = group.prev
        node.group = node.next_sibling.group
        node.count -= 1
    else:
        other_group = node.group.next
        _remove_from_siblings(node)
        node.count -= 1
        if other_group is None:
            _insert_into_siblings_after(node, node.parent.tail_child)
        else:
            _insert_into_siblings_before(node, other_group.head)


class _StdHeap:
    """``std::priority_queue`` over (prob, node, idx, parent) with ``a.prob < b.prob``: libstdc++'s
    push_heap and pop_heap, so items of equal probability come out in the reference's order."""

    def __init__(self) -> None:
        self.items: list[tuple] = []

    def push(self, item: tuple) -> None:
        self.items.append(item)
        self._push_up(len(self.items) - 1, 0, item)

    def _push_up(self, hole: int, top: int, value: tuple) -> None:
        items = self.items
        parent = (hole - 1) // 2
        while hole > top and items[parent][0] < value[0]:
            items[hole] = items[parent]
            hole = parent
            parent = (hole - 1) // 2
        items[hole] = value

    def pop(self) -> tuple:
        items = self.items
        top = items[0]
        value = items.pop()
        if items:
            length = len(items)
            hole, second = 0, 0
            while second < (length - 1) // 2:
                second = 2 * (second + 1)
                if items[second][0] < items[second - 1][0]:
                    second -= 1
                items[hole] = items[second]
                hole = second
            if length % 2 == 0 and second == (length - 2) // 2:
                second = 2 * (second + 1)
                items[hole] = items[second - 1]
                hole = second - 1
            self._push_up(hole, 0, value)
        return top

    def __bool__(self) -> bool:
        return bool(self.items)


class SuffixTree:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node()
        self.seqs: dict[int, list[int]] = {}
        self.active: dict[int, deque[Node]] = {}  # per sequence: the nodes its newest suffixes end at

    def num_seqs(self) -> int:
        return len(self.seqs)

    def tokens(self) -> int:
        """Tokens held over every sequence (what a pool's memory bound counts)."""
        return sum(len(seq) for seq in self.seqs.values())

    def extend(self, seq_id: int, tokens) -> None:
        for token in tokens:
            self.append(seq_id, int(token))

    def append(self, seq_id: int, token: int) -> None:
        """Every suffix of sequence ``seq_id`` shorter than ``max_depth`` grows by ``token``,
        and a new one starts (the reference's four cases of ``append``)."""
        root = self.root
        if seq_id not in self.seqs:
            self.seqs[seq_id] = []
            self.active[seq_id] = deque()
        seq, actives = self.seqs[seq_id], self.active[seq_id]
        actives.append(root)
        root.endpoints[seq_id] = len(seq)
        root.count += 1
        if len(actives) > self.max_depth:
            actives.popleft()
        seq.append(token)
        seq_len = len(seq)
        for i, node in enumerate(actives):
            child = node.children.get(token)
            if child is None:
                if node.count == 1 and node is not root:  # 1a: a leaf only this suffix reaches grows
                    node.length += 1
                    node.endpoints[seq_id] += 1
                else:  # 1b: a new child
                    new_child = Node(1, token, 1, seq_id, seq_len - 1)
                    new_child.parent = node
                    new_child.endpoints[seq_id] = seq_len
                    node.children[token] = new_child
                    del node.endpoints[seq_id]
                    if len(node.children) == 1:
                        node.head_child = node.tail_child = new_child
                        new_child.group = Group(new_child)
                    else:
                        _insert_into_siblings_after(new_child, node.tail_child)
                    actives[i] = new_child
            elif node.count == child.count + 1 and node is not root:
                if child.length == 1:  # 2a: fuse the node with its only child
                    child.count += 1
                    child.token = node.token
                    child.length = node.length + 1
                    child.ref_seq = seq_id
                    child.ref_idx = seq_len - child.length
                    child.endpoints[seq_id] = seq_len
                    child.parent = node.parent
                    _replace_in_siblings(node, child)
                    del node.children[token]
                    node.parent.children[child.token] = child
                    actives[i] = child
                else:  # 2b: the node grows one token into its only child
                    node.length += 1
                    node.endpoints[seq_id] += 1
                    node.ref_seq = seq_id
                    node.ref_idx = seq_len - node.length
                    child.length -= 1
                    child.ref_idx += 1
                    child.token = self.seqs[child.ref_seq][child.ref_idx]
                    if child.token != token:
                        del node.children[token]
                        node.children[child.token] = child
            else:
                if child.length == 1:  # 3a: move into the child
                    del node.endpoints[seq_id]
                    child.endpoints[seq_id] = seq_len
                    _increment_count(child)
                    actives[i] = child
                else:  # 3b: split the child after its first token
                    new_node = Node(child.count, token, 1, seq_id, seq_len - 1)
                    new_node.parent = node
                    _replace_in_siblings(child, new_node)
                    node.children[token] = new_node
                    child.length -= 1
                    child.ref_idx += 1
                    child.token = self.seqs[child.ref_seq][child.ref_idx]
                    new_node.children[child.token] = child
                    child.parent = new_node
                    del node.endpoints[seq_id]
                    new_node.endpoints[seq_id] = seq_len
                    new_node.head_child = new_node.tail_child = child
                    child.group = Group(child)
                    _increment_count(new_node)
                    actives[i] = new_node

    def remove(self, seq_id: int) -> None:
        """Take sequence ``seq_id`` out: every suffix's counts down, nodes only it reached dropped,
        nodes left with one equal child merged, references moved off it."""
        seq = self.seqs[seq_id]
        root = self.root
        for start in range(len(seq)):
            node = root
            node.count -= 1
            idx = start
            path: list[Node] = []
            while idx < len(seq):
                token = seq[idx]
                child = node.children.get(token)
                if child is None:
                    break
                if child.count > 1:
                    _decrement_count(child)
                else:
                    _remove_from_siblings(child)
                    del node.children[token]
                    break
                child.endpoints.pop(seq_id, None)
                idx += child.length
                node = child
                path.append(node)
            if node is not root and len(node.children) == 1:
                child = next(iter(node.children.values()))
                if node.count == child.count:  # merge the node into its child
                    child.token = node.token
                    child.length += node.length
                    child.ref_idx -= node.length
                    child.parent = node.parent
                    _replace_in_siblings(node, child)
                    path[-1] = node = child
                    node.parent.children[node.token] = node
            leaf, distance = node, 0
            while leaf.children:
                leaf = next(iter(leaf.children.values()))
                distance += leaf.length
            if not leaf.endpoints or seq_id in leaf.endpoints:
                continue  # visited again later in this removal
            ref_seq, end = next(iter(leaf.endpoints.items()))
            ref_idx = end - distance
            while path:
                n = path.pop()
                ref_idx -= n.length
                if n.ref_seq == seq_id:
                    n.ref_seq, n.ref_idx = ref_seq, ref_idx
        del self.seqs[seq_id]
        del self.active[seq_id]

    # ---- speculation ---------------------------------------------------------------------------
    def speculate(self, context: list[int], max_spec_tokens: int, max_spec_factor: float,
                  max_spec_offset: float, min_token_prob: float, use_tree_spec: bool) -> SuffixDraft:
        """The best draft over match lengths 1 .. len(context) - 1 (a longer match wins a tie):
        each drafts at most ``max_spec_factor x match length + max_spec_offset`` tokens (and
        ``max_spec_tokens``), down the head children (a path) or best-first (a tree) while a
        token's estimated probability stays at least ``min_token_prob``."""
        factor, offset, floor = f32(max_spec_factor), f32(max_spec_offset), f32(min_token_prob)
        best = SuffixDraft()
        for match_len in range(1, len(context)):
            node, idx = self._match_context(context[len(context) - match_len :])
            if node is None:
                break
            limit = int(f32(f32(match_len * factor) + offset) + 1e-6)
            max_tokens = max(min(max_spec_tokens, limit), 0)
            if use_tree_spec:
                draft = self._speculate_tree(node, idx, max_tokens, floor)
            else:
                draft = self._speculate_path(node, idx, max_tokens, floor)
            if draft.score >= best.score:
                best = draft
                best.match_len = match_len
        return best

    def _match_context(self, context: list[int]) -> tuple[Node | None, int]:
        node, idx, ref = self.root, 0, None
        for token in context:
            if idx >= node.length:
                node = node.children.get(token)
                if node is None:
                    return None, -1
                ref = self.seqs[node.ref_seq]
                idx = 0
            if ref[node.ref_idx + idx] != token:
                return None, -1
            idx += 1
        return node, idx

    def _speculate_path(self, node: Node, idx: int, max_spec_tokens: int, min_token_prob: float) -> SuffixDraft:
        draft = SuffixDraft()
        prob = 1.0
        ref = self.seqs[node.ref_seq]
        while len(draft.token_ids) < max_spec_tokens and prob >= min_token_prob:
            if idx < node.length:
                draft.parents.append(len(draft.token_ids) - 1)
                draft.token_ids.append(ref[node.ref_idx + idx])
                draft.probs.append(prob)
                draft.score = f32(draft.score + prob)
                idx += 1
            else:
                child = node.head_child
                if child is None:
                    break
                prob = f32(prob * f32(f32(child.count) / f32(node.count)))
                node = child
                ref = self.seqs[node.ref_seq]
                idx = 0
        return draft

    def _speculate_tree(self, node: Node, idx: int, max_spec_tokens: int, min_token_prob: float) -> SuffixDraft:
        draft = SuffixDraft()
        queue = _StdHeap()
        queue.push((1.0, node, idx, -1))
        while len(draft.token_ids) < max_spec_tokens and queue:
            prob, at, index, parent = queue.pop()
            if index < at.length:
                draft.token_ids.append(self.seqs[at.ref_seq][at.ref_idx + index])
                draft.parents.append(parent)
                draft.probs.append(prob)
                draft.score = f32(draft.score + prob)
                queue.push((prob, at, index + 1, len(draft.token_ids) - 1))
            else:
                child = at.head_child
                while child is not None:
                    # float x int64 -> float, then / float: the reference's order of operations
                    child_prob = f32(f32(prob * f32(child.count)) / f32(at.count))
                    if child_prob < min_token_prob:
                        break
                    queue.push((child_prob, child, 0, parent))
                    child = child.next_sibling
        return draft
