"""Checks on text the model wrote for itself: degenerate loops, near-duplicates, and overlap
with any benchmark prompt of this repository (which must never be trained on).

Texts are compared as sets of word n-grams after normalisation (lower case, every run of
characters that are not letters or digits one space). :class:`NgramIndex` answers, for a new
text, the largest *overlap* with a text it holds: shared n-grams over the smaller set's size
(1.0 when one text's n-grams all occur in the other, e.g. a benchmark question pasted into a
longer message), and the largest *Jaccard* similarity (shared over union: near-duplicates).
A text shorter than ``n`` words is one "n-gram", itself, so short texts compare exactly.

The benchmark's prompts are read as text, not imported (training and the benchmark are on
the same floor of the package, see tests/test_layering.py): every string literal of every
module in ``hasten/bench`` and every string value in its data files (Spec-Bench's 480
questions with both MT-bench turns, the GEC sentences, ...). Docstrings and messages come
along; they cost nothing but a rare dropped prompt. tests/test_selfgen.py checks that every
prompt the bench's own functions build is caught.
"""
from __future__ import annotations

import ast
import json
import re
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
BENCH_NGRAM = 5  # words per n-gram for the benchmark guard
BENCH_MIN_CHARS = 16  # shorter string literals of the bench's modules are names and keys, not prompts
_NOT_WORD = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> str:
    return _NOT_WORD.sub(" ", text.lower()).strip()


def ngrams(text: str, n: int) -> frozenset[tuple[str, ...]]:
    words = normalise(text).split()
    if len(words) < n:
        return frozenset([tuple(words)]) if words else frozenset()
    return frozenset(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


class NgramIndex:
    """Texts held as n-gram sets, with an inverted index so a query touches only texts that
    share an n-gram with it."""

    def __init__(self, n: int):
        self.n = n
        self.sets: list[frozenset] = []
        self.holders: dict[tuple[str, ...], list[int]] = defaultdict(list)

    def add(self, text: str) -> None:
        grams = ngrams(text, self.n)
        if not grams:
            return
        number = len(self.sets)
        self.sets.append(grams)
        for gram in grams:
            self.holders[gram].append(number)

    def shared(self, grams: frozenset) -> Counter:
        """Held text number -> n-grams it shares with ``grams``."""
        counts: Counter = Counter()
        for gram in grams:
            counts.update(self.holders.get(gram, ()))
        return counts

    def overlap(self, text: str) -> float:
        """The largest shared / min(size) over held texts (0.0 when none shares an n-gram)."""
        grams = ngrams(text, self.n)
        return max((count / min(len(grams), len(self.sets[k])) for k, count in self.shared(grams).items()),
                   default=0.0)

    def jaccard(self, text: str) -> float:
        """The largest shared / union over held texts."""
        grams = ngrams(text, self.n)
        return max((count / (len(grams) + len(self.sets[k]) - count) for k, count in self.shared(grams).items()),
                   default=0.0)


def degenerate(text: str, *, min_words: int = 3, n: int = 3, max_repeated: float = 0.3) -> str | None:
    """Why ``text`` is not a usable message (None when it is): no letters, fewer than
    ``min_words`` words, or a loop (over ``max_repeated`` of its word n-grams repeat an
    earlier one, or one word is over half of a text of 8 words or more)."""
    if not re.search(r"[^\W\d_]", text):
        return "no letters"
    words = normalise(text).split()
    if len(words) < min_words:
        return "too short"
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if grams and 1 - len(set(grams)) / len(grams) > max_repeated:
        return "repeated n-grams"
    if len(words) >= 8 and Counter(words).most_common(1)[0][1] > len(words) / 2:
        return "one word repeated"
    return None


# ---- the benchmark's prompts --------------------------------------------------------------------
def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _module_strings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


@lru_cache(maxsize=1)
def bench_texts(root: Path = BENCH_DIR) -> tuple[str, ...]:
    """Every text the benchmark could put in a prompt: its modules' string literals and its
    data files' string values (JSONL)."""
    texts = [s for path in sorted(root.rglob("*.py")) for s in _module_strings(path)]
    for path in sorted(root.rglob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.extend(_strings(json.loads(line)))
    return tuple(sorted({t for t in texts if len(t.strip()) >= BENCH_MIN_CHARS}))


@lru_cache(maxsize=1)
def bench_index() -> NgramIndex:
    index = NgramIndex(BENCH_NGRAM)
    for text in bench_texts():
        index.add(text)
    return index


def bench_overlap(text: str) -> float:
    """How much of ``text`` (or of a benchmark text inside it) is a benchmark prompt: the
    largest share of word 5-grams it has in common with one (0.0 to 1.0)."""
    return bench_index().overlap(text)
