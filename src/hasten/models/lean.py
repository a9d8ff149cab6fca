"""A Llama-family forward with fewer operations, for CPU models on hasten's kernels.

Under Hugging Face's modules, a small model's decode step spends a large share outside its
linear layers (norms, rotary embedding, cache, attention, and the module calls, keyword plumbing,
mask building and output objects around them), and the same operations called directly cost
much less (docs/cpu.md, "The measurements behind the code's choices"). vLLM's CPU step is fused kernels throughout;
this is the part of that which keeps the model's numbers: :func:`forward` runs **the same
tensor operations, in the same order, on the same weights** as transformers' Llama and Qwen2
decoder prepared for hasten's kernels (models/invariant.py: the row-invariant linear layers and
attention, and the norm kernel, whose sum of squares goes in its own fixed order), with
``rotate_half`` rotary embedding and SiLU-gated MLP, so its logits equal the prepared model's own
forward bit for bit (tests/test_lean.py checks them, one token, blocks, trees and prefills),
only with less around them: each norm is one kernel call that also adds the residual stream
(PyTorch's add, bit for bit), and queries and keys rotate in one call (PyTorch's bits).

Where it runs (:func:`usable`): a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (without sliding
windows) prepared for hasten's kernels on the CPU (models/invariant.py: float32, bfloat16 or
float16), in eval mode, on their attention, with a rotary
embedding whose frequencies do not change with the input ("default", "linear", "llama3"), and
with no forward hooks anywhere in the model (drafters that read the target's modules hook them;
those forwards take the model's own path). Everything else, and any forward that asks for
riders or images, goes through the model as before; a forward that asks for the last hidden
states (the feature drafters: Medusa, EAGLE, Chimera) gets them from here. :func:`run` is the decoder
itself over tokens of one sequence or of several packed together (the batched decoder,
``models/packed_batch.py``: each row's numbers are its own, whatever the other rows).
``HASTEN_LEAN_FORWARD=0`` turns it off.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..kernels import ops
from . import invariant

MODEL_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3")  # inverse frequencies fixed at load time
CAPTURING_HOOKS = "transformers.utils.output_capturing"  # where transformers' hidden-state recorders live


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
    return any((m._forward_hooks or m._forward_pre_hooks) and not _inert(m) for m in modules)


def _inert(module: nn.Module) -> bool:
    """Whether every hook of ``module`` is transformers' own output capturing, which it installs
    for good at the first forward that asks for hidden states and which records nothing outside
    such a forward (without this, one such forward turned the lean path off for the model's life),
    or a hook whose :class:`LayerTap` this forward calls itself (:func:`add_tap`)."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return all(getattr(hook, "__module__", None) == CAPTURING_HOOKS or getattr(hook, MIRRORED, False)
               for hook in hooks)


MIRRORED = "mirrored_by_lean_taps"  # set on a torch hook whose work a LayerTap does on the lean forward


class LayerTap:
    """What a drafter reads of the target's residual stream on the lean forward, where no torch
    hook runs: :func:`run` hands it the input of each of its ``layers`` and then the forward's
    last-layer states. A drafter that also hooks the model's own forward (for the forwards the
    lean one does not take) marks those hooks with :data:`MIRRORED`, so they do not turn the lean
    forward off."""

    layers: tuple[int, ...] = ()

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        """``x`` [N, hidden]: the residual stream entering decoder layer ``layer``, every packed row."""

    def close(self, states: torch.Tensor, keep: torch.Tensor | None) -> None:
        """``states`` [K, hidden]: the final norm's output at the rows ``keep`` ([K] indices into
        the N rows; None: all of them)."""


TAPS = "_hasten_lean_taps"  # the model's attribute listing its LayerTaps


def add_tap(model: PreTrainedModel, tap: LayerTap) -> None:
    setattr(model, TAPS, (*getattr(model, TAPS, ()), tap))


def remove_tap(model: PreTrainedModel, tap: LayerTap) -> None:
    setattr(model, TAPS, tuple(t for t in getattr(model, TAPS, ()) if t is not tap))


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


def _rms_norm(norm: nn.Module, x: torch.Tensor,
              delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm`` (transformers' LlamaRMSNorm) of ``x`` [N, hidden], or of ``x + delta`` (the
    residual stream's add, rounded as transformers' ``residual + out`` rounds it): (the normed
    rows, the stream). On the CPU one kernel call (ops.rms_norm: the model's own forward runs the
    same norm, models/invariant.py), on CUDA the Triton kernel."""
    if delta is not None and x.is_cuda:
        x = x + delta
        delta = None
    if x.is_cuda:
        return invariant.rms_norm(norm, x), x
    return ops.rms_norm(x, norm.weight, norm.variance_epsilon, delta)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Attend = Callable[[int, float, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def run(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
        keep: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder over ``ids`` ([N] tokens of one or several sequences, packed along one token
    dimension) at ``positions`` ([N]): every linear layer is one kernel call for all N rows
    (each row's numbers its own, whatever the others), and ``attend(layer, scale, q, k, v)``
    (q [N, H, D], rotated keys and values [N, H_kv, D]) stores the keys and values where their
    sequences keep them and returns the attention output [N, H, D]. Returns the last-layer
    states [K, hidden] of the rows in ``keep`` ([K] indices; None: every row): the final
    norm's output, what transformers reports as the last hidden states and the LM head reads."""
    inner = model.model
    config = model.config
    count = ids.shape[0]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = inner.rotary_emb
    freqs = positions[:, None].float() * rope.inv_freq  # [N, head_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
    cos = (angles.cos() * rope.attention_scaling).to(model.dtype)  # [N, head_dim]
    sin = (angles.sin() * rope.attention_scaling).to(model.dtype)
    x = inner.embed_tokens(ids)  # [N, hidden]
    taps = getattr(model, TAPS, ())
    layers = inner.layers
    h, x = _rms_norm(layers[0].input_layernorm, x)  # h: the layer's normed input, x: the residual stream
    for index, layer in enumerate(layers):
        for tap in taps:
            if index in tap.layers:
                tap.layer_input(index, x)
        attention = layer.self_attn
        q, k, v = _attention_inputs(attention, h, heads, kv_heads, head_dim, cos, sin)
        out = attend(index, attention.scaling, q, k, v)  # [N, H, D]
        h, x = _rms_norm(layer.post_attention_layernorm, x, attention.o_proj(out.reshape(count, heads * head_dim)))
        delta = _mlp(layer.mlp, h)  # [N, hidden]
        if index + 1 < len(layers):
            h, x = _rms_norm(layers[index + 1].input_layernorm, x, delta)
        else:
            x = x + delta
    if keep is not None:
        x = x.index_select(0, keep)  # [K, hidden]
    states, _ = _rms_norm(inner.norm, x)
    for tap in taps:
        tap.close(states, keep)
    return states


@torch.no_grad()
def forward(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, positions: torch.Tensor,
            mask: torch.Tensor | None, logits_to_keep: int = 0) -> torch.Tensor:
    """One sequence: the model's last-layer states (the final norm's output, which the LM head
    turns into logits and transformers reports as its last hidden states) for ``ids`` ([1, Q])
    at ``positions`` ([1, Q]) after the cached entries, which ``cache`` gains: [Q, hidden], or
    the last ``logits_to_keep`` rows. ``mask``: a tree block's 4D additive mask
    [1, 1, Q, past + Q] (what transformers is given), or None for causal order."""
    length = ids.shape[1]
    past = cache.get_seq_length()
    lists = invariant.key_lists(mask, length, past + length, True, 1, ids.device)[0]  # each row's own keys, in order

    def attend(index: int, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], index)  # [1, H_kv, past + Q, D]
        return invariant.attend(q, keys[0], values[0], lists, scale)  # [Q, H, D]

    keep = torch.arange(length - logits_to_keep, length, device=ids.device) if logits_to_keep else None
    return run(model, ids[0], positions[0], attend, keep)  # [Q or logits_to_keep, hidden]


def _attention_inputs(attention: nn.Module, h: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                      cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries [N, H, D] and keys [N, H_kv, D], and values [N, H_kv, D], of the normed
    input ``h`` [N, hidden] (``cos``/``sin`` [N, D]): one packed product and one rotation for
    queries and keys together where the weights allow (elementwise, so the same bits), else as
    transformers does it."""
    count = h.shape[0]
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    qkv = fused_linear(attention, layers, h)
    if qkv is None:
        q = attention.q_proj(h).view(count, heads, head_dim)
        k = attention.k_proj(h).view(count, kv_heads, head_dim)
        v = attention.v_proj(h).view(count, kv_heads, head_dim)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v
    qkv = qkv.view(count, heads + 2 * kv_heads, head_dim)
    qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)  # [N, H + H_kv, D]
    return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` for ``x`` [N, heads, D]: one kernel call
    with PyTorch's bits on the CPU (ops.rotary), PyTorch's operations elsewhere."""
    if x.is_cuda:
        return x * cos[:, None] + _rotate_half(x) * sin[:, None]
    return ops.rotary(x, cos, sin)


def _mlp(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """transformers' SiLU-gated MLP of ``h`` [N, hidden] (the residual is added by the next
    norm); gate and up in one packed product where the weights allow."""
    fused = fused_linear(mlp, (mlp.gate_proj, mlp.up_proj), h)
    if fused is None:
        return mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
    gate, up = fused.chunk(2, dim=-1)
    return mlp.down_proj(F.silu(gate) * up)
