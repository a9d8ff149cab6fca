"""SparseD (Wang et al. 2025): head-specific block-sparse attention for diffusion LMs.

Full attention for the first ``skip`` fraction of the steps (early denoising steps shape the
output most); after them every head of every layer picks, for each block of ``block`` query
positions, the ``select`` fraction of key blocks that took most of its attention probability, the
first time that query block runs, and every later step reuses those patterns, which barely change
across steps. Without a cache every position runs at every step, so all patterns are picked at the
first step after ``skip`` (as the paper does).

SparseD composes with the caches (``SparseD(cache=DKVCache())``, as the paper suggests): the cache
policy chooses which positions run, and SparseD computes their attention over every key, the
cached ones included. A partial forward sees the keys in cache order, so the attention function
gathers each kept key from where the cache put it; a query block first seen in a partial forward
gets its pattern from the attention of the queries that ran in it.

The sparse attention is gather-based (it runs on CPU): the queries of each query block attend to the
keys of its own selected key blocks, gathered into one dense tile, so its cost is ``select`` of
full attention. It reaches the model through ``transformers.AttentionInterface`` as
``"hasten_sparsed"``; the per-generation state travels in the forward's keyword arguments, not on
the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..core.settings import Settings
from .forward import context_positions
from .policies import CachePolicy, Layout, NoCache, Runtime

ATTENTION_NAME = "hasten_sparsed"


@dataclass
class SparseState:
    """One generation's attention mode, the current forward's positions and the per-layer patterns."""

    block: int
    select: float
    mode: str = "full"  # full | select (full attention that also picks patterns) | sparse
    queries: torch.Tensor | None = None  # [queries] positions this forward runs (None: all, in order)
    key_positions: torch.Tensor | None = None  # [length] position of each key as attention sees it (None: in order)
    choose: torch.Tensor | None = None  # [blocks] bool: query blocks whose patterns a select forward picks
    patterns: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, query blocks, kept] key blocks


def block_mass(probs: torch.Tensor, block: int, query_positions: torch.Tensor | None = None,
               key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """probs [heads, queries, length] -> attention mass per (query block, key block) [heads, blocks, blocks].
    Positions None: queries (keys) are every position in order; both None takes a fast reshape."""
    heads, queries, length = probs.shape
    blocks = math.ceil(length / block)
    if query_positions is None and key_positions is None:
        pad = blocks * block - length
        padded = F.pad(probs, (0, pad, 0, pad))  # [heads, padded, padded]
        return padded.view(heads, blocks, block, blocks, block).sum((2, 4))
    if query_positions is None:
        query_positions = torch.arange(queries, device=probs.device)
    if key_positions is None:
        key_positions = torch.arange(length, device=probs.device)
    per_key_block = probs.new_zeros(heads, queries, blocks).index_add_(2, key_positions // block, probs)
    return probs.new_zeros(heads, blocks, blocks).index_add_(1, query_positions // block, per_key_block)


def pick_patterns(probs: torch.Tensor, block: int, select: float, query_positions: torch.Tensor | None = None,
                  key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """probs [heads, queries, length] -> per head and query block, the key blocks holding most of the
    attention mass, sorted: [heads, blocks, kept] with kept = ceil(select * blocks). Rows of query
    blocks without a query are meaningless."""
    mass = block_mass(probs, block, query_positions, key_positions)  # [heads, blocks, blocks]
    kept = max(1, math.ceil(select * mass.shape[-1]))
    return mass.topk(kept, dim=-1).indices.sort(-1).values


def block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pattern: torch.Tensor,
                           block: int, scaling: float, query_positions: torch.Tensor | None = None,
                           key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """query [heads, queries, dim], key/value [kv_heads, length, dim], pattern [heads, blocks, kept]
    -> [heads, queries, dim]: each query attends only to the keys of its query block's kept key blocks.
    ``query_positions`` [queries] (sorted) and ``key_positions`` [length] (a permutation) say where the
    queries and keys sit (None: every position in order)."""
    heads, queries, dim = query.shape
    kv_heads, length = key.shape[:2]
    blocks = pattern.shape[1]
    pad = blocks * block - length
    if query_positions is None:
        query_tiles = F.pad(query, (0, 0, 0, pad)).reshape(heads, blocks, block, dim)
        tile_pattern = pattern  # [heads, blocks, kept]
    else:  # one tile per query block that holds a query; empty rows are computed and dropped
        query_block = query_positions // block  # [queries]
        used = torch.unique_consecutive(query_block)  # [tiles]
        slot = torch.searchsorted(used, query_block) * block + query_positions % block  # [queries]
        query_tiles = query.new_zeros(heads, len(used) * block, dim).index_copy_(1, slot, query)
        query_tiles = query_tiles.view(heads, len(used), block, dim)
        tile_pattern = pattern[:, used]  # [heads, tiles, kept]
    tiles, kept = tile_pattern.shape[1:]
    kv_head = torch.arange(heads, device=query.device) // (heads // kv_heads)  # [heads]
    key_position = (tile_pattern[..., None] * block + torch.arange(block, device=query.device)).view(
        heads, tiles, kept * block)  # [heads, tiles, kept * block] the positions each tile attends to
    # One flat index_select per tensor: much faster on CPU than advanced indexing with broadcast indices.
    if key_positions is None:  # keys in position order: gather whole blocks
        key_blocks = F.pad(key, (0, 0, 0, pad)).reshape(kv_heads * blocks, block * dim)
        value_blocks = F.pad(value, (0, 0, 0, pad)).reshape(kv_heads * blocks, block * dim)
        flat = (kv_head[:, None, None] * blocks + tile_pattern).reshape(-1)  # [heads * tiles * kept]
        gathered_keys = key_blocks.index_select(0, flat).view(heads, tiles, kept * block, dim)
        gathered_values = value_blocks.index_select(0, flat).view(heads, tiles, kept * block, dim)
    else:  # keys in cache order: gather each kept position from where the cache put it (no reordering copy)
        where = torch.empty_like(key_positions).index_copy_(0, key_positions, torch.arange(
            length, device=query.device))  # [length] position -> index in the keys
        where = F.pad(where, (0, pad))  # padded positions read key 0 and are masked below
        flat = (kv_head[:, None, None] * length + where[key_position]).reshape(-1)  # [heads * tiles * kept * block]
        gathered_keys = key.reshape(kv_heads * length, dim).index_select(0, flat).view(heads, tiles, -1, dim)
        gathered_values = value.reshape(kv_heads * length, dim).index_select(0, flat).view(heads, tiles, -1, dim)
    padding = None
    if pad:  # padded keys never count
        padding = torch.zeros(key_position.shape, dtype=query.dtype, device=query.device)
        padding = padding.masked_fill_(key_position >= length, float("-inf"))[:, :, None]
    out = F.scaled_dot_product_attention(query_tiles, gathered_keys, gathered_values, attn_mask=padding,
                                         scale=scaling).reshape(heads, tiles * block, dim)
    if query_positions is None:
        return out[:, :length]
    return out.index_select(1, slot)


def _full_with_probs(query, key, value, scaling, groups):
    """Plain attention that also returns its probabilities. query [heads, Q, d], key/value [kv_heads, L, d]
    -> ([heads, Q, d], [heads, Q, L])"""
    key = key.repeat_interleave(groups, dim=0)
    value = value.repeat_interleave(groups, dim=0)
    probs = torch.softmax((query @ key.transpose(-1, -2)) * scaling, dim=-1)
    return probs @ value, probs


def sparsed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      sparsed: SparseState | None = None, **kwargs):
    """The attention function registered as ``hasten_sparsed``: sdpa unless ``sparsed`` says otherwise.
    query [1, heads, Q, d], key/value [1, kv_heads, L, d] -> ([1, Q, heads, d], None)."""
    if sparsed is None or sparsed.mode == "full" or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = module.layer_idx
    if sparsed.mode == "select":
        out, probs = _full_with_probs(query[0], key[0], value[0], scaling, query.shape[1] // key.shape[1])
        picked = pick_patterns(probs, sparsed.block, sparsed.select, sparsed.queries, sparsed.key_positions)
        if layer not in sparsed.patterns:
            sparsed.patterns[layer] = picked
        else:  # patterns already chosen stay as they are
            sparsed.patterns[layer][:, sparsed.choose] = picked[:, sparsed.choose]
    else:
        out = block_sparse_attention(query[0], key[0], value[0], sparsed.patterns[layer], sparsed.block, scaling,
                                     sparsed.queries, sparsed.key_positions)
    return out.transpose(0, 1)[None].contiguous(), None


AttentionInterface.register(ATTENTION_NAME, sparsed_attention)


class SparseAttention:
    """The attention object of one generation (see ``policies.DenseAttention``): dense for the first
    ``skip`` of the steps; then a forward whose query blocks all have patterns is sparse, and one with
    a query block never seen since is dense and picks that block's patterns (``select`` mode)."""

    def __init__(self, model, layout: Layout, settings: "SparseD"):
        self.model, self.length = model, layout.length
        self.full_steps = math.ceil(settings.skip * layout.num_steps)
        self.state = SparseState(settings.block, settings.select)
        blocks = math.ceil(layout.length / settings.block)
        self.known = torch.zeros(blocks, dtype=torch.bool, device=model.device)  # [blocks] patterns chosen
        self.kept = max(1, math.ceil(settings.select * blocks)) / blocks
        self.previous = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)

    def prepare(self, step: int, queries: torch.Tensor | None) -> tuple[dict, float]:
        state = self.state
        if step < self.full_steps:
            state.mode = "full"
            return {"sparsed": state}, 1.0
        state.queries = queries
        state.key_positions = None if queries is None else torch.cat([context_positions(queries, self.length),
                                                                        queries])
        needed = torch.ones_like(self.known) if queries is None else torch.zeros_like(self.known).index_fill_(
            0, queries // state.block, True)  # [blocks]
        missing = needed & ~self.known
        if bool(missing.any()):
            state.mode, state.choose = "select", missing
            self.known |= missing
            return {"sparsed": state}, 1.0
        state.mode = "sparse"
        return {"sparsed": state}, self.kept

    def close(self) -> None:
        self.model.set_attn_implementation(self.previous)


@dataclass(frozen=True)
class SparseD(Settings):
    """Full attention for the first ``skip`` fraction of steps, then per-head block-sparse attention
    keeping ``select`` of the key blocks (chosen once per query block, reused); ``select=1.0`` is full
    attention. ``cache``: the cache policy whose forwards it runs on (None: every position, every step)."""

    skip: float = 0.2
    select: float = 0.3
    block: int = 32
    cache: CachePolicy | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.skip <= 1:
            raise ValueError(f"SparseD: skip must be in [0, 1], got {self.skip}")
        if not 0 < self.select <= 1:
            raise ValueError(f"SparseD: select must be in (0, 1], got {self.select}")
        if self.block < 1:
            raise ValueError(f"SparseD: block must be >= 1, got {self.block}")
        if self.cache is not None and not isinstance(self.cache, CachePolicy):
            raise ValueError(f"SparseD: cache must be a cache policy (NoCache, DKVCache, FastDLLMPrefix, "
                             f"FastDLLMDual) or None, got {self.cache!r}")

    def start(self, model, layout: Layout) -> Runtime:
        cache = NoCache() if self.cache is None else self.cache
        return cache.start(model, layout, SparseAttention(model, layout, self))
