"""The EAGLE-3 layer (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"), computed as vLLM's ``llama_eagle3`` computes it, so
that ``hasten export`` is a renaming-free copy (:mod:`hasten.export.eagle3`).

Inputs: the target's residual stream entering three of its layers (``aux_layers``: low, mid,
high; vLLM's default ``(2, N // 2, N - 3)``), concatenated in that order and projected by
``fc`` [H, 3 H_target]; the next token's embedding (the target's own embeddings). One Llama
decoder layer whose attention reads ``[input_layernorm(embed); hidden_norm(hidden)]`` (width
2H), with the un-normalised ``hidden`` as its residual, then a SwiGLU MLP. Its output before
the final ``norm`` (the "pre-norm" state) is what the next draft step reads instead of
``fc(aux)``; ``lm_head(norm(.))`` scores a draft vocabulary (``draft_tokens``: the most
frequent target tokens, ascending), mapped back to target ids through ``d2t`` (draft id ->
target id minus draft id, vLLM's convention) and ``t2d`` (target id -> in the draft vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..models.layers import attention_layout, llama_layer_settings, num_layers
from .nn import KVCache, RMSNorm, rotary, rotate
from .trained import ModuleConfig, TrainedModule


@dataclass(frozen=True)
class Eagle3Config(ModuleConfig):
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 0
    intermediate_size: int = 0
    # the residual stream entering these target layers (Hugging Face's hidden_states[k]; vLLM's
    # eagle_aux_hidden_state_layer_ids), low to high: fc reads them concatenated in this order
    aux_layers: tuple[int, ...] = ()
    draft_tokens: tuple[int, ...] = ()  # target ids of the draft vocabulary, ascending; (): all of them
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 8192  # the target's max_position_embeddings (an exported config repeats it)


def default_aux_layers(layers: int) -> tuple[int, ...]:
    """vLLM's default (2, N // 2, N - 3) from 7 layers on; below, where that repeats a layer (vLLM
    concatenates the features of distinct layers in layer order), the last three (N - 3, N - 2, N - 1)."""
    if layers >= 7:
        return 2, layers // 2, layers - 3
    return max(layers - 3, 0), max(layers - 2, 0), layers - 1


def _children(**modules: nn.Module) -> nn.Module:
    """A plain container, so that parameter names read as vLLM's (``midlayer.self_attn.q_proj``)."""
    container = nn.Module()
    for name, module in modules.items():
        container.add_module(name, module)
    return container


class Eagle3Layer(TrainedModule):
    Config = Eagle3Config
    name = "eagle3"

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        H, heads, kv, hd, eps = config.hidden_size, config.heads, config.kv_heads, config.head_dim, config.rms_norm_eps
        linear = lambda inputs, outputs: nn.Linear(inputs, outputs, bias=False)  # noqa: E731
        self.fc = linear(len(config.aux_layers) * H, H)
        self.midlayer = _children(
            self_attn=_children(q_proj=linear(2 * H, heads * hd), k_proj=linear(2 * H, kv * hd),
                                v_proj=linear(2 * H, kv * hd), o_proj=linear(heads * hd, H)),
            mlp=_children(gate_proj=linear(H, config.intermediate_size), up_proj=linear(H, config.intermediate_size),
                          down_proj=linear(config.intermediate_size, H)),
            input_layernorm=RMSNorm(H, eps), hidden_norm=RMSNorm(H, eps), post_attention_layernorm=RMSNorm(H, eps))
        self.norm = RMSNorm(H, eps)
        draft = torch.tensor(config.draft_tokens or range(config.vocab_size), dtype=torch.long)  # [Vd] target ids
        self.lm_head = linear(H, len(draft))
        # vLLM's d2t (offsets) and t2d (membership); rebuilt from the config, never stored as weights
        self.register_buffer("d2t", draft - torch.arange(len(draft)), persistent=False)  # [Vd]
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[draft] = True
        self.register_buffer("t2d", t2d, persistent=False)  # [V]

    @classmethod
    def for_target(cls, target: PreTrainedModel, draft_tokens: tuple[int, ...] = (),
                   intermediate_size: int = 0, aux_layers: tuple[int, ...] = ()) -> "Eagle3Layer":
        heads, kv_heads, head_dim = attention_layout(target)
        layer = llama_layer_settings(target)
        sizes = cls.target_sizes(target)
        embed = target.get_input_embeddings().weight.shape[1]
        if embed != sizes["hidden_size"]:
            raise ValueError(f"eagle3 needs embeddings as wide as the hidden states ({embed} != {sizes['hidden_size']})")
        return cls(cls.Config(
            **sizes, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=intermediate_size or layer["intermediate_size"],
            aux_layers=tuple(aux_layers) or default_aux_layers(num_layers(target)), draft_tokens=tuple(draft_tokens),
            rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer["rope_theta"], max_positions=layer["max_positions"]))

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., 3 H_target] the target's low/mid/high features -> [..., H] the layer's hidden input."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor | None, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """hidden: [B, n, H] fc(aux) or a previous step's pre-norm output; token_embeds: [B, n, H]
        the next tokens' embeddings, at ``positions`` [B, n] -> the pre-norm outputs [B, n, H].
        With a cache the n positions' keys and values go into it at ``start``; visible:
        [B, n, start + n] bool (None: everything)."""
        return self.attend_and_mix(hidden, token_embeds, positions, lambda q, k, v: self._attend(q, k, v, visible,
                                                                                                   cache, start))

    def forward_rows(self, hidden: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                     rows: list[tuple[KVCache, int, int, torch.Tensor | None]]) -> torch.Tensor:
        """Several generations' positions packed along one token dimension: hidden, token_embeds
        [1, N, H] and positions [1, N], each generation's ``(cache, start, n, visible)`` in order (n
        of its positions, keys and values into its cache at ``start``, visible as in
        :meth:`forward`, [1, n, start + n] or None), the n summing to N -> [1, N, H]. Each attends
        over its own cache alone, and its outputs are what :meth:`forward` gives it alone where
        the layer's products are row-invariant (hasten's kernels)."""
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [1, heads, N, hd] ...
            outs, at = [], 0
            for cache, start, n, visible in rows:
                part = slice(at, at + n)
                outs.append(self._attend(q[:, :, part].contiguous(), k[:, :, part].contiguous(),
                                         v[:, :, part].contiguous(), visible, cache, start))  # [1, heads, n, hd]
                at += n
            return torch.cat(outs, 2)

        return self.attend_and_mix(hidden, token_embeds, positions, attend)

    def attend_and_mix(self, hidden: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                       attend) -> torch.Tensor:
        """The layer with ``attend(q, k, v)`` -> [B, heads, n, head_dim] as its attention (training
        passes its own: the training-time test's masks)."""
        c, mid = self.config, self.midlayer
        batch, n, _ = hidden.shape
        x = torch.cat([mid.input_layernorm(token_embeds.to(hidden.dtype)), mid.hidden_norm(hidden)], -1)  # [B, n, 2H]
        attn = mid.self_attn
        q = attn.q_proj(x).view(batch, n, c.heads, c.head_dim).transpose(1, 2)  # [B, heads, n, hd]
        k = attn.k_proj(x).view(batch, n, c.kv_heads, c.head_dim).transpose(1, 2)  # [B, kv, n, hd]
        v = attn.v_proj(x).view(batch, n, c.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, c.head_dim, x.dtype, c.rope_theta)
        attended = attend(rotate(q, cos, sin), rotate(k, cos, sin), v)  # [B, heads, n, hd]
        residual = hidden + attn.o_proj(attended.transpose(1, 2).reshape(batch, n, c.heads * c.head_dim))
        mlp = mid.mlp
        normed = mid.post_attention_layernorm(residual)
        return residual + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))

    def _attend(self, q, k, v, visible, cache, start) -> torch.Tensor:
        if cache is not None:
            k, v = cache.write(start, k, v)  # [B, kv, start + n, hd]
        mask = None if visible is None else visible[:, None]  # [B, 1, n, start + n]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm outputs -> [..., Vd] scores of the draft vocabulary."""
        return self.lm_head(self.norm(prenorm))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (vLLM: ``arange(Vd) + d2t``)."""
        return draft_ids + self.d2t[draft_ids]
