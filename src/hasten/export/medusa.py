"""Medusa heads in vLLM's layout (``vllm/model_executor/models/medusa.py``, ``speculative_config
= {"method": "medusa", "model": DIR}``).

vLLM's head ``h`` is ``num_hidden_layers`` residual blocks ``x + SiLU(W x + b)`` over the target's
last hidden state, then an LM head; ``original_lm_head`` makes every head share one ``lm_head``.
hasten's head is one such block (``drafters.nn.ResidualBlock``: bias included) and, by default,
the target's own LM head: that head is copied into the export once (``lm_head.weight``), since
vLLM reads the LM head from the drafter's checkpoint, not from the target.
"""
from __future__ import annotations

import torch

from ..drafters.medusa import MedusaHeads
from .layout import Shape

ENGINE = "vLLM's Medusa (vllm.model_executor.models.medusa)"


def vllm_config(heads: MedusaHeads) -> dict:
    config = heads.config
    return {
        "architectures": ["MedusaModel"], "model_type": "medusa",
        "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
        "num_heads": config.num_heads, "num_hidden_layers": 1, "medusa_fc_bias": True,
        "truncated_vocab_size": config.vocab_size, "original_lm_head": config.share_lm_head,
    }


def vllm_layout(config: dict) -> dict[str, Shape]:
    """The parameters vLLM's Medusa module declares for ``config``: name -> shape."""
    H, V = config["hidden_size"], config["truncated_vocab_size"]
    names: dict[str, Shape] = {}
    for h in range(config["num_heads"]):
        for layer in range(config["num_hidden_layers"]):
            names[f"blocks.{h}.layers.{layer}.weight"] = (H, H)
            if config.get("medusa_fc_bias", False):
                names[f"blocks.{h}.layers.{layer}.bias"] = (H,)
    if config.get("original_lm_head", False):
        names["lm_head.weight"] = (V, H)
    else:
        names.update({f"lm_heads.{h}.weight": (V, H) for h in range(config["num_heads"])})
    return names


def vllm_tensors(heads: MedusaHeads, target_lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """hasten's names -> vLLM's; ``target_lm_head`` [V, H] is the target's, needed when the heads share it."""
    tensors = {}
    for h, block in enumerate(heads.blocks):
        tensors[f"blocks.{h}.layers.0.weight"] = block.linear.weight  # [H, H]
        tensors[f"blocks.{h}.layers.0.bias"] = block.linear.bias  # [H]
    if heads.lm_heads is None:
        tensors["lm_head.weight"] = target_lm_head  # [V, H]
    else:
        tensors.update({f"lm_heads.{h}.weight": own.weight for h, own in enumerate(heads.lm_heads)})
    return tensors
