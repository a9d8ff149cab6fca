"""Hugging Face transformers as a :class:`~hasten.core.runtime.Runtime`.

Everything the engine asks of a ``PreTrainedModel`` is answered here (its vocabulary, its
context from the config, its EOS ids from the generation config, what its attention can do),
so no code above the models floor reads a Hugging Face config. :func:`runtime_of` is the one
place that turns what a caller passes (a ``PreTrainedModel`` or any runtime) into a runtime.
"""
from __future__ import annotations

import hashlib

import torch
from transformers import PreTrainedModel

from ..core.runtime import Capability, Runtime
from . import invariant, lean, vlm
from .adapter import ModelAdapter, decoder_start_token, vocab_size
from .attention import MaskedTree
from .batch import BatchAdapter
from .packed_batch import PackedBatch
from .layers import model_name

# Config names of the number of positions a model was built for (learned position
# embeddings fail beyond it; rotary ones drift off what they were trained on).
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def max_positions(model: PreTrainedModel) -> int | None:
    """The positions the model's config allows, or None where it sets no limit (T5)."""
    config = model.config.get_text_config()
    for name in POSITION_LIMITS:
        limit = getattr(config, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
    return None


class HuggingFaceRuntime(Runtime):
    """A transformers model in PyTorch: every capability hasten's drafters use, except
    trees and riders on encoder-decoders (which verify chains) and query capture where the
    model's attention does not go through transformers' attention interface (Falcon, T5)."""

    name = "Hugging Face"
    unbatched = frozenset({Capability.RIDERS})  # BatchAdapter verifies blocks without rider positions

    def __init__(self, model: PreTrainedModel):
        self.model = model
        # a CPU model runs hasten's forwards on its row-invariant kernels, so that every position
        # of a block gets a one-token step's numbers (models/invariant.py); before the cost key is
        # read, since its layers' class names are part of it
        self.invariant = invariant.prepare(model)
        self.label = model_name(model)
        self.source = model.config._name_or_path
        self.encoder_decoder = bool(model.config.is_encoder_decoder)
        self.vocab_size = vocab_size(model)
        self.context_length = max_positions(model)
        self.device = model.device
        capabilities = {Capability.FEATURES, Capability.MODULES, Capability.KV_READ, Capability.PROMPT_LOGITS}
        if not self.encoder_decoder:
            capabilities |= {Capability.TREES, Capability.RIDERS}
        if vlm.is_vision_language(model):
            capabilities.add(Capability.IMAGES)
        if type(model)._supports_attention_backend:  # attention through AttentionInterface: queries can be captured
            capabilities.add(Capability.QUERY_CAPTURE)
        self.capabilities = frozenset(capabilities)

    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)

    def check_prompt_inputs(self, input_ids: torch.Tensor, model_inputs: dict) -> None:
        vlm.check_model_inputs(self.model, input_ids, model_inputs)

    def decoder_start(self) -> list[int]:
        return [decoder_start_token(self.model)] if self.encoder_decoder else []

    def session(self, tree_attention: MaskedTree | None = None) -> ModelAdapter:
        return ModelAdapter(self.model, tree_attention)

    def batch(self, max_rows: int, needs: frozenset[Capability] = frozenset(),
              kv_cache_bytes: int | None = None) -> BatchAdapter | PackedBatch:
        """Rows packed along one token dimension on the lean forward where the model takes it
        (models/packed_batch.py) and the drafter needs no more than it serves (features, the
        lent LM head and embeddings, trees); a drafter that reads the target's KV cache or its
        attention queries gets padded rows through the model's own forward (models/batch.py; it
        pads, and ``kv_cache_bytes`` does not bound it). Decided once per batch. (A hook on the
        model that the lean forward does not mirror sends each packed row through the model's
        own forward: the same numbers, slower; models/lean.py.)"""
        if lean.eligible(self.model) and needs <= PackedBatch.serves:
            return PackedBatch(self.model, kv_cache_bytes)
        return BatchAdapter(self.model)

    def warm_up(self, tokens: int = 8) -> None:
        """A short prefill. A model's first forward packs its weights for hasten's kernels
        (models/invariant.py), fuses the lean forward's and builds the kernels, so a first prefill
        costs several later ones (docs/cpu.md, "The measurements behind the code's choices")."""
        tokens = min(tokens, self.context_length or tokens)
        ids = [3 + (7 * i) % max(self.vocab_size - 3, 1) for i in range(tokens)]  # any ids will do
        with torch.no_grad():
            self.session().start(torch.tensor([ids], device=self.device))

    def cost_key(self) -> dict:
        model = self.model
        config = model.config.to_json_string(use_diff=False)
        return {
            "model": model.config._name_or_path or type(model).__name__,
            "config": hashlib.sha256(config.encode()).hexdigest()[:16],
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(model.dtype).removeprefix("torch."),
            # an int8-quantized model keeps float32 as its dtype but runs other kernels
            "linear": sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}),
            "lean_forward": lean.eligible(model),  # models/lean.py: fewer operations around the same layers
            # models/invariant.py: which instruction path its kernels take (the bfloat16 dot product or not)
            "kernels": invariant.kernel_path() if self.invariant else None,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def runtime_of(model) -> Runtime:
    """The runtime that runs ``model``: a runtime is itself; a transformers model gets a
    :class:`HuggingFaceRuntime`; anything else is a TypeError."""
    if isinstance(model, Runtime):
        return model
    if isinstance(model, PreTrainedModel):
        return HuggingFaceRuntime(model)
    raise TypeError(f"model must be a transformers PreTrainedModel or a hasten Runtime (such as "
                    f"hasten.models.llamacpp.LlamaCppModel), got {type(model).__name__}")
