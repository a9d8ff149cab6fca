"""Stop strings: end a sequence once its text contains one of them (as OpenAI's ``stop`` and
Hugging Face's ``stop_strings`` do).

The decode loop works on tokens, the rule on text, so a :class:`StopStrings` holds the
tokenizer. Token side (:meth:`StopStrings.stop_index`): the sequence ends after the
token whose text completes a stop string; that token is kept, as in Hugging Face
``generate``. Text side (:meth:`StopStrings.cut`, :meth:`StopStrings.safe_length`): the
returned text ends *before* the stop string, and a stream holds back any tail that could
still grow into one.

``min_tokens`` (vLLM's): no stop string ends a sequence before it has more than that many
tokens, and an occurrence that ends within the text of the first ``min_tokens`` tokens is not
a stop (vLLM checks each token's new text only once the output is longer than ``min_tokens``).
"""
from __future__ import annotations

from typing import Iterable


class StopStrings:
    def __init__(self, tokenizer, strings: Iterable[str], min_tokens: int = 0):
        strings = [strings] if isinstance(strings, str) else list(strings)
        if not all(isinstance(s, str) for s in strings):
            raise TypeError(f"stop strings must be strings, got {strings!r}")
        if any(s == "" for s in strings):
            raise ValueError("a stop string cannot be empty")
        if strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to read the generated text")
        self.tokenizer = tokenizer
        self.strings = tuple(dict.fromkeys(strings))  # unique, order kept
        self.min_tokens = min_tokens

    def __bool__(self) -> bool:
        return bool(self.strings)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def find(self, text: str, after: int = 0) -> int | None:
        """Character index of the earliest stop string in ``text`` that ends past character
        ``after`` (see :meth:`after`), or None."""
        hits = [i for i in (text.find(s, max(after - len(s) + 1, 0)) for s in self.strings) if i >= 0]
        return min(hits) if hits else None

    def after(self, tokens: list[int]) -> int | None:
        """Where in the text of ``tokens`` a stop string may end (past that character), or None
        while they are at most ``min_tokens``: then none may."""
        if len(tokens) <= self.min_tokens:
            return None
        return len(self.decode(tokens[: self.min_tokens])) if self.min_tokens else 0

    def stop_index(self, generated: list[int], checked: int) -> int | None:
        """Index of the token whose text completes a stop string, looking only at tokens
        from ``checked`` on (the earlier ones were checked by an earlier call), or None."""
        checked = max(checked, self.min_tokens)
        if not self.strings or len(generated) <= checked:
            return None
        after = self.after(generated)
        if self.find(self.decode(generated), after) is None:
            return None
        for end in range(checked, len(generated)):  # the first prefix that contains one
            if self.find(self.decode(generated[: end + 1]), after) is not None:
                return end
        return len(generated) - 1  # the text only matches as a whole (a token merge): stop at the end

    def cut(self, text: str, after: int | None = 0, include: bool = False) -> tuple[str, bool]:
        """``text`` up to the earliest stop string ending past ``after`` (None: none counts), not
        including it (with ``include``: including it, the first in order that starts there), and
        whether one was found."""
        at = None if after is None else self.find(text, after)
        if at is None:
            return text, False
        if include:
            at += len(next(s for s in self.strings if text.startswith(s, at)))
        return text[:at], True

    def safe_length(self, text: str, after: int | None = 0) -> int:
        """How much of ``text`` a stream may emit now: all but a tail that is the start of a
        stop string (it may still complete), and nothing from a complete one on."""
        at = None if after is None else self.find(text, after)
        if at is not None:
            return at
        hold = 0
        for s in self.strings:
            for size in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:size]):
                    hold = max(hold, size)
                    break
        return len(text) - hold



class TextStream:
    """Token ids in, text a user may see out (streams, servers): the text ends *before* the
    first stop string (as OpenAI's ``stop``), and while a sequence runs a tail that could
    still grow into a stop string, or that ends inside a multi-byte character, is held
    back until the next tokens settle it. Every :meth:`push` and the :meth:`finish` joined
    are the final text. With ``streaming=False`` nobody reads the pieces as they come: every
    push shows nothing and :meth:`finish` decodes the text once (a step's push would decode the
    whole sequence again, a cost that grows with the text)."""

    def __init__(self, tokenizer, stop: StopStrings | Iterable[str] = (), min_tokens: int = 0,
                 include_stop: bool = False, streaming: bool = True):
        self.tokenizer = tokenizer
        self.streaming = streaming
        self.stop = stop if isinstance(stop, StopStrings) else StopStrings(tokenizer, stop, min_tokens)
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the text ends after the stop string
        self.token_ids: list[int] = []
        self.shown = ""  # text handed out so far
        self.stopped = False  # a stop string was found: the text is final

    def push(self, tokens: list[int]) -> str:
        """The new text these tokens make visible ('' while it is held back)."""
        if self.stopped or not tokens:
            return ""
        self.token_ids.extend(tokens)
        if not self.streaming:
            return ""
        text = self._decode()
        after = self.stop.after(self.token_ids)
        if after is not None and self.stop.find(text, after) is not None:
            return self._final(text)
        if text.endswith(_UNFINISHED):
            return ""
        return self._show(text[: self.stop.safe_length(text, len(text) if after is None else after)])

    def finish(self) -> str:
        """The rest of the text once the sequence has ended (a held-back tail that never
        became a stop string)."""
        return "" if self.stopped else self._final(self._decode())

    def _decode(self) -> str:
        # The whole sequence each time: a token's text can depend on its neighbours
        # (byte-level merges, leading spaces), so pieces decoded alone need not add up.
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _final(self, text: str) -> str:
        cut, self.stopped = self.stop.cut(text, self.stop.after(self.token_ids), self.include_stop)
        return self._show(cut)

    def _show(self, visible: str) -> str:
        # Text already shown is never taken back; a decode that rewrites it (rare: some
        # tokenizers' clean-up rules) shows nothing new until it grows past it again.
        if not visible.startswith(self.shown):
            return ""
        piece = visible[len(self.shown):]
        self.shown = visible
        return piece


_UNFINISHED = "\ufffd"  # what a tokenizer decodes an unfinished multi-byte character to
