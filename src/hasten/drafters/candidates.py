"""Candidate trees shared by the drafters that guess several tokens at once.

Two builders, both returning trees whose siblings hold distinct tokens and whose
parents precede their children (what :class:`~hasten.core.tree.TokenTree` and the
verifier need):

* **top-k combinations** (Medusa, Chimera, hidden transfer, GAD): every level of the tree
  is one ranked list of guesses made *at once* for that depth; the node with path
  ``(i1, i2, ...)`` holds the ``i_d``-th guess for depth ``d``. Which paths to keep is
  Medusa's sparse tree: the ``size`` paths of highest expected acceptance, from
  per-depth rank accuracies measured in training (or a prior).
* **dynamic trees** (EAGLE-2, Li et al. 2024): grown level by level from an
  autoregressive drafter, expanding the ``top_k`` most confident frontier nodes by
  cumulative draft log-probability, then keeping the ``total_tokens`` best nodes overall.
"""
from __future__ import annotations

import ast
import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..core.settings import Settings
from ..core.tree import TokenTree

Paths = tuple[tuple[int, ...], ...]


# ---- top-k combinations --------------------------------------------------------------------
def sparse_tree(accuracy: Sequence[Sequence[float]], size: int) -> Paths:
    """Medusa's sparse tree: the ``size`` paths with the highest expected acceptance, a
    path's acceptance being the product of its levels' rank accuracies (treated as
    independent). A child never scores above its parent, so best-first search returns a
    prefix-closed set."""
    frontier = [(-acc, (rank,)) for rank, acc in enumerate(accuracy[0])]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < size:
        negative_score, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(accuracy):
            for rank, acc in enumerate(accuracy[len(path)]):
                heapq.heappush(frontier, (negative_score * acc, path + (rank,)))
    return tuple(chosen)


def guessed_accuracy(levels: int, ranks: int) -> list[list[float]]:
    """A prior for untrained guessers: deeper levels and lower ranks are right less
    often (the shape of the tables in the Medusa paper)."""
    return [[0.6 ** (k + 1) * 0.4**rank for rank in range(ranks)] for k in range(levels)]


def parse_paths(tree) -> Paths | None:
    """Validate Medusa-style paths given as a sequence or as a string from the command line
    (``"[(0,), (0, 0), (1,)]"``); ``None`` stays ``None``."""
    if tree is None:
        return None
    if isinstance(tree, str):
        try:
            tree = ast.literal_eval(tree)
        except (ValueError, SyntaxError):
            raise ValueError(f"tree must be a list of paths like [(0,), (0, 0), (1,)], got {tree!r}") from None
    try:
        paths = tuple(tuple(int(i) for i in path) for path in tree)
    except TypeError:
        raise ValueError(f"tree must be a list of paths like [(0,), (0, 0), (1,)], got {tree!r}") from None
    if not paths or any(i < 0 for path in paths for i in path):
        raise ValueError(f"tree needs at least one path of ranks >= 0, got {tree!r}")
    TokenTree.from_paths(paths)  # every prefix of a path must be a path
    return paths


@dataclass(frozen=True)
class TreeSettings(Settings):
    """The knobs of a top-k-combination tree; drafters' settings dataclasses extend it."""

    # explicit paths, e.g. ((0,), (0, 0), (1,)) or the same as a string; None: a sparse
    # tree of tree_size nodes from the measured rank accuracies (a prior when untrained)
    tree: tuple[tuple[int, ...], ...] | None = None
    top_k: int = 3  # ranks per level the default tree may use
    tree_size: int = 16  # nodes of the default tree: wider trees accept more but cost more per verify

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tree", parse_paths(self.tree))
        for name in ("top_k", "tree_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class CombinationTree:
    """A fixed top-k-combination tree: paths in :meth:`TokenTree.from_paths` node order."""

    def __init__(self, paths: Paths):
        self.paths = tuple(sorted(set(paths), key=lambda p: (len(p), p)))
        self.tree = TokenTree.from_paths(self.paths)
        self.width = 1 + max(i for path in self.paths for i in path)  # ranks needed per level
        self.depth = max(map(len, self.paths))

    @classmethod
    def choose(cls, settings: TreeSettings, accuracy: Sequence[Sequence[float]] | None,
               levels: int) -> "CombinationTree":
        """The settings' explicit paths, else a sparse tree from ``accuracy`` (rank
        accuracies per level; None: a prior) over ``levels`` levels."""
        paths = settings.tree
        if paths is None:
            accuracy = accuracy or guessed_accuracy(levels, settings.top_k)
            paths = sparse_tree([row[: settings.top_k] for row in accuracy[:levels]], settings.tree_size)
        if max(map(len, paths)) > levels:
            raise ValueError(f"tree is {max(map(len, paths))} deep but the drafter guesses only {levels} levels")
        return cls(paths)

    def tokens(self, ranked: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """``ranked[d][r]``: the rank-r guess for depth d + 1 -> one token per node."""
        return tuple(int(ranked[len(path) - 1][path[-1]]) for path in self.paths)

    def ranked(self, logits: torch.Tensor) -> list[list[int]]:
        """[levels, vocab] scores -> the ``width`` best token ids per level."""
        return logits.topk(min(self.width, logits.shape[-1]), dim=-1).indices.tolist()


# ---- dynamic trees (EAGLE-2) ---------------------------------------------------------------------
@dataclass
class GrowingTree:
    """Candidate nodes in creation order (parents first); scores are cumulative log-probs."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: a child of the root
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1


class LevelVisibility:
    """What each node of a :class:`GrowingTree` sees among the nodes already fed to the draft,
    level by level: its ancestors and itself (tree attention inside the draft)."""

    def __init__(self) -> None:
        self.sees: dict[int, list[int]] = {-1: []}  # node -> indices of the fed nodes it sees

    @property
    def fed(self) -> int:
        """Nodes fed so far (earlier levels)."""
        return len(self.sees) - 1

    def add_level(self, nodes: list[int], tree: GrowingTree) -> torch.Tensor:
        """Feed ``nodes`` (one level, after the earlier ones): [len(nodes), fed + len(nodes)]
        bool, row i the fed nodes node i sees, this level's own columns last."""
        fed, count = self.fed, len(nodes)
        rows = torch.zeros(count, fed + count, dtype=torch.bool)
        for row, node in enumerate(nodes):
            self.sees[node] = self.sees[tree.parents[node]] + [fed + row]
            rows[row, self.sees[node]] = True
        return rows


# expand(nodes, tree) -> [len(nodes), vocab] the draft's log-probs of each node's next token
Expand = Callable[[list[int], GrowingTree], torch.Tensor]


def dynamic_tree(first_logp: torch.Tensor, expand: Expand, depth: int, top_k: int,
                 total_tokens: int) -> tuple[tuple[int, ...], TokenTree]:
    """EAGLE-2's context-aware tree.

    ``first_logp`` ([vocab]) is the draft's log-distribution for depth 1. Each level keeps
    the ``top_k`` children of every expanded node; the next level expands the ``top_k``
    nodes of the newest level with the highest cumulative log-prob (the product of draft
    probabilities along the path, EAGLE-2's estimate of acceptance). Finally the
    ``total_tokens`` candidates of highest score form the tree. A child never scores above
    its parent and ties go to the shallower node, so the kept set holds every ancestor of
    each kept node; siblings are distinct as top-k of one distribution.
    """
    grown = GrowingTree()
    top_k = min(top_k, first_logp.shape[-1])
    values, ids = first_logp.clamp(max=0).topk(top_k)
    level = [grown.add(t, -1, v) for v, t in zip(values.tolist(), ids.tolist())]
    for _ in range(depth - 1):
        frontier = sorted(level, key=lambda n: (-grown.scores[n], n))[:top_k]
        logp = expand(frontier, grown).clamp(max=0)  # [len(frontier), vocab]
        values, ids = logp.topk(top_k, dim=-1)
        level = []
        for node, row_values, row_ids in zip(frontier, values.tolist(), ids.tolist()):
            level.extend(grown.add(t, node, grown.scores[node] + v) for v, t in zip(row_values, row_ids))
    return select(grown, total_tokens)


def select(grown: GrowingTree, total_tokens: int) -> tuple[tuple[int, ...], TokenTree]:
    """The ``total_tokens`` best candidates, renumbered parents first."""
    best = sorted(range(len(grown.tokens)), key=lambda n: (-grown.scores[n], grown.depths[n], n))[:total_tokens]
    kept = sorted(best, key=lambda n: (grown.depths[n], n))
    index = {-1: -1, **{old: new for new, old in enumerate(kept)}}
    parents = tuple(index[grown.parents[n]] for n in kept)  # KeyError would mean an orphan: impossible
    return tuple(grown.tokens[n] for n in kept), TokenTree(parents)
