"""SparseD (Wang et al. 2025): head-specific block-sparse attention for diffusion LMs.

Full attention for the early steps (they shape the output most): every step up to
``int(skip * steps) + 1``, at which the patterns are chosen (the reference's rule). Each head of
each layer picks, for each block of ``block`` query positions, its key blocks by *isolated
selection* (the reference's ``SparseD_param`` branch): the key blocks are split at the first block
lying wholly in the generated span; a top-k of ``int(select * blocks) + 1`` over all key blocks,
ranked by the block's attention probability, keeps its picks before the split, and a separate
top-k of ``int(select * generated blocks) + 1`` over the generated key blocks, ranked by the
attention renormalised over those keys alone, adds its picks, so the generated span always keeps
some of its own blocks however long the prompt. Every later step reuses the patterns, which barely
change across steps. Without a cache every position runs at every step, so all patterns are picked
at the choosing step (as the paper does). ``selection="single"`` is hasten's earlier rule, one
top-k of ``int(select * blocks) + 1`` over all key blocks, kept for comparison.

Presets (``select``/``block`` None): the reference's two command lines, ``skip 0.2, select 0.3,
block_size 128`` for its 4k-and-longer prompts and ``select 0.5, block_size 32`` for its short one;
hasten applies the first from ``LONG_PROMPT`` (2,048) prompt tokens on, a line of its own between the
reference's short prompt (about 50 tokens) and its 4k one.

SparseD composes with the caches (``SparseD(cache=DKVCache())``, as the paper suggests): the cache
policy chooses which positions run, and SparseD computes their attention over every key, the
cached ones included. A partial forward sees the keys in cache order, so the attention function
gathers each kept key from where the cache put it; a query block first seen in a partial forward
gets its pattern from the attention of the queries that ran in it.

The sparse attention is gather-based (it runs on CPU): the queries of each query block attend to the
keys of its own selected key blocks, gathered into one dense tile, so its cost is ``select`` of
full attention. It reaches the model through ``transformers.AttentionInterface`` as
``"hasten_sparsed"``. The generation's state reaches it through a context variable set for the
generation, not through the forward's keyword arguments: some decoder layers (StableLM's) do not
pass those on to their attention, which then ran full attention and recorded no pattern. Before
the first step a one-token forward checks that every layer's attention calls it; a model whose
attention does not go through the interface is refused there, in one line.
"""
from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..core.settings import Settings
from .forward import context_positions
from .policies import CachePolicy, GenerationForwards, Layout, NoCache

ATTENTION_NAME = "hasten_sparsed"


@dataclass
class SparseState:
    """One generation's attention mode, the current forward's positions and the per-layer patterns."""

    block: int
    select: float
    split: int | None  # first key block wholly in the generated span (None: one top-k over all blocks)
    mode: str = "full"  # full | select (full attention that also picks patterns) | sparse | probe (records layers)
    queries: torch.Tensor | None = None  # [queries] positions this forward runs (None: all, in order)
    key_positions: torch.Tensor | None = None  # [length] position of each key as attention sees it (None: in order)
    choose: torch.Tensor | None = None  # [blocks] bool: query blocks whose patterns a select forward picks
    patterns: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, query blocks, key blocks] bool
    probed: set = field(default_factory=set)  # the layers whose attention a probe forward reached


# The running generation's state, read by the attention function (None: no SparseD generation).
CURRENT: contextvars.ContextVar[SparseState | None] = contextvars.ContextVar("hasten_sparsed", default=None)


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


def kept_blocks(select: float, blocks: int) -> int:
    """The reference's count ``int(select * blocks) + 1``, at most ``blocks`` (the reference's top-k would fail)."""
    return min(blocks, int(select * blocks) + 1)


def top_blocks(mass: torch.Tensor, select: float) -> torch.Tensor:
    """mass [heads, query blocks, key blocks] -> bool of the same shape: each row's ``kept_blocks`` heaviest."""
    picked = mass.topk(kept_blocks(select, mass.shape[-1]), dim=-1).indices
    return torch.zeros(mass.shape, dtype=torch.bool, device=mass.device).scatter_(-1, picked, True)


def generated_split(prompt_length: int, block: int, blocks: int) -> int:
    """The first key block lying wholly in the generated span (the last block when none does), as the
    reference's ``self.last``."""
    return min(math.ceil(prompt_length / block), blocks - 1)


def pick_patterns(probs: torch.Tensor, block: int, select: float, split: int | None = None,
                  query_positions: torch.Tensor | None = None,
                  key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """probs [heads, queries, length] -> per head and query block, the key blocks to keep: bool
    [heads, blocks, blocks]. ``split`` (the first key block wholly in the generated span): isolated
    selection, the picks of one top-k over every key block that lie before ``split``, joined with a top-k
    over the key blocks from ``split`` on under the attention renormalised over their keys. None: one
    top-k over every key block. Rows of query blocks without a query are meaningless."""
    mass = block_mass(probs, block, query_positions, key_positions)  # [heads, blocks, blocks]
    picked = top_blocks(mass, select)
    if split is None:
        return picked
    length = probs.shape[-1]
    if key_positions is None:
        key_positions = torch.arange(length, device=probs.device)
    generated = (key_positions >= split * block).to(probs.dtype)  # [length] keys from the split on
    renormalised = probs * generated / (probs * generated).sum(-1, keepdim=True).clamp_min(1e-30)
    generated_mass = block_mass(renormalised, block, query_positions, key_positions)[..., split:]
    picked[..., split:] = top_blocks(generated_mass, select)
    return picked


def block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pattern: torch.Tensor,
                           block: int, scaling: float, query_positions: torch.Tensor | None = None,
                           key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """query [heads, queries, dim], key/value [kv_heads, length, dim], pattern [heads, blocks, blocks] bool
    -> [heads, queries, dim]: each query attends only to the keys of its query block's kept key blocks.
    ``query_positions`` [queries] (sorted) and ``key_positions`` [length] (a permutation) say where the
    queries and keys sit (None: every position in order)."""
    heads, queries, dim = query.shape
    kv_heads, length = key.shape[:2]
    blocks = pattern.shape[1]
    pad = blocks * block - length
    # kept blocks first, ascending: [heads, blocks, widest] indices, padded with dropped blocks masked below
    widest = int(pattern.sum(-1).max())
    pattern, valid = pattern_indices(pattern, widest)
    if query_positions is None:
        query_tiles = F.pad(query, (0, 0, 0, pad)).reshape(heads, blocks, block, dim)
        tile_pattern, tile_valid = pattern, valid  # [heads, blocks, kept]
    else:  # one tile per query block that holds a query; empty rows are computed and dropped
        query_block = query_positions // block  # [queries]
        used = torch.unique_consecutive(query_block)  # [tiles]
        slot = torch.searchsorted(used, query_block) * block + query_positions % block  # [queries]
        query_tiles = query.new_zeros(heads, len(used) * block, dim).index_copy_(1, slot, query)
        query_tiles = query_tiles.view(heads, len(used), block, dim)
        tile_pattern, tile_valid = pattern[:, used], valid[:, used]  # [heads, tiles, kept]
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
    dropped = (key_position >= length) | ~tile_valid.repeat_interleave(block, dim=-1)  # [heads, tiles, kept * block]
    padding = None
    if bool(dropped.any()):  # padded keys and the filler blocks of short rows never count
        padding = torch.zeros(key_position.shape, dtype=query.dtype, device=query.device)
        padding = padding.masked_fill_(dropped, float("-inf"))[:, :, None]
    out = F.scaled_dot_product_attention(query_tiles, gathered_keys, gathered_values, attn_mask=padding,
                                         scale=scaling).reshape(heads, tiles * block, dim)
    if query_positions is None:
        return out[:, :length]
    return out.index_select(1, slot)


def pattern_indices(pattern: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pattern [heads, blocks, blocks] bool -> (indices [heads, blocks, width], valid [heads, blocks, width]):
    each row's kept key blocks ascending, then dropped ones (valid False) to fill the width."""
    order = pattern.to(torch.uint8).sort(dim=-1, descending=True, stable=True).indices[..., :width]
    return order, pattern.gather(-1, order)


def _full_with_probs(query, key, value, scaling, groups):
    """Plain attention that also returns its probabilities. query [heads, Q, d], key/value [kv_heads, L, d]
    -> ([heads, Q, d], [heads, Q, L])"""
    key = key.repeat_interleave(groups, dim=0)
    value = value.repeat_interleave(groups, dim=0)
    probs = torch.softmax((query @ key.transpose(-1, -2)) * scaling, dim=-1)
    return probs @ value, probs


def sparsed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """The attention function registered as ``hasten_sparsed``: sdpa unless the running generation's
    state (:data:`CURRENT`) says otherwise. query [1, heads, Q, d], key/value [1, kv_heads, L, d] ->
    ([1, Q, heads, d], None)."""
    sparsed = CURRENT.get()
    if sparsed is not None and sparsed.mode == "probe":
        sparsed.probed.add(getattr(module, "layer_idx", None))
    if sparsed is None or sparsed.mode in ("full", "probe") or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = module.layer_idx
    if sparsed.mode == "select":
        out, probs = _full_with_probs(query[0], key[0], value[0], scaling, query.shape[1] // key.shape[1])
        picked = pick_patterns(probs, sparsed.block, sparsed.select, sparsed.split, sparsed.queries,
                               sparsed.key_positions)
        if layer not in sparsed.patterns:
            sparsed.patterns[layer] = picked
        else:  # patterns already chosen stay as they are
            sparsed.patterns[layer][:, sparsed.choose] = picked[:, sparsed.choose]
    else:
        out = block_sparse_attention(query[0], key[0], value[0], sparsed.patterns[layer], sparsed.block, scaling,
                                     sparsed.queries, sparsed.key_positions)
    return out.transpose(0, 1)[None].contiguous(), None


AttentionInterface.register(ATTENTION_NAME, sparsed_attention)


LONG_PROMPT = 2048  # prompt tokens from which SparseD's presets take the reference's 4k-and-longer command line
SELECTIONS = ("isolated", "single")


class SparseAttention:
    """The attention object of one generation (see ``policies.DenseAttention``): dense up to the choosing
    step ``int(skip * steps) + 1``; from it, a forward whose query blocks all have patterns is sparse, and
    one with a query block never seen since is dense and picks that block's patterns (``select`` mode)."""

    def __init__(self, model, layout: Layout, settings: "SparseD"):
        self.model, self.length = model, layout.length
        skip, select, block = settings.resolved(layout.prompt_length)
        self.choosing_step = int(skip * layout.num_steps) + 1
        blocks = math.ceil(layout.length / block)
        split = generated_split(layout.prompt_length, block, blocks) if settings.selection == "isolated" else None
        self.state = SparseState(block, select, split)
        self.known = torch.zeros(blocks, dtype=torch.bool, device=model.device)  # [blocks] patterns chosen
        self.previous = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
        self.token = CURRENT.set(self.state)
        try:
            self.check_routed()
        except BaseException:
            self.close()
            raise

    def check_routed(self) -> None:
        """Refuse, before the first step, a model whose layers' attention does not reach
        :func:`sparsed_attention` (it would run full attention and pick no pattern): a one-token
        forward must reach it once in every layer."""
        state, model = self.state, self.model
        state.mode = "probe"
        with torch.no_grad():
            one = torch.ones(1, 1, dtype=torch.long, device=model.device)
            model(input_ids=one, attention_mask=one, use_cache=False)
        state.mode = "full"
        layers = set(range(model.config.get_text_config().num_hidden_layers))
        if state.probed != layers:
            reached = sorted(layer for layer in state.probed if layer is not None)
            raise ValueError(f"SparseD cannot route the attention of {type(model).__name__}: its layers' attention "
                             f"does not go through transformers' AttentionInterface (reached in layers {reached} of "
                             f"{len(layers)}); run it with a cache policy alone, or without one")

    def kept_fraction(self, queries: torch.Tensor | None) -> float:
        """The fraction of query-key pairs the sparse forward computes, in whole key blocks, over the
        layers, heads and the queries that run."""
        state = self.state
        query_blocks = None if queries is None else queries // state.block  # [queries]
        fractions = []
        for pattern in state.patterns.values():  # [heads, blocks, blocks]
            per_block = pattern.sum(-1).float()  # [heads, blocks]
            per_query = per_block if query_blocks is None else per_block[:, query_blocks]
            if query_blocks is None:  # every position: weight each query block by the positions it holds
                sizes = torch.full((pattern.shape[1],), float(state.block), device=pattern.device)
                sizes[-1] = self.length - state.block * (pattern.shape[1] - 1)
                fractions.append(float((per_query * sizes).sum() / (sizes.sum() * pattern.shape[0])))
            else:
                fractions.append(float(per_query.mean()))
        return sum(fractions) / len(fractions) / len(self.known)

    def prepare(self, step: int, queries: torch.Tensor | None) -> float:
        state = self.state
        if step < self.choosing_step:
            state.mode = "full"
            return 1.0
        state.queries = queries
        state.key_positions = None if queries is None else torch.cat([context_positions(queries, self.length),
                                                                        queries])
        needed = torch.ones_like(self.known) if queries is None else torch.zeros_like(self.known).index_fill_(
            0, queries // state.block, True)  # [blocks]
        missing = needed & ~self.known
        if bool(missing.any()):
            state.mode, state.choose = "select", missing
            self.known |= missing
            return 1.0
        state.mode = "sparse"
        return self.kept_fraction(queries)

    def close(self) -> None:
        self.model.set_attn_implementation(self.previous)
        CURRENT.reset(self.token)


@dataclass(frozen=True)
class SparseD(Settings):
    """Full attention up to the step ``int(skip * steps) + 1``, which picks per head and query block the key
    blocks to keep (isolated selection, reused after); ``select=1.0`` is full attention. ``select`` and
    ``block`` None take the reference's preset for the prompt's length (see the module docstring).
    ``cache``: the cache policy whose forwards it runs on (None: every position, every step)."""

    skip: float = 0.2
    select: float | None = None  # None: 0.3 from LONG_PROMPT prompt tokens on, else 0.5 (the reference's presets)
    block: int | None = None  # None: 128 from LONG_PROMPT prompt tokens on, else 32
    selection: str = "isolated"  # isolated (the reference's) | single (hasten's earlier rule: one top-k)
    cache: CachePolicy | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.skip <= 1:
            raise ValueError(f"SparseD: skip must be in [0, 1], got {self.skip}")
        if self.select is not None and not 0 < self.select <= 1:
            raise ValueError(f"SparseD: select must be in (0, 1] or None, got {self.select}")
        if self.block is not None and self.block < 1:
            raise ValueError(f"SparseD: block must be >= 1 or None, got {self.block}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"SparseD: selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.cache is not None and not isinstance(self.cache, CachePolicy):
            raise ValueError(f"SparseD: cache must be a cache policy (NoCache, DKVCache, FastDLLMPrefix, "
                             f"FastDLLMDual) or None, got {self.cache!r}")

    def resolved(self, prompt_length: int) -> tuple[float, float, int]:
        """(skip, select, block) for a prompt of this many tokens: the preset fills what is None."""
        long = prompt_length >= LONG_PROMPT
        select = (0.3 if long else 0.5) if self.select is None else self.select
        block = (128 if long else 32) if self.block is None else self.block
        return self.skip, select, block

    def start(self, model, layout: Layout) -> GenerationForwards:
        cache = NoCache() if self.cache is None else self.cache
        return cache.start(model, layout, SparseAttention(model, layout, self))
