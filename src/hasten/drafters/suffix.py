"""SuffixDecoding (Oliaro et al., arXiv 2411.04975, NeurIPS 2025): drafts from suffix trees over
the text generations wrote before and the current generation's own prompt and output.

A *global* tree holds the responses of earlier generations of the drafter (and of those still
running), oldest evicted first past ``max_cached_requests`` (or ``max_cached_tokens``); a *local*
tree holds this generation's prompt and tokens so far. Each step matches the newest tokens at
every length, scores each candidate continuation by the sum of its tokens' estimated
probabilities (count ratios down the tree), and drafts the best: at most ``max_spec_factor``
tokens per matched token (the draft grows with the match), no token below ``min_token_prob``.
With ``tree_spec=True`` the draft is a token tree grown best-first, verified in one forward.

The trees and the cache are a step-for-step port of the reference, ``arctic-inference``
(:mod:`hasten.drafters.suffix_tree`, :mod:`hasten.drafters.suffix_pool`); vLLM runs the same reference as
``speculative_config={"method": "suffix"}``, with these defaults.

``shared=True`` (the default) keeps one pool on the drafter object for every generation;
``shared=False``, or a generation that does not read the shared pool, drafts from its local tree
alone (and a corpus, where one is given; the lifecycle: :mod:`hasten.drafters.pooled`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.settings import Settings
from .suffix_pool import SuffixPool
from .suffix_tree import SuffixDraft
from ..core.tree import TokenTree
from .base import Draft, DraftContext, EMPTY_DRAFT, register
from .pooled import PooledDrafter, PooledState

# evidence classes (Drafter.evidence): the newest tokens matched; a draft found after a longer
# match is accepted more often (SuffixDecoding's reason for sizing drafts by the match length)
MATCH_CLASSES = (1, 3, 6, 12)  # a class starts at each of these match lengths


@dataclass(frozen=True)
class SuffixSettings(Settings):
    max_tree_depth: int = 24  # suffixes kept this long; the newest this many tokens are matched (vLLM's default)
    max_spec_tokens: int = 24  # draft tokens at most (vLLM's num_speculative_tokens default for suffix)
    # draft tokens per matched token: 4, not vLLM's 1, since hasten's cost-aware sizing chooses
    # how much of a draft to verify (the replays that chose it: docs/methods.md, suffix)
    max_spec_factor: float = 4.0
    max_spec_offset: float = 0.0  # ... plus this many
    min_token_prob: float = 0.1  # no draft token whose estimated probability is lower
    tree_spec: bool = True  # a token tree grown best-first (False: the likeliest path, as vLLM drafts)
    shared: bool = True  # one pool for every generation of this drafter; False: each drafts from its own text
    max_cached_requests: int = 10000  # responses the global tree keeps, oldest evicted first (vLLM's default)
    max_cached_tokens: int = 1 << 19  # hasten's bound on the global tree's tokens, oldest responses evicted first
    corpus: str | None = None  # a text file the shared pool learns once, as if it were a response

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_tree_depth", "max_spec_tokens", "max_cached_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {self.max_cached_requests}")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


@dataclass
class SuffixState(PooledState):
    found: tuple[int, SuffixDraft, bool] | None = None  # (len(tokens), draft, from the global tree) last drafted


@register
class Suffix(PooledDrafter):
    name = "suffix"
    Settings = SuffixSettings
    State = SuffixState

    def new_pool(self) -> SuffixPool:
        s = self.settings
        return SuffixPool(s.max_tree_depth, s.max_cached_requests, s.max_cached_tokens)

    def private_pool(self) -> SuffixPool:
        """The local tree alone (no global tree), or the corpus and this response where a corpus is given."""
        s = self.settings
        return SuffixPool(s.max_tree_depth, 2 if s.corpus else 0, s.max_cached_tokens)

    def evidence(self, ctx: DraftContext) -> int:
        """0: no draft; else 1 + how many of MATCH_CLASSES the match length reaches beyond the first."""
        draft, _ = self._speculate(ctx)
        if not draft.token_ids:
            return 0
        return sum(draft.match_len >= start for start in MATCH_CLASSES)

    def propose(self, ctx: DraftContext) -> Draft:
        if ctx.max_depth < 1:
            return EMPTY_DRAFT
        draft, learned = self._speculate(ctx)
        ctx.state.pool.count(learned and bool(draft.token_ids))
        if not draft.token_ids:
            return EMPTY_DRAFT
        tree = TokenTree(tuple(draft.parents))
        return Draft(tuple(draft.token_ids), tree).limit_depth(ctx.max_depth).within_vocab(ctx.target.vocab_size)

    def _speculate(self, ctx: DraftContext) -> tuple[SuffixDraft, bool]:
        state: SuffixState = ctx.state
        if state.found is None or state.found[0] != len(ctx.tokens):
            s = self.settings
            draft, learned = state.pool.speculate(state.place, ctx.tokens, s.max_spec_tokens, s.max_spec_factor,
                                                  s.max_spec_offset, s.min_token_prob, s.tree_spec)
            state.found = (len(ctx.tokens), draft, learned)
        return state.found[1], state.found[2]
