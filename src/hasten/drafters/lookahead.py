"""Lookahead (Zhao et al. 2023, Alipay): multi-branch drafts retrieved from a pool of what
followed each token, shared by every generation of the drafter (:mod:`hasten.drafters.lookahead_pool`
has the pool as the reference builds it: prompt and output frequencies kept apart and mixed
for ranking, pruning by ``squeeze``, hierarchical multi-branch drafts, save and load).

``shared=True`` (the default) keeps one pool on the drafter object for every generation;
``shared=False`` starts every generation on an empty pool of its own (the lifecycle:
:mod:`hasten.drafters.pooled`).

Graded drafts (``Drafter.evidence``, for cost-aware sizing): 2 per query token matched, minus
1 when the likeliest first token followed the query only once. A draft found after a longer
query, or whose first token followed it more than once, is accepted far more often.
"""
from __future__ import annotations

from dataclasses import dataclass

from .lookahead_pool import LookaheadPool
from ..core.settings import Settings
from ..core.tree import TokenTree
from .base import Draft, DraftContext, EMPTY_DRAFT, register
from .pooled import PooledDrafter, PooledState


@dataclass(frozen=True)
class LookaheadSettings(Settings):
    draft_tokens: int = 12  # tree nodes verified per step (the reference: decoding_length 64, so 63)
    branch_length: int = 6  # deepest draft node (the reference: 12)
    max_prefix: int = 2  # newest tokens a draft is looked up after, the longest first (the reference's max_query_length)
    min_prefix: int = 1  # the shortest such query tried
    output_weight: float = 1e-4  # weight of output frequency against prompt frequency in the ranking
    shared: bool = True  # one pool for every generation of this drafter; False: a new one per generation
    max_nodes: int = 1 << 19  # the pool's bound: squeezed (halved, rare nodes dropped) while it holds more
    max_tree_nodes: int = 65536  # the reference's max_node: one token's tree is squeezed past it ...
    max_output_nodes: int = 512  # ... or past this many nodes grown from output (max_output_node)
    corpus: str | None = None  # a text file the pool learns once, as if generated, before the first draft

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("draft_tokens", "branch_length", "min_prefix", "max_nodes", "max_tree_nodes",
                     "max_output_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefix < self.min_prefix:
            raise ValueError(f"max_prefix ({self.max_prefix}) must be >= min_prefix ({self.min_prefix})")
        if not 0.0 <= self.output_weight <= 1.0:
            raise ValueError(f"output_weight must be in [0, 1], got {self.output_weight}")


@register
class Lookahead(PooledDrafter):
    name = "lookahead"
    Settings = LookaheadSettings

    def new_pool(self) -> LookaheadPool:
        s = self.settings
        return LookaheadPool(s.max_prefix - 1 + s.branch_length, s.max_prefix, s.min_prefix, s.output_weight,
                             s.max_tree_nodes, s.max_output_nodes, s.max_nodes)

    def evidence(self, ctx: DraftContext) -> int:
        """0: no draft; else 2 per query token, minus 1 when the likeliest first token followed
        the query once (1 .. 2 * max_prefix)."""
        found = self._draft(ctx, self.settings.branch_length)
        return 0 if not found.query else 2 * found.query - (found.top < 2.0)

    def propose(self, ctx: DraftContext) -> Draft:
        depth = min(self.settings.branch_length, ctx.max_depth)
        if depth < 1:
            return EMPTY_DRAFT
        found = self._draft(ctx, depth)
        ctx.state.pool.count(found.learned)
        if not found.tokens:
            return EMPTY_DRAFT
        return Draft(tuple(found.tokens), TokenTree(tuple(found.parents))).within_vocab(ctx.target.vocab_size)

    def _draft(self, ctx: DraftContext, depth: int):
        state: PooledState = ctx.state
        return state.pool.draft(state.place, ctx.tokens, self.settings.draft_tokens, depth)
