"""Forward passes of an unmodified Hugging Face causal LM used bidirectionally, full or partial.

A diffusion LM sees the whole sequence at every step, so any causal LM becomes one when given an
all-zeros additive 4D attention mask. A *partial* forward runs only some positions (with their
true ``position_ids``) and hands the model, as its past key/values, the keys and values of every
other position as they were last computed. Attention is bidirectional and keys carry their
rotary position, so the order of the cached entries does not matter: when the cached K/V are
fresh, a partial forward gives the full forward's outputs at the positions it runs.

``KVStore`` keeps, per layer, the K/V of every position at its last computation and the token it
was computed from; caching policies choose which positions to run each step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..models.compat import cache_argument


def bidirectional_mask(queries: int, keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask letting every query see every key. [1, 1, queries, keys]"""
    return torch.zeros(1, 1, queries, keys, dtype=dtype, device=device)


@dataclass
class ForwardCounts:
    """What one generation's forwards cost, counted exactly (no timing)."""

    forwards: int = 0
    tokens_recomputed: int = 0  # positions run through the model, summed over forwards
    attention_flops: int = 0  # multiply-adds x 2 of QK^T and AV actually run
    attention_flops_full: int = 0  # what full attention over the whole sequence would have run

    def add(self, queries: int, keys: int, length: int, per_pair: int, kept: float = 1.0) -> None:
        """One forward of ``queries`` positions over ``keys`` keys; ``per_pair`` is the FLOPs of
        one query-key pair summed over layers and heads (QK^T and AV); ``kept`` the fraction of
        pairs a sparse attention computes."""
        self.forwards += 1
        self.tokens_recomputed += queries
        self.attention_flops += round(per_pair * queries * keys * kept)
        self.attention_flops_full += per_pair * length * length


def attention_flops_per_pair(config) -> int:
    """FLOPs of one query-key pair over all layers and heads: 2 (multiply-add) x 2 (QK^T, AV) x heads x dim."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4 * config.num_hidden_layers * config.num_attention_heads * head_dim


class KVStore:
    """Per layer, the keys and values of every position as last computed ([1, kv_heads, length, head_dim]),
    and ``computed_from`` [length]: the token each position's K/V were computed from (-1: never)."""

    def __init__(self, length: int, device):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.computed_from = torch.full((length,), -1, dtype=torch.long, device=device)

    def replace_all(self, cache: DynamicCache, tokens: torch.Tensor) -> None:
        """Take every position's K/V from a full forward's cache (the tensors are owned, no copy)."""
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        self.computed_from = tokens.clone()

    def context_cache(self, context: torch.Tensor) -> DynamicCache:
        """A fresh cache holding the K/V of the ``context`` positions (a gathered copy)."""
        return DynamicCache(ddp_cache_data=[(k.index_select(2, context), v.index_select(2, context))
                                            for k, v in zip(self.keys, self.values)])

    def write(self, cache: DynamicCache, start: int, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store the K/V the partial forward computed (entries from ``start`` on in ``cache``) at ``positions``."""
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            keys.index_copy_(2, positions, layer.keys[:, :, start:])
            values.index_copy_(2, positions, layer.values[:, :, start:])
        self.computed_from[positions] = tokens


def full_forward(model, tokens: torch.Tensor, rows: torch.Tensor, counts: ForwardCounts, per_pair: int,
                 store: KVStore | None = None, kept: float = 1.0) -> torch.Tensor:
    """Every position of ``tokens`` [length]; logits at ``rows`` [rows, vocab]. With ``store``, keep all K/V.
    ``kept``: the fraction of query-key pairs the attention computes (a sparse attention passes it)."""
    length = tokens.shape[0]
    cache = DynamicCache() if store is not None else None
    out = model(input_ids=tokens[None], attention_mask=bidirectional_mask(length, length, model.dtype, tokens.device),
                **cache_argument(model, cache), use_cache=store is not None, logits_to_keep=rows)
    counts.add(length, length, length, per_pair, kept)
    if store is not None:
        store.replace_all(cache, tokens)
    return out.logits[0]


def context_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    """The positions a partial forward running ``positions`` [queries] takes from the cache, ascending.
    Its attention sees the keys as ``cat(context_positions(...), positions)``."""
    is_query = torch.zeros(length, dtype=torch.bool, device=positions.device)
    is_query[positions] = True
    return (~is_query).nonzero().squeeze(1)  # [length - queries]


def partial_forward(model, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, store: KVStore,
                    counts: ForwardCounts, per_pair: int, kept: float = 1.0) -> torch.Tensor:
    """Only ``positions`` (sorted) are run; every other position's K/V come from ``store``. Their new K/V
    are written back to ``store``. Returns logits at ``rows`` (a subset of ``positions``) [rows, vocab].
    The attention sees the keys in the order (other positions ascending, then ``positions``);
    ``kept`` as in :func:`full_forward`."""
    length = tokens.shape[0]
    context = context_positions(positions, length)  # [length - queries]
    cache = store.context_cache(context)
    keep = torch.searchsorted(positions, rows)  # rows as offsets into the queries
    out = model(input_ids=tokens[positions][None], position_ids=positions[None], **cache_argument(model, cache), use_cache=True,
                attention_mask=bidirectional_mask(len(positions), length, model.dtype, tokens.device),
                logits_to_keep=keep)
    counts.add(len(positions), length, length, per_pair, kept)
    store.write(cache, len(context), positions, tokens[positions])
    return out.logits[0]
