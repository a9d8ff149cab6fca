"""The n-gram matching of input-guided drafting (prompt lookup), with no torch and no model:
hasten's ``prompt_lookup`` drafter and its vLLM proposer (:mod:`hasten.vllm`) share it.

:class:`NgramIndex` keeps, for every n-gram of the text that has a continuation, where it
last (or first) ended; :func:`find` looks up the longest suffix of the newest tokens and
returns a :class:`Match` to copy from. A match that overlaps the suffix (a repeating
stretch) is copied cyclically.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_NGRAM, MIN_NGRAM = 3, 1  # prompt lookup's default suffix lengths: the longest tried first, the shortest accepted


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
# text just written. A long match means a copy stretch is under way, and its copy is accepted
# far more often than one after a short match (docs/cpu.md, "Graded drafts")
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

    def copy(self, count: int) -> list[int]:
        """The next ``count`` tokens after the match (fewer where the text ends)."""
        if self.period is None:
            return list(self.text[self.start : self.start + count])
        return [self.text[self.start + i % self.period] for i in range(count)]


def matched_tokens(text: list[int], end: int, tokens: list[int], n: int) -> int:
    """Tokens of ``text`` ending at ``end`` equal to the newest ``tokens`` (``n`` known to be),
    counted up to LONG_FROM."""
    matched = n
    while matched < LONG_FROM and matched <= end and matched < len(tokens) and \
            text[end - matched] == tokens[-1 - matched]:
        matched += 1
    return matched


def find(tokens: list[int], sources: list[tuple[NgramIndex, list[int]]]) -> Match | None:
    """The longest suffix of ``tokens`` (the sizes of the indexes, longest first) found in
    one of ``sources`` (an index and the text it covers, tried in order for each size), or
    None. A source whose text is ``tokens`` itself may match overlapping the suffix: the text
    then continues with period ``len(tokens) - end - 1``, copied cyclically."""
    for n in sources[0][0].sizes:
        if n > len(tokens):
            continue
        suffix = tuple(tokens[-n:])
        for index, text in sources:
            end = index.find(suffix)
            if end is not None:
                period = len(tokens) - end - 1 if text is tokens else None
                return Match(text, end + 1, period, matched_tokens(text, end, tokens, n))
    return None
