"""The target model's log-probabilities of tokens, read from logits a forward already made.

The one place hasten computes them: the decode step scores each emitted token from the
verification forward's row for that token's position (every accepted draft token and the
bonus or recovered token were scored by the forward that verified them), and a prefill that
is asked to keeps its logits to score the prompt. No forward runs for them, so the tokens a
generation emits are the same whether or not anyone asks.

By default they are the model's own distribution, ``log_softmax`` of the raw logits, before
temperature, top-k or top-p: vLLM's default (``logprobs_mode="raw_logprobs"``), which is also what
makes a greedy and a sampled request report the same number for the same token in the same
context. A request may ask for them processed instead (vLLM's ``processed_logprobs``): the law
the token was drawn from, after the request's logit rules and sampling transform
(``Sequence._scoring_rows``); tokens that transform rules out are -inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives a token may list: vLLM's default max_logprobs, OpenAI's top_logprobs
# rows scored at once: a long prompt's float32 log-softmax is made a slice at a time (256 rows of a
# 152k vocabulary: 156 MB) rather than beside its whole [T - 1, vocab] logits
ROWS_AT_ONCE = 256


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # the target's log-probability of ``token`` at its position
    rank: int  # 1 + how many tokens the target found likelier there
    top: tuple[tuple[int, float], ...]  # the ``k`` likeliest tokens there, best first: (token id, log-probability)


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """``logits`` [m, vocab] (row i: the target's scores for the token after position i),
    ``tokens`` the m tokens that came there, ``k`` >= 0 alternatives each -> one entry per
    token, with one device-to-host transfer per ROWS_AT_ONCE rows (a decode step's block is one)."""
    return [entry for start in range(0, len(tokens), ROWS_AT_ONCE)
            for entry in _scored(logits[start:start + ROWS_AT_ONCE], tokens[start:start + ROWS_AT_ONCE], k)]


def _scored(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    logp = logits.float().log_softmax(dim=-1)  # [m, vocab]
    ids = torch.tensor(tokens, dtype=torch.long, device=logp.device)  # [m]
    chosen = logp.gather(-1, ids[:, None])  # [m, 1]
    rank = (logp > chosen).sum(-1, keepdim=True) + 1  # [m, 1]
    k = min(k, logp.shape[-1])
    top = logp.topk(k, dim=-1)  # values, indices: [m, k] each, best first
    # [m, 2 + 2k] in one transfer; ids and ranks are exact in float32 (below 2^24)
    rows = torch.cat([chosen, rank.float(), top.values, top.indices.float()], dim=-1).tolist()
    return [TokenLogprob(token, row[0], int(row[1]), tuple(zip(map(int, row[2 + k:]), row[2:2 + k])))
            for token, row in zip(tokens, rows)]
