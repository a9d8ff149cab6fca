"""TriForce: hierarchical speculative decoding for long contexts (Sun et al. 2024).

Three levels, each verifying the one below:

1. a **small model** (the draft model) with a StreamingLLM cache (the first ``sinks``
   tokens and the latest ``window``; positions are cache slots, so its memory and its cost
   per token stay constant however long the context) drafts ``small_gamma`` tokens;
2. the **target itself with a retrieval cache** (the middle level) verifies them: after
   prefill, the prompt's KV is split into chunks of ``chunk_size`` tokens, every chunk is
   scored per layer and KV head by the last prompt token's query against the chunk's mean
   key, and only the first chunk, the last (partial) chunk and the best-scoring chunks up to
   ``budget`` entries are kept; tokens generated later are appended, with the exact K/V the
   target's full cache holds for them once committed (copied before each step, as the
   reference does; ``copy_generated=False`` keeps the ones the middle level computed over its
   sparse cache), each taking the place of the lowest-scored selected entry so that the cache
   keeps ``budget`` entries, as the reference's (``fixed_size``). Reading ``budget``
   entries instead of the whole context is what makes it cheap when the KV, not the
   weights, dominates a forward. Rounds repeat until ``gamma`` tokens are drafted;
3. the **target with its full cache** (the decode loop) verifies those ``gamma`` tokens.

Both verifications are the generation's own acceptance rule (``ctx.acceptance``: greedy or
speculative sampling), so the middle level's output is distributed exactly as its own
``p``; that ``p`` is the ``q`` handed to the top level, whose verification keeps the
target's law exactly. Greedy output is the target's.

The retrieval cache is chosen from the loop's own full cache with the query of the newest
token (one extra one-token forward, cropped away), not from a second prefill as the
reference's separate cache is (which doubled prefill work: at 16k tokens that second
prefill cost more than all the decoding); batch rows, llama.cpp and compressed caches,
whose entries it cannot read as one sequence's, still get a prefill of their own. The
reference chooses the chunks once;
``refresh=N`` re-chooses them every N steps with the newest token's query (the prompt's
entries are read from the loop's full cache, the generated tokens stay), one extra
middle-level forward of the pending tokens per refresh. Full-attention decoders only: a
sliding-window layer's mask cannot follow per-head selected entries.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..core.runtime import Capability
from ..core.settings import Settings
from ..core.stats import cache_bytes, holder_kv_bytes
from ..core.tree import TokenTree
from ..models.adapter import ModelAdapter, model_name
from ..models.compat import cache_argument
from ..models.layers import has_sliding_layers, last_queries
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, register
from .draft_model import check_same_vocabulary, draft_chain


@dataclass(frozen=True)
class TriForceSettings(Settings):
    # KV entries per layer and KV head the retrieval cache keeps (the reference: 4,096 for its
    # model's 128k positions, 1/32; 512 is 1/32 of zoo:code-tiny-long's 16,384)
    budget: int = 512
    chunk_size: int = 8  # prompt tokens per retrieval chunk
    gamma: int = 6  # tokens the middle level drafts for the target per step
    small_gamma: int = 3  # tokens the small model drafts per round of the middle level
    sinks: int = 16  # the small model's attention sinks (first tokens, always kept), as the reference
    window: int = 240  # the small model's recent window (sinks + window = the reference's 256 entries)
    # re-choose the prompt's chunks every this many steps with the newest token's query
    # (0: chosen once after prefill, as the reference does)
    refresh: int = 0
    # the middle level's entries of committed generated tokens: True copies their exact K/V
    # from the target's full cache before each step (the reference's rule); False keeps the
    # ones the middle level computed over its sparse cache (approximate)
    copy_generated: bool = True
    # the reference's fixed-size retrieval cache: where entries are copied (copy_generated),
    # the selection and the committed generated tokens hold at most ``budget`` entries
    # together, each generated token's entry taking the place of the lowest-scored selected
    # one (the first chunk stays); False keeps the whole selection and appends
    fixed_size: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("chunk_size", "gamma", "small_gamma", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sinks", "refresh"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.budget < 2 * self.chunk_size:
            raise ValueError(f"budget ({self.budget}) must hold at least two chunks of chunk_size "
                             f"({self.chunk_size}): the first and the latest")


# ---- the middle level: the target over a retrieval cache ----------------------------------------
def retrieval_cache(full: DynamicCache, queries: dict[int, torch.Tensor], budget: int,
                    chunk_size: int, ranked: bool = False) -> DynamicCache:
    """Keep, per layer and KV head, the first chunk, the last (partial) chunk and the chunks
    whose mean key best matches the query (the largest score over the heads sharing that KV
    head), ``budget`` entries at most, in position order; ``ranked``: the first chunk, the
    latest, then the best chunks from the highest score down (a cut of the tail drops the
    lowest-scored entries first)."""
    picked = DynamicCache()
    for layer_index, layer in enumerate(full.layers):
        keys, values = layer.keys, layer.values  # [1, kv_heads, T, head_dim]
        length = keys.shape[2]
        if length <= budget:
            picked.update(keys.clone(), values.clone(), layer_index)
            continue
        kv_heads, dim = keys.shape[1], keys.shape[3]
        full_chunks = (length - 1) // chunk_size  # the rest, 1 .. chunk_size tokens, is the latest chunk
        tail = length - full_chunks * chunk_size
        means = keys[0, :, : full_chunks * chunk_size].reshape(kv_heads, full_chunks, chunk_size, dim).mean(2)
        query = queries[layer_index][:, -1].to(keys.dtype)  # [heads, head_dim] the last prompt token's
        query = query.view(kv_heads, -1, dim)  # [kv_heads, group, head_dim]
        scores = torch.einsum("hgd,hcd->hgc", query, means).amax(1)  # [kv_heads, chunks]
        room = (budget - tail) // chunk_size - 1  # middle chunks besides the first
        best = scores[:, 1:].topk(min(room, full_chunks - 1), dim=1).indices + 1  # [kv_heads, room]
        first = torch.zeros(kv_heads, 1, dtype=torch.long, device=keys.device)
        offsets = torch.arange(chunk_size, device=keys.device)
        latest = torch.arange(length - tail, length, device=keys.device).expand(kv_heads, tail)
        if ranked:  # topk's order: the best chunk first
            index = torch.cat([offsets.expand(kv_heads, chunk_size), latest,
                               (best[:, :, None] * chunk_size + offsets).flatten(1)], 1)  # [kv_heads, kept]
        else:
            chunks = torch.cat([first, best], 1).sort(1).values
            index = torch.cat([(chunks[:, :, None] * chunk_size + offsets).flatten(1), latest], 1)  # [kv_heads, kept]
        index = index[None, :, :, None].expand(1, -1, -1, dim)
        picked.update(keys.gather(2, index), values.gather(2, index), layer_index)
    return picked


@dataclass
class Middle:
    """The target over the retrieval cache: it holds the selected prompt entries (for the
    first ``prompt`` tokens), then one entry per token of ``fed``, at positions ``prompt ..``."""

    model: PreTrainedModel
    cache: DynamicCache
    selected: int  # entries of the selection (per layer and KV head)
    prompt: int  # prompt tokens the selection was made from
    fed: list[int] = field(default_factory=list)
    exact: int = 0  # the first fed tokens whose entries were copied from the target's full cache
    # fixed size: the whole ranked selection ([1, kv_heads, entries, head_dim] per layer) and the
    # entries the selection and the copied tokens may hold together; None: keep the selection whole
    ranked: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    size: int = 0
    floor: int = 0  # selected entries never evicted (the first chunk)

    def copy_committed(self, full: list[tuple[torch.Tensor, torch.Tensor]], committed: list[int]) -> None:
        """Make the fed tokens ``committed`` (the generated tokens the target's full cache
        holds, from position ``prompt`` on), with their exact entries read from ``full``
        ([1, kv_heads, entries, head_dim] per layer) in place of those computed here."""
        self.keep(self.exact)  # entries copied before stay: committed tokens never change
        start, end = self.prompt + self.exact, self.prompt + len(committed)
        if end > start:
            for layer, (keys, values) in zip(self.cache.layers, full):
                layer.keys = torch.cat([layer.keys, keys[:, :, start:end]], 2)
                layer.values = torch.cat([layer.values, values[:, :, start:end]], 2)
            self.fed.extend(committed[self.exact:])
        self.exact = len(committed)
        if self.ranked is not None:
            self._evict()

    def _evict(self) -> None:
        """Hold at most ``size`` entries: the best of the ranked selection, then the fed tokens'."""
        kept = max(self.floor, min(self.ranked[0][0].shape[2], self.size - len(self.fed)))
        if kept != self.selected:
            for layer, (keys, values) in zip(self.cache.layers, self.ranked):
                layer.keys = torch.cat([keys[:, :, :kept], layer.keys[:, :, self.selected:]], 2)
                layer.values = torch.cat([values[:, :, :kept], layer.values[:, :, self.selected:]], 2)
            self.selected = kept

    @torch.no_grad()
    def forward(self, block: list[int]) -> torch.Tensor:
        """[len(block), vocab] float32 logits of ``block`` after what is cached."""
        start = self.prompt + len(self.fed)
        positions = torch.arange(start, start + len(block), device=self.model.device)[None]
        ids = torch.tensor([block], dtype=torch.long, device=self.model.device)
        # Full attention over everything cached is the causal mask in cache order, which the
        # model builds itself; the positions are the tokens' true ones.
        out = self.model(input_ids=ids, **cache_argument(self.model, self.cache), position_ids=positions, use_cache=True)
        self.fed.extend(block)
        return out.logits[0].float()

    def keep(self, count: int) -> None:
        """Keep the first ``count`` fed tokens' entries."""
        self.exact = min(self.exact, count)
        if count < len(self.fed):
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, : self.selected + count]
                layer.values = layer.values[:, :, : self.selected + count]
            del self.fed[count:]


# ---- the bottom level: a small model with a StreamingLLM cache ------------------------------
@dataclass
class Streaming:
    """The small model's cache stands for the first ``base`` committed tokens (all of them,
    or the sinks and the window when it was last rebuilt), then one entry per token of
    ``fed``. Positions are cache slots, so rebuilding re-positions the window's keys."""

    adapter: ModelAdapter
    base: int  # committed tokens the cache stands for (fewer entries once the window slid)
    fed: list[int] = field(default_factory=list)

    @property
    def entries(self) -> int:
        return self.adapter.cache_length


# ---- the drafter -------------------------------------------------------------------------------
@dataclass
class TriForceState:
    middle: Middle
    small: Streaming
    steps: int = 0  # proposals made, for the refresh schedule


@register
class TriForce(Drafter):
    name = "triforce"
    Settings = TriForceSettings
    # the retrieval cache scores the target's queries over the prompt's entries in its cache
    needs = frozenset({Capability.MODULES, Capability.QUERY_CAPTURE, Capability.KV_READ})
    needs_draft_model = True
    encoder_decoder_ok = False

    def __init__(self, model: PreTrainedModel, settings: TriForceSettings | None = None, **kwargs):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"TriForce needs a small transformers PreTrainedModel, got {type(model).__name__}")
        super().__init__(settings, **kwargs)
        self.model = model

    def check_target(self, target) -> None:
        super().check_target(target)
        check_same_vocabulary(self.model, target)
        if has_sliding_layers(target.modules):
            raise ValueError(f"triforce needs a full-attention target; {model_name(target.modules)!r} has "
                             "sliding-window layers, whose masks cannot follow a per-head retrieval cache")

    def begin(self, ctx: DraftContext) -> TriForceState:
        settings = self.settings
        if settings.refresh and not ctx.target.kv_readable:
            raise ValueError("triforce refresh reads the prompt's entries from the target's own full cache: "
                             "one sequence on a plain ModelAdapter only (not batches, llama.cpp or "
                             "compressed caches); use refresh=0 there")
        model = ctx.target.modules
        prompt = ctx.tokens[:-1]  # what the loop's target has cached: all but the root
        cache = DynamicCache()
        if prompt and ctx.target.kv_readable and ctx.target.cache_length == len(prompt):
            # the loop's own cache holds the prompt's entries; the target's probe of the root
            # records the query that picks the chunks, and leaves its cache as it was
            queries = ctx.target.probe_queries(ctx.tokens[-1])
            cache = self._selection(ctx, queries, len(prompt))
        elif prompt:  # batch rows, llama.cpp, compressed caches: a prefill of its own, as the reference
            with torch.no_grad(), last_queries(model) as queries:
                ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
                model(input_ids=ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
            cache = retrieval_cache(cache, queries, settings.budget, settings.chunk_size)
        selected = cache.get_seq_length() if prompt else 0
        middle = Middle(model, cache, selected, len(prompt))
        self._rank(middle)
        return TriForceState(middle, self._streaming(ctx.tokens[:-1]))

    def _rank(self, middle: Middle) -> None:
        """Give the middle level its ranked selection to evict from (fixed_size, copied entries)."""
        settings = self.settings
        if settings.fixed_size and settings.copy_generated and middle.selected:
            middle.ranked = [(layer.keys[:, :, : middle.selected], layer.values[:, :, : middle.selected])
                             for layer in middle.cache.layers]
            middle.size, middle.floor = settings.budget, min(settings.chunk_size, middle.selected)

    def _selection(self, ctx: DraftContext, queries: dict[int, torch.Tensor], prompt: int) -> DynamicCache:
        """The retrieval selection of the first ``prompt`` entries of the loop's full cache."""
        prompt_part = DynamicCache()
        for index, (keys, values) in enumerate(ctx.target.read_all_kv()):  # [1, kv_heads, committed, head_dim]
            prompt_part.update(keys[:, :, :prompt], values[:, :, :prompt], index)
        ranked = self.settings.fixed_size and self.settings.copy_generated  # the tail goes first
        return retrieval_cache(prompt_part, queries, self.settings.budget, self.settings.chunk_size, ranked)

    def _streaming(self, committed: list[int]) -> Streaming:
        """A fresh small-model cache standing for ``committed``: its sinks and its window."""
        settings = self.settings
        kept = committed
        if len(committed) > settings.sinks + settings.window:
            kept = committed[: settings.sinks] + committed[-settings.window:]
        adapter = ModelAdapter(self.model)
        if kept:
            adapter.start(torch.tensor([kept + [0]], dtype=torch.long))  # caches all but the dummy root
        return Streaming(adapter, len(committed))

    def cache_bytes(self, state: TriForceState) -> int:
        """KV bytes this drafter holds: the middle level's retrieval cache (the selected
        prompt entries and every token fed since) and the small model's streaming cache."""
        return cache_bytes(state.middle.cache) + (holder_kv_bytes(state.small.adapter) or 0)

    def propose(self, ctx: DraftContext) -> Draft:
        count = min(self.settings.gamma, ctx.max_depth)
        if count < 1:
            return EMPTY_DRAFT
        state, tokens = ctx.state, ctx.tokens
        state.steps += 1
        if self.settings.refresh and state.steps % self.settings.refresh == 0 and state.middle.prompt:
            state.middle = self._refreshed(ctx, state.middle)
        middle = state.middle
        if self.settings.copy_generated and ctx.target.kv_readable and middle.prompt:
            committed = ctx.target.cache_length  # the full cache's entries: every token but the root
            middle.copy_committed(ctx.target.read_all_kv(), tokens[middle.prompt:committed])
        small = state.small
        if small.entries + len(tokens) - small.base - len(small.fed) > self.settings.sinks + 2 * self.settings.window:
            small = state.small = self._streaming(tokens[:-1])  # slide the window (rebuilt once per window)
        drafted: list[int] = []
        rows: list[torch.Tensor] = []  # the middle level's p for each drafted token
        while len(drafted) < count:
            known = tokens + drafted  # the sequence so far; its last token is not cached anywhere yet
            small_tokens, small_q = self._small_draft(ctx, small, known, min(self.settings.small_gamma,
                                                                                  count - len(drafted)))
            middle = state.middle
            shared = _common_prefix(middle.fed, known, middle.prompt)
            middle.keep(shared)
            pending = known[middle.prompt + shared:]  # at least the last known token
            logits = middle.forward(pending + small_tokens)[len(pending) - 1:]  # [n + 1, vocab]
            verdict = ctx.acceptance.verify(TokenTree.chain(len(small_tokens)), tuple(small_tokens), logits, small_q,
                                            ctx.sampling, ctx.generator)
            accepted = len(verdict.accepted)
            middle.keep(len(middle.fed) - (len(small_tokens) - accepted))  # drop the rejected small tokens
            drafted += small_tokens[:accepted] + [verdict.next_token]
            if not ctx.sampling.greedy:
                rows.append(ctx.sampling.probs(logits[: accepted + 1]))
        drafted = drafted[:count]
        probs = None if ctx.sampling.greedy else torch.cat(rows)[:count]
        return Draft.chain(drafted, probs)

    def _refreshed(self, ctx: DraftContext, middle: Middle) -> Middle:
        """The middle level with the prompt's chunks chosen again by the newest token's query:
        the prompt's entries come from the loop's full cache, the generated ones stay."""
        tokens = ctx.tokens
        shared = _common_prefix(middle.fed, tokens, middle.prompt)
        middle.keep(shared)
        with last_queries(middle.model) as queries:
            middle.forward(tokens[middle.prompt + shared:])  # ends with the root: its query is recorded
        middle.keep(len(tokens) - 1 - middle.prompt)  # the root's entry goes: the drafting rounds feed it
        picked = self._selection(ctx, queries, middle.prompt)
        selected = picked.get_seq_length()
        for index, layer in enumerate(middle.cache.layers):  # the generated tokens' entries, kept as they are
            picked.update(layer.keys[:, :, middle.selected:], layer.values[:, :, middle.selected:], index)
        refreshed = Middle(middle.model, picked, selected, middle.prompt, list(middle.fed), middle.exact)
        self._rank(refreshed)
        return refreshed

    def _small_draft(self, ctx: DraftContext, small: Streaming, known: list[int],
                     count: int) -> tuple[list[int], torch.Tensor | None]:
        """``count`` tokens from the small model after ``known``, and the q each was drawn from."""
        shared = _common_prefix(small.fed, known, small.base)
        small.adapter.crop(small.entries - (len(small.fed) - shared))
        del small.fed[shared:]
        block = known[small.base + shared:]  # at least the last known token

        def forward(block: list[int], _: int) -> torch.Tensor:
            small.fed.extend(block)
            return small.adapter.forward(block, tree=None).logits[-1]  # [vocab]

        return draft_chain(forward, block, count, ctx)


def _common_prefix(fed: list[int], known: list[int], offset: int) -> int:
    """How many of ``fed`` equal ``known[offset:]``, never reaching ``known``'s last token
    (which must be fed again: its logits are the ones drafting needs)."""
    limit = max(0, min(len(fed), len(known) - 1 - offset))
    for i in range(limit):
        if fed[i] != known[offset + i]:
            return i
    return limit
