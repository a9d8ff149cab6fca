"""A Llama-family forward with fewer operations, for CPU models on hasten's kernels.

A decode step of SmolLM2-135M on one CPU thread spends about 41 ms in its linear layers and,
under Hugging Face's modules, about 18 ms in everything else (norms, rotary embedding, cache,
attention, and the module calls, keyword plumbing, mask building and output objects around
them); the same operations called directly cost about 13 ms (measured November 2026 on the
2-core development VM, linear layers stubbed out). vLLM's CPU step is fused kernels throughout;
this is the part of that which keeps Hugging Face's numbers: :func:`forward` runs **the same
tensor operations, in the same order, on the same weights** as transformers' Llama and Qwen2
decoder (its RMSNorm formula, ``rotate_half`` rotary embedding, the attention the model is
prepared with (hasten's row-invariant kernel, models/invariant.py), SiLU-gated MLP), so its
logits equal the model's own forward bit for bit (tests/test_lean.py checks them, one token,
blocks, trees and prefills), only with less around them.

Where it runs (:func:`usable`): a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (without sliding
windows) prepared for hasten's kernels on the CPU (models/invariant.py: float32, bfloat16 or
float16), in eval mode, on their attention, with a rotary
embedding whose frequencies do not change with the input ("default", "linear", "llama3"), and
with no forward hooks anywhere in the model (drafters that read the target's modules hook them;
those forwards take the model's own path). Everything else, and any forward that asks for
hidden states, riders or images, goes through the model as before, and so does the batched
decoder (``models/batch.py``: several sequences in one forward, the server's path).
``HASTEN_LEAN_FORWARD=0`` turns it off.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from . import invariant

MODEL_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3")  # inverse frequencies fixed at load time


def eligible(model: PreTrainedModel) -> bool:
    """Whether ``model``'s architecture and settings are what :func:`forward` reproduces."""
    if os.environ.get("HASTEN_LEAN_FORWARD", "1") == "0" or type(model).__name__ not in MODEL_CLASSES:
        return False
    config = model.config
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}).get("rope_type", "default")
    return (invariant.is_prepared(model)
            and config.hidden_act == "silu" and rope in STATIC_ROPE and not getattr(config, "use_sliding_window", False)
            and getattr(config, "pretraining_tp", 1) == 1)


def hooked(modules: list[nn.Module]) -> bool:
    """Whether any of ``modules`` (a model's, listed once) has forward hooks (a drafter
    reading the target's modules), or global ones are set: then the model's own forward must run."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def usable(model: PreTrainedModel, modules: list[nn.Module] | None) -> bool:
    """``modules``: the model's modules where it is :func:`eligible` (decided once per
    generation), else None. Usable when nothing needs the model's modules: eval mode, its
    attention still transformers' sdpa (query capture switches it for a forward) and no hooks
    (checked at every forward, since drafters hook targets as they begin)."""
    return (modules is not None and not model.training and invariant.is_prepared(model) and not hooked(modules))


def fused_linear(owner: nn.Module, layers: tuple[nn.Linear, ...], h: torch.Tensor) -> torch.Tensor | None:
    """``layers`` (reading the same input ``h`` [..., in]) as one product [..., sum of outs]:
    the kernel computes each output feature alone, so the fused product has every layer's own
    bits; None where they cannot be fused."""
    fused = invariant.fused_weight(owner, layers)
    return None if fused is None else invariant.apply_linear(h, fused[0], fused[1])


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm ([..., hidden]): ``weight * (x * rsqrt(mean(x^2) + eps))``
    computed in float32, the product with the weight in the input's dtype, each row alone
    (models/invariant.py). On float32 CPU input PyTorch's fused ``rms_norm`` computes it alike
    (tests/test_lean.py compares both with the model's own forward bit for bit)."""
    if x.dtype == torch.float32 and not x.is_cuda:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return invariant.rms_norm(norm, x)


def _add_linear(layer: nn.Module, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + layer(h)``, as transformers adds them (the layer's output rounded to the
    model's dtype first)."""
    return residual + layer(h)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def forward(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, positions: torch.Tensor,
            mask: torch.Tensor | None, logits_to_keep: int = 0) -> torch.Tensor:
    """The model's logits for ``ids`` ([1, Q]) at ``positions`` ([1, Q]) after the cached
    entries, which ``cache`` gains: [Q, vocab], or the last ``logits_to_keep`` rows.
    ``mask``: a tree block's 4D additive mask [1, 1, Q, past + Q] (what transformers is
    given), or None for causal order."""
    inner = model.model
    config = model.config
    length = ids.shape[1]
    past = cache.get_seq_length()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = inner.rotary_emb
    freqs = positions[..., None].float() * rope.inv_freq  # [1, Q, head_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [1, Q, head_dim]
    cos = (angles.cos() * rope.attention_scaling).to(model.dtype)[:, None]  # [1, 1, Q, head_dim]
    sin = (angles.sin() * rope.attention_scaling).to(model.dtype)[:, None]
    lists = invariant.key_lists(mask, length, past + length, True, 1, ids.device)[0]  # each row's own keys, in order
    x = inner.embed_tokens(ids)  # [1, Q, hidden]
    for index, layer in enumerate(inner.layers):
        attention = layer.self_attn
        h = _rms_norm(layer.input_layernorm, x)
        q, k, v = _attention_inputs(attention, h, heads, kv_heads, head_dim, cos, sin)
        k, v = cache.update(k, v, index)  # [1, H_kv, past + Q, D]
        out = invariant.attend(q[0].transpose(0, 1), k[0], v[0], lists, attention.scaling)  # [Q, H, D]
        x = _add_linear(attention.o_proj, out.reshape(1, length, heads * head_dim), x)
        h = _rms_norm(layer.post_attention_layernorm, x)
        x = _mlp(layer.mlp, h, x)
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    return model.lm_head(_rms_norm(inner.norm, x))[0]  # [Q or logits_to_keep, vocab]


def _attention_inputs(attention: nn.Module, h: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                      cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries [1, H, Q, D] and keys [1, H_kv, Q, D], and values [1, H_kv, Q, D], of
    the normed input ``h`` [1, Q, hidden]: one packed product and one rotation for queries
    and keys together where the weights allow (elementwise, so the same bits), else as
    transformers does it."""
    length = h.shape[1]
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    qkv = fused_linear(attention, layers, h)
    if qkv is None:
        q = attention.q_proj(h).view(1, length, heads, head_dim).transpose(1, 2)
        k = attention.k_proj(h).view(1, length, kv_heads, head_dim).transpose(1, 2)
        v = attention.v_proj(h).view(1, length, kv_heads, head_dim).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v
    qkv = qkv.view(1, length, heads + 2 * kv_heads, head_dim).transpose(1, 2)
    qk = qkv[:, : heads + kv_heads]  # [1, H + H_kv, Q, D]
    qk = qk * cos + _rotate_half(qk) * sin
    return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]


def _mlp(mlp: nn.Module, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual`` plus transformers' SiLU-gated MLP of ``h`` [1, Q, hidden]; gate and up in
    one packed product where the weights allow."""
    fused = fused_linear(mlp, (mlp.gate_proj, mlp.up_proj), h)
    if fused is None:
        return _add_linear(mlp.down_proj, F.silu(mlp.gate_proj(h)) * mlp.up_proj(h), residual)
    gate, up = fused.chunk(2, dim=-1)
    return _add_linear(mlp.down_proj, F.silu(gate) * up, residual)
