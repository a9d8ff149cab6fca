"""Lossy KV-cache compression after prefill: SpecKV and its baselines (StreamingLLM, SnapKV).

**Lossy**, and named so: the target decodes from a cache that keeps only ``budget`` of the
prompt's entries per layer and KV head, so its output may differ from the full model's.
Nothing here runs unless asked for by name (``hasten.generate(..., kv_compression=SpecKV(draft))``),
and a generation that used one lists it in ``GenerationOutput.lossy``. Speculative decoding
on top stays exact *relative to the compressed target*: any lossless drafter composes.

Every policy prefills the target once, records the queries of the positions it observes
and keeps, per layer and KV head, the most recent ``window`` prompt entries plus the
``budget - window`` earlier ones it scores highest:

* :class:`StreamingLLM` (Xiao et al. 2024): no scores; the first ``budget - window`` entries
  (attention sinks) and the window;
* :class:`SnapKV` (Li et al. 2024): the attention the prompt's own last ``window`` queries
  give each entry (largest over the query heads sharing the KV head, then max-pooled over
  ``pool`` neighbours so kept entries come with their context);
* :class:`SpecKV` (Galim et al. 2025, "Draft-based Approximate Inference for LLMs"): the
  same scores, but observed by the last window *and* a ``lookahead`` of tokens the draft
  model writes after the prompt, which approximate the queries the answer itself will make.
  As in the reference code, the lookahead is as long as the answer (``max_new_tokens``)
  unless set.

Full-attention targets only (a kept entry's position is not its cache index, which a
sliding-window mask would need).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..models.adapter import ModelAdapter, model_name, vocab_size
from ..models.compat import cache_argument
from ..models.layers import last_queries


class KVCompression:
    """A policy: ``start`` replaces a target's prefill by a compressed one."""

    lossless = False
    name = "kv_compression"
    budget: int
    window: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.budget <= self.window:
            raise ValueError(f"{self.name}: budget ({self.budget}) must exceed window ({self.window}) >= 1")

    def describe(self) -> str:
        return f"{self.name}(budget={self.budget})"

    def observed(self, tokens: list[int], max_new_tokens: int | None) -> list[int]:
        """Tokens run after the prompt's cached part, observed but never kept: none."""
        return []

    def check(self, target: ModelAdapter) -> None:
        """Raise ValueError if this policy cannot serve ``target``."""

    def scores(self, queries: dict[int, torch.Tensor], cache: DynamicCache, cached: int) -> dict[int, torch.Tensor]:
        """{layer: [kv_heads, cached]} how much each cached prompt entry is worth keeping."""
        return {layer: attention_scores(queries[layer], cache.layers[layer].keys[0], cached, self.pool)
                for layer in range(len(cache.layers))}

    @torch.no_grad()
    def start(self, target: ModelAdapter, input_ids: torch.Tensor, hidden: bool,
              max_new_tokens: int | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Prefill ``input_ids`` ([1, T]) and leave ``target`` holding the compressed cache of
        its first T - 1 tokens; returns the tokens and, if asked, the prefilled features.
        ``max_new_tokens``: the answer's length, which SpecKV's default lookahead needs."""
        check_full_attention(target.model)
        self.check(target)
        tokens = input_ids[0].tolist()
        cached = len(tokens) - 1
        if cached <= self.budget:  # nothing to drop
            return target.start(input_ids, hidden=hidden)
        extra = self.observed(tokens, max_new_tokens)
        sequence = tokens[:-1] + extra
        model = target.model
        cache = DynamicCache()
        with last_queries(model, self.window + len(extra)) as queries:
            out = model(input_ids=torch.tensor([sequence], device=model.device), **cache_argument(model, cache),
                        use_cache=True, output_hidden_states=hidden, logits_to_keep=1)
        kept = keep_entries(cache, self.scores(queries, cache, cached), cached, self.budget, self.window)
        target.adopt(kept, cached)
        features = out.hidden_states[-1][0, :cached] if hidden else None
        return tokens, features


def check_full_attention(model: PreTrainedModel) -> None:
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    if model.config.is_encoder_decoder or (getattr(config, "sliding_window", None) is not None
                                           and "sliding_attention" in kinds):
        raise ValueError(f"KV compression needs a full-attention causal LM; {model_name(model)!r} is not one")


def attention_scores(queries: torch.Tensor, keys: torch.Tensor, cached: int, pool: int,
                     query_weights: torch.Tensor | None = None) -> torch.Tensor:
    """queries [heads, n, dim] of the last n positions of a sequence whose keys are
    ``keys`` [kv_heads, T, dim] -> [kv_heads, cached]: the largest softmax weight any observed
    query (and any query head sharing the KV head) gives each of the first ``cached`` keys,
    each query's weights first multiplied by its ``query_weights`` ([n]) if given, then
    max-pooled over ``pool`` neighbours (odd ``pool``: centred)."""
    heads, count, dim = queries.shape
    kv_heads, length = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    keys = keys.float().repeat_interleave(group, 0)  # [heads, T, dim]
    logits = queries.float() @ keys.transpose(1, 2) / math.sqrt(dim)  # [heads, n, T]
    query_pos = torch.arange(length - count, length, device=keys.device)
    future = torch.arange(length, device=keys.device)[None] > query_pos[:, None]  # [n, T]
    weights = logits.masked_fill(future, float("-inf")).softmax(-1)[..., :cached]  # [heads, n, cached]
    if query_weights is not None:
        weights = weights * query_weights.to(weights)[None, :, None]
    scores = weights.amax(1).view(kv_heads, group, cached).amax(1)  # [kv_heads, cached]
    return centred_max_pool(scores, pool)


def centred_max_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """[..., T] -> [..., T]: each entry the largest of the ``kernel`` entries from ``(kernel - 1) // 2``
    before it to ``kernel // 2`` after it (the reference's centring, which even kernels need)."""
    if kernel <= 1:
        return scores
    left = (kernel - 1) // 2
    padded = F.pad(scores.unsqueeze(-2), (left, kernel - 1 - left), value=float("-inf"))  # [..., 1, T + kernel - 1]
    return F.max_pool1d(padded, kernel, stride=1).squeeze(-2)


def keep_entries(cache: DynamicCache, scores: dict[int, torch.Tensor], cached: int, budget: int,
                 window: int) -> DynamicCache:
    """A new cache of ``budget`` entries per layer and KV head: the last ``window`` of the
    first ``cached`` entries and the best-scored before them, in position order."""
    kept = DynamicCache()
    for layer_index, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values  # [1, kv_heads, T, dim]
        kv_heads, dim = keys.shape[1], keys.shape[3]
        earlier = scores[layer_index][:, : cached - window]  # [kv_heads, cached - window]
        best = earlier.topk(budget - window, dim=1).indices.sort(1).values  # [kv_heads, budget - window]
        recent = torch.arange(cached - window, cached, device=keys.device).expand(kv_heads, window)
        index = torch.cat([best, recent], 1)[None, :, :, None].expand(1, -1, -1, dim)
        kept.update(keys.gather(2, index), values.gather(2, index), layer_index)
    return kept


@dataclass(frozen=True)
class StreamingLLM(KVCompression):
    budget: int = 256
    window: int = 252  # so 4 attention sinks by default
    name = "streaming_llm"
    pool = 1

    def scores(self, queries, cache, cached):
        first = torch.zeros(cached)
        first[: self.budget - self.window] = 1.0  # the sinks win; the window is kept anyway
        return {layer: first.to(cache.layers[layer].keys.device).expand(cache.layers[layer].keys.shape[1], cached)
                for layer in range(len(cache.layers))}


@dataclass(frozen=True)
class SnapKV(KVCompression):
    budget: int = 256
    window: int = 32
    pool: int = 7
    name = "snapkv"


@dataclass(frozen=True)
class SpecKV(KVCompression):
    draft: PreTrainedModel | None = None
    budget: int = 256
    window: int = 32
    pool: int = 7
    lookahead: int | None = None  # tokens the draft writes after the prompt (greedy); None: max_new_tokens
    name = "speckv"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_draft(self.name, self.draft, self.lookahead)

    def check(self, target: ModelAdapter) -> None:
        if vocab_size(self.draft) != target.vocab_size:
            raise ValueError(f"SpecKV's draft model has a vocabulary of {vocab_size(self.draft)} tokens, the target "
                             f"{target.vocab_size}: they must share one tokenizer")

    def observed(self, tokens: list[int], max_new_tokens: int | None) -> list[int]:
        """The prompt's last token, then the draft model's greedy continuation, every token of
        it observed (the reference's window is ``window + lookahead + 1`` queries)."""
        count = self.lookahead if self.lookahead is not None else max_new_tokens
        if count is None:
            raise ValueError("SpecKV(lookahead=None) writes a lookahead as long as the answer, but was not told "
                             "max_new_tokens; set lookahead=N")
        return [tokens[-1], *draft_lookahead(self.draft, tokens, count)]


def check_draft(name: str, draft, lookahead: int | None) -> None:
    if not isinstance(draft, PreTrainedModel):
        raise TypeError(f"{name} needs a draft model (a transformers PreTrainedModel), got {draft!r}")
    if lookahead is not None and lookahead < 1:
        raise ValueError(f"{name}: lookahead must be >= 1, got {lookahead}")


@torch.no_grad()
def draft_lookahead(draft: PreTrainedModel, tokens: list[int], count: int) -> list[int]:
    """The draft model's greedy continuation of ``tokens``, ``count`` tokens."""
    adapter = ModelAdapter(draft)
    known, _ = adapter.start(torch.tensor([tokens]))
    block, written = [known[-1]], []
    for _ in range(count):
        token = int(adapter.forward(block, tree=None).logits[-1].argmax())
        written.append(token)
        block = [token]
    return written
