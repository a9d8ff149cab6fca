"""Checks of what a caller passes to the decode loop, each failing with one clear message."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..drafters.base import Drafter
from ..models import vlm
from ..models.adapter import vocab_size


def opens_own_target(model) -> bool:
    """A model from another runtime (hasten.models.llamacpp.LlamaCppModel) that opens its own
    target per generation (``session()``) and says its ``vocab_size``, ``max_positions`` and
    ``eos_token_ids()`` itself."""
    return not isinstance(model, PreTrainedModel) and callable(getattr(model, "session", None))


def check_inputs(model, input_ids, drafter, max_new_tokens, generator, model_inputs: dict | None = None) -> None:
    """``model_inputs``: a vision-language prompt's images (pixel_values, ...), by keyword."""
    if not isinstance(model, PreTrainedModel) and not opens_own_target(model):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a torch.LongTensor of shape [1, T]")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids has a batch of {input_ids.shape[0]} rows where one sequence is decoded; "
                         "hasten.generate takes a batch (a list of prompts, or [B, T] with an attention_mask)")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    vocab = model.vocab_size if opens_own_target(model) else vocab_size(model)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contains token id {bad}, outside the model's vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_positions(model, input_ids.shape[1], max_new_tokens)
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a hasten Drafter or None, got {type(drafter).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if not opens_own_target(model):
        vlm.check_model_inputs(model, input_ids, model_inputs or {})
    elif model_inputs:
        raise ValueError(f"{', '.join(sorted(model_inputs))}: this backend takes text prompts only")


# Config names of the number of positions a model was built for (learned position
# embeddings fail beyond it; rotary ones drift off what they were trained on).
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def max_positions(model: PreTrainedModel) -> int | None:
    """The positions the model's config allows, or None where it sets no limit (T5)."""
    if opens_own_target(model):
        return min(model.max_positions, model.context)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in POSITION_LIMITS:
        limit = getattr(config, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
    return None


def check_positions(model: PreTrainedModel, prompt_length: int, max_new_tokens: int) -> None:
    """ValueError naming both numbers when the prompt, or the prompt and the tokens asked
    for, need more positions than the model has. An encoder-decoder reads the prompt in
    its encoder and writes the new tokens after one start token in its decoder."""
    limit = max_positions(model)
    if limit is None:
        return
    if prompt_length > limit:
        raise ValueError(f"the prompt has {prompt_length} tokens, more than the model's context of {limit} positions")
    if not opens_own_target(model) and model.config.is_encoder_decoder:
        needed, room, where = 1 + max_new_tokens, limit - 1, f"the model's decoder has {limit} positions"
    else:
        needed, room = prompt_length + max_new_tokens, limit - prompt_length
        where = f"the prompt has {prompt_length} tokens and the model {limit} positions"
    if needed > limit:
        raise ValueError(f"max_new_tokens={max_new_tokens} does not fit: {where}, room for at most {room} new tokens")


def eos_ids(model: PreTrainedModel, eos_token_id) -> frozenset[int]:
    """None means the model's own generation config, as in Hugging Face generate."""
    if eos_token_id is None and opens_own_target(model):
        return model.eos_token_ids()
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    return frozenset(ids)
