"""Input-guided aggressive decoding as the reference runs it (Ge et al. 2022, "Lossless
Acceleration for Seq2seq Generation with Aggressive Decoding"; microsoft/unilm
``decoding/IAD/inference.py``, ``paper_aggressive_generate``).

The draft is the **whole rest of the source** from the aligned position, verified in one
forward; the verifier keeps the tokens up to the first mismatch and the target's correction.
The source is the encoder input (grammar correction, the paper's task) or, for a decoder-only
target, the prompt. Alignment follows the reference's ``find_hash_sets``:

* before anything is generated for an encoder-decoder target, the copy point is the source's start;
* otherwise, for n = 1, 2, 3 in turn: if the newest n tokens are not an n-gram of the source,
  there is no alignment (decode a token); if they occur exactly once, copy from just after
  that occurrence; if they occur several times, try n + 1 (three ambiguous sizes: no alignment).

Only the source is searched, never the text generated so far (``prompt_lookup`` searches both,
copies a fixed number of tokens and re-aligns at repeated n-grams). How deep a draft may go is
the request's sizing rule's: fixed sizing lets it copy the whole rest, cost-aware sizing cuts it
where verifying more costs more than it is expected to gain.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.settings import Settings
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, register


@dataclass(frozen=True)
class IADSettings(Settings):
    min_ngram: int = 1  # the reference's min_gram
    max_ngram: int = 3  # the reference's max_gram

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {self.min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")


@dataclass
class SourceIndex:
    """The source, and for each of its n-grams the positions just after each occurrence."""

    tokens: list[int]
    ends: dict[tuple[int, ...], list[int]]
    start_length: int  # decoder tokens when the generation began
    from_start: bool  # an encoder input: copy from its start before anything is generated

    @classmethod
    def of(cls, source: list[int], sizes: range, start_length: int, from_start: bool) -> "SourceIndex":
        ends: dict[tuple[int, ...], list[int]] = {}
        for i in range(len(source)):
            for n in sizes:
                if i + n <= len(source):
                    ends.setdefault(tuple(source[i:i + n]), []).append(i + n)
        return cls(list(source), ends, start_length, from_start)

    def align(self, tokens: list[int], sizes: range) -> int | None:
        """Where to copy from after ``tokens``: the end of the shortest unique suffix n-gram."""
        if self.from_start and len(tokens) == self.start_length:
            return 0
        for n in sizes:
            if len(tokens) < n:
                return None
            ends = self.ends.get(tuple(tokens[-n:]))
            if not ends:
                return None
            if len(ends) == 1:
                return ends[0]
        return None


@register
class IAD(Drafter):
    name = "iad"
    Settings = IADSettings

    def __init__(self, settings: IADSettings | None = None, **kwargs):
        super().__init__(settings, **kwargs)
        self._sizes = range(self.settings.min_ngram, self.settings.max_ngram + 1)  # shortest first

    def begin(self, ctx: DraftContext) -> SourceIndex:
        encoder_input = ctx.source is not None
        source = ctx.source if encoder_input else ctx.tokens
        return SourceIndex.of(source, self._sizes, len(ctx.tokens), from_start=encoder_input)

    def propose(self, ctx: DraftContext) -> Draft:
        index: SourceIndex = ctx.state
        start = index.align(ctx.tokens, self._sizes) if ctx.max_depth >= 1 else None
        if start is None or start >= len(index.tokens):
            return EMPTY_DRAFT
        return Draft.chain(index.tokens[start:start + ctx.max_depth])
