"""The scheduler's scored tokens (:class:`~hasten.engine.logprobs.TokenLogprob`) in the shapes
OpenAI's and vLLM's clients read. Nothing here computes a log-probability: they come from the
verification forward (generated tokens) and the prefill (prompt tokens).

A token's text is the tokenizer's decoding of that token alone (a character split across
tokens shows as U+FFFD in each); ``bytes`` in chat are that text's UTF-8 bytes.
"""
from __future__ import annotations

from ..engine.logprobs import TokenLogprob

NO_MASS = -9999.0  # what JSON shows for -inf (a token the request's sampling rules out), as vLLM's server does


def finite(logprob: float) -> float:
    return max(logprob, NO_MASS)


class TokenText:
    """Token id -> its text, decoded alone, remembered."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.known.get(token)
        if text is None:
            text = self.known[token] = self.tokenizer.decode([token])
        return text


def completion_logprobs(tokens: list[int], scored: list[TokenLogprob | None], k: int, text: TokenText,
                        offset: int = 0) -> tuple[dict, int]:
    """OpenAI's legacy ``logprobs`` object for ``tokens`` (``scored`` None where a token has no
    log-probability: an echoed prompt's first), and the text offset after them. ``top_logprobs``
    maps the text of the k likeliest tokens, and of the token itself, to their log-probabilities
    (k or k + 1 entries, as vLLM)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, scored):
        piece = text(token)
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        offset += len(piece)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(finite(entry.logprob))
        top = {text(t): finite(logprob) for t, logprob in entry.top[:k]}
        top.setdefault(piece, finite(entry.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(scored: list[TokenLogprob], text: TokenText) -> list[dict]:
    """OpenAI's chat ``logprobs.content`` entries: each token with its ``top_logprobs`` (k, best first)."""
    def item(token: int, logprob: float) -> dict:
        piece = text(token)
        return {"token": piece, "logprob": finite(logprob), "bytes": list(piece.encode("utf-8"))}

    return [{**item(entry.token, entry.logprob), "top_logprobs": [item(t, logprob) for t, logprob in entry.top]}
            for entry in scored]


def prompt_logprobs(scored: list[TokenLogprob], k: int, text: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each later one
    ``{token id: {"logprob", "rank", "decoded_token"}}`` over the token itself and the k likeliest."""
    out: list[dict | None] = [None]
    for entry in scored:
        ranked = {str(t): {"logprob": finite(logprob), "rank": rank, "decoded_token": text(t)}
                  for rank, (t, logprob) in enumerate(entry.top[:k], start=1)}
        ranked.setdefault(str(entry.token), {"logprob": finite(entry.logprob), "rank": entry.rank,
                                             "decoded_token": text(entry.token)})
        out.append(ranked)
    return out
