"""How the verifier's tree block attends: one attention path, chosen once per generation.

A tree block of Q tokens after P cached ones needs a [Q, P + Q] mask, and a custom mask
keeps most attention kernels off their fastest path although the [Q, P] part is all
visible. :class:`HybridTree` splits the work (as LongSpec's hybrid tree attention does):

* the cached prefix through the fused kernel with no mask at all, which also returns each
  query's log-sum-exp of scores;
* the tree part, Q x Q, with its mask, in plain tensor ops;
* the two merged exactly by their log-sum-exps:
  ``out = out_p * exp(lse_p - lse) + out_t * exp(lse_t - lse)``, ``lse = logaddexp(lse_p, lse_t)``.

The result equals the masked attention to float tolerance. A layer whose prefix is not all
visible (a sliding window that already hides part of it) takes the masked path, as does
any call that is no tree verification (a prefill, one token), so switching a model to
this path changes nothing else. :class:`MaskedTree` is today's single masked call.

Grouped-query models on the CPU: transformers' sdpa copies every cached key and value once
per query group whenever a mask is given (``repeat_kv``), which a verification block always
has; at 16k cached tokens that copy cost more than the attention itself. Both paths read
the grouped KV heads in place instead (:func:`kv_heads_in_place` around a long block's
forward; the hybrid path folds each group's queries into one KV head's query rows).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import PreTrainedModel

HYBRID = "hasten_hybrid_tree"
GROUPED = "hasten_sdpa_grouped"
# Cached entries from which reading grouped KV heads in place repays switching the model's
# attention function for one forward: the switch costs a fixed time, the copy it saves grows with
# the cache (docs/cpu.md, "The measurements behind the code's choices").
IN_PLACE_FROM = 512


class MaskedTree:
    """The whole block with one 4D mask: the model's own attention implementation."""

    name = "mask"

    @contextmanager
    def active(self, model: PreTrainedModel) -> Iterator[None]:
        yield


class HybridTree(MaskedTree):
    """Prefix through the fused kernel, tree part masked, merged by log-sum-exp."""

    name = "hybrid"

    @contextmanager
    def active(self, model: PreTrainedModel) -> Iterator[None]:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(HYBRID, hybrid_attention)
        AttentionMaskInterface.register(HYBRID, sdpa_mask)
        before = model.config._attn_implementation
        model.set_attn_implementation(HYBRID)
        try:
            yield
        finally:
            model.set_attn_implementation(before)


ATTENTION_PATHS = {path.name: path for path in (MaskedTree, HybridTree)}


@contextmanager
def kv_heads_in_place(model: PreTrainedModel, block: int, cached: int) -> Iterator[None]:
    """Around one forward of ``block`` tokens after ``cached`` entries: a CPU model on
    transformers' sdpa whose grouped KV heads would be copied for the block's mask reads
    them in place (:func:`grouped_attention`). Anything else runs as it is."""
    config = model.config.get_text_config()
    grouped = getattr(config, "num_key_value_heads", None) not in (None, config.num_attention_heads)
    if (block < 2 or cached < IN_PLACE_FROM or not grouped or model.device.type != "cpu"
            or model.config._attn_implementation != "sdpa"):
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, sdpa_mask)
    model.set_attn_implementation(GROUPED)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' sdpa, except that a masked call of a grouped-query layer hands torch the
    KV heads as they are (``enable_gqa``; torch's CPU kernel takes a mask with it) instead of
    a copy repeated per group. query [B, H, Q, D]; key/value [B, H_kv, K, D] -> ([B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.shape[1] == key.shape[1] or not torch.is_tensor(attention_mask) or attention_mask.dim() != 4
            or dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[2]]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=True)  # [B, H, Q, D]
    return out.transpose(1, 2).contiguous(), None


def attention_path(name: str | MaskedTree) -> MaskedTree:
    if isinstance(name, MaskedTree):
        return name
    if name not in ATTENTION_PATHS:
        raise ValueError(f"tree_attention must be one of {sorted(ATTENTION_PATHS)}, got {name!r}")
    return ATTENTION_PATHS[name]()


def hybrid_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     **kwargs):
    """The attention function transformers calls per layer. query [B, H, Q, D]; key/value
    [B, H_kv, P + Q, D]; attention_mask additive [B, 1, Q, P + Q]. Returns ([B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    queries, keys = query.shape[2], key.shape[2]
    past = keys - queries
    masked = (attention_mask is None or not torch.is_tensor(attention_mask) or attention_mask.dim() != 4
              or queries == 1 or past <= 0 or kwargs.get("softcap") is not None
              or kwargs.get("position_bias") is not None or (attention_mask[..., :past] != 0).any())
    if masked:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    # the prefix needs no mask, so each KV head's group of query heads can be folded into its
    # query rows: the cache is read once, as it lies (query head h uses KV head h // group)
    folded = query.reshape(batch, kv_heads, group * queries, dim)  # [B, H_kv, G * Q, D]
    out_prefix, lse_prefix = prefix_attention(folded, key[:, :, :past], value[:, :, :past], scale)
    out_prefix = out_prefix.reshape(batch, heads, queries, dim)  # [B, H, Q, D]
    lse_prefix = lse_prefix.reshape(batch, heads, queries)
    tree_keys, tree_values = repeat_kv(key[:, :, past:], group), repeat_kv(value[:, :, past:], group)  # [B, H, Q, D]
    scores = (query @ tree_keys.transpose(-1, -2)).float() * scale + attention_mask[..., past:].float()
    lse_tree = scores.logsumexp(-1)  # [B, H, Q]
    out_tree = scores.softmax(-1).to(value.dtype) @ tree_values  # [B, H, Q, D]
    lse = torch.logaddexp(lse_prefix, lse_tree)
    out = (out_prefix.float() * (lse_prefix - lse).exp()[..., None]
           + out_tree.float() * (lse_tree - lse).exp()[..., None]).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def prefix_attention(query, key, value, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every query over the whole prefix: (out [B, H, Q, D], lse [B, H, Q])."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=None, scale=scale)[:2]
        return out, lse.float()
    if query.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, 0.0, False, scale=scale)[:2]
        return out, lse[..., : query.shape[2]].float()
    scores = (query @ key.transpose(-1, -2)).float() * scale  # other devices: plain ops
    return (scores.softmax(-1).to(value.dtype) @ value), scores.logsumexp(-1)
