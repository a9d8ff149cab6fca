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
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, register


@dataclass(frozen=True)
class PromptLookupSettings(Settings):
    max_ngram: int = 3  # longest suffix tried first
    min_ngram: int = 1  # shortest suffix accepted as a match
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


class NgramIndex:
    """For each n, the latest (or, with ``earliest``, the first) end position of every
    n-gram that has a continuation."""

    def __init__(self, sizes: range, earliest: bool = False):
        self.sizes, self.earliest = sizes, earliest
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the tables

    def extend(self, tokens: list[int]) -> None:
        # An n-gram ending at position e is usable only once tokens[e + 1] exists.
        for end in range(self.indexed, len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    key = tuple(tokens[end + 1 - n : end + 1])
                    if not (self.earliest and key in self.tables[n]):
                        self.tables[n][key] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def find(self, suffix: tuple[int, ...]) -> int | None:
        return self.tables[len(suffix)].get(suffix)


# evidence classes (see Drafter.evidence): how many tokens before the copy point match the
# text just written. A long match means a copy stretch is under way; measured on SmolLM2's chat
# tasks, copies after 16+ matching tokens were accepted at 0.96 at depth 1 and ~1.0 deeper,
# after fewer than 8 at 0.70 (then 0.76-0.95)
NO_MATCH, SHORT_MATCH, MEDIUM_MATCH, LONG_MATCH = 0, 1, 2, 3
MEDIUM_FROM, LONG_FROM = 8, 16  # matching tokens (the n-gram included)


@dataclass(frozen=True)
class Match:
    """Where this step's suffix was found: copy ``text[start:]`` (cyclically with ``period``
    when the match overlaps the suffix); ``matched`` tokens before it equal the newest ones
    (at least the n-gram, counted up to LONG_FROM)."""

    text: list[int]
    start: int
    period: int | None
    matched: int

    @property
    def evidence(self) -> int:
        return LONG_MATCH if self.matched >= LONG_FROM else MEDIUM_MATCH if self.matched >= MEDIUM_FROM else SHORT_MATCH

    def copy(self, count: int) -> Draft:
        if self.period is None:
            return Draft.chain(self.text[self.start : self.start + count])
        return Draft.chain(self.text[self.start + i % self.period] for i in range(count))


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
        return EMPTY_DRAFT if match is None else match.copy(count)

    def lookup(self, ctx: DraftContext) -> Match | None:
        """The longest suffix (down to ``min_ngram``) found in the committed tokens, else in
        the encoder input; remembered until the tokens change."""
        tokens, state = ctx.tokens, ctx.state
        if state.found is not None and state.found[0] == len(tokens):
            return state.found[1]
        state.history.extend(tokens)
        match = None
        for n in self._sizes:
            if n > len(tokens):
                continue
            suffix = tuple(tokens[-n:])
            end = state.history.find(suffix)
            if end is not None:
                # The match may overlap the suffix (a repeating stretch): the text
                # then continues with period len(tokens) - end - 1, so copy cyclically.
                match = Match(tokens, end + 1, len(tokens) - end - 1, _matched(tokens, end, tokens, n))
                break
            end = state.source.find(suffix)
            if end is not None:
                match = Match(state.source_tokens, end + 1, None, _matched(state.source_tokens, end, tokens, n))
                break
        state.found = (len(tokens), match)
        return match


def _matched(text: list[int], end: int, tokens: list[int], n: int) -> int:
    """Tokens of ``text`` ending at ``end`` equal to the newest ``tokens`` (``n`` known to be),
    counted up to LONG_FROM."""
    matched = n
    while matched < LONG_FROM and matched <= end and matched < len(tokens) and \
            text[end - matched] == tokens[-1 - matched]:
        matched += 1
    return matched
