"""Diffusion language models: a masked-diffusion sampler over unmodified Hugging Face models used
bidirectionally, with cache and attention policies chosen once.

    from hasten.dlm import generate, DKVCache
    out = generate(model, input_ids, gen_length=128, block_length=32, steps=128, cache=DKVCache())
    out.sequences, out.stats.tokens_recomputed

Policies: ``NoCache`` (the reference), ``DKVCache`` (dKV-Cache, by its reference code's per-block
schedule; ``variant="greedy"`` with ``remasking="random_order"``), ``SparseD`` (head-wise block-sparse
attention with isolated selection, reused after full-attention early steps; ``SparseD(cache=DKVCache())``
runs it on a cache's forwards) and the peers ``FastDLLMPrefix`` and ``FastDLLMDual`` (Fast-dLLM);
``threshold=`` turns on confidence-threshold parallel decoding.
See docs/dlm.md.
"""
from .policies import CachePolicy, DKVCache, FastDLLMDual, FastDLLMPrefix, NoCache, describe
from .sampler import DLMOutput, DLMStats, find_mask_token_id, generate
from .sparse import SparseD

__all__ = ["CachePolicy", "DKVCache", "DLMOutput", "DLMStats", "FastDLLMDual", "FastDLLMPrefix", "NoCache", "SparseD",
           "describe", "find_mask_token_id", "generate"]
