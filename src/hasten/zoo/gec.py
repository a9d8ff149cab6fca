"""Grammatical error correction data for ``zoo:gec-tiny``: clean English sentences the project
already ships (the Python standard library's docstrings and ``pydoc_data.topics``, Python's own
documentation), and synthetic corruptions of them: the model reads the corrupted sentence and
writes the clean one.

Corruptions, 0 to 3 a sentence (none in 15 % of sentences: a corrector must leave correct text
alone): typos (two adjacent letters swapped, a letter dropped or doubled), agreement (is/are,
was/were, has/have, do/does, this/these, a final -s dropped), articles (the/a/an deleted or
inserted, a/an swapped) and word order (two adjacent words swapped).

The split is fixed by a hash of each sentence (``HELDOUT_PERCENT`` held out). The held-out
sentences the bench and the tests use were corrupted once, with a fixed seed, and ship in
``hasten/bench/data/gec/heldout.jsonl`` (written before the model was measured):
:func:`heldout_pairs` reads them.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from pathlib import Path

from . import corpus

HELDOUT_PERCENT = 3
HELDOUT_FILE = Path(__file__).resolve().parent.parent / "bench" / "data" / "gec" / "heldout.jsonl"
HELDOUT_SHIPPED = 200  # sentences in the shipped held-out file
MIN_CHARS, MAX_CHARS, MIN_WORDS = 30, 140, 5
SENTENCE = re.compile(r"[A-Za-z ,.;:'()-]+")  # plain prose: no code, no markup
EDITS_PER_SENTENCE = ((0, 0.15), (1, 0.4), (2, 0.3), (3, 0.15))  # (edits, probability)
EDIT_KINDS = (("typo", 0.4), ("agreement", 0.2), ("article", 0.25), ("order", 0.15))
AGREEMENT = {"is": "are", "are": "is", "was": "were", "were": "was", "has": "have", "have": "has",
             "does": "do", "do": "does", "this": "these", "these": "this"}
ARTICLES = ("the", "a", "an")


# ---------------------------------------------------------------- sentences


def _texts() -> list[str]:
    """Python's documentation topics, then every docstring of the stdlib, in file order."""
    import pydoc_data.topics

    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    for path in corpus.all_files():
        try:
            tree = ast.parse(corpus.read_text(path))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return texts


def sentences() -> list[str]:
    """The clean sentences, deduplicated, in first-seen order."""
    seen: dict[str, None] = {}
    for text in _texts():
        for paragraph in re.split(r"\n\s*\n", text):
            for s in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                if (MIN_CHARS <= len(s) <= MAX_CHARS and s[0].isupper() and s.endswith(".")
                        and SENTENCE.fullmatch(s) and len(s.split()) >= MIN_WORDS):
                    seen.setdefault(s, None)
    return list(seen)


def is_heldout(sentence: str) -> bool:
    digest = hashlib.sha256(sentence.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def split(all_sentences: list[str]) -> tuple[list[str], list[str]]:
    """(training, held-out) sentences."""
    return ([s for s in all_sentences if not is_heldout(s)], [s for s in all_sentences if is_heldout(s)])


# ---------------------------------------------------------------- corruptions


def _core(word: str) -> tuple[str, str, str]:
    """A word split into leading punctuation, letters, trailing punctuation."""
    m = re.fullmatch(r"([^A-Za-z]*)([A-Za-z]*)(.*)", word)
    return m.group(1), m.group(2), m.group(3)


def _typo(words: list[str], rng: random.Random) -> bool:
    spots = [i for i, w in enumerate(words) if len(_core(w)[1]) >= 4]
    if not spots:
        return False
    i = rng.choice(spots)
    lead, letters, trail = _core(words[i])
    kind, j = rng.choice(("swap", "drop", "double")), rng.randrange(1, len(letters) - 1)
    if kind == "swap":
        letters = letters[:j] + letters[j + 1] + letters[j] + letters[j + 2:]
    elif kind == "drop":
        letters = letters[:j] + letters[j + 1:]
    else:
        letters = letters[:j] + letters[j] + letters[j:]
    words[i] = lead + letters + trail
    return True


def _agreement(words: list[str], rng: random.Random) -> bool:
    swaps = [i for i, w in enumerate(words) if _core(w)[1] in AGREEMENT and not _core(w)[0] + _core(w)[2]]
    plurals = [i for i, w in enumerate(words) if i > 0 and w.isalpha() and w.islower() and len(w) >= 4
               and w.endswith("s") and not w.endswith("ss")]
    spots = [("swap", i) for i in swaps] + [("plural", i) for i in plurals]
    if not spots:
        return False
    kind, i = rng.choice(spots)
    words[i] = AGREEMENT[words[i]] if kind == "swap" else words[i][:-1]
    return True


def _article(words: list[str], rng: random.Random) -> bool:
    present = [i for i, w in enumerate(words) if w in ARTICLES and i + 1 < len(words)]
    free = [i for i, w in enumerate(words) if i > 0 and w.isalpha() and w.islower() and words[i - 1] not in ARTICLES]
    choices = [("delete", i) for i in present] + [("insert", i) for i in free]
    if not choices:
        return False
    kind, i = rng.choice(choices)
    if kind == "delete" and words[i] in ("a", "an") and rng.random() < 0.5:
        words[i] = "an" if words[i] == "a" else "a"
    elif kind == "delete":
        del words[i]
    else:
        words.insert(i, rng.choice(("the", "the", "a")))
    return True


def _order(words: list[str], rng: random.Random) -> bool:
    spots = [i for i in range(1, len(words) - 1) if words[i].isalpha() and words[i + 1].isalpha()
             and words[i] != words[i + 1]]
    if not spots:
        return False
    i = rng.choice(spots)
    words[i], words[i + 1] = words[i + 1], words[i]
    return True


EDITS = {"typo": _typo, "agreement": _agreement, "article": _article, "order": _order}


def _pick(table, rng: random.Random):
    r, total = rng.random(), 0.0
    for value, p in table:
        total += p
        if r < total:
            return value
    return table[-1][0]


def corrupt(sentence: str, rng: random.Random, edit_kinds=EDIT_KINDS) -> tuple[str, list[str]]:
    """The sentence with 0-3 synthetic errors, and the kinds of the edits made."""
    words, kinds = sentence.split(" "), []
    for _ in range(_pick(EDITS_PER_SENTENCE, rng)):
        for _attempt in range(4):  # a kind that finds no place in this sentence: try another
            kind = _pick(edit_kinds, rng)
            if EDITS[kind](words, rng):
                kinds.append(kind)
                break
    return " ".join(words), kinds


def word_pool(training: list[str]) -> list[str]:
    """Every word of the training sentences, as often as it occurs (punctuation kept)."""
    return [w for s in training for w in s.split(" ")]


def salad(pool: list[str], rng: random.Random) -> str:
    """A sentence of 6-18 words drawn at random from ``pool``: text no corrector can have
    memorised, so only copying (and spelling) writes it back. Training mixes these in so that
    the decoder learns to copy its source instead of recalling the few thousand training sentences."""
    words = [rng.choice(pool) for _ in range(rng.randint(6, 18))]
    text = " ".join(words).rstrip(".,;:")
    return text[0].upper() + text[1:] + "."


# ---------------------------------------------------------------- the shipped held-out set


def write_heldout(path: Path = HELDOUT_FILE, count: int = HELDOUT_SHIPPED, seed: int = 30) -> Path:
    """``count`` held-out sentences, corrupted with ``seed``, one JSON object a line:
    ``{"source": corrupted, "target": clean, "edits": [kinds]}``."""
    heldout = split(sentences())[1]
    rng = random.Random(seed)
    picks = rng.sample(heldout, min(count, len(heldout)))
    lines = []
    for clean in picks:
        source, kinds = corrupt(clean, rng)
        lines.append(json.dumps({"source": source, "target": clean, "edits": kinds}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def heldout_pairs(path: Path = HELDOUT_FILE) -> list[dict]:
    """The shipped held-out set: dicts with ``source``, ``target`` and ``edits``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
