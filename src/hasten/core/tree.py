"""TokenTree: the shape of a draft, as a value.

A draft is a set of nodes, each holding one token and the index of its parent node;
parent ``-1`` means the node hangs off the *root*, the newest committed token. A chain
(the draft of prompt lookup or a draft model) is a tree whose node ``i`` has parent
``i - 1``, so the decode loop has a single code path for both.

During verification the target runs over ``[root] + nodes``: index 0 of that block is
the root, node ``i`` sits at block index ``i + 1``. Everything below speaks in node
indices unless a name says ``block``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenTree:
    parents: tuple[int, ...]  # parents[i] < i, or -1 for a child of the root

    def __post_init__(self) -> None:
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"TokenTree: node {i} has parent {parent}; parents must precede their children")

    # ---- construction -------------------------------------------------------------
    @classmethod
    def chain(cls, length: int) -> "TokenTree":
        return cls(tuple(range(-1, length - 1)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TokenTree":
        """Build from Medusa-style paths: ``(0,)`` is the top-1 child of the root,
        ``(0, 1)`` the second child of that node, and so on. Every prefix of a path must
        be a path too. Nodes are numbered in the order the sorted paths give
        (shorter first), which keeps parents before children."""
        ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        index = {(): -1}
        parents = []
        for path in ordered:
            if not path:
                raise ValueError("TokenTree.from_paths: empty path")
            if path[:-1] not in index:
                raise ValueError(f"TokenTree.from_paths: path {path} has no parent path {path[:-1]}")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
        return cls(tuple(parents))

    # ---- derived views --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """depths[i]: 1 for a child of the root."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return tuple(out)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[0] lists the root's children; children[i + 1] those of node i."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return tuple(tuple(k) for k in kids)

    def ancestors(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def block_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: block index a may attend to block index b (root included)."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i in range(n):
            mask[i + 1, [a + 1 for a in self.ancestors(i)]] = True
        return mask

    @cached_property
    def block_positions(self) -> torch.Tensor:
        """[n + 1] position offsets of the block relative to the root."""
        return torch.tensor((0,) + self.depths, dtype=torch.long)

    @cached_property
    def leaf_paths(self) -> list[list[int]]:
        """Every root-to-leaf path as node indices (the retrieve indices of Medusa)."""
        return [self.ancestors(i) for i in range(len(self)) if not self.children[i + 1]]
