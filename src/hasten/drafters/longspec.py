"""LongSpec: a constant-memory drafter for long contexts (Yang et al. 2025, "LongSpec:
Long-Context Lossless Speculative Decoding with Efficient Drafting and Verification").

One layer, three parts, reading the target's own cache instead of keeping a copy of the context:

1. **sliding-window self-attention** over the drafter's own tokens: its input at position
   ``t`` is ``embed(x_t)`` (the target's input embedding, as the reference does: no target
   features), and it sees its own keys of the last ``window`` positions only. A key
   depends on its token and position alone (one layer), so the drafter's cache holds at
   most ``2 * window`` committed rows plus the tree's scratch rows, preallocated once:
   its memory does not grow with the context;
2. **cross-attention to the target's last-layer KV cache**, read in place from the
   target's adapter (never recomputed or copied): the queries have the target's head
   layout (grouped-query heads over its KV heads) and are rotated by the target's own
   rotary embedding at their true positions, so they match the cached post-RoPE keys;
3. an MLP; the target's frozen LM head turns the result into the next token.

Drafting grows EAGLE-2's dynamic tree (:func:`~.candidates.dynamic_tree`) from the root;
a node at depth ``d`` sees the target's cache up to the root's predecessor, ``d + 1``
positions behind it (training draws that lag at random, as the reference does). Drafts
are deterministic (``probs=None``), so verification keeps decoding exact.

Training (``hasten train longspec``): the target runs each batch with **anchor-offset
positions** (the first few positions kept, the rest shifted by a random large offset, the
same positions for the target's keys and the drafter's queries), so short training windows
teach the drafter what long positions look like; the loss is the KL divergence from the
target's own next-token law at every position, with a random cross-attention lag.

Single sequences only: the rows of a batch share one padded cache whose entries move,
which the cross-attention cannot read in place (``begin`` refuses them).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..core.runtime import Capability
from ..core.settings import Settings, option
from ..models.adapter import model_name
from ..models.compat import cache_argument
from ..models.hf import max_positions
from ..models.layers import attention_layout, layer_types
from .base import Draft, DraftContext, EMPTY_DRAFT, register
from .candidates import GrowingTree, LevelVisibility, dynamic_tree
from .nn import KV, RMSNorm, heads_for, rotary, rotate
from .trainable import Batch, TrainedTraining, valid_positions
from .trained import ModuleConfig, TrainedDrafter, TrainedModule, WeightsSetting, at_least_one


# ---- what the drafter reads of the target -------------------------------------------------------
class TargetRotary:
    """The target's rotary embedding as its last layer uses it: ``rotary(x, positions) ->
    (cos, sin)``, [batch, n, rotary_dim] each. A ValueError says why a model has none the
    drafter can use."""

    def __init__(self, model: PreTrainedModel):
        found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
        if not found:
            raise ValueError(f"longspec needs a target with rotary positions in its KV cache; {model_name(model)!r} "
                             "has none (its cached keys carry no position a drafter query could be rotated to match)")
        if len(found) > 1:
            raise ValueError(f"longspec needs one rotary embedding module in the target; {model_name(model)!r} has "
                             f"{len(found)} and it cannot tell which one its last layer uses")
        self.module = found[0]
        # models with local and global layers (Gemma 3) pick the angles by layer type
        kinds = layer_types(model)
        takes_type = "layer_type" in inspect.signature(self.module.forward).parameters
        self.layer_type = kinds[-1] if takes_type and kinds else None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_type is None:
            return self.module(x, positions)
        return self.module(x, positions, self.layer_type)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, n, head_dim] as the target rotates its keys: cos, sin
    [batch, n, rotary_dim] (Hugging Face's layout: both halves repeated); only the first
    ``rotary_dim`` channels turn (partial rotary, GPT-NeoX and Phi style)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [batch, 1, n, rotary_dim]
    width = cos.shape[-1]
    turned, kept = x[..., :width], x[..., width:]
    first, second = turned[..., : width // 2], turned[..., width // 2 :]
    rotated_half = torch.cat([-second, first], dim=-1)
    return torch.cat([turned * cos + rotated_half * sin, kept], dim=-1)


# ---- the layer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LongSpecConfig(ModuleConfig):
    embed_size: int = 0  # the target's input embedding width
    heads: int = 1  # the drafter's own self-attention heads
    mlp_size: int = 0
    window: int = 64  # own positions the self-attention sees (the query's included)
    target_heads: int = 1  # the target's query heads: the cross-attention's
    target_kv_heads: int = 1
    target_head_dim: int = 0


class LongSpecLayer(TrainedModule):
    Config = LongSpecConfig
    name = "longspec"

    def __init__(self, config: LongSpecConfig):
        super().__init__(config)
        size, heads = config.hidden_size, config.heads
        if size % heads or (size // heads) % 2:
            raise ValueError(f"longspec: size {size} must split into {heads} heads of even size")
        if config.target_heads % config.target_kv_heads:
            raise ValueError(f"longspec: {config.target_heads} query heads do not group over "
                             f"{config.target_kv_heads} KV heads")
        cross = config.target_heads * config.target_head_dim
        self.inp = nn.Linear(config.embed_size, size) if config.embed_size != size else nn.Identity()
        self.self_norm, self.cross_norm, self.mlp_norm, self.out_norm = (RMSNorm(size) for _ in range(4))
        self.qkv = nn.Linear(size, 3 * size, bias=False)
        self.self_out = nn.Linear(size, size, bias=False)
        self.cross_q = nn.Linear(size, cross, bias=False)
        self.cross_out = nn.Linear(cross, size, bias=False)
        self.up, self.down = nn.Linear(size, config.mlp_size), nn.Linear(config.mlp_size, size)
        for zero in (self.self_out.weight, self.cross_out.weight, self.down.weight, self.down.bias):
            nn.init.zeros_(zero)  # an untrained layer passes its input through: training starts from "change nothing"

    @classmethod
    def for_target(cls, target: PreTrainedModel, window: int = 64, mlp_ratio: int = 2) -> "LongSpecLayer":
        sizes = cls.target_sizes(target)
        hidden = sizes["hidden_size"]
        heads, kv_heads, head_dim = attention_layout(target)
        TargetRotary(target)  # refuse targets without a usable rotary embedding here already
        embed = int(target.get_input_embeddings().weight.shape[1])
        return cls(LongSpecConfig(**sizes, embed_size=embed, heads=heads_for(hidden), mlp_size=mlp_ratio * hidden,
                                  window=window, target_heads=heads, target_kv_heads=kv_heads,
                                  target_head_dim=head_dim))

    def check_fits(self, model: PreTrainedModel) -> None:
        super().check_fits(model)
        c = self.config
        if attention_layout(model) != (c.target_heads, c.target_kv_heads, c.target_head_dim):
            raise ValueError(f"longspec weights for {c.target!r} expect {c.target_heads} query / {c.target_kv_heads} "
                             f"KV heads of {c.target_head_dim}; {model_name(model)!r} has {attention_layout(model)}")
        TargetRotary(model)

    def own_kv(self, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, KV]:
        """embeds [B, n, E] of tokens at positions [B, n] -> (the layer's input x [B, n, H],
        their self-attention keys and values [B, heads, n, head]). A key needs only its token
        and position: what lets the committed window be computed for any new tokens alone."""
        x = self.inp(embeds)
        batch, n, size = x.shape
        head = size // self.config.heads
        q, k, v = self.qkv(self.self_norm(x)).view(batch, n, 3, self.config.heads, head).permute(2, 0, 3, 1, 4)
        cos, sin = rotary(positions, head, x.dtype)
        return x, (rotate(k, cos, sin), v)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, own: KV, own_visible: torch.Tensor,
                target_kv: KV, cross_visible: torch.Tensor | None, target_angles: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """x [B, n, H] from :meth:`own_kv` at positions [B, n]; own: the self-attention keys
        and values it may see [B, heads, m, head] (the block's own included), own_visible
        [B, n, m] bool; target_kv: the target's last-layer cache [B, kv_heads, T, D],
        cross_visible [B, n, T] bool (None: all of it); target_angles: the target's cos, sin
        at ``positions``. -> the output [B, n, H], for the target's LM head."""
        batch, n, size = x.shape
        c = self.config
        head = size // c.heads
        q = self.qkv(self.self_norm(x))[..., :size].view(batch, n, c.heads, head).transpose(1, 2)
        cos, sin = rotary(positions, head, x.dtype)
        attended = F.scaled_dot_product_attention(rotate(q, cos, sin), *own, attn_mask=own_visible[:, None])
        x = x + self.self_out(attended.transpose(1, 2).reshape(batch, n, size))  # [B, n, H]
        q = self.cross_q(self.cross_norm(x)).view(batch, n, c.target_heads, c.target_head_dim).transpose(1, 2)
        q = apply_rotary(q, *target_angles)  # [B, heads, n, D] at true positions, like the cached keys
        x = x + self.cross_out(cross_attention(q, *target_kv, cross_visible).transpose(1, 2).reshape(batch, n, -1))
        x = x + self.down(F.gelu(self.up(self.mlp_norm(x))))
        return self.out_norm(x)


def cross_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    visible: torch.Tensor | None) -> torch.Tensor:
    """q [B, heads, n, D] over the target's keys/values [B, kv_heads, T, D] (query head h
    uses KV head h // group, as the target does) -> [B, heads, n, D]. Without a mask the
    group's queries are folded into the sequence, so the cache is read as it lies, never repeated."""
    batch, heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    if visible is None:
        folded = q.reshape(batch, kv_heads, heads // kv_heads * n, dim)  # [B, kv_heads, group * n, D]
        return F.scaled_dot_product_attention(folded, keys, values).view(batch, heads, n, dim)
    group = heads // kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # training: short windows
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None])


# ---- training (``hasten train longspec``) --------------------------------------------------------
@dataclass(frozen=True)
class LongSpecTrainOptions(Settings):
    window: int = option(64, "own positions the self-attention sees (constant drafter memory)")
    mlp_ratio: int = option(2, "MLP width of the layer, in multiples of the hidden size")
    max_lag: int = option(5, "cross-attention lags trained (a node at depth d reads the target d + 1 behind)")
    anchors: int = option(4, "at most this many first positions keep their index (attention sinks)")
    max_offset: int = option(16384, "largest position offset of the rest (bounded by the target's max positions)")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "window", "mlp_ratio", "max_lag")
        if self.anchors < 0 or self.max_offset < 0:
            raise ValueError("anchors and max_offset must be >= 0")


class LongSpecTraining(TrainedTraining):
    Options = LongSpecTrainOptions

    def build(self) -> LongSpecLayer:
        return LongSpecLayer.for_target(self.target, self.options.window, self.options.mlp_ratio)

    def positions(self, batch: int, length: int, device) -> torch.Tensor:
        """[batch, length] anchor-offset positions: the first ``a`` indices as they are, the
        rest shifted by one random offset (a and the offset drawn per batch)."""
        positions = torch.arange(length, device=device)
        limit = max_positions(self.target) or self.options.max_offset
        offset = int(torch.randint(max(0, min(self.options.max_offset, limit - length)) + 1, ()))
        anchored = int(torch.randint(self.options.anchors + 1, ()))
        positions[anchored:] += offset
        return positions.expand(batch, -1)

    def loss(self, module: LongSpecLayer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        ids = batch.ids
        count, length = ids.shape
        positions = self.positions(count, length, ids.device)
        with torch.no_grad():  # the target at the same positions: its last-layer cache and its own next-token law
            cache = DynamicCache()
            out = self.target(input_ids=ids, position_ids=positions, **cache_argument(self.target, cache), use_cache=True)
            target_kv = (cache.layers[-1].keys.float(), cache.layers[-1].values.float())  # [B, kv_heads, T, D]
            log_p = out.logits.float().log_softmax(-1)  # [B, T, V]: position t's law of x_{t+1}
            angles = TargetRotary(self.target)(target_kv[0], positions)
        x, own = module.own_kv(self.target.get_input_embeddings()(ids).float(), positions)
        index = torch.arange(length, device=ids.device)
        behind = index[:, None] - index[None, :]  # [T, T] query index minus key index
        own_visible = ((behind >= 0) & (behind < module.config.window)).expand(count, -1, -1)
        lags = [int(torch.randint(1, self.options.max_lag + 1, ()))] if module.training else \
            range(1, self.options.max_lag + 1)  # held-out: every lag, reported one by one
        lm_head, valid = self.target.get_output_embeddings(), valid_positions(batch)
        losses, metrics = [], {}
        for lag in lags:
            cross_visible = behind >= lag
            cross_visible[:lag, 0] = True  # rows that see nothing yet attend to one key; their loss is dropped
            guess = module(x, positions, own, own_visible, target_kv, cross_visible.expand(count, -1, -1), angles)
            keep = valid & (index >= lag)  # [B, T]
            if not keep.any():
                return torch.zeros(()), {}
            logits = lm_head(guess[keep].to(lm_head.weight.dtype)).float()  # [M, V]
            truth = log_p[keep]  # KL(p || q): the cross-entropy less the target's own entropy, 0 when q = p
            losses.append((truth.exp() * (truth - logits.log_softmax(-1))).sum(-1).mean())
            metrics[f"lag{lag}_top1"] = (logits.argmax(-1) == truth.argmax(-1)).float().mean().item()
        loss = torch.stack(losses).mean()
        if module.training:
            metrics = {"top1": next(iter(metrics.values()))}
        return loss, metrics


# ---- the drafter's own cache -----------------------------------------------------------------------
class WindowCache:
    """The drafter's own keys and values: committed rows of consecutive positions
    ``first .. first + committed`` (at most ``2 * window``; the oldest are dropped in one
    move when full, so each row moves at most once), then ``scratch`` rows for the tree.
    Allocated once: its size never depends on the context."""

    def __init__(self, window: int, scratch: int, heads: int, head_dim: int, dtype, device):
        self.window, self.capacity = window, 2 * window
        shape = (1, heads, self.capacity + scratch, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [1, heads, slots, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.first = 0  # position of the oldest committed row
        self.committed = 0  # committed rows
        self.count = 0  # committed positions covered: the next committed row is position `count`

    @property
    def bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reset(self, count: int) -> None:
        """Forget every row; the next committed row will be position ``count``."""
        self.first, self.committed, self.count = count, 0, count

    def append(self, own: KV) -> None:
        """Committed rows for positions count .. count + n (keys/values [1, heads, n, head_dim])."""
        keys, values = own
        n = keys.shape[2]
        end = self.count + n
        if n >= self.window:  # only the last window rows can ever be seen again
            keys, values = keys[:, :, -self.window:], values[:, :, -self.window:]
            n, self.first, self.committed = self.window, end - self.window, 0
        elif self.committed + n > self.capacity:  # slide: keep the newest window - n rows, at the front
            kept = self.window - n
            start = self.committed - kept
            for buffer in (self.keys, self.values):
                buffer[:, :, :kept] = buffer[:, :, start : self.committed].clone()
            self.first, self.committed = self.first + start, kept
        self.keys[:, :, self.committed : self.committed + n] = keys
        self.values[:, :, self.committed : self.committed + n] = values
        self.committed += n
        self.count = end  # == first + committed

    def write_scratch(self, start: int, own: KV) -> KV:
        """Tree rows at scratch slots start .. start + n -> every valid row's keys and
        values (views: committed, then scratch up to these)."""
        keys, values = own
        end = self.committed + start + keys.shape[2]
        self.keys[:, :, self.committed + start : end] = keys
        self.values[:, :, self.committed + start : end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]

    def seen_from(self, query_positions: torch.Tensor) -> torch.Tensor:
        """[n, committed] bool: the committed rows each query position sees (its window)."""
        rows = self.first + torch.arange(self.committed, device=query_positions.device)
        return rows[None, :] > query_positions[:, None] - self.window


@dataclass
class LongSpecState:
    cache: WindowCache


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LongSpecSettings(WeightsSetting):
    depth: int = 5  # levels of the draft tree (draft-layer passes per step)
    top_k: int = 4  # children per expanded node, and nodes expanded per level
    total_tokens: int = 16  # nodes kept in the tree (verified per step)
    window: int = 64  # an untrained layer's self-attention window (trained weights bring their own)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "depth", "top_k", "total_tokens", "window")


@register
class LongSpec(TrainedDrafter):
    name = "longspec"
    Settings = LongSpecSettings
    Module = LongSpecLayer
    Training = LongSpecTraining  # how `hasten train longspec` builds, trains and saves the layer
    untrained_sizes = ("window",)
    needs = frozenset({Capability.MODULES, Capability.KV_READ})  # the target's KV cache, not its hidden states

    def check_target(self, target) -> None:
        super().check_target(target)
        if not target.encoder_decoder:
            TargetRotary(target.modules)

    def setup(self, model: PreTrainedModel) -> None:
        self.rotary = TargetRotary(model)  # borrowed, like the LM head

    def start(self, ctx: DraftContext) -> LongSpecState:
        if not ctx.target.kv_readable:
            raise ValueError("longspec reads one sequence's full KV cache in place; the rows of a batch share a "
                             "padded cache and a compressed prompt lacks entries: decode its prompts one at a time")
        c, s = self.module.config, self.settings
        weight = self.lm_head.weight
        cache = WindowCache(c.window, (s.depth - 1) * s.top_k, c.heads, c.hidden_size // c.heads, weight.dtype,
                            weight.device)
        return LongSpecState(cache)

    def cache_bytes(self, state: LongSpecState) -> int:
        """Bytes of this generation's own caches (the target's excluded): constant in the context."""
        return state.cache.bytes

    def _catch_up(self, ctx: DraftContext, cache: WindowCache, device) -> None:
        """Committed rows for every committed token, the root included (only the last window's are kept)."""
        total = len(ctx.tokens)
        if cache.count > total:  # the loop cut committed tokens (a stop): start the window again
            cache.reset(max(0, total - cache.window))
        start = max(cache.count, total - cache.window)
        if start > cache.count:
            cache.reset(start)
        if start < total:
            ids = torch.tensor(ctx.tokens[start:total], device=device)
            positions = torch.arange(start, total, device=device)[None]  # [1, new]
            cache.append(self.module.own_kv(self.embed(ids)[None], positions)[1])

    def _run(self, target_kv: KV, x: torch.Tensor, positions: torch.Tensor, own: KV,
             own_visible: torch.Tensor) -> torch.Tensor:
        """The layer on x [1, n, H] at positions [n] -> next-token log-probs [n, V]. Every
        entry the target has cached precedes every query: the cross-attention needs no mask."""
        angles = self.rotary(target_kv[0], positions[None])
        out = self.module(x, positions[None], own, own_visible[None], target_kv, None, angles)  # [1, n, H]
        return self.lm_head(out[0]).float().log_softmax(-1)

    def root_logp(self, ctx: DraftContext) -> torch.Tensor:
        """[V] the draft's log-probs of the token after the root (the tree's first level);
        brings the committed window up to date first."""
        cache, device = ctx.state.cache, self.lm_head.weight.device
        self._catch_up(ctx, cache, device)
        root = torch.tensor([len(ctx.tokens) - 1], device=device)
        x, _ = self.module.own_kv(self.embed(torch.tensor([ctx.tokens[-1]], device=device))[None], root[None])
        committed = (cache.keys[:, :, : cache.committed], cache.values[:, :, : cache.committed])  # the root's row last
        return self._run(ctx.target.read_kv(-1), x, root, committed, cache.seen_from(root))[0]

    def draft(self, ctx: DraftContext) -> Draft:
        if len(ctx.tokens) < 2:  # nothing cached by the target yet (one-token prompt)
            return EMPTY_DRAFT
        first = self.root_logp(ctx)
        cache, module, device = ctx.state.cache, self.module, self.lm_head.weight.device
        target_kv, root = ctx.target.read_kv(-1), len(ctx.tokens) - 1
        levels = LevelVisibility()  # the scratch rows each node sees: its ancestors' and its own

        def expand(nodes: list[int], grown: GrowingTree) -> torch.Tensor:
            n, fed = len(nodes), levels.fed
            tokens = torch.tensor([grown.tokens[node] for node in nodes], device=device)
            positions = torch.tensor([root + grown.depths[node] for node in nodes], device=device)  # [n]
            x, own = module.own_kv(self.embed(tokens)[None], positions[None])
            keys_values = cache.write_scratch(fed, own)  # after the earlier levels' rows
            tree_rows = levels.add_level(nodes, grown).to(device)  # [n, fed + n]
            visible = torch.cat([cache.seen_from(positions), tree_rows], dim=1)  # [n, committed + fed + n]
            return self._run(target_kv, x, positions, keys_values, visible)

        s = self.settings
        tokens, tree = dynamic_tree(first, expand, min(s.depth, ctx.max_depth), s.top_k, s.total_tokens)
        return Draft(tokens, tree)
