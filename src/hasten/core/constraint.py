"""Constraints: rules on which tokens may come next (a JSON schema, a regular expression, a choice
among strings, a grammar), as a small protocol beside the acceptance and sizing rules.

A constraint is what a request asks for (a :class:`ConstraintSpec`, e.g.
``hasten.structured.JsonSchema(schema)``), compiled once for a tokenizer into a
:class:`Constraint` that every row of the request shares; each row walks it with a
:class:`Matcher` of its own, which follows the row's committed tokens only. The grammar engine
behind the protocol (llguidance today: :mod:`hasten.structured`) is an optional extra on an
upper floor; the decode loop sees these protocols and nothing else
(:mod:`hasten.engine.constraint` holds the loop's hook: masks, draft checks, forced drafts).

Why a row's tokens stay exact under speculation: the target's logits are masked at every
verified position with the mask of the state that position's path leads to, so the verifier
accepts, rejects and draws from exactly the masked distribution plain constrained decoding
draws from, one token at a time.

Ending tokens (EOS, stop ids) are the row's business, not the grammar engine's: a matcher says
whether its text is complete (:meth:`Matcher.accepting`), and the loop allows the row's own ending
ids exactly there.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from .errors import FieldError


class ConstraintError(FieldError):
    """A constraint that cannot be honoured: it does not compile, is too large, conflicts with
    the request's other rules, or leaves a row with no token it may write. ``field`` is
    ``"constraint"`` unless a conflicting field is the one to fix."""

    def __init__(self, message: str, code: str = "invalid_value", field: str = "constraint"):
        super().__init__(field, code, message)


class Matcher(Protocol):
    """One row's position in a constraint. Tokens go in one at a time and come out again
    (``rollback``), so a draft tree is walked without copying the state."""

    def consume(self, token: int) -> bool:
        """Advance by ``token`` if the constraint allows it there (True); else leave the state as it
        was (False). Never called with an ending token."""

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens."""

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the tokens allowed next into ``out`` ([ceil(vocab / 32)] uint32; bit ``t % 32`` of
        word ``t // 32`` set for token t). Ending tokens may be set or not: the loop sets them itself."""

    def accepting(self) -> bool:
        """Whether the text so far is complete, so the row may end here."""

    def forced_bytes(self) -> bytes:
        """Text every continuation of the current state starts with (b"" when none is forced)."""


class Constraint(Protocol):
    """A compiled constraint, shared by every row that asks for it (threads included)."""

    vocab_size: int  # the model's: masks cover every id the target can score
    description: str  # for messages and logs, e.g. "JSON schema"
    end_ids: frozenset[int]  # the ids the engine's masks may set where the text is complete (the loop clears them)

    def matcher(self) -> Matcher:
        """A matcher at the start of the constrained text."""

    def tokenize(self, text: bytes) -> list[int]:
        """The tokenizer's own (canonical) tokenization of ``text``."""

    def token_bytes(self, tokens: list[int]) -> bytes:
        """The text ``tokens`` write."""


class ConstraintSpec(Protocol):
    """What a request asks for, before it is compiled for a tokenizer."""

    def compile(self, tokenizer, vocab_size: int) -> Constraint:
        """The compiled constraint (cached by the engine); ConstraintError when it cannot be."""


def words(vocab_size: int) -> int:
    """uint32 words of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def compiled(constraint, tokenizer, vocab_size: int) -> Constraint | None:
    """A request's constraint compiled: a spec is compiled for ``tokenizer`` (which it needs), a
    compiled constraint is checked against the model's vocabulary, None stays None."""
    if constraint is None:
        return None
    if callable(getattr(constraint, "matcher", None)):
        _check_vocab(constraint, vocab_size)
        return constraint
    if not callable(getattr(constraint, "compile", None)):
        raise ConstraintError(f"constraint must be a hasten.structured spec (JsonSchema, Regex, Choice, Grammar) or "
                              f"a compiled constraint, got {type(constraint).__name__}", "invalid_type")
    if tokenizer is None:
        raise ConstraintError("a constraint is compiled for the model's tokenizer: pass tokenizer= as well")
    return constraint.compile(tokenizer, vocab_size)


def check_constraint(constraint, vocab: int, ending_ids: frozenset[int], sampling, ignore_eos: bool) -> None:
    """Refuse, at admission, a constraint that is not a compiled one for this vocabulary, or a request
    whose other rules leave it nothing to write or no way to end: ConstraintError naming the field."""
    if not callable(getattr(constraint, "matcher", None)):
        raise ConstraintError(f"constraint must be a compiled constraint (a spec's .compile(tokenizer, vocab_size)), "
                              f"got {type(constraint).__name__}", "invalid_type")
    _check_vocab(constraint, vocab)
    if ignore_eos:
        raise ConstraintError("a constrained row ends with EOS once its text is complete; ignore_eos would "
                              "leave it nothing to write after that", "conflicting_parameters", "ignore_eos")
    if not ending_ids:
        raise ConstraintError("a constrained row needs an EOS or stop token to end with once its text is complete",
                              "conflicting_parameters", "eos_token_ids")
    bits, empty_text_ok = start_mask(constraint)
    allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[: constraint.vocab_size])
    allowed = np.setdiff1d(allowed, list(ending_ids | frozenset(getattr(constraint, "end_ids", ()))))
    if not len(allowed) and not empty_text_ok:
        raise ConstraintError("no token of this model's vocabulary can start text the constraint allows")
    allowed_token_ids = sampling.allowed_token_ids
    if allowed_token_ids is not None and not set(allowed_token_ids) & set(allowed.tolist()) and not empty_text_ok:
        raise ConstraintError("none of allowed_token_ids can start the constrained text", "conflicting_parameters",
                              "allowed_token_ids")


def start_mask(constraint: Constraint) -> tuple[np.ndarray, bool]:
    """([words] uint32 the tokens that may start the constrained text, whether the empty text is
    complete); computed once per compiled constraint (where it is compiled: off the server's event
    loop) and kept on it."""
    start = getattr(constraint, "_hasten_start", None)
    if start is None:
        bits = np.empty(words(constraint.vocab_size), dtype=np.uint32)
        matcher = constraint.matcher()
        matcher.fill_bitmask(bits)
        start = constraint._hasten_start = (bits, matcher.accepting())
    return start


def _check_vocab(constraint: Constraint, vocab: int) -> None:
    if constraint.vocab_size != vocab:
        raise ConstraintError(f"the constraint was compiled for a vocabulary of {constraint.vocab_size} tokens; "
                              f"the model has {vocab}")
