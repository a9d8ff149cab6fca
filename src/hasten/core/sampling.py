"""Sampling settings, the target distribution ``p`` they define, and drawing from it.

The target distribution is made in two stages, both applied to the target's logits in one
place (:meth:`hasten.engine.sequence.Sequence.settle`), identically in plain decoding and at
every verified position of a draft block or tree:

1. :class:`LogitRules` (only when a request asks for one of them): ``allowed_token_ids``,
   ``logit_bias``, ``min_tokens`` and the repetition, frequency and presence penalties, in
   vLLM's order and with its semantics. They read the tokens before each position: at draft
   position j those are the committed tokens and the draft tokens on the path to j, exactly
   what plain decoding would have seen there. Greedy decoding takes the argmax of these logits.
2. :meth:`Sampling.probs` (sampling only): temperature, then top-k, then top-p, then min-p.

The warpers' order and tie rules follow Hugging Face's logits warpers, so "distributed as the
plain model samples" means the same thing here as in ``model.generate(do_sample=True)``:

* top-k keeps every token scoring at least the k-th best score (all ties at the k-th
  score stay);
* top-p drops a token when the mass of the tokens ranked at or below it is at most
  ``1 - top_p``, and always keeps the best token. Hugging Face leaves the order of equal
  scores to ``torch.sort``'s unstable kernel; here the higher token id ranks higher, as a
  stable ascending sort gives, so the set does not depend on the kernel;
* min-p drops a token whose probability (after the warpers before it) is below ``min_p``
  times the best token's (Hugging Face's order; vLLM applies it before top-k/top-p, which
  differs only when top-p and min-p are both set).

Neither sorts the whole vocabulary on the CPU: top-k is one ``torch.topk``, and the top-p
nucleus is found among a few candidates (the best 64 by ``torch.topk``, or, for a wider
nucleus, the tokens above a probability floor lowered until what lies below it cannot be
kept), then masked on the full row. On an accelerator a sort is cheap, while deciding
whether the candidates suffice would cost a host sync, so there the nucleus comes from one
stable sort. Both give the same set.

Drawing is inverse-CDF sampling with one uniform per row (:func:`draw`), on the
probabilities' device, from the caller's generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import FieldError
from .settings import Settings
from .tree import TokenTree

_FIRST_CANDIDATES = 64  # top-p candidates tried first; nuclei of real models are mostly smaller
_SMALLEST_DIVISOR = torch.finfo(torch.float32).tiny  # below it every score but the best is -inf anyway


@dataclass(frozen=True)
class Sampling(Settings):
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None  # keep tokens with at least min_p times the best token's probability
    # the logit rules (LogitRules), greedy and sampled alike:
    presence_penalty: float = 0.0  # subtracted once from each token generated so far (OpenAI)
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens (OpenAI)
    repetition_penalty: float = 1.0  # prompt and generated tokens: positive logits / r, others * r (HF, vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits; a dict is taken too
    allowed_token_ids: tuple[int, ...] | None = None  # every other token gets -inf
    min_tokens: int = 0  # the stop tokens (EOS, stop ids) get -inf until this many tokens were generated

    def __post_init__(self) -> None:
        super().__post_init__()  # types: finite numbers, ints that are not bools
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is none), got {self.repetition_penalty!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((token, value) for token, value in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if not all(_is_int(token) and _is_number(value) for token, value in bias):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r}")
        bias = tuple((token, float(value)) for token, value in bias)  # an int bias adds as a float does
        object.__setattr__(self, "logit_bias", bias)  # a dict becomes sorted pairs: hashable and equal alike
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            if not allowed or not all(_is_int(token) for token in allowed):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", allowed)

    @classmethod
    def asked(cls, temperature: float, top_k: int | None = None, top_p: float | None = None,
              min_p: float | None = None, **rules) -> "Sampling":
        """As an API asks for it: greedy decoding (temperature 0) ignores the warpers top_k, top_p
        and min_p, which OpenAI accepts with temperature 0; the logit rules (penalties,
        logit_bias, allowed_token_ids, min_tokens) apply either way."""
        if temperature > 0:
            return cls(temperature, top_k, top_p, min_p, **rules)
        return cls(**rules)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_logit_rules(self) -> bool:
        """Whether any rule of :class:`LogitRules` is on (without one a step does no extra work)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.allowed_token_ids is not None or self.min_tokens)

    def check_vocab(self, vocab: int) -> None:
        """FieldError naming the field whose token id lies outside [0, vocab)."""
        for name, ids in (("logit_bias", [token for token, _ in self.logit_bias]),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((token for token in ids if not 0 <= token < vocab), None)
            if bad is not None:
                raise FieldError(name, "invalid_value",
                                 f"{{field}} holds token id {bad}, outside the model's vocabulary [0, {vocab})")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits -> [..., vocab] float32 probabilities after processing."""
        logits = logits.float()
        # shifted by the row's best score first (softmax does not change): any temperature > 0,
        # however small, then divides finite numbers <= 0, and a temperature too small for the
        # others to survive leaves the limit law (the best tokens, ties shared) instead of NaNs
        temperature = max(self.temperature, _SMALLEST_DIVISOR)  # a double below float32's range must not become 0
        scores = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
        vocab = scores.shape[-1]
        if self.top_k is not None and self.top_k < vocab:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]  # [..., 1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            rows = scores.reshape(-1, vocab)  # [rows, vocab]
            find = _nucleus_by_topk if rows.device.type == "cpu" else _nucleus_by_sort
            scores = torch.where(find(rows, self.top_p).view(scores.shape), scores, float("-inf"))
        if self.min_p:
            probs = scores.softmax(dim=-1)  # [..., vocab]
            scores = scores.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        return scores.softmax(dim=-1)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


class LogitRules:
    """The request's rules on the target's logits, for one sequence: it keeps the counts they
    read (tokens generated so far, tokens seen in prompt and output) on the logits' device and
    applies the rules to a verification block, each row with the tokens before it on its path.

    In vLLM's order: ``allowed_token_ids`` (others -inf), ``logit_bias`` (added), ``min_tokens``
    (the stop tokens -inf while fewer than that many tokens precede the position), then the
    repetition penalty (a token in the prompt or the output: positive logit / r, others * r),
    then the frequency and presence penalties (over the output: ``logit -= frequency * count
    + presence * (count > 0)``). Built only for a request that has one (``has_logit_rules``).
    """

    def __init__(self, sampling: Sampling, vocab: int, device: torch.device, prompt: list[int],
                 generated: list[int], stop_ids: frozenset[int]):
        self.sampling = sampling
        self.emitted = len(generated)
        self.banned = None  # [vocab] bool: outside allowed_token_ids
        if sampling.allowed_token_ids is not None:
            self.banned = torch.ones(vocab, dtype=torch.bool, device=device)
            self.banned[list(sampling.allowed_token_ids)] = False
        self.bias = None  # [vocab] float32
        if sampling.logit_bias:
            tokens, values = zip(*sampling.logit_bias)
            self.bias = torch.zeros(vocab, device=device).index_put_(
                (torch.tensor(tokens, device=device),), torch.tensor(values, device=device), accumulate=True)
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)  # [stops]
        self.counts = self.seen = None
        if sampling.presence_penalty or sampling.frequency_penalty:
            self.counts = torch.zeros(vocab, device=device)  # [vocab] occurrences in the output
            self.counts.index_add_(0, torch.tensor(generated, dtype=torch.long, device=device),
                                   torch.ones(len(generated), device=device))
        if sampling.repetition_penalty != 1:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # [vocab] in prompt or output
            self.seen[torch.tensor(prompt + generated, dtype=torch.long, device=device)] = True

    def commit(self, tokens: list[int]) -> None:
        """The sequence committed ``tokens``: they precede every later position."""
        self.emitted += len(tokens)
        if tokens and (self.counts is not None or self.seen is not None):
            kept = self.counts if self.seen is None else self.seen
            ids = torch.tensor(tokens, dtype=torch.long).to(kept.device, non_blocking=True)  # [len(tokens)]
            if self.counts is not None:
                self.counts.index_add_(0, ids, torch.ones(len(tokens), device=ids.device))
            if self.seen is not None:
                self.seen[ids] = True

    def apply(self, logits: torch.Tensor, tree: TokenTree, draft: tuple[int, ...]) -> torch.Tensor:
        """logits [n + 1, vocab] at each block index of ``tree`` (0: after the committed tokens,
        b: after draft node b - 1 and its ancestors) -> [n + 1, vocab] float32 under the rules."""
        s = self.sampling
        logits = logits.float()
        if self.banned is not None:
            logits = logits.masked_fill(self.banned, float("-inf"))
        if self.bias is not None:
            logits = logits + self.bias
        if s.min_tokens and self.emitted < s.min_tokens and len(self.stop_ids):
            depths = (0, *tree.depths)  # draft tokens before each block index
            early = [b for b, depth in enumerate(depths) if self.emitted + depth < s.min_tokens]
            rows = torch.tensor(early, dtype=torch.long, device=logits.device)
            logits = logits.index_put((rows[:, None], self.stop_ids[None, :]),
                                      torch.tensor(float("-inf"), device=logits.device))
        if self.counts is None and self.seen is None:
            return logits
        drafted = None  # [n + 1, vocab] occurrences of each token among the draft tokens on each row's path
        if draft:
            blocks, nodes = _path_pairs(tree, logits.device)  # [pairs] each: block b, a node on b's path
            tokens = torch.tensor(draft, dtype=torch.long).to(logits.device, non_blocking=True)  # [n]
            drafted = torch.zeros_like(logits).index_put_(
                (blocks, tokens[nodes]), torch.ones(len(blocks), device=logits.device), accumulate=True)
        if self.seen is not None:
            seen = self.seen.expand_as(logits) if drafted is None else self.seen | (drafted > 0)  # [n + 1, vocab]
            r = s.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        if self.counts is not None:
            counts = self.counts if drafted is None else self.counts + drafted  # [vocab] or [n + 1, vocab]
            logits = logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
        return logits


@lru_cache(maxsize=256)
def _path_pairs(tree: TokenTree, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([pairs] block indices, [pairs] node indices): every node on each block's path (the node
    itself and its ancestors), on ``device``; trees are values, so an equal tree finds them here."""
    # block_mask[b, c]: block c is b or one of its ancestors; column c >= 1 is node c - 1
    pairs = tree.block_mask[:, 1:].nonzero()  # [pairs, 2] on the host: no device sync
    return pairs[:, 0].to(device, non_blocking=True), pairs[:, 1].to(device, non_blocking=True)


def _nucleus_by_sort(rows: torch.Tensor, top_p: float) -> torch.Tensor:
    """[rows, vocab] scores -> [rows, vocab] bool kept by top-p (one stable sort, no host sync)."""
    probs = rows.softmax(dim=-1)  # [rows, vocab] the same numbers the top-k search uses
    order = torch.sort(rows, dim=-1, stable=True).indices  # [rows, vocab] ascending
    at_or_below = probs.gather(-1, order).double().cumsum(dim=-1).float()  # mass of each token and those below it
    drop = at_or_below <= 1 - top_p
    drop[:, -1] = False  # the best token always stays
    return ~drop.scatter(-1, order, drop)


def _nucleus_by_topk(rows: torch.Tensor, top_p: float) -> torch.Tensor:
    """[rows, vocab] scores -> [rows, vocab] bool kept by top-p, without sorting the vocabulary.

    The candidates are the best 64 tokens or, when the nucleus reaches past them, every token
    above a probability floor lowered until the tokens below it hold at most 1 - top_p (so
    none of them can be kept). Host-side decisions: this runs on the CPU only.
    """
    vocab, limit = rows.shape[-1], 1 - top_p
    probs = rows.softmax(dim=-1)  # [rows, vocab]
    best_scores, best = rows.topk(min(_FIRST_CANDIDATES, vocab), dim=-1)  # [rows, count] best first
    best_probs = probs.gather(-1, best)
    # mass below the candidates (a float32 sum over the vocabulary: converting it to float64 costs more)
    below = probs.sum(-1, keepdim=True).double() - best_probs.sum(-1, keepdim=True, dtype=torch.float64)
    whole_ties = best.shape[-1] == vocab  # whether every token tied with a candidate is a candidate too
    if whole_ties:
        below = torch.zeros_like(below)
    floor = best_probs[:, -1:]  # [rows, 1]
    while not bool((below.float() <= limit).all()):
        floor = floor / 16
        outside = probs < floor  # [rows, vocab]
        below = torch.where(outside, probs, 0.0).sum(-1, keepdim=True).double()
        if bool((below.float() <= limit).all()):
            best_scores, best = _best_first(rows, ~outside)
            best_probs = torch.where(best_scores > float("-inf"), probs.gather(-1, best), 0.0)  # padding weighs 0
            whole_ties = True  # a token tied with a candidate has its probability: above the floor too
    # cumulative mass from the bottom over the candidates: summed in float64 and rounded
    # once, like the sort search, so both agree even where a sum lands exactly on 1 - top_p
    ascending = torch.cat([below.clamp_min(0), best_probs.double().flip(-1)], dim=-1)  # [rows, 1 + count]
    kept = ascending.cumsum(dim=-1)[:, 1:].flip(-1).float() > limit  # [rows, count]
    kept[:, 0] = True  # the best token always stays
    kept_count = kept.sum(-1, keepdim=True)  # [rows, 1]
    cut = best_scores.gather(-1, kept_count - 1)  # [rows, 1] the lowest kept score
    tied_wanted = kept_count - (best_scores > cut).sum(-1, keepdim=True)  # [rows, 1] how many at the cut stay
    whole_ties = whole_ties or bool((best_scores[:, -1:] < cut).all())
    tied_count = (best_scores == cut).sum(-1, keepdim=True) if whole_ties else (rows == cut).sum(-1, keepdim=True)
    if not bool((tied_count > tied_wanted).any()):
        return rows >= cut
    # the cut splits a group of equal scores (flat rows): the higher token ids stay
    tied = rows == cut  # [rows, vocab]
    rank_from_top_id = tied.flip(-1).cumsum(-1).flip(-1)  # [rows, vocab] 1 for the highest tied id
    return (rows > cut) | (tied & (rank_from_top_id <= tied_wanted))


def _best_first(rows: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates of each row, best score first: ([rows, k] scores, [rows, k] token ids),
    k the most candidates of any row, shorter rows padded with -inf scores."""
    where = candidates.nonzero()  # [total, 2] (row, token), row by row
    counts = candidates.sum(-1)  # [rows]
    slot = torch.arange(where.shape[0]) - (counts.cumsum(0) - counts)[where[:, 0]]  # place within its row
    width = int(counts.max())
    scores = rows.new_full((rows.shape[0], width), float("-inf"))
    tokens = torch.zeros(rows.shape[0], width, dtype=torch.long)
    scores[where[:, 0], slot] = rows[where[:, 0], where[:, 1]]
    tokens[where[:, 0], slot] = where[:, 1]
    order = scores.argsort(dim=-1, descending=True)
    return scores.gather(-1, order), tokens.gather(-1, order)


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """A generator draws on its own device only: say so plainly instead of a torch error."""
    if generator is None:
        return
    mine = generator.device
    if mine.type != device.type or (mine.index is not None and device.index is not None and mine.index != device.index):
        raise ValueError(
            f"the random generator is on {mine} but the model's logits are on {device}; make the generator on "
            f"the model's device, e.g. torch.Generator(device=model.device).manual_seed(seed)"
        )


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] non-negative weights (need not sum to 1), [rows] uniforms in [0, 1) ->
    [rows] long token ids, on the weights' device, with no host sync.

    Inverse CDF: the first token whose cumulative weight reaches ``(1 - u) * total``. That
    target lies in (0, total], so the token found always has positive weight: a zero-weight
    token never raises the cumulative sum, so it is never the first to reach a target.
    """
    cumulative = weights.cumsum(dim=-1, dtype=torch.float64)  # [rows, vocab] float32 sums drift over 100k tokens
    target = (1 - uniforms.double()).unsqueeze(-1) * cumulative[:, -1:]  # [rows, 1]
    return torch.searchsorted(cumulative, target).squeeze(-1)


def uniforms(count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """[count] float32 uniforms in [0, 1) drawn on ``device`` from ``generator``."""
    check_generator(generator, device)
    return torch.rand(count, generator=generator, device=device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [vocab] distribution (one host transfer: the id)."""
    return int(draw(probs.reshape(1, -1), uniforms(1, generator, probs.device))[0])
