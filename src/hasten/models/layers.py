"""Running a causal LM with its hidden states replaced at one layer, for placeholder positions.

Hidden transfer (Wu et al. 2024) appends placeholder positions after the real tokens and,
at an intermediate decoder layer, swaps their hidden states for *pseudo* hidden states
made from the real ones; the layers above then run as usual, so the placeholders attend
to the real context. This module does that for any Hugging Face causal LM whose decoder
layers form one ``nn.ModuleList`` (Llama, Qwen2, Mistral, Phi-3, GPT-2, GPT-NeoX, ...):
a forward pre-hook on that layer replaces the hidden states, for the length of one
forward only. Drafters never see a model-specific branch.

Layer ``L`` means the input of decoder layer ``L``, i.e. ``hidden_states[L]`` of a Hugging
Face forward with ``output_hidden_states=True`` (0: the embeddings).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from ..engine import cache as kv
from .adapter import attention_mask, model_name


class UnsupportedArchitecture(ValueError):
    """The model's decoder layers could not be found, so its hidden states cannot be replaced."""


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The list of decoder layers of a causal LM: the one ``nn.ModuleList`` child of its
    base model with ``num_hidden_layers`` entries."""
    if model.config.is_encoder_decoder:
        raise UnsupportedArchitecture(
            f"model {model_name(model)!r} is an encoder-decoder; only causal LMs are supported"
        )
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    found = [m for m in model.base_model.children() if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(found) != 1:
        raise UnsupportedArchitecture(
            f"cannot find the decoder layers of {model_name(model)!r} ({type(model).__name__}): expected one "
            f"list of {count} layers in {type(model.base_model).__name__}, found {len(found)}"
        )
    return found[0]


def num_layers(model: PreTrainedModel) -> int:
    return len(decoder_layers(model))


@contextmanager
def replaced_hidden(model: PreTrainedModel, layer: int,
                    replace: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside the block, the input of decoder layer ``layer`` ([batch, seq, hidden]) goes
    through ``replace`` first. The hook is removed on exit, whatever happens."""
    layers = decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}) for {model_name(model)!r}, got {layer}")

    def hook(module, args, kwargs):
        if args:  # every supported architecture passes the hidden states first
            return (replace(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": replace(kwargs["hidden_states"])}

    handle = layers[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


# pseudo(h) -> pseudo hidden states: [..., hidden] -> [..., placeholders, hidden]
Transfer = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def placeholder_logits(model: PreTrainedModel, cache, block: list[int], placeholders: int, layer: int,
                       transfer: Transfer) -> torch.Tensor:
    """Run ``block`` after the ``cache``d tokens, followed by ``placeholders`` positions
    whose input to decoder layer ``layer`` is ``transfer(h)``, ``h`` being the last block
    token's input to that layer. Returns [len(block) + placeholders, vocab] float32 logits.
    The cache is cropped back to its length before the call, so it is left as found.
    Placeholders come after the block in causal order, so the block's own logits are
    those of a plain forward."""
    past = kv.length(cache)
    real = len(block)
    ids = torch.tensor([block + [block[-1]] * placeholders], device=model.device)  # [1, real + placeholders]

    def replace(hidden: torch.Tensor) -> torch.Tensor:  # [1, real + placeholders, hidden]
        if not placeholders:
            return hidden
        pseudo = transfer(hidden[0, real - 1])  # [placeholders, hidden]
        return torch.cat([hidden[:, :real], pseudo[None].to(hidden.dtype)], dim=1)

    positions = torch.arange(past, past + ids.shape[1], device=model.device)[None]
    try:
        with replaced_hidden(model, layer, replace):
            out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    finally:
        kv.crop(cache, past)
    return out.logits[0].float()


def placeholder_logits_batch(model: PreTrainedModel, ids: torch.Tensor, anchors: torch.Tensor, placeholders: int,
                             layer: int, transfer: Transfer) -> torch.Tensor:
    """Training form: for every row of ``ids`` ([B, T]) and every anchor position ``a`` in
    ``anchors`` ([B, A]), ``placeholders`` positions a + 1 .. a + k that see the real
    tokens up to ``a`` and their own earlier placeholders, with pseudo hidden states
    ``transfer(h_a)`` at ``layer``. All anchors share one forward (a block mask), and
    gradients flow into ``transfer``. Returns [B, A, k, vocab] logits."""
    batch, length = ids.shape
    count = anchors.shape[1]
    k = placeholders
    device = ids.device
    # placeholder j of anchor a sits at block index T + a_index * k + j, position a + 1 + j
    slot = torch.arange(k, device=device)
    query_pos = torch.cat([torch.arange(length, device=device).expand(batch, -1),
                           (anchors[:, :, None] + 1 + slot).reshape(batch, count * k)], dim=1)  # [B, Q]
    real_pos = torch.arange(length, device=device)
    allowed = torch.zeros(batch, length + count * k, length + count * k, dtype=torch.bool, device=device)
    allowed[:, :length, :length] = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    sees_real = real_pos[None, None, None, :] <= anchors[:, :, None, None]  # [B, A, 1, T]
    allowed[:, length:, :length] = sees_real.expand(batch, count, k, length).reshape(batch, count * k, length)
    own = torch.ones(k, k, dtype=torch.bool, device=device).tril()
    allowed[:, length:, length:] = torch.block_diag(*[own] * count)
    filler = torch.zeros(batch, count * k, dtype=ids.dtype, device=device)

    def replace(hidden: torch.Tensor) -> torch.Tensor:  # [B, Q, hidden]
        at_anchor = hidden[torch.arange(batch, device=device)[:, None], anchors]  # [B, A, hidden]
        pseudo = transfer(at_anchor).reshape(batch, count * k, -1)  # [B, A * k, hidden]
        return torch.cat([hidden[:, :length], pseudo.to(hidden.dtype)], dim=1)

    with replaced_hidden(model, layer, replace):
        out = model(input_ids=torch.cat([ids, filler], 1), position_ids=query_pos,
                    attention_mask=attention_mask(model, allowed, query_pos, query_pos), use_cache=False)
    return out.logits[:, length:].reshape(batch, count, k, -1)
