"""Checks of what a caller passes to the decode loop, each failing with one clear message.
What the model allows (vocabulary, context, images) is its runtime's to say."""
from __future__ import annotations

import torch

from ..core.request import check_positions  # noqa: F401 - its home is the request's
from ..core.runtime import Runtime
from ..drafters.base import Drafter


def check_inputs(runtime: Runtime, input_ids, drafter, max_new_tokens, generator,
                 model_inputs: dict | None = None) -> None:
    """What ``hasten.generate`` takes as tensors and objects, before it builds its requests:
    ``input_ids`` one [1, T] LongTensor, a hasten drafter, a torch generator. Everything a
    request holds is checked once, at admission (:meth:`hasten.core.request.Request.check`)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a torch.LongTensor of shape [1, T]")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids has a batch of {input_ids.shape[0]} rows where one sequence is decoded; "
                         "hasten.generate takes a batch (a list of prompts, or [B, T] with an attention_mask)")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a hasten Drafter or None, got {type(drafter).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def eos_ids(runtime: Runtime, eos_token_id) -> frozenset[int]:
    """None means the model's own generation config, as in Hugging Face generate."""
    if eos_token_id is None:
        return runtime.eos_token_ids()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    return frozenset(ids)
