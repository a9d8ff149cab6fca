"""One cache interface over Hugging Face ``Cache`` objects: ``length``, ``crop`` and ``keep``.

The caches hasten builds grow in place (:class:`GrowingLayer`): transformers' ``DynamicLayer``
concatenates every new block onto the whole cache, a copy of every cached key and value at
every step (what it costs: docs/cpu.md, "The measurements behind the code's choices"). A growing
layer writes the block into spare capacity (:data:`SLACK` entries) and hands attention a view of the filled
part; crop and keep only move its end. Attention reads the same numbers either way.

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


# Entries a layer reserves past what it holds whenever it (re)allocates. A fixed margin keeps
# the memory a cache reports (its allocated storage, see core.stats.cache_bytes) within that
# many entries of what it holds, and a copy of the whole cache then happens once per SLACK
# tokens instead of at every step.
SLACK = 64


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place. ``keys``/``values`` are always the filled
    prefix [batch, kv_heads, length, head_dim] of a larger store; whoever shortens them to a
    prefix of themselves (crop) only moves the end, and any other tensor put there (a batch
    gaining a row) is copied into a new store at the next update."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_store = self._value_store = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, added = self.get_seq_length(), key_states.shape[-2]
        if not self._in_store(length) or length + added > self._key_store.shape[-2]:
            self._move_to_new_store(key_states, value_states, length + added)
        self._key_store[..., length:length + added, :].copy_(key_states)
        self._value_store[..., length:length + added, :].copy_(value_states)
        self.keys = self._key_store[..., : length + added, :]
        self.values = self._value_store[..., : length + added, :]
        return self.keys, self.values

    def _in_store(self, length: int) -> bool:
        """Are keys/values still a prefix of the store (nothing but a crop happened to them)?"""
        if self._key_store is None or length == 0:
            return self._key_store is not None
        return all(tensor.data_ptr() == store.data_ptr() and tensor.stride() == store.stride()
                   and tensor.shape[:-2] == store.shape[:-2]
                   for tensor, store in ((self.keys, self._key_store), (self.values, self._value_store)))

    def _move_to_new_store(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        length = self.get_seq_length()
        capacity = needed + SLACK
        stores = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            store = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))  # [batch, kv_heads, capacity, head_dim]
            if length:
                store[..., :length, :].copy_(old)
            stores.append(store)
        self._key_store, self._value_store = stores

    def reset(self) -> None:
        super().reset()
        self._key_store = self._value_store = None

    def held_bytes(self) -> int:
        """Bytes of the entries held (what hasten reports as KV memory); the spare capacity
        behind them (SLACK entries, and any cropped away since) is left out."""
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes


def new_cache(encoder_decoder: bool) -> Cache:
    """An empty cache of growing layers, one per decoder layer as the model asks. Built
    without a config on purpose: every layer keeps every entry (sliding-window models still
    mask correctly) and can be cropped."""
    self_attention = DynamicCache()
    self_attention.layer_class_to_replicate = GrowingLayer
    if encoder_decoder:
        return EncoderDecoderCache(self_attention, DynamicCache())
    return self_attention


def _self_attention(cache: Cache) -> Cache:
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def check_rollback(cache: Cache, model_name: str) -> None:
    layers = _self_attention(cache).layers
    bad = sorted({type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, GrowingLayer)})
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
    end = start + len(index)
    for layer in _self_attention(cache).layers:
        if layer.is_initialized and layer.keys.numel():
            # index_select copies first, so writing back over the same entries is safe
            layer.keys[..., start:end, :] = layer.keys.index_select(-2, index)
            layer.values[..., start:end, :] = layer.values.index_select(-2, index)
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
