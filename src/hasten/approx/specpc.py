"""SpecPC: draft-guided prompt compression (Galim et al. 2025). **Lossy**, named so.

The draft model reads the prompt and writes a short ``lookahead``; the attention its last
``window`` prompt queries and its lookahead queries give each prompt token (largest over
layers, heads and observing queries, then max-pooled over ``pool`` neighbours so kept
tokens come with their context) ranks the tokens. The ``budget - window`` best earlier ones
and the last ``window`` make the compressed prompt, in order; the target then runs on it as
on any prompt (positions renumbered), so every method, lossless drafters included, applies
unchanged. The output answers the compressed prompt, not the original: that is the loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..models.layers import last_queries
from ..models.compat import cache_argument
from .kv import attention_scores, check_draft, draft_lookahead


@dataclass(frozen=True)
class SpecPC:
    draft: PreTrainedModel
    budget: int = 256  # prompt tokens kept
    window: int = 32
    pool: int = 7
    lookahead: int = 16

    lossless = False
    name = "specpc"

    def __post_init__(self) -> None:
        check_draft(self.name, self.draft, self.lookahead)
        if self.window < 1 or self.budget <= self.window:
            raise ValueError(f"{self.name}: budget ({self.budget}) must exceed window ({self.window}) >= 1")

    def describe(self) -> str:
        return f"{self.name}(budget={self.budget})"

    @torch.no_grad()
    def compress(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, T] -> [1, min(T, budget)]: the kept prompt tokens, in order."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError("input_ids must be one prompt, a [1, T] torch.LongTensor")
        tokens = input_ids[0].tolist()
        if len(tokens) <= self.budget:
            return input_ids
        extra = draft_lookahead(self.draft, tokens, self.lookahead)[:-1]  # observed after the prompt
        cache = DynamicCache()
        with last_queries(self.draft, self.window + len(extra)) as queries:
            self.draft(input_ids=torch.tensor([tokens + extra], device=self.draft.device), **cache_argument(self.draft, cache),
                       use_cache=True, logits_to_keep=1)
        scores = torch.stack([
            attention_scores(queries[layer], cache.layers[layer].keys[0], len(tokens), self.pool).amax(0)
            for layer in range(len(cache.layers))
        ]).amax(0)  # [T] the best any layer and head gives each prompt token
        earlier = len(tokens) - self.window
        best = scores[:earlier].topk(self.budget - self.window).indices.sort().values.tolist()
        return torch.tensor([[tokens[i] for i in best] + tokens[earlier:]], dtype=input_ids.dtype)
