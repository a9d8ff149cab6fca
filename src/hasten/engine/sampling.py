"""Sampling settings and the target distribution ``p`` they define.

The processing order (temperature, then top-k, then top-p) and the tie rules follow
Hugging Face's logits warpers, so "distributed as the plain model samples" means the
same thing here as in ``model.generate(do_sample=True)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits -> [..., vocab] float32 probabilities after processing."""
        scores = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            sorted_scores, order = torch.sort(scores, dim=-1)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= 1 - self.top_p
            drop_sorted[..., -1] = False  # always keep the most likely token
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
