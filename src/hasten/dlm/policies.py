"""Cache policies of the diffusion-LM sampler: which positions each denoising step runs.

A policy is a frozen settings dataclass; ``policy.start(model, layout)`` returns the runtime of one
generation, whose ``logits(tokens, view)`` returns the logits the sampler asks for (``view.rows``)
and counts what it ran. The sampler never asks a policy's name.

* ``NoCache``: every step runs every position (the reference).
* ``DKVCache`` (Ma et al. 2025, dKV-Cache): keys and values are cached per position; a token's
  K/V enter the cache one step *after* it is decoded (the step it is decoded its input was still
  the mask token), every masked position is recomputed every step, and a full forward refreshes
  everything every ``refresh`` steps. Variants: ``decode`` (prompt and decoded tokens cached,
  delayed), ``prefill`` (only the prompt is cached), ``greedy`` (decoded tokens cached at once,
  with their mask-input K/V, and only a ``window`` of masked positions at the front of the
  current block recomputed). ``fresh_before_block=W`` (ours, any variant) also recomputes every
  unmasked position from ``W`` before the current block to its end at every step: the keys and
  values that drift most when a token is decoded are its neighbours' (measured on zoo:dlm-tiny),
  so the cache keeps only the far ones, which barely move.
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
    first_in_block: bool
    masked: torch.Tensor  # [length] bool: still the mask token
    rows: torch.Tensor  # [rows] sorted positions whose logits the sampler needs


class DenseAttention:
    """The model's own attention over every query-key pair (what every cache policy uses alone).

    An attention object answers, before each forward, the keyword arguments that forward passes
    to the model (they reach the attention function) and the fraction of query-key pairs it
    computes; ``queries`` is None for a full forward, else the sorted positions a partial forward runs."""

    def prepare(self, step: int, queries: torch.Tensor | None) -> tuple[dict, float]:
        return {}, 1.0

    def close(self) -> None:
        """Undo anything done to the model (called in a ``finally``)."""


class Runtime:
    """One generation's forwards under a policy; this base runs every position every step."""

    def __init__(self, model, layout: Layout, attention=None):
        self.model, self.layout = model, layout
        self.attention = DenseAttention() if attention is None else attention
        self.counts = ForwardCounts()
        self.per_pair = attention_flops_per_pair(model.config)

    def logits(self, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        """tokens [length] -> logits at view.rows [rows, vocab]."""
        kwargs, kept = self.attention.prepare(view.step, None)
        return full_forward(self.model, tokens, view.rows, self.counts, self.per_pair, kept=kept, **kwargs)

    def close(self) -> None:
        """Undo anything the runtime changed on the model (called in a ``finally``)."""
        self.attention.close()


class _CachedRuntime(Runtime):
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
            kwargs, kept = self.attention.prepare(view.step, None)
            return full_forward(self.model, tokens, view.rows, self.counts, self.per_pair, store=self.store,
                                kept=kept, **kwargs)
        run = self.positions(self, tokens, view)  # [length] bool
        run[view.rows] = True
        positions = run.nonzero().squeeze(1)  # [queries]
        kwargs, kept = self.attention.prepare(view.step, positions)
        return partial_forward(self.model, tokens, positions, view.rows, self.store, self.counts, self.per_pair,
                               kept=kept, **kwargs)


class CachePolicy(Settings):
    """Base of the policies that choose which positions run; ``start(model, layout, attention=None)``
    returns one generation's runtime, computing attention with ``attention`` (dense when None)."""


@dataclass(frozen=True)
class NoCache(CachePolicy):
    """Runs every position at every step: the reference every other policy is measured against."""

    def start(self, model, layout: Layout, attention=None) -> Runtime:
        return Runtime(model, layout, attention)


# ---------------------------------------------------------------- dKV-Cache


def _decode_positions(runtime: _CachedRuntime, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
    # A position whose token changed since its K/V were stored was decoded at the last step: run it
    # once more with its real token (the delay), after which its K/V stay cached.
    return view.masked | (tokens != runtime.store.computed_from)


def _prefill_positions(runtime: _CachedRuntime, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
    return runtime.index >= runtime.layout.prompt_length


def _fresh_near_block(positions, before: int):
    """``positions`` plus every unmasked position in [block_start - before, block_end): the neighbourhood
    where decoding happens, whose K/V move most at each step."""
    def with_neighbourhood(runtime: _CachedRuntime, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        near = (runtime.index >= view.block_start - before) & (runtime.index < view.block_end)
        return positions(runtime, tokens, view) | (near & ~view.masked)
    return with_neighbourhood


def _greedy_positions(window: int):
    def positions(runtime: _CachedRuntime, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        in_block = view.masked & (runtime.index >= view.block_start) & (runtime.index < view.block_end)
        first = int(in_block.nonzero()[0]) if bool(in_block.any()) else view.block_start
        return view.masked & (runtime.index >= first) & (runtime.index < first + window)
    return positions


DKV_VARIANTS = ("decode", "prefill", "greedy")


@dataclass(frozen=True)
class DKVCache(CachePolicy):
    """dKV-Cache: delayed caching of decoded tokens' keys and values (see the module docstring)."""

    variant: str = "decode"  # decode | prefill | greedy
    refresh: int | None = None  # full forward every this many steps (None: only at the first step)
    window: int = 8  # greedy only: masked positions recomputed per step, from the block's first masked one
    # every step also recompute the unmasked positions from this many before the current block to its end
    # (None: none, the paper's rule; reaching position 0 from the last block recomputes everything, as NoCache)
    fresh_before_block: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in DKV_VARIANTS:
            raise ValueError(f"DKVCache: variant must be one of {DKV_VARIANTS}, got {self.variant!r}")
        if self.refresh is not None and self.refresh < 1:
            raise ValueError(f"DKVCache: refresh must be >= 1 or None, got {self.refresh}")
        if self.window < 1:
            raise ValueError(f"DKVCache: window must be >= 1, got {self.window}")
        if self.fresh_before_block is not None and self.fresh_before_block < 0:
            raise ValueError(f"DKVCache: fresh_before_block must be >= 0 or None, got {self.fresh_before_block}")

    def start(self, model, layout: Layout, attention=None) -> Runtime:
        positions = {"decode": _decode_positions, "prefill": _prefill_positions,
                     "greedy": _greedy_positions(self.window)}[self.variant]
        if self.fresh_before_block is not None:
            positions = _fresh_near_block(positions, self.fresh_before_block)
        interval = self.refresh

        def refresh_now(view: StepView) -> bool:
            return interval is not None and view.step % interval == 0
        return _CachedRuntime(model, layout, attention, refresh_now, positions)


# ---------------------------------------------------------------- Fast-dLLM (the peers)


def _at_block_start(view: StepView) -> bool:
    return view.first_in_block


@dataclass(frozen=True)
class FastDLLMPrefix(CachePolicy):
    """Fast-dLLM prefix cache: a full forward at each block's first step; then the prefix before the block
    stays cached and the block and everything after it are recomputed."""

    def start(self, model, layout: Layout, attention=None) -> Runtime:
        def positions(runtime: _CachedRuntime, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
            return runtime.index >= view.block_start
        return _CachedRuntime(model, layout, attention, _at_block_start, positions)


@dataclass(frozen=True)
class FastDLLMDual(CachePolicy):
    """Fast-dLLM dual cache: a full forward at each block's first step; then prefix and suffix stay cached
    and only the current block is recomputed."""

    def start(self, model, layout: Layout, attention=None) -> Runtime:
        def positions(runtime: _CachedRuntime, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
            return (runtime.index >= view.block_start) & (runtime.index < view.block_end)
        return _CachedRuntime(model, layout, attention, _at_block_start, positions)


def describe(policy) -> str:
    """Short label, e.g. ``DKVCache(variant=decode, refresh=8, window=8)``; a policy inside a policy
    (SparseD's ``cache``) is described the same way. A knob that is off (None, its default) is left out."""
    values = [(f.name, getattr(policy, f.name), f.default) for f in fields(policy)]
    parts = [f"{name}={describe(value) if isinstance(value, Settings) else value}" for name, value, default in values
             if value is not None or default is not None]
    return f"{type(policy).__name__}({', '.join(parts)})"
