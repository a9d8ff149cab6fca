"""The masked-diffusion sampler (LLaDA's semi-autoregressive low-confidence remasking).

The generated span starts as mask tokens and is cut into blocks of ``block_length`` decoded left
to right. Each block gets its share of ``steps``; at every step the model predicts every masked
position of the block (``x0``: argmax, or a Gumbel-max sample when ``temperature > 0``), and the
positions the remasking rule is most sure of keep their prediction: the scheduled number (the
block's mask count split evenly over its steps, earlier steps taking the remainder) or, with
``threshold``, also every one whose confidence exceeds it (Fast-dLLM's parallel decoding). The
rest stay masked. ``remasking="random_order"`` (dKV-Cache-Greedy's rule) instead draws the block's
decoding order at the block's start, so each step knows before its forward which positions it
decodes and asks for their logits only. Vocabulary: *masked* positions, *decoded* tokens, *confidence* of a prediction.

How each step's forward is computed (in full, with cached keys/values, with sparse attention) is
the cache policy's business, chosen once; the sampler never asks its name.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from .forward import ForwardCounts
from .policies import Layout, NoCache, StepView


def _low_confidence(probs_of_x0: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return probs_of_x0


def _random(probs_of_x0: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(probs_of_x0.shape, generator=generator, device=probs_of_x0.device)


# remasking rule -> confidence of each prediction; the least confident stay masked
REMASKING = {"low_confidence": _low_confidence, "random": _random}
# the rule whose order is drawn at each block's start (no confidence: the step decodes the next in order)
RANDOM_ORDER = "random_order"


def draw_order(block_positions: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """block_positions [n] -> the same positions in a uniformly random decoding order (dKV-Cache-Greedy's,
    drawn once at the block's start: the reference sorts one uniform draw per position, descending)."""
    priority = torch.rand(len(block_positions), generator=generator, device=block_positions.device)  # [n]
    return block_positions[priority.argsort(descending=True)]


@dataclass
class DLMStats:
    """What one generation cost: counted exactly, plus its wall time."""

    steps: int  # denoising steps run
    forwards: int
    tokens_recomputed: int  # positions run through the model, summed over forwards
    tokens_full: int  # what running every position at every forward would have been
    attention_flops: int
    attention_flops_skipped: int  # against full attention over the whole sequence at every forward
    seconds: float

    @classmethod
    def from_counts(cls, steps: int, length: int, counts: ForwardCounts, seconds: float) -> "DLMStats":
        return cls(steps=steps, forwards=counts.forwards, tokens_recomputed=counts.tokens_recomputed,
                   tokens_full=counts.forwards * length, attention_flops=counts.attention_flops,
                   attention_flops_skipped=counts.attention_flops_full - counts.attention_flops, seconds=seconds)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DLMOutput:
    sequences: torch.Tensor  # [1, prompt + gen_length], prompt included
    stats: DLMStats


def find_mask_token_id(model, tokenizer=None) -> int | None:
    """The mask token from the model's config, its generation config, or the tokenizer."""
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "mask_token_id", None) if source is not None else None
        if value is not None:
            return int(value)
    return None


def _check(input_ids, gen_length: int, block_length: int, steps: int, temperature: float, remasking: str,
           threshold: float | None) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1 \
            or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [1, T] tensor with T >= 1, got {shape}")
    for name, value in (("gen_length", gen_length), ("block_length", block_length), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if gen_length % block_length:
        raise ValueError(f"block_length ({block_length}) must divide gen_length ({gen_length})")
    if steps < gen_length // block_length:
        raise ValueError(f"steps ({steps}) must be at least the number of blocks, gen_length / block_length "
                         f"= {gen_length // block_length}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if remasking not in REMASKING and remasking != RANDOM_ORDER:
        raise ValueError(f"remasking must be one of {sorted([*REMASKING, RANDOM_ORDER])}, got {remasking!r}")
    if threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1] or None, got {threshold}")
    if threshold is not None and remasking == RANDOM_ORDER:
        raise ValueError("threshold compares confidences; remasking='random_order' decodes in an order drawn at "
                         "the block's start and has none: pass threshold=None")


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` items over ``parts`` parts, the first ones taking the remainder."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def predict(logits: torch.Tensor, temperature: float, confidence_of, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, vocab] -> (x0 [n], confidence [n]). Sampling is Gumbel-max on logits / temperature;
    the confidence is the unscaled softmax probability of x0 (as LLaDA)."""
    logits = logits.float()
    if temperature > 0:
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
        x0 = (logits / temperature - torch.log(-torch.log(uniform))).argmax(-1)
    else:
        x0 = logits.argmax(-1)
    probs_of_x0 = torch.softmax(logits, -1).gather(-1, x0[:, None]).squeeze(1)
    return x0, confidence_of(probs_of_x0, generator)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, *, mask_token_id: int | None = None, gen_length: int,
             block_length: int, steps: int, cache=None, temperature: float = 0.0,
             remasking: str = "low_confidence", generator: torch.Generator | None = None,
             threshold: float | None = None, shifted_logits: bool | None = None, tokenizer=None) -> DLMOutput:
    """Denoise ``gen_length`` mask tokens after ``input_ids`` [1, T] in ``gen_length / block_length`` blocks
    and ``steps`` steps in all. ``remasking``: ``"low_confidence"`` (LLaDA's), ``"random"`` (a fresh uniform
    draw per step, LLaDA's) or ``"random_order"`` (the order drawn at each block's start, dKV-Cache-Greedy's;
    ``DKVCache(variant="greedy")`` needs it). ``cache``: a policy (``NoCache()`` when None). ``threshold``: also decode
    every prediction more confident than this (parallel decoding). ``shifted_logits`` (Dream-style: the
    output at position i - 1 predicts token i) defaults to ``model.config.dlm_shifted_logits``."""
    _check(input_ids, gen_length, block_length, steps, temperature, remasking, threshold)
    if model.config.is_encoder_decoder:
        raise ValueError(f"hasten.dlm runs a causal LM bidirectionally; {type(model).__name__} is an encoder-decoder")
    if mask_token_id is None:
        mask_token_id = find_mask_token_id(model, tokenizer)
    if mask_token_id is None:
        raise ValueError("mask_token_id: the model's config, generation config and tokenizer name no mask token; "
                         "pass mask_token_id= (a diffusion LM needs one)")
    if shifted_logits is None:
        shifted_logits = bool(getattr(model.config, "dlm_shifted_logits", False))
    confidence_of = REMASKING.get(remasking)  # None: random_order
    policy = NoCache() if cache is None else cache
    shift = 1 if shifted_logits else 0

    prompt_length = input_ids.shape[1]
    length = prompt_length + gen_length
    tokens = torch.full((length,), mask_token_id, dtype=torch.long, device=input_ids.device)  # [length]
    tokens[:prompt_length] = input_ids[0]
    num_blocks = gen_length // block_length
    block_steps = split_evenly(steps, num_blocks)
    scheduled_steps = sum(min(s, block_length) for s in block_steps)  # a step decodes at least one token
    runtime = policy.start(model, Layout(prompt_length, length, block_length, scheduled_steps))
    step = 0
    start_time = time.perf_counter()
    try:
        for block, steps_here in enumerate(block_steps):
            start = prompt_length + block * block_length
            end = start + block_length
            schedule = split_evenly(block_length, min(steps_here, block_length))
            order = draw_order(torch.arange(start, end, device=tokens.device), generator) \
                if confidence_of is None else None  # [block_length] the block's decoding order (random_order)
            for i, scheduled in enumerate(schedule):
                masked = tokens == mask_token_id  # [length]
                if order is not None:  # the next `scheduled` masked positions in the drawn order
                    upcoming = order[masked[order]]  # [pending] in decoding order
                    decoding = upcoming[:scheduled]  # [scheduled]
                    pending = decoding.sort().values  # [scheduled] ascending
                else:
                    decoding = None
                    pending = masked[start:end].nonzero().squeeze(1) + start  # [pending] masked positions in the block
                if len(pending) == 0:
                    break  # parallel decoding finished the block early
                view = StepView(step, start, end, i, masked, pending - shift, decoding)
                logits = runtime.logits(tokens, view)  # [pending, vocab]
                if confidence_of is None:
                    x0, _ = predict(logits, temperature, _low_confidence, generator)
                    tokens[pending] = x0
                    step += 1
                    continue
                x0, confidence = predict(logits, temperature, confidence_of, generator)
                count = scheduled
                if threshold is not None:
                    count = max(count, int((confidence > threshold).sum()))
                chosen = confidence.topk(min(count, len(pending))).indices
                tokens[pending[chosen]] = x0[chosen]
                step += 1
    finally:
        runtime.close()
    seconds = time.perf_counter() - start_time
    return DLMOutput(tokens[None], DLMStats.from_counts(step, length, runtime.counts, seconds))
