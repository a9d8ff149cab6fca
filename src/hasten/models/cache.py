"""One cache interface over Hugging Face ``Cache`` objects: ``length``, ``crop`` and ``keep``.

Speculation writes KV entries for draft tokens that may be rejected, so every cache
hasten drives must be able to forget a suffix (``crop``) and, for trees, keep an
arbitrary subset of the newest entries (``keep``). Only plain growing layers can do
that exactly; anything else (sliding windows that already dropped entries, recurrent
or linear-attention state) is refused up front by :func:`check_rollback`.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache


class CacheRollbackError(ValueError):
    """The model's cache cannot be rolled back, so speculation would be wrong."""


def new_cache(encoder_decoder: bool) -> Cache:
    # Built without a config on purpose: that gives plain DynamicLayers everywhere, which
    # keep every entry (sliding-window models still mask correctly) and can be cropped.
    if encoder_decoder:
        return EncoderDecoderCache(DynamicCache(), DynamicCache())
    return DynamicCache()


def _self_attention(cache: Cache) -> Cache:
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def check_rollback(cache: Cache, model_name: str) -> None:
    layers = _self_attention(cache).layers
    bad = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if bad:
        raise CacheRollbackError(
            f"model {model_name!r} uses cache layers {bad} that cannot be rolled back; "
            "hasten needs a plain growing KV cache to discard rejected draft tokens"
        )


def length(cache: Cache) -> int:
    return _self_attention(cache).get_seq_length()


def crop(cache: Cache, new_length: int) -> None:
    """Forget every entry at position >= new_length."""
    for layer in _self_attention(cache).layers:
        if layer.is_initialized and layer.keys.numel():
            layer.keys = layer.keys[..., :new_length, :]  # [batch, kv_heads, seq, head_dim]
            layer.values = layer.values[..., :new_length, :]


def keep(cache: Cache, start: int, offsets: torch.Tensor) -> None:
    """Keep positions < start, then the entries at ``start + offsets`` moved into place
    (in the order given), and forget the rest. Used to compact an accepted tree path."""
    index = offsets + start  # [kept]
    for layer in _self_attention(cache).layers:
        if layer.is_initialized and layer.keys.numel():
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, index)], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, index)], dim=-2)
