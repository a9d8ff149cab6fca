"""Decoder-layer plumbing of Hugging Face causal LMs: masks, and placeholder positions
whose hidden states are replaced at one layer.

Hidden transfer (Wu et al. 2024) appends placeholder positions after real tokens and,
at an intermediate decoder layer, swaps their hidden states for *pseudo* hidden states
made from a real one (its *anchor*); the layers above then run as usual, so the
placeholders attend to the anchor's context. This works for any causal LM whose decoder
layers form one ``nn.ModuleList`` (Llama, Qwen2, Mistral, Phi-3, GPT-2, GPT-NeoX, ...):
a forward pre-hook on that layer replaces the hidden states for the length of one
forward only. Drafters never see a model-specific branch.

One construction serves training and decoding (:func:`forward_with_placeholders`): the
real tokens keep whatever mask they have (causal for a training sequence, a tree over a
KV cache for verification) and never see a placeholder; placeholder ``j`` of anchor ``a``
sits at position ``pos(a) + 1 + j`` and sees what ``a`` sees, ``a`` itself and the
placeholders ``0 .. j`` of ``a``.

Layer ``L`` means the input of decoder layer ``L``, i.e. ``hidden_states[L]`` of a Hugging
Face forward with ``output_hidden_states=True`` (0: the embeddings).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

# pseudo(h) -> pseudo hidden states: [..., hidden] -> [..., placeholders, hidden]
Transfer = Callable[[torch.Tensor], torch.Tensor]


class UnsupportedArchitecture(ValueError):
    """The model's decoder layers could not be found, so its hidden states cannot be replaced."""


def model_name(model: PreTrainedModel) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def attention_mask(model: PreTrainedModel, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
    """[B, Q, K] bool (query may see key), [B, Q] and [B, K] positions -> the 4D additive
    mask(s) Hugging Face models take. Sliding-window layers also hide keys a window or more
    behind the query, measured in positions (tree depth), not block indices; models mixing
    layer kinds get one mask per kind."""
    window, kinds = sliding_window(model), set(layer_types(model)) - {None} or {"sliding_attention"}

    def additive(mask: torch.Tensor) -> torch.Tensor:  # [B, 1, Q, K]
        low = torch.finfo(model.dtype).min
        return torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(~mask, low)[:, None]

    if window is None or "sliding_attention" not in kinds:
        return additive(allowed)
    near = key_pos[:, None, :].to(allowed.device) > query_pos[:, :, None].to(allowed.device) - window
    sliding = additive(allowed & near)
    if kinds == {"sliding_attention"}:
        return sliding
    return {"full_attention": additive(allowed), "sliding_attention": sliding}


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


def layer_types(model: PreTrainedModel) -> tuple[str | None, ...]:
    """Each layer's kind ("full_attention", "sliding_attention"); () where the config names none."""
    return tuple(getattr(model.config.get_text_config(), "layer_types", None) or ())


def sliding_window(model: PreTrainedModel) -> int | None:
    """The window of the model's sliding-window layers; None where it has none."""
    return getattr(model.config.get_text_config(), "sliding_window", None)


def has_sliding_layers(model: PreTrainedModel) -> bool:
    """Whether some layer attends within a window only (a config with a window and no layer
    kinds slides everywhere)."""
    return sliding_window(model) is not None and "sliding_attention" in (layer_types(model) or ("sliding_attention",))


def llama_layer_settings(model: PreTrainedModel) -> dict:
    """What a Llama-style decoder layer built beside ``model`` (EAGLE-3's) reads from its
    config: MLP width, RMSNorm epsilon, default RoPE's theta and the positions it covers.
    Another RoPE type is refused."""
    config = model.config.get_text_config()
    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {parameters['rope_type']!r} of the target is not supported (default only)")
    hidden = config.hidden_size
    return {"intermediate_size": int(getattr(config, "intermediate_size", None) or 4 * hidden),
            "rms_norm_eps": float(getattr(config, "rms_norm_eps", None) or 1e-6),
            "rope_theta": float(parameters.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0),
            "max_positions": int(getattr(config, "max_position_embeddings", None) or 8192)}


def encoder_width(model: PreTrainedModel) -> int:
    """Width of an encoder-decoder's encoder states (0 for a decoder-only model)."""
    config = model.config
    if not config.is_encoder_decoder:
        return 0
    return int(getattr(config, "d_model", None) or config.hidden_size)


def attention_layout(model: PreTrainedModel) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of the model's attention."""
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim


@dataclass(frozen=True)
class LlamaFamilyParts:
    """What running a Llama-family causal LM layer by layer needs, read from the model once
    (pre-norm attention then MLP; Gemma's "sandwich" layers also normalise each sublayer's output)."""

    layers: nn.ModuleList
    rotary: nn.Module  # rotary_emb(hidden, positions[, layer_type]) -> (cos, sin)
    final_norm: nn.Module
    sandwich: bool  # layers carry pre_/post_feedforward_layernorm
    rotary_by_kind: bool  # rotary_emb takes a layer type (one table per kind of layer)
    layer_types: tuple[str | None, ...]  # per layer: "full_attention", "sliding_attention", or None
    logit_softcap: float | None  # final logits = tanh(logits / cap) * cap


LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
SANDWICH_PARTS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def llama_family_parts(model: PreTrainedModel) -> LlamaFamilyParts:
    """The parts of ``model`` a hand-driven forward calls; UnsupportedArchitecture naming what
    is missing when it is not a Llama-family causal LM."""
    layers, base, config = decoder_layers(model), model.base_model, model.config.get_text_config()
    missing = [name for name in ("rotary_emb", "norm") if not hasattr(base, name)]
    missing += [name for name in LAYER_PARTS if not all(hasattr(layer, name) for layer in layers)]
    if missing or model.get_output_embeddings() is None:
        raise UnsupportedArchitecture(
            f"{model_name(model)!r} is not a Llama-family model (pre-norm attention then MLP): "
            f"it lacks {missing or ['an output head']}")
    kinds = layer_types(model) or (None,) * len(layers)
    return LlamaFamilyParts(
        layers, base.rotary_emb, base.norm,
        sandwich=all(hasattr(layer, name) for layer in layers for name in SANDWICH_PARTS),
        rotary_by_kind="layer_type" in inspect.signature(base.rotary_emb.forward).parameters,
        layer_types=kinds, logit_softcap=getattr(config, "final_logit_softcapping", None))


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


def with_placeholders(allowed: torch.Tensor, positions: torch.Tensor, anchors: torch.Tensor,
                      count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend a forward's layout by ``count`` placeholders per anchor, appended after the
    real queries (anchor by anchor, in causal order within each anchor).

    ``allowed`` [B, Q, K]: which keys each real query sees, the Q real keys last (cached
    keys, if any, first); ``positions`` [B, Q] of the real queries; ``anchors`` [B, A]
    query indices. Every anchor must see itself. Returns ``allowed`` [B, Q + A*count,
    K + A*count] and the queries' ``positions`` [B, Q + A*count]."""
    batch, queries, keys = allowed.shape
    riders = anchors.shape[1] * count
    rows = torch.arange(batch, device=allowed.device)[:, None]
    seen_by_anchor = allowed[rows, anchors]  # [B, A, K]
    rider_sees_real = seen_by_anchor[:, :, None].expand(-1, -1, count, -1).reshape(batch, riders, keys)
    own = torch.ones(count, count, dtype=torch.bool, device=allowed.device).tril()
    rider_sees_riders = torch.block_diag(*[own] * anchors.shape[1]).expand(batch, -1, -1)  # [B, A*count, A*count]
    real_rows = torch.cat([allowed, allowed.new_zeros(batch, queries, riders)], dim=2)  # never see a rider
    rider_rows = torch.cat([rider_sees_real, rider_sees_riders], dim=2)
    slot = torch.arange(1, count + 1, device=positions.device)
    rider_pos = (positions[rows, anchors][:, :, None] + slot).reshape(batch, riders)  # pos(a) + 1 + j
    return torch.cat([real_rows, rider_rows], dim=1), torch.cat([positions, rider_pos], dim=1)


def _narrowed(value, real: int, total: int):
    """A decoder layer's input cut from ``total`` positions to the first ``real`` ones:
    a 4D attention mask [B, 1, total, keys] loses the last ``total - real`` queries and
    keys, sequence-long tensors (cache positions [total], position ids [B, total], rotary
    cos/sin [B, total, d]) their tail; anything else passes unchanged."""
    if isinstance(value, tuple):
        return tuple(_narrowed(v, real, total) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.ndim == 4 and value.shape[-2] == total:
        return value[..., :real, : value.shape[-1] - (total - real)]
    if value.ndim == 1 and value.shape[0] == total:
        return value[:real]
    if value.ndim in (2, 3) and value.shape[1] == total:
        return value[:, :real]
    return value


@contextmanager
def _real_only_below(model: PreTrainedModel, layer: int, real: int, total: int) -> Iterator[None]:
    """Decoder layers below ``layer`` run on the first ``real`` of ``total`` positions:
    whatever the placeholders would compute there is replaced at ``layer``, so skipping
    it changes nothing but the cost. (Their cache layers then get no placeholder entries.)"""
    def narrow(module, args, kwargs):
        narrowed = {name: _narrowed(value, real, total) for name, value in kwargs.items()}
        if args:
            return (args[0][:, :real], *(_narrowed(a, real, total) for a in args[1:])), narrowed
        return args, {**narrowed, "hidden_states": kwargs["hidden_states"][:, :real]}

    handles = [below.register_forward_pre_hook(narrow, with_kwargs=True) for below in decoder_layers(model)[:layer]]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def forward_with_placeholders(model: PreTrainedModel, ids: torch.Tensor, allowed: torch.Tensor,
                              positions: torch.Tensor, anchors: torch.Tensor, count: int, layer: int,
                              transfer: Transfer, past_positions: torch.Tensor | None = None, **kwargs):
    """Run the real tokens ``ids`` ([B, Q], see :func:`with_placeholders` for ``allowed``,
    ``positions`` and ``anchors``) plus ``count`` placeholders per anchor whose input to
    decoder layer ``layer`` is ``transfer(h_a)``, ``h_a`` being the anchor's input there;
    layers below ``layer`` never run the placeholders. ``past_positions`` ([P]): positions
    of the P cached keys ``allowed`` starts with. ``kwargs`` go to the model (a cache,
    ``output_hidden_states``, ...); gradients flow into ``transfer``. Returns the model's
    output: its logits ([B, Q + A*count, vocab]) hold the real positions, then placeholder
    ``j`` of anchor ``i`` at ``Q + i*count + j``."""
    batch, queries = ids.shape
    riders = anchors.shape[1] * count
    allowed, positions = with_placeholders(allowed, positions, anchors, count)
    key_pos = positions if past_positions is None else torch.cat(
        [past_positions.to(positions.device).expand(batch, -1), positions], dim=1)
    filler = torch.zeros(batch, riders, dtype=ids.dtype, device=ids.device)  # embedded, then never read
    rows = torch.arange(batch, device=ids.device)[:, None]

    def replace(hidden: torch.Tensor) -> torch.Tensor:  # [B, Q (+ A*count at layer 0), hidden]
        pseudo = transfer(hidden[rows, anchors])  # [B, A, count, hidden]
        return torch.cat([hidden[:, :queries], pseudo.reshape(batch, riders, -1).to(hidden.dtype)], dim=1)

    with _real_only_below(model, layer, queries, queries + riders), replaced_hidden(model, layer, replace):
        return model(input_ids=torch.cat([ids, filler], dim=1), position_ids=positions,
                     attention_mask=attention_mask(model, allowed, positions, key_pos), **kwargs)


def placeholder_logits_batch(model: PreTrainedModel, ids: torch.Tensor, anchors: torch.Tensor, placeholders: int,
                             layer: int, transfer: Transfer) -> torch.Tensor:
    """Training form: for every row of ``ids`` ([B, T]) and every anchor position ``a`` in
    ``anchors`` ([B, A]), ``placeholders`` positions a + 1 .. a + k that see the real
    tokens up to ``a`` and their own earlier placeholders, all in one forward. Returns
    [B, A, k, vocab] logits."""
    batch, length = ids.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril().expand(batch, -1, -1)
    positions = torch.arange(length, device=ids.device).expand(batch, -1)
    out = forward_with_placeholders(model, ids, causal, positions, anchors, placeholders, layer, transfer,
                                    use_cache=False)
    return out.logits[:, length:].reshape(batch, anchors.shape[1], placeholders, -1)


# ---- the queries of a forward -----------------------------------------------------------------
_CAPTURE = "hasten_capture_queries"
_captured: list[dict[int, torch.Tensor]] = []  # the innermost capture's store, while one runs


def _capturing_attention(module, query, key, value, attention_mask, **kwargs):
    if _captured:
        store = _captured[-1]
        store[module.layer_idx] = query[0, :, -store.count:].detach()  # [heads, count, head_dim]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class _Queries(dict):
    count: int = 1


@contextmanager
def last_queries(model: PreTrainedModel, count: int = 1) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block, the model's forwards record each layer's post-RoPE queries of the
    last ``count`` positions (``{layer: [heads, count, head_dim]}``, batch row 0). The model runs through
    transformers' sdpa attention meanwhile (registered under its own name, so outputs are
    those of sdpa), and gets its own attention implementation back afterwards."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_CAPTURE, _capturing_attention)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    before = model.config._attn_implementation
    store = _Queries()
    store.count = count
    _captured.append(store)
    model.set_attn_implementation(_CAPTURE)
    try:
        yield store
    finally:
        model.set_attn_implementation(before)
        _captured.pop()
