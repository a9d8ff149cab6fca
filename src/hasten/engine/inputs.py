"""Checks of what a caller passes to the decode loop, each failing with one clear message.
What the model allows (vocabulary, context, images) is its runtime's to say."""
from __future__ import annotations

import torch

from ..core.errors import FieldError
from ..core.runtime import Runtime
from ..drafters.base import Drafter


def check_inputs(runtime: Runtime, input_ids, drafter, max_new_tokens, generator,
                 model_inputs: dict | None = None) -> None:
    """``model_inputs``: a vision-language prompt's images (pixel_values, ...), by keyword."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a torch.LongTensor of shape [1, T]")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids has a batch of {input_ids.shape[0]} rows where one sequence is decoded; "
                         "hasten.generate takes a batch (a list of prompts, or [B, T] with an attention_mask)")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    vocab = runtime.vocab_size
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contains token id {bad}, outside the model's vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_positions(runtime, input_ids.shape[1], max_new_tokens)
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a hasten Drafter or None, got {type(drafter).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    runtime.check_prompt_inputs(input_ids, model_inputs or {})


def check_positions(runtime: Runtime, prompt_length: int, max_new_tokens: int) -> None:
    """ValueError naming both numbers when the prompt, or the prompt and the tokens asked
    for, need more positions than the model has. An encoder-decoder reads the prompt in
    its encoder and writes the new tokens after one start token in its decoder."""
    limit = runtime.context_length
    if limit is None:
        return
    if prompt_length > limit:
        raise FieldError("input_ids", "context_length_exceeded",
                         f"the prompt has {prompt_length} tokens, more than the model's context of {limit} positions")
    if runtime.encoder_decoder:
        needed, room, where = 1 + max_new_tokens, limit - 1, f"the model's decoder has {limit} positions"
    else:
        needed, room = prompt_length + max_new_tokens, limit - prompt_length
        where = f"the prompt has {prompt_length} tokens and the model {limit} positions"
    if needed > limit:
        raise FieldError("max_new_tokens", "context_length_exceeded",
                         f"{{field}}={max_new_tokens} does not fit: {where}, room for at most {room} new tokens")


def eos_ids(runtime: Runtime, eos_token_id) -> frozenset[int]:
    """None means the model's own generation config, as in Hugging Face generate."""
    if eos_token_id is None:
        return runtime.eos_token_ids()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    return frozenset(ids)
