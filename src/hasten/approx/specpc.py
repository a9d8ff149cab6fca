"""SpecPC: draft-guided prompt compression (Galim et al. 2025). **Lossy**, named so.

The steps of the reference code (furiosa-ai/draft-based-approx-llm, ``specpc/``), with its
paper configurations for Llama (``cfg/paper/specpc/``) as defaults:

1. the draft reads the prompt and writes ``lookahead`` tokens (1: none is observed, only the
   prompt's own queries count);
2. each prompt token's score is the largest attention weight it gets from the prompt's last
   ``window`` queries (weighted linearly from 0 for the earliest to 1 for the last) and from
   the lookahead's queries, over the query heads and the draft's layers from
   ``starting_layer`` up;
3. the scores are max-pooled (``pool`` wide, centred as the reference centres them);
4. the ``budget`` best tokens, best first, each bring their ``neighbours`` (offsets
   ``-(n - 1) // 2 .. n // 2``, nearest first);
5. the last ``window`` tokens come first, then the expanded picks in that order; the first
   ``budget`` distinct positions, in prompt order, are the compressed prompt.

The target then runs on it as on any prompt (positions renumbered), so every method,
lossless drafters included, applies unchanged. The output answers the compressed prompt,
not the original: that is the loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..models.compat import cache_argument
from ..models.layers import last_queries
from .kv import attention_scores, centred_max_pool, check_draft, draft_lookahead


@dataclass(frozen=True)
class SpecPC:
    draft: PreTrainedModel
    budget: int = 256  # prompt tokens kept, the window's included
    window: int = 64  # the prompt's last tokens: always kept, and their queries score the rest
    pool: int = 32  # max-pool kernel over the scores
    neighbours: int = 32  # tokens each pick brings, itself included (+-16 for 32); 0 or 1: itself only
    lookahead: int = 1  # tokens the draft writes; all but the last are observed
    starting_layer: int | None = None  # the draft's first layer that scores; None: half its depth
    weighted_query: bool = True  # the window's queries weighted linearly from 0 to 1

    lossless = False
    name = "specpc"

    def __post_init__(self) -> None:
        check_draft(self.name, self.draft, self.lookahead)
        if self.window < 1 or self.budget <= self.window:
            raise ValueError(f"{self.name}: budget ({self.budget}) must exceed window ({self.window}) >= 1")
        if self.pool < 1 or self.neighbours < 0:
            raise ValueError(f"{self.name}: pool must be >= 1 and neighbours >= 0, got {self.pool}, {self.neighbours}")
        layers = self.draft.config.get_text_config().num_hidden_layers
        if self.starting_layer is not None and not 0 <= self.starting_layer < layers:
            raise ValueError(f"{self.name}: starting_layer must be in 0..{layers - 1} (the draft's layers), "
                             f"got {self.starting_layer}")

    def describe(self) -> str:
        return f"{self.name}(budget={self.budget})"

    @property
    def first_layer(self) -> int:
        """The reference starts at layer 8 of its Llama draft's 16: half the depth."""
        layers = self.draft.config.get_text_config().num_hidden_layers
        return layers // 2 if self.starting_layer is None else self.starting_layer

    @torch.no_grad()
    def scores(self, tokens: list[int]) -> torch.Tensor:
        """[T]: each prompt token's score (step 2), before pooling."""
        extra = draft_lookahead(self.draft, tokens, self.lookahead)[:-1] if self.lookahead > 1 else []
        cache = DynamicCache()
        observed = self.window + len(extra)
        with last_queries(self.draft, observed) as queries:
            self.draft(input_ids=torch.tensor([tokens + extra], device=self.draft.device),
                       **cache_argument(self.draft, cache), use_cache=True, logits_to_keep=1)
        weights = torch.ones(observed)
        if self.weighted_query and self.window > 1:
            weights[: self.window] = torch.linspace(0, 1, self.window)
        return torch.stack([
            attention_scores(queries[layer], cache.layers[layer].keys[0], len(tokens), 1, weights).amax(0)
            for layer in range(self.first_layer, len(cache.layers))
        ]).amax(0).cpu()  # [T]

    @torch.no_grad()
    def compress(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, T] -> [1, min(T, budget)]: the kept prompt tokens, in order."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError("input_ids must be one prompt, a [1, T] torch.LongTensor")
        tokens = input_ids[0].tolist()
        if len(tokens) <= self.budget:
            return input_ids
        kept = select_positions(self.scores(tokens), self.budget, self.window, self.pool, self.neighbours)
        return torch.tensor([[tokens[i] for i in kept]], dtype=input_ids.dtype)


def select_positions(scores: torch.Tensor, budget: int, window: int, pool: int, neighbours: int) -> list[int]:
    """Steps 3-5 on ``scores`` ([T], T > budget): the kept positions, in order. Ties in score
    go to the earlier position (the reference leaves them to ``topk``); out-of-range
    neighbours are clamped to the ends, as the reference clamps them."""
    length = scores.shape[0]
    pooled = centred_max_pool(scores.float(), pool)
    picks = pooled.sort(descending=True, stable=True).indices[:budget]  # [budget], best first
    if neighbours > 1:
        offsets = torch.arange(-((neighbours - 1) // 2), neighbours // 2 + 1)  # [neighbours]
        offsets = offsets[offsets.abs().sort(stable=True).indices]  # 0, -1, 1, -2, 2, ...
        picks = (picks[:, None] + offsets).flatten().clamp(0, length - 1)
    order = [*range(length - window, length), *picks.tolist()]
    return sorted(list(dict.fromkeys(order))[:budget])
