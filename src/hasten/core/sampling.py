"""Sampling settings, the target distribution ``p`` they define, and drawing from it.

The processing order (temperature, then top-k, then top-p) and the tie rules follow
Hugging Face's logits warpers, so "distributed as the plain model samples" means the
same thing here as in ``model.generate(do_sample=True)``:

* top-k keeps every token scoring at least the k-th best score (all ties at the k-th
  score stay);
* top-p drops a token when the mass of the tokens ranked at or below it is at most
  ``1 - top_p``, and always keeps the best token. Between equal scores the higher token
  id ranks higher, as the stable ascending sort Hugging Face's warper relies on gives.

Neither sorts the whole vocabulary on the CPU: top-k is one ``torch.topk``, and the top-p
nucleus is found with ``torch.topk`` over a growing number of candidates (64, doubled until
the nucleus ends inside them), then masked on the full row. On an accelerator a sort is
cheap, while deciding whether to grow would cost a host sync per row batch, so there the
nucleus comes from one stable sort. Both give the same set.

Drawing is inverse-CDF sampling with one uniform per row (:func:`draw`), on the
probabilities' device, from the caller's generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .settings import Settings

_FIRST_CANDIDATES = 64  # top-p candidates tried first; nuclei of real models are mostly smaller


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
        scores = logits.float() / self.temperature
        vocab = scores.shape[-1]
        if self.top_k is not None and self.top_k < vocab:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]  # [..., 1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            rows = scores.reshape(-1, vocab)  # [rows, vocab]
            find = _nucleus_by_topk if rows.device.type == "cpu" else _nucleus_by_sort
            scores = scores.masked_fill(~find(rows, self.top_p).view(scores.shape), float("-inf"))
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
    """[rows, vocab] scores -> [rows, vocab] bool kept by top-p, without sorting the vocabulary."""
    vocab = rows.shape[-1]
    probs = rows.softmax(dim=-1)  # [rows, vocab]
    total = probs.sum(-1, keepdim=True, dtype=torch.float64)  # [rows, 1]
    count = min(_FIRST_CANDIDATES, vocab)
    while True:
        best_scores, best = rows.topk(count, dim=-1)  # [rows, count] best first
        best_probs = probs.gather(-1, best)  # [rows, count]
        best_probs_f64 = best_probs.double()
        # mass outside the candidates (they rank below every candidate), then the cumulative
        # mass from the bottom: summed in float64 and rounded once, like the sort search, so
        # both searches agree even where a sum lands exactly on 1 - top_p
        outside = torch.zeros_like(total) if count == vocab else (total - best_probs_f64.sum(-1, keepdim=True)).clamp_min(0)
        ascending = torch.cat([outside, best_probs_f64.flip(-1)], dim=-1)  # [rows, 1 + count]
        at_or_below = ascending.cumsum(dim=-1)[:, 1:].flip(-1).float()  # [rows, count]
        kept = at_or_below > 1 - top_p
        kept[:, 0] = True  # the best token always stays
        if count == vocab or not bool(kept[:, -1].any()):  # host-side on the CPU: no device sync
            break
        # each token still missing weighs at most the last candidate's p: at least this many more
        missing = ((at_or_below[:, -1:] - (1 - top_p)) / best_probs[:, -1:].clamp_min(1e-30)).max()
        count = min(max(2 * count, count + int(missing) + 1), vocab)
    kept_count = kept.sum(-1, keepdim=True)  # [rows, 1]
    cut = best_scores.gather(-1, kept_count - 1)  # [rows, 1] the lowest kept score
    keep = rows >= cut  # [rows, vocab]
    tied = rows == cut
    tied_wanted = kept_count - (best_scores > cut).sum(-1, keepdim=True)  # [rows, 1]
    if bool((tied.sum(-1, keepdim=True) > tied_wanted).any()):  # the cut splits a tie (rare but for flat rows)
        rank_from_top_id = tied.flip(-1).cumsum(-1).flip(-1)  # [rows, vocab] 1 for the highest tied id
        keep = (rows > cut) | (tied & (rank_from_top_id <= tied_wanted))
    return keep


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
