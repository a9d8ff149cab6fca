"""Sampling settings, the target distribution ``p`` they define, and drawing from it.

The processing order (temperature, then top-k, then top-p) and the tie rules follow
Hugging Face's logits warpers, so "distributed as the plain model samples" means the
same thing here as in ``model.generate(do_sample=True)``:

* top-k keeps every token scoring at least the k-th best score (all ties at the k-th
  score stay);
* top-p drops a token when the mass of the tokens ranked at or below it is at most
  ``1 - top_p``, and always keeps the best token. Hugging Face leaves the order of equal
  scores to ``torch.sort``'s unstable kernel; here the higher token id ranks higher, as a
  stable ascending sort gives, so the set does not depend on the kernel.

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

from dataclasses import dataclass

import torch

from .settings import Settings

_FIRST_CANDIDATES = 64  # top-p candidates tried first; nuclei of real models are mostly smaller
_SMALLEST_DIVISOR = torch.finfo(torch.float32).tiny  # below it every score but the best is -inf anyway


@dataclass(frozen=True)
class Sampling(Settings):
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # types: finite numbers, ints that are not bools
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
        return scores.softmax(dim=-1)


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
