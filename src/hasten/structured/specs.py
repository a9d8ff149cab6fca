"""What a request may ask its text to be: :class:`JsonSchema`, :class:`Regex`, :class:`Choice`,
:class:`Grammar`. Each is a value (hashable, checked when made) that compiles for a tokenizer into a
:class:`~hasten.core.constraint.Constraint`.

Compiling is bounded and cached: a spec's text is at most :data:`MAX_SPEC_BYTES`; a compile runs on
a thread of its own (so a caller on the server's event loop or decode thread never runs one) and
is refused after :data:`COMPILE_SECONDS`; the last :data:`CACHED` compiled constraints are kept,
per tokenizer, so a request that repeats a schema does not compile it again.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass

from ..core.constraint import Constraint, ConstraintError
from . import llguidance as default_engine

MAX_SPEC_BYTES = 64 * 1024  # a schema, pattern, choice list or grammar; OpenAI's strict schemas are far smaller
MAX_CHOICES = 1024
COMPILE_SECONDS = 10.0
CACHED = 64
# name -> (compile(kind, source, tokenizer, vocab_size, description) -> Constraint, validate(kind, source));
# the first is the default
ENGINES = {"llguidance": (default_engine.LLGuidanceConstraint, default_engine.validate)}

_pool = ThreadPoolExecutor(2, thread_name_prefix="hasten-grammar")  # two: one runaway compile does not block the next
_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> OrderedDict[(spec, vocab), Constraint]
_cache_lock = threading.Lock()


class Spec:
    """Base of the specs: ``kind`` names what the engine compiles, ``source()`` what it reads."""

    kind: str

    def source(self):
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def validate(self, engine: str = "llguidance") -> None:
        """ConstraintError unless the spec compiles (no tokenizer needed: a quick check before any model loads)."""
        _engine(engine)[1](self.kind, self.source())

    def compile(self, tokenizer, vocab_size: int, engine: str = "llguidance") -> Constraint:
        """The compiled constraint for ``tokenizer`` and a model of ``vocab_size`` tokens (cached)."""
        build = _engine(engine)[0]
        key = (self, vocab_size, engine)
        with _cache_lock:
            known = _cache.setdefault(tokenizer, OrderedDict())
            if key in known:
                known.move_to_end(key)
                return known[key]
        future = _pool.submit(build, self.kind, self.source(), tokenizer, vocab_size, self.describe())
        try:
            constraint = future.result(timeout=COMPILE_SECONDS)
        except FutureTimeout:
            raise ConstraintError(f"the {self.describe()} did not compile within {COMPILE_SECONDS:g} seconds",
                                  "compile_timeout") from None
        with _cache_lock:
            known[key] = constraint
            while len(known) > CACHED:
                known.popitem(last=False)
        return constraint


def _engine(name: str):
    if name not in ENGINES:
        raise ConstraintError(f"unknown grammar engine {name!r}; known: {', '.join(ENGINES)}")
    return ENGINES[name]


def _sized(text: str, what: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise ConstraintError(f"the {what} is {size} bytes; at most {MAX_SPEC_BYTES}", "too_large")
    return text


@dataclass(frozen=True, init=False)
class JsonSchema(Spec):
    """JSON text valid under ``schema`` (a dict, or its JSON text); ``None``: any JSON object
    (OpenAI's ``json_object``). Written without free whitespace, with Python's separators
    (``", "``, ``": "``)."""

    schema_json: str  # the JSON text of the schema, its properties in their order (the order they are written in)
    kind = "json"

    def __init__(self, schema: dict | str | bool | None = None):
        if schema is None:
            schema = {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise ConstraintError(f"the JSON schema is not valid JSON: {err}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}", "invalid_type")
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ConstraintError(f"the JSON schema cannot be written as JSON: {err}") from None
        object.__setattr__(self, "schema_json", _sized(text, "JSON schema"))

    def source(self):
        return self.schema_json

    def describe(self) -> str:
        return "JSON schema"


@dataclass(frozen=True)
class Regex(Spec):
    """Text matching the regular expression ``pattern`` whole (Rust regex syntax, as vLLM's)."""

    pattern: str
    kind = "regex"

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ConstraintError("a regex must be a non-empty string", "invalid_type")
        _sized(self.pattern, "regex")

    def source(self):
        return self.pattern

    def describe(self) -> str:
        return "regex"


@dataclass(frozen=True)
class Choice(Spec):
    """Exactly one of ``options`` (strings)."""

    options: tuple[str, ...]
    kind = "choice"

    def __post_init__(self) -> None:
        options = self.options
        if isinstance(options, str) or not isinstance(options, (list, tuple)) or not options \
                or not all(isinstance(option, str) and option for option in options):
            raise ConstraintError("a choice must be a non-empty list of non-empty strings", "invalid_type")
        if len(options) > MAX_CHOICES:
            raise ConstraintError(f"a choice holds {len(options)} strings; at most {MAX_CHOICES}", "too_large")
        _sized("".join(options), "choice")
        object.__setattr__(self, "options", tuple(options))

    def source(self):
        return list(self.options)

    def describe(self) -> str:
        return "choice"


@dataclass(frozen=True)
class Grammar(Spec):
    """Text in the language of a context-free grammar: Lark syntax or llama.cpp's GBNF (vLLM's
    ``guided_grammar`` EBNF), its start rule ``start`` (Lark) or ``root`` (GBNF)."""

    text: str
    kind = "grammar"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise ConstraintError("a grammar must be non-empty text", "invalid_type")
        _sized(self.text, "grammar")

    def source(self):
        return self.text

    def describe(self) -> str:
        return "grammar"
