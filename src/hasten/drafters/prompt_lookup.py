"""Input-guided drafting (IAD, prompt lookup): copy what followed an earlier occurrence of
the current suffix (the latest one, or with ``match="earliest"`` the first, as Hugging Face's
prompt lookup does: in an edit, the first occurrence is usually the original text).

Ge et al.'s Aggressive Decoding drafts from the input for tasks whose output restates
it (grammar correction, editing, retrieval-augmented answers); prompt lookup decoding
applies the same idea to any prompt. For an encoder-decoder target the encoder input
(the text being corrected) is searched too.

The n-gram tables are updated incrementally as tokens are committed, so a lookup costs
O(max_ngram) whatever the context length.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.settings import Settings
from .ngram import MAX_NGRAM, MIN_NGRAM, NO_MATCH, Match, NgramIndex, find
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, register


@dataclass(frozen=True)
class PromptLookupSettings(Settings):
    max_ngram: int = MAX_NGRAM  # longest suffix tried first
    min_ngram: int = MIN_NGRAM  # shortest suffix accepted as a match
    num_tokens: int = 10  # tokens copied after the match
    match: str = "latest"  # which occurrence of the suffix to copy after: "latest" or "earliest"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.match not in ("latest", "earliest"):
            raise ValueError(f"match must be 'latest' or 'earliest', got {self.match!r}")
        if self.min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {self.min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")


@dataclass
class LookupState:
    """One generation's n-gram tables: of the committed tokens, and of the encoder input."""

    history: NgramIndex
    source: NgramIndex
    source_tokens: list[int]
    found: tuple[int, Match | None] | None = None  # (len(tokens), match) of the latest lookup


@register
class PromptLookup(Drafter):
    name = "prompt_lookup"
    Settings = PromptLookupSettings
    hindsight_ok = True  # a proposal is a lookup, remembered for these tokens, and a copy

    def __init__(self, settings: PromptLookupSettings | None = None, **kwargs):
        super().__init__(settings, **kwargs)
        self._sizes = range(self.settings.max_ngram, self.settings.min_ngram - 1, -1)  # longest first

    def begin(self, ctx: DraftContext) -> "LookupState":
        earliest = self.settings.match == "earliest"
        state = LookupState(NgramIndex(self._sizes, earliest), NgramIndex(self._sizes, earliest), ctx.source or [])
        state.source.extend(state.source_tokens)
        state.history.extend(ctx.tokens)  # the prompt, now rather than in the first (timed) step
        return state

    def evidence(self, ctx: DraftContext) -> int:
        match = self.lookup(ctx)
        return NO_MATCH if match is None else match.evidence

    def propose(self, ctx: DraftContext) -> Draft:
        count = min(self.settings.num_tokens, ctx.max_depth)
        match = self.lookup(ctx) if count >= 1 else None
        return EMPTY_DRAFT if match is None else Draft.chain(match.copy(count))

    def lookup(self, ctx: DraftContext) -> Match | None:
        """The longest suffix (down to ``min_ngram``) found in the committed tokens, else in
        the encoder input; remembered until the tokens change."""
        tokens, state = ctx.tokens, ctx.state
        if state.found is not None and state.found[0] == len(tokens):
            return state.found[1]
        state.history.extend(tokens)
        match = find(tokens, [(state.history, tokens), (state.source, state.source_tokens)])
        state.found = (len(tokens), match)
        return match
