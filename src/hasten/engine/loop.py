"""The one decode loop: prefill -> propose -> verify -> commit -> repeat.

Plain autoregressive decoding is this loop with no drafter: every step then verifies an
empty draft and commits the bonus token alone, so the baseline and every method share
one code path and one set of stop rules.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator

import torch

from ..core.sampling import Sampling
from ..core.generators import consume
from ..core.stats import DecodeStats
from ..core.threads import DEFAULT_THREADS, using_threads
from ..drafters.base import Drafter, TargetView
from ..core.runtime import Runtime
from ..models.hf import runtime_of
from ..models.attention import MaskedTree, attention_path
from ..core.constraint import compiled
from ..core.request import Request
from .batch import Scheduler
from .inputs import check_inputs, eos_ids
from .planner import DraftPlanner
from .requests import request_from
from .sequence import open_row, step
from .sizing import SizingRule
from .stops import StopStrings
from .verify import Acceptance, acceptance_rule

if TYPE_CHECKING:  # type hints only: the engine runs any runtime, Hugging Face's or not
    from transformers import PreTrainedModel


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [1, T + n] prompt (decoder start for seq2seq) + new tokens
    stats: DecodeStats
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    lossy: tuple[str, ...] = ()  # the lossy parts asked for by name (hasten.approx); empty: exact


@dataclass
class BatchGenerationOutput:
    rows: list[GenerationOutput]  # one per prompt, in order; each row's sequences is [1, T_i + n_i]
    stats: DecodeStats  # summed over the rows

    @property
    def sequences(self) -> list[torch.Tensor]:
        """Each row's [T_i + n_i] tokens (rows differ in length, so no padded tensor)."""
        return [row.sequences[0] for row in self.rows]


def decode(
    runtime: Runtime,
    request: Request,
    drafter: Drafter | None,
    stats: DecodeStats,
    acceptance: Acceptance,
    planner: DraftPlanner | None = None,
    kv_compression=None,
    tree_attention: MaskedTree | None = None,
) -> Generator[list[int], None, str | None]:
    """Yield each step's committed tokens of one sequence, then return why it ended. The
    request is admitted here (checked against the model, its defaults filled in). The row is
    opened as a batch's rows are (:func:`~hasten.engine.sequence.open_row`) and the step is the
    batch's (:func:`~hasten.engine.sequence.step`); ``planner`` sizes its drafts (None: each
    drafter's own depth, ``draft_size="fixed"``). A vision-language request's images
    (``request.model_inputs``) are read by the prefill only."""
    request = request.admit(runtime)
    planner = planner or DraftPlanner("fixed")
    if drafter is not None:
        drafter.check_runtime(runtime)  # before any forward
    target = runtime.session(tree_attention)
    if drafter is not None:
        drafter.check_target(TargetView(target, drafter.needs, runtime.source))
    clock = time.perf_counter()
    input_ids = torch.tensor([request.input_ids], dtype=torch.long, device=runtime.device)  # [1, T]

    def prefill(features: bool):
        if kv_compression is None:
            tokens, prefilled = target.start(input_ids, hidden=features, **request.model_inputs)
        else:  # lossy, asked for by name: the target keeps a compressed cache of the prompt
            tokens, prefilled = kv_compression.start(target, input_ids, features,
                                                     max_new_tokens=request.max_new_tokens)
        return target, tokens, prefilled

    sequence = open_row(request, drafter, prefill, planner, acceptance, stats, runtime.source)
    stats.prefill_seconds += time.perf_counter() - clock
    try:
        while not sequence.finished:
            yield step(target, [sequence], planner)[0]
    finally:  # also when a caller stops the stream early
        sequence.close()
    sequence.record_kv_bytes()
    return sequence.finish_reason


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor | list[torch.Tensor],
    *,
    attention_mask: torch.Tensor | None = None,
    drafter: Drafter | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    lossy_acceptance: Acceptance | None = None,
    draft_size: str | SizingRule | None = None,
    stop_strings: str | list[str] | None = None,
    tokenizer=None,
    stop: str | list[str] | None = None,
    seed: int | None = None,
    speculate: bool = True,
    pool: bool = True,
    kv_compression=None,
    tree_attention: str = "mask",
    min_p: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    allowed_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    threads: int | None = DEFAULT_THREADS,
    constraint=None,
    **model_inputs: torch.Tensor,
) -> GenerationOutput | BatchGenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ([1, T]).

    Greedy (temperature 0) output is token-identical to the plain model's; sampled output
    is distributed exactly as the plain model samples with the same temperature, top-k and
    top-p, whichever drafter is used. ``draft_size`` is ``"fixed"`` (each drafter's own
    depth), ``"auto"`` (each step's depth chosen from the target's measured forward cost
    and the drafter's measured acceptance; see :mod:`hasten.engine.sizing`) or unset, as at
    every entry point: auto, except fixed for seeded sampling (:func:`~hasten.engine.sizing.default_size`). ``lossy_acceptance`` (e.g.
    ``hasten.approx.TypicalAcceptance()``) replaces the exact rule and gives that up.
    ``kv_compression`` (e.g. ``hasten.approx.SpecKV(draft)``) decodes from a compressed cache
    of the prompt: lossy, so the output is exact only relative to that compressed target;
    ``GenerationOutput.lossy`` names every lossy part a generation used.
    ``tree_attention="hybrid"`` verifies tree drafts with the cached prefix through the fused
    attention kernel and only the tree part masked, merged by log-sum-exp (equal to the
    masked path to float tolerance; see :mod:`hasten.models.attention`).
    ``stop`` (or ``stop_strings``, Hugging Face's name for it; with the ``tokenizer`` that reads
    the text) ends generation after the token that completes one of the strings, as Hugging Face
    ``generate`` does. ``seed`` seeds the generation's own generator (row i of a batch: ``seed +
    i``, as :meth:`hasten.Engine.generate_batch`); ``generator`` is one the caller keeps instead.
    ``speculate=False`` decodes plainly (the same text, no drafting cost); ``pool=False`` keeps the
    generation out of its drafter's shared pool. These keywords mean what they mean to
    :class:`hasten.Engine`: both build their requests with
    :func:`~hasten.engine.requests.request_from`.

    ``min_p``, the penalties, ``logit_bias``, ``allowed_token_ids`` and ``min_tokens`` (EOS
    held back until that many tokens) transform the target distribution as vLLM does (see
    :class:`~hasten.core.sampling.Sampling`); greedy output is then the plain model's under the
    same transform, token for token, and sampled output follows its law.

    A batch (a list of 1-D prompts of any lengths, or ``[B, T]`` with an ``attention_mask``
    marking each row's real tokens) is decoded together, one target forward per step for
    all rows, each row exactly as it would be alone; it returns a
    :class:`BatchGenerationOutput`. Batches need a causal LM.

    A vision-language target (LLaVA, Idefics3/SmolVLM) takes its images by keyword:
    ``pixel_values=`` and whatever else its processor returns (``pixel_attention_mask``,
    ``image_sizes``, ...); the prefill reads them, decoding is text only (see
    :mod:`hasten.models.vlm`). One prompt at a time: batches take no images.

    ``constraint``: the generated text follows it (structured output): a spec of
    :mod:`hasten.structured` (``JsonSchema(schema)``, ``Regex(pattern)``, ``Choice([...])``,
    ``Grammar(text)``, compiled for ``tokenizer``, which it then needs) or a compiled constraint. The
    target's logits are masked at every verified position, so greedy output is plain constrained
    decoding's (the argmax of the masked logits), token for token, and sampled output follows the
    masked law, whichever drafter is used (see :mod:`hasten.engine.constraint`).

    ``threads``: CPU threads torch computes with during the call, the caller's count restored
    after it; 1 by default, as on the command line (on a busy machine torch's default of one per
    core was 4-10x slower: :mod:`hasten.core.threads`); 0 takes every core, None leaves torch's
    setting alone.
    """
    with using_threads(threads):
        if stop is not None and stop_strings is not None:
            raise ValueError("give stop or stop_strings (Hugging Face's name for it), not both")
        if seed is not None and generator is not None:
            raise ValueError("give seed (the generation's own generator) or generator (yours), not both")
        sampling = Sampling(temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty,
                            logit_bias or (), allowed_token_ids, min_tokens)
        stops = StopStrings(tokenizer, stop if stop is not None else stop_strings or [])
        attention = attention_path(tree_attention)
        attention_mask, model_inputs = _image_inputs(input_ids, attention_mask, model_inputs)
        prompts = batch_prompts(input_ids, attention_mask)
        lossy = lossy_parts(lossy_acceptance, kv_compression)
        if kv_compression is not None and model_inputs:
            raise ValueError(f"kv_compression compresses a text prompt's cache; {', '.join(sorted(model_inputs))} "
                             "cannot go with it")
        runtime = runtime_of(model)
        constraint = compiled(constraint, tokenizer, runtime.vocab_size)
        eos = eos_ids(runtime, eos_token_id)

        def asked(prompt: torch.Tensor, row: int = 0, images: dict | None = None) -> Request:
            check_inputs(runtime, prompt, drafter, max_new_tokens, generator, images)
            return request_from(prompt[0].tolist(), max_new_tokens, sampling=sampling,
                                seed=None if seed is None else seed + row, generator=generator, stop=stops,
                                eos_token_ids=eos, speculate=speculate, pool=pool, model_inputs=images,
                                constraint=constraint)

        if prompts is not None:
            if kv_compression is not None:
                raise ValueError("kv_compression takes one prompt at a time, not a batch")
            requests = [asked(prompt, row) for row, prompt in enumerate(prompts)]
            return _generate_batch(runtime, prompts, requests, drafter, lossy_acceptance, draft_size)
        request = asked(input_ids, images=model_inputs)
        stats = DecodeStats()
        new: list[int] = []
        pieces = decode(runtime, request, drafter, stats, acceptance_rule(sampling, lossy_acceptance),
                        DraftPlanner(draft_size), kv_compression, attention)
        reason = consume(pieces, new.extend)
        head = runtime.decoder_start() if runtime.encoder_decoder else input_ids[0].tolist()
        return GenerationOutput(torch.tensor([head + new], dtype=torch.long), stats, reason, lossy)


def lossy_parts(lossy_acceptance, kv_compression) -> tuple[str, ...]:
    """Names of the lossy parts of a generation; a KV compression must be a lossy
    policy from hasten.approx (acceptance rules are checked by acceptance_rule)."""
    parts = []
    if lossy_acceptance is not None:
        parts.append(type(lossy_acceptance).__name__)
    if kv_compression is not None:
        if getattr(kv_compression, "lossless", True) or not callable(getattr(kv_compression, "start", None)):
            raise TypeError("kv_compression must be a lossy KV policy from hasten.approx, e.g. SpecKV(draft)")
        parts.append(kv_compression.describe())
    return tuple(parts)


# ---- vision-language prompts ------------------------------------------------------------------
def _image_inputs(input_ids, attention_mask, model_inputs: dict) -> tuple[torch.Tensor | None, dict]:
    """The attention_mask and image inputs of a vision-language prompt. A keyword given as
    None is absent (as in Hugging Face); with images, the processor's all-ones
    attention_mask of one [1, T] prompt means no batch and is dropped; batches of image
    prompts are refused (batch.py has no image prefill)."""
    model_inputs = {key: value for key, value in model_inputs.items() if value is not None}
    if not model_inputs:
        return attention_mask, model_inputs
    one_prompt = isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 and input_ids.shape[0] == 1
    if not one_prompt:
        stray = next((key for key, value in model_inputs.items() if not isinstance(value, torch.Tensor)), None)
        if stray is not None:  # a misspelt keyword, not an image input
            raise TypeError(f"generate() got an unexpected keyword argument {stray!r}")
        raise ValueError(f"{', '.join(sorted(model_inputs))} given with a batch of prompts: vision-language "
                         "prompts are decoded one at a time; pass one [1, T] prompt")
    if attention_mask is None:
        return None, model_inputs
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape \
            or not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask must be all ones on input_ids' shape for one image prompt (padding "
                         "belongs to batches, which take no images)")
    return None, model_inputs


def batch_prompts(input_ids, attention_mask) -> list[torch.Tensor] | None:
    """The prompts of a batch as [1, T_i] tensors, or None for a single [1, T] prompt."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a [B, T] tensor; a list of prompts needs none")
        if not input_ids:
            raise ValueError("input_ids is an empty list: give at least one prompt")
        prompts = []
        for i, prompt in enumerate(input_ids):
            if not isinstance(prompt, torch.Tensor) or prompt.dtype != torch.long or prompt.ndim != 1:
                raise TypeError(f"input_ids[{i}] must be a 1-D torch.LongTensor (one prompt)")
            prompts.append(prompt[None])
        return prompts
    if attention_mask is None:
        if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 and input_ids.shape[0] > 1:
            return [row[None] for row in input_ids]
        return None
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise TypeError("input_ids must be a [B, T] torch.LongTensor when an attention_mask is given")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {list(input_ids.shape)}, got "
                         f"{list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}")
    return [row[mask.bool()][None] for row, mask in zip(input_ids, attention_mask)]


def _generate_batch(runtime, prompts: list[torch.Tensor], requests: list[Request], drafter, lossy_acceptance,
                    draft_size) -> BatchGenerationOutput:
    scheduler = Scheduler(runtime, drafter, max_batch=len(prompts), draft_size=draft_size,
                          lossy_acceptance=lossy_acceptance)
    row_ids = [scheduler.submit(request) for request in requests]
    results = scheduler.run()
    rows = [
        GenerationOutput(torch.tensor([prompt[0].tolist() + results[row_id].tokens], dtype=torch.long),
                         results[row_id].stats, results[row_id].finish_reason)
        for prompt, row_id in zip(prompts, row_ids)
    ]
    return BatchGenerationOutput(rows, sum((row.stats for row in rows), DecodeStats()))
