"""The llguidance grammar engine behind :mod:`hasten.core.constraint` (``pip install 'hasten[serve]'``
or ``'hasten[structured]'``).

Why llguidance (https://github.com/guidance-ai/llguidance): one 3 MB wheel with no Python
dependencies (xgrammar 0.2.8 requires torch, triton, pydantic and apache-tvm-ffi, which would put a
second torch stack into a CPU lock), masks computed in Rust with the GIL released, a matcher that
rolls back (a draft tree is walked without copies), validates tokens without entering an error
state (``try_consume_tokens``), reports the bytes the grammar forces (``compute_ff_bytes``), and
takes JSON schemas, regular expressions, Lark and GBNF grammars.

A second engine is one more file like this one (a compile function returning a
:class:`~hasten.core.constraint.Constraint`) and its name in :data:`hasten.structured.specs.ENGINES`.
"""
from __future__ import annotations

import json
import threading
import weakref

import numpy as np

from ..core.constraint import ConstraintError

try:
    import llguidance
    import llguidance.hf
except ImportError:  # the optional extra is not installed: say so when a constraint is compiled
    llguidance = None

# JSON as hasten writes it: no free whitespace (so the text between values is forced and proposed as
# drafts), the separators Python's json.dumps writes
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def available() -> bool:
    return llguidance is not None


def _require() -> None:
    if llguidance is None:
        raise ConstraintError("structured output needs the llguidance grammar engine: pip install 'hasten[serve]' "
                              "(or 'hasten[structured]' without the server)", "unsupported_parameter")


_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF tokenizer -> {vocab: LLTokenizer}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face fast tokenizer, built once per tokenizer and vocabulary
    (about a second for a 49k vocabulary; kept while the tokenizer lives)."""
    _require()
    with _tokenizers_lock:
        known = _tokenizers.setdefault(tokenizer, {})
        if vocab_size not in known:
            try:
                known[vocab_size] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
            except Exception as err:  # noqa: BLE001 - a slow tokenizer, or one llguidance cannot read
                raise ConstraintError(f"the grammar engine cannot read this model's tokenizer: {err}",
                                      "unsupported_parameter") from None
        return known[vocab_size]


def grammar_text(kind: str, source) -> str:
    """llguidance's grammar for one spec kind: "json" (a schema, a dict), "regex", "choice" (a list
    of strings), "grammar" (Lark or GBNF text)."""
    _require()
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in source))
        return llguidance.grammar_from("grammar", source)
    except ValueError as err:
        raise ConstraintError(f"the {_NAMES.get(kind, kind)} does not compile: {err}") from None


def validate(kind: str, source) -> None:
    """ConstraintError unless the spec compiles to a valid grammar (no tokenizer needed: cheap)."""
    grammar = grammar_text(kind, source)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise ConstraintError(f"the {_NAMES.get(kind, kind)} does not compile: {problem}")


_NAMES = {"json": "JSON schema"}


class LLGuidanceConstraint:
    """A compiled grammar: a matcher at its start, copied for every row."""

    def __init__(self, kind: str, source, tokenizer, vocab_size: int, description: str):
        self.vocab_size, self.description = vocab_size, description
        self.ll_tokenizer = ll_tokenizer(tokenizer, vocab_size)
        self.end_ids = frozenset(self.ll_tokenizer.eos_tokens)  # what its masks set at the end (the loop sets its own)
        grammar = grammar_text(kind, source)
        limits = llguidance.LLParserLimits(verbose_errors=False)
        self._start = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if self._start.is_error():
            raise ConstraintError(f"the {description} does not compile: {self._start.get_error()}")

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self._start.deep_copy())

    def tokenize(self, text: bytes) -> list[int]:
        return self.ll_tokenizer.tokenize_bytes(text)

    def token_bytes(self, tokens: list[int]) -> bytes:
        return self.ll_tokenizer.decode_bytes(tokens)


class LLGuidanceMatcher:
    def __init__(self, matcher):
        self._matcher = matcher

    def consume(self, token: int) -> bool:
        # try_consume_tokens leaves the state as it was on a refused token (consume_token would
        # put the matcher in an error state it never leaves)
        return self._matcher.try_consume_tokens([token]) == 1

    def rollback(self, count: int) -> None:
        if count and not self._matcher.rollback(count):
            raise ConstraintError(f"the grammar engine could not roll back {count} tokens: {self._matcher.get_error()}",
                                  "internal_error")

    def fill_bitmask(self, out: np.ndarray) -> None:
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._matcher.is_error():
            raise ConstraintError(f"the grammar engine failed: {self._matcher.get_error()}", "internal_error")

    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    def forced_bytes(self) -> bytes:
        return self._matcher.compute_ff_bytes()
