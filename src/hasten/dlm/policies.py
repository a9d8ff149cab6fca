"""Cache policies of the diffusion-LM sampler: which positions each denoising step runs.

A policy is a frozen settings dataclass; ``policy.start(model, layout)`` returns the runtime of one
generation, whose ``logits(tokens, view)`` returns the logits the sampler asks for (``view.rows``)
and counts what it ran. The sampler never asks a policy's name.

* ``NoCache``: every step runs every position (the reference).
* ``DKVCache`` (Ma et al. 2025, dKV-Cache): keys and values are cached per position; a token's
  K/V enter the cache one step *after* it is decoded (the step it is decoded its input was still
  the mask token). ``schedule="reference"`` (the default) is the reference code's LLaDA rule: the
  cache starts afresh at every block, the block's first steps are full forwards (decode: steps 0
  and 1; greedy: step 0) and so is every step of the block whose index is a multiple of
  ``cache_reloading_step``. ``schedule="whole_generation"`` (hasten's own) keeps one cache for the
  whole generation and counts ``cache_reloading_step`` over the generation's steps. Variants:
  ``decode`` (masked positions and the tokens decoded at the previous step run; prompt and older
  decoded tokens cached), ``prefill`` (only the prompt cached, made once at the first step, as the
  reference's Dream ``--prefill``), ``greedy`` (the reference's dKV-Cache-Greedy: with the decoding
  order drawn at the block's start, a step runs only the positions it decodes, the ones decoded at
  the previous step and ``window`` masked neighbours of the first; every other position keeps its
  K/V). ``fresh_before_block=W`` (hasten's own addition, any variant) also recomputes every unmasked
  position from ``W`` before the current block to its end at every cached step: the keys and values
  that drift most when a token is decoded are its neighbours' (measured on zoo:dlm-tiny).
* ``FastDLLMPrefix`` and ``FastDLLMDual`` (Wu et al. 2025, Fast-dLLM): a full forward at the first
  step of every block; then the prefix before the block is cached (prefix) and the suffix after
  it too (dual), and only the rest is recomputed until the next block.

*Which positions run* (the cache policy) and *how attention is computed* (an attention object,
dense by default) are separate: every cache policy's ``start`` takes an ``attention``, so SparseD
runs on any cache's forwards (``SparseD(cache=DKVCache())``) with no branch on either's name.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..core.settings import Settings
from .forward import ForwardCounts, KVStore, attention_flops_per_pair, full_forward, partial_forward


@dataclass(frozen=True)
class Layout:
    """The shape of one generation."""

    prompt_length: int
    length: int  # prompt + generated positions
    block_length: int
    num_steps: int  # scheduled denoising steps (parallel decoding may finish in fewer)


@dataclass(frozen=True)
class StepView:
    """What a policy may look at in one step."""

    step: int  # from 0, over the whole generation
    block_start: int
    block_end: int
    step_in_block: int  # from 0 at each block
    masked: torch.Tensor  # [length] bool: still the mask token
    rows: torch.Tensor  # [rows] sorted positions whose logits the sampler needs
    # [n] the positions this step decodes, in the order drawn at the block's start (remasking="random_order");
    # None when the sampler chooses them from the forward's confidences
    decoding: torch.Tensor | None = None

    @property
    def first_in_block(self) -> bool:
        return self.step_in_block == 0


class DenseAttention:
    """The model's own attention over every query-key pair (what every cache policy uses alone).

    An attention object sets up, before each forward, how that forward's attention is computed
    and answers the fraction of query-key pairs it computes; ``queries`` is None for a full
    forward, else the sorted positions a partial forward runs."""

    def prepare(self, step: int, queries: torch.Tensor | None) -> float:
        return 1.0

    def close(self) -> None:
        """Undo anything done to the model (called in a ``finally``)."""


class GenerationForwards:
    """One generation's forwards under a policy; this base runs every position every step."""

    def __init__(self, model, layout: Layout, attention=None):
        self.model, self.layout = model, layout
        self.attention = DenseAttention() if attention is None else attention
        self.counts = ForwardCounts()
        self.per_pair = attention_flops_per_pair(model.config)

    def logits(self, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        """tokens [length] -> logits at view.rows [rows, vocab]."""
        kept = self.attention.prepare(view.step, None)
        return full_forward(self.model, tokens, view.rows, self.counts, self.per_pair, kept=kept)

    def close(self) -> None:
        """Undo anything the runtime changed on the model (called in a ``finally``)."""
        self.attention.close()


class _CachedForwards(GenerationForwards):
    """Full forward (refilling the store) when ``refresh_now``; otherwise runs ``positions`` plus the rows."""

    def __init__(self, model, layout: Layout, attention, refresh_now, positions):
        super().__init__(model, layout, attention)
        self.refresh_now, self.positions = refresh_now, positions
        self.store: KVStore | None = None
        self.index: torch.Tensor | None = None  # [length] positions, made on the first step

    def logits(self, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        if self.store is None or self.refresh_now(view):
            self.store = KVStore(len(tokens), tokens.device)
            self.index = torch.arange(len(tokens), device=tokens.device)
            kept = self.attention.prepare(view.step, None)
            return full_forward(self.model, tokens, view.rows, self.counts, self.per_pair, store=self.store,
                                kept=kept)
        run = self.positions(self, tokens, view)  # [length] bool
        run[view.rows] = True
        positions = run.nonzero().squeeze(1)  # [queries]
        kept = self.attention.prepare(view.step, positions)
        return partial_forward(self.model, tokens, positions, view.rows, self.store, self.counts, self.per_pair,
                               kept=kept)


class CachePolicy(Settings):
    """Base of the policies that choose which positions run; ``start(model, layout, attention=None)``
    returns one generation's runtime, computing attention with ``attention`` (dense when None)."""


@dataclass(frozen=True)
class NoCache(CachePolicy):
    """Runs every position at every step: the reference every other policy is measured against."""

    def start(self, model, layout: Layout, attention=None) -> GenerationForwards:
        return GenerationForwards(model, layout, attention)


# ---------------------------------------------------------------- dKV-Cache


def _decode_positions(runtime: _CachedForwards, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
    # A position whose token changed since its K/V were stored was decoded at the last step: run it
    # once more with its real token (the delay), after which its K/V stay cached.
    return view.masked | (tokens != runtime.store.computed_from)


def _prefill_positions(runtime: _CachedForwards, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
    return runtime.index >= runtime.layout.prompt_length


def _fresh_near_block(positions, before: int):
    """``positions`` plus every unmasked position in [block_start - before, block_end): the neighbourhood
    where decoding happens, whose K/V move most at each step."""
    def with_neighbourhood(runtime: _CachedForwards, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        near = (runtime.index >= view.block_start - before) & (runtime.index < view.block_end)
        return positions(runtime, tokens, view) | (near & ~view.masked)
    return with_neighbourhood


def add_window(chosen: list[bool], centres: list[int], masked: list[bool], size: int) -> None:
    """Mark ``size`` masked, not yet chosen positions around each centre in turn, looking left and right
    alternately one position at a time (the reference's ``find_window_tokens``, in place)."""
    length = len(chosen)
    for centre in centres:
        left, right, found, look_left = centre - 1, centre + 1, 0, True
        while found < size and (left >= 0 or right < length):
            if look_left:
                if left >= 0 and not chosen[left] and masked[left]:
                    chosen[left], found = True, found + 1
                left -= 1
            else:
                if right < length and not chosen[right] and masked[right]:
                    chosen[right], found = True, found + 1
                right += 1
            look_left = not look_left


def _greedy_positions(window: int):
    """dKV-Cache-Greedy: the positions this step decodes, those decoded at the previous step (their token
    changed since their K/V were stored) and ``window`` masked neighbours of each position decoded now."""
    def positions(runtime: _CachedForwards, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        if view.decoding is None:
            raise ValueError("DKVCache(variant='greedy') runs only the positions a step decodes, so it needs them "
                             "before the forward: generate(..., remasking='random_order'), the reference's order "
                             "drawn at each block's start")
        run = tokens != runtime.store.computed_from  # [length]
        run[view.decoding] = True
        chosen = run.tolist()
        add_window(chosen, view.decoding.tolist(), view.masked.tolist(), window)
        return torch.tensor(chosen, device=tokens.device)
    return positions


DKV_VARIANTS = ("decode", "prefill", "greedy")
DKV_SCHEDULES = ("reference", "whole_generation")


def _reloads(variant: str, schedule: str, interval: int | None):
    """view -> whether this step is a full forward (which refills the whole cache)."""
    if variant == "prefill":  # the reference's Dream --prefill: the prompt's cache is made once
        return lambda view: view.step == 0
    if schedule == "whole_generation":
        return lambda view: view.step == 0 or (interval is not None and view.step % interval == 0)
    opening = 2 if variant == "decode" else 1  # LLaDA decode: step 0 without a cache, step 1 building it
    return lambda view: view.step_in_block < opening or (interval is not None and view.step_in_block % interval == 0)


@dataclass(frozen=True)
class DKVCache(CachePolicy):
    """dKV-Cache: delayed caching of decoded tokens' keys and values, by the reference's LLaDA schedule unless
    ``schedule="whole_generation"`` (see the module docstring)."""

    variant: str = "decode"  # decode | prefill | greedy (greedy needs remasking="random_order")
    # a full forward at each step of a block whose index is a multiple of this (None: only the block's opening
    # steps); the reference's --cache-steps, 8 in its README's LLaDA example (llada_generate.py defaults to 2)
    cache_reloading_step: int | None = 8
    window: int = 4  # greedy only: masked neighbours run per decoded position (the reference README's 4)
    # reference: a fresh cache and full forwards at each block's start; whole_generation (hasten's own): one cache
    schedule: str = "reference"
    # hasten's own addition: at every cached step also recompute the unmasked positions from this many before the
    # current block to its end (None: none, as the reference; reaching position 0 from the last block is NoCache)
    fresh_before_block: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in DKV_VARIANTS:
            raise ValueError(f"DKVCache: variant must be one of {DKV_VARIANTS}, got {self.variant!r}")
        if self.schedule not in DKV_SCHEDULES:
            raise ValueError(f"DKVCache: schedule must be one of {DKV_SCHEDULES}, got {self.schedule!r}")
        if self.cache_reloading_step is not None and self.cache_reloading_step < 1:
            raise ValueError(f"DKVCache: cache_reloading_step must be >= 1 or None, got {self.cache_reloading_step}")
        if self.window < 0:
            raise ValueError(f"DKVCache: window must be >= 0, got {self.window}")
        if self.fresh_before_block is not None and self.fresh_before_block < 0:
            raise ValueError(f"DKVCache: fresh_before_block must be >= 0 or None, got {self.fresh_before_block}")

    def start(self, model, layout: Layout, attention=None) -> GenerationForwards:
        positions = {"decode": _decode_positions, "prefill": _prefill_positions,
                     "greedy": _greedy_positions(self.window)}[self.variant]
        if self.fresh_before_block is not None:
            positions = _fresh_near_block(positions, self.fresh_before_block)
        reload = _reloads(self.variant, self.schedule, self.cache_reloading_step)
        return _CachedForwards(model, layout, attention, reload, positions)


# ---------------------------------------------------------------- Fast-dLLM (the peers)


def _at_block_start(view: StepView) -> bool:
    return view.first_in_block


@dataclass(frozen=True)
class FastDLLMPrefix(CachePolicy):
    """Fast-dLLM prefix cache: a full forward at each block's first step; then the prefix before the block
    stays cached and the block and everything after it are recomputed."""

    def start(self, model, layout: Layout, attention=None) -> GenerationForwards:
        def positions(runtime: _CachedForwards, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
            return runtime.index >= view.block_start
        return _CachedForwards(model, layout, attention, _at_block_start, positions)


@dataclass(frozen=True)
class FastDLLMDual(CachePolicy):
    """Fast-dLLM dual cache: a full forward at each block's first step; then prefix and suffix stay cached
    and only the current block is recomputed."""

    def start(self, model, layout: Layout, attention=None) -> GenerationForwards:
        def positions(runtime: _CachedForwards, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
            return (runtime.index >= view.block_start) & (runtime.index < view.block_end)
        return _CachedForwards(model, layout, attention, _at_block_start, positions)


def describe(policy) -> str:
    """Short label, e.g. ``DKVCache(variant=decode, cache_reloading_step=8, window=4, schedule=reference)``; a
    policy inside a policy (SparseD's ``cache``) is described the same way. A knob that is off (None, its default) is left out."""
    values = [(f.name, getattr(policy, f.name), f.default) for f in fields(policy)]
    parts = [f"{name}={describe(value) if isinstance(value, Settings) else value}" for name, value, default in values
             if value is not None or default is not None]
    return f"{type(policy).__name__}({', '.join(parts)})"
