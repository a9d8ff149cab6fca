"""Forwards whose every position gets a one-token step's numbers, by construction: every CPU
model in float32, bfloat16 or float16.

Verifying a block of k draft tokens runs one forward over k positions where plain decoding runs
k forwards of one. Library kernels choose their blocking, their vector path and their split of
a reduction by the number of rows, so the k rows come out rounded otherwise than k lone rows
(oneDNN's products do, from 2 rows on); where the top two logits are that close, the argmax flips
and speculative decoding writes other text than plain decoding (how often: docs/cpu.md, "The
measurements behind the code's choices"). Here the two reductions whose order a library picks, the linear layers
and attention, run hasten's own kernels (``hasten/kernels/invariant.c``), which fix each output
element's sequence of operations whatever the rows, threads or instruction set:

* :class:`InvariantLinear`: every ``nn.Linear`` (the LM head included) on a packed copy of its
  weight; each output is a float32 fused multiply-add chain over the inputs in order (bfloat16
  layers, where the CPU has them: the AVX512-BF16 dot product's chain over input pairs, or AMX
  tiles' over chunks of 32 inputs; one of them for every layer of the process, so a lone row
  and a batch's row share their bits);
* :func:`invariant_attention`, registered as transformers' attention implementation
  ``hasten_invariant``: each query row attends over its own list of keys in order (a chain
  row over the cache and the block up to itself, a tree row over the cache and its
  ancestors), so a row gets exactly what a one-token step at that position gets.

The rest of a forward is PyTorch's own element-wise operations and row-wise norms, which
compute each row alone (tests/test_invariant.py checks a block's every position against
one-token steps, bit for bit, on tiny Llama, Qwen2, Gemma and GPT-2 models in every dtype).
The kernels are also the faster path here: on SmolLM2-135M a float32 step and a block of 6
cost less than on oneDNN's packed weights, and a bfloat16 step half of PyTorch's (docs/cpu.md).

Not prepared: models whose attention is another of hasten's (the int8 row-by-row attention of
models/quantize.py keeps its own, and its linear layers are not ``nn.Linear``), models whose
attention does not go through transformers' attention interface (their linear layers still
run the kernels, without the guarantee), and models whose weights' packed copy would take more
than a quarter of the available memory.

On CUDA the same three things run as Triton kernels (``hasten/kernels/cuda.py``: fixed tiles, no
split reductions), and transformers' Llama and Qwen2 RMS norms run one as well, since PyTorch's
CUDA reductions choose their launch by the tensor's shape. They have run only in Triton's CPU
interpreter so far (no GPU was lent since they were written), so CUDA models take them only with
``HASTEN_CUDA_INVARIANT=1`` (scripts/gpu-check sets it); otherwise a CUDA model runs PyTorch's
kernels as before, without the guarantee.

Outside hasten's forwards (a Hugging Face ``generate`` of the same model object, training)
both fall back to PyTorch (``F.linear`` and sdpa), so the model is the user's own. Where the
kernels cannot be built (no C compiler), :func:`prepare` returns False and
:func:`unavailable` says why; the model then runs on PyTorch's kernels without the guarantee.
``HASTEN_INVARIANT=0`` turns the path off (for comparisons).
"""
from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from .. import kernels
from ..kernels import cuda, ops
from . import forwards

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF = (torch.bfloat16, torch.float16)
ATTENTION = "hasten_invariant"
_masks = threading.local()  # .last: (mask tensor, rows, KeyLists per batch row) of the latest call


def unavailable(model: PreTrainedModel | None = None) -> str | None:
    """Why a model would not get invariant forwards (None if it would)."""
    if os.environ.get("HASTEN_INVARIANT", "1") == "0":
        return "HASTEN_INVARIANT=0"
    if model is not None:
        if model.device.type not in ("cpu", "cuda"):
            return f"the model is on {model.device.type}, and hasten's invariant kernels run on the CPU and CUDA"
        if model.dtype not in DTYPES:
            return f"{model.dtype} models keep their own kernels"
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in (None, "sdpa", "eager", ATTENTION):
            return f"the model's attention is {attention!r}, which it keeps"
        if model.device.type == "cuda":
            if os.environ.get("HASTEN_CUDA_INVARIANT") != "1":  # opt-in until a GPU run has checked them
                return "the CUDA kernels are opt-in (HASTEN_CUDA_INVARIANT=1) until a GPU run has checked them"
            return cuda.available()
        if not is_prepared(model) and not _room_for_copies(model):
            return "a packed copy of its linear weights would take more than a quarter of the available memory"
    return kernels.unavailable()


BF16_LAYOUT_NAMES = {"amx": "AMX tiles", "pairs": "AVX512-BF16 dot product"}


def kernel_path() -> str:
    """The instruction path the kernels take here, in words (they are the same bits across
    paths, except the bfloat16 dot product's and AMX tiles': docs/fidelity.md, "Precision")."""
    path = kernels.instruction_path()
    layout = "fma" if path == "unavailable" else ops.bf16_layout()
    return f"{path} (bfloat16 layers: {BF16_LAYOUT_NAMES[layout]})" if layout in BF16_LAYOUT_NAMES else path


def eligible(model: PreTrainedModel) -> bool:
    return unavailable(model) is None


def _linear_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) in (nn.Linear, Conv1D, InvariantLinear, InvariantConv1D)]


def _room_for_copies(model: nn.Module) -> bool:
    needed = sum(m.weight.numel() * m.weight.element_size() for m in _linear_layers(model))
    available = _available_bytes()
    return available is None or needed <= available // 4


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` whose forwards inside hasten run the row-invariant kernel on a packed copy
    of its weight (made on first use, again if the weight changes); ``F.linear`` outside."""

    _packed: ops.Packed | None
    _packed_of: tuple[int, int] | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if forwards.is_active() and x.dtype == self.weight.dtype:
            return apply_linear(x, self.kernel_weight(), self.bias)
        return F.linear(x, self.weight, self.bias)

    def kernel_weight(self) -> ops.Packed | torch.Tensor:
        """The weight as the kernel reads it: packed once on the CPU, as it is on CUDA."""
        weight = self.weight
        if weight.is_cuda:
            return weight
        key = (weight.data_ptr(), weight._version)
        if self._packed is None or self._packed_of != key:
            self._packed = ops.pack(weight.detach())
            self._packed_of = key
        return self._packed


class InvariantConv1D(Conv1D):
    """GPT-2's ``Conv1D`` (weight [in, out]) with :class:`InvariantLinear`'s two paths; set on a
    model's Conv1D layers by :func:`prepare` (the class changes, nothing else)."""

    _packed: ops.Packed | None
    _packed_of: tuple[int, int] | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if forwards.is_active() and x.dtype == self.weight.dtype:
            return apply_linear(x, self.kernel_weight(), self.bias)
        return super().forward(x)

    def kernel_weight(self) -> ops.Packed | torch.Tensor:
        weight = self.weight.detach().t()  # [out, in]
        if weight.is_cuda:
            return weight
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed_of != key:
            self._packed = ops.pack(weight)
            self._packed_of = key
        return self._packed


def apply_linear(x: torch.Tensor, weight: ops.Packed | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The row-invariant product [..., in] -> [..., out]: the CPU kernel on a packed weight, the
    CUDA kernel on a weight [out, in] as it is."""
    if isinstance(weight, ops.Packed):
        return ops.linear(x, weight, bias)
    return cuda.linear(x, weight, bias)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: ops.KeyLists, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """Row-invariant attention (query [rows, heads, D], key/value [kv_heads, T, D]) on the
    tensors' device."""
    if query.is_cuda:
        return cuda.attention(query, key, value, keys, scale, softcap)
    return ops.attention(query, key, value, keys, scale, softcap)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMS norm of ``x`` [..., hidden] with ``norm``'s weight and epsilon,
    each row alone: the CPU kernel (one call; its sum of squares in the kernel's own order,
    invariant.c "rms norm"), the Triton kernel on CUDA."""
    if x.is_cuda:
        return cuda.rms_norm(x, norm.weight, norm.variance_epsilon)
    rows = x.reshape(-1, x.shape[-1])
    return ops.rms_norm(rows, norm.weight, norm.variance_epsilon)[0].view(*x.shape[:-1], x.shape[-1])


NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm")  # transformers' formula, which rms_norm computes
_invariant_norms: dict[type, type] = {}


def _invariant_norm_class(original: type) -> type:
    """A subclass of a model's RMS norm whose forward inside hasten runs :func:`rms_norm`."""
    if original not in _invariant_norms:
        def forward(self, x):
            if forwards.is_active() and x.dtype in ops.DTYPES and x.device.type in ("cpu", "cuda"):
                return rms_norm(self, x)
            return original.forward(self, x)

        _invariant_norms[original] = type(f"Invariant{original.__name__}", (original,), {"forward": forward})
    return _invariant_norms[original]


def fused_weight(owner: nn.Module, layers: tuple[nn.Linear, ...]) -> tuple[ops.Packed | torch.Tensor, torch.Tensor | None] | None:
    """One packed weight (and bias) for ``layers`` that read the same input (q, k and v; gate and
    up), cached on ``owner``; the kernel computes each output feature alone, so the fused product
    has every layer's own bits. None unless every layer is an :class:`InvariantLinear` with
    biases all present or all absent."""
    if not all(type(layer) is InvariantLinear for layer in layers):
        return None
    biases = [layer.bias for layer in layers]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    key = tuple((layer.weight.data_ptr(), layer.weight._version) for layer in layers)
    cached = owner.__dict__.get("_hasten_invariant_fused")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            weight = torch.cat([layer.weight.detach() for layer in layers])  # [sum of outs, in]
            weight = weight if weight.is_cuda else ops.pack(weight)
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        cached = owner.__dict__["_hasten_invariant_fused"] = (key, weight, bias)
    return cached[1], cached[2]


def prepare(model: PreTrainedModel) -> bool:
    """Give ``model`` invariant forwards (idempotent): its linear layers become
    :class:`InvariantLinear` (GPT-2's Conv1D :class:`InvariantConv1D`) and its attention
    implementation ``hasten_invariant`` (sdpa outside hasten's forwards). Returns whether it
    has both; a model whose attention cannot be switched keeps its own, its linear layers
    still run the kernel."""
    if not eligible(model):
        return False
    use_kernels(model)
    for module in model.modules():  # the norms the lean forward computes by the kernel's contract (models/lean.py)
        if type(module).__name__ in NORM_CLASSES:
            module.__class__ = _invariant_norm_class(type(module))
    if not is_prepared(model) and getattr(type(model), "_supports_attention_backend", False):
        register()
        try:
            model.set_attn_implementation(ATTENTION)
        except (ValueError, NotImplementedError):  # this architecture picks its attention otherwise
            return False
    return is_prepared(model)


def use_kernels(module: nn.Module) -> None:
    """``module``'s linear layers become :class:`InvariantLinear` (GPT-2's Conv1D
    :class:`InvariantConv1D`): inside hasten's forwards (:mod:`.forwards`) they run the kernel on a
    packed copy of their weight, outside them PyTorch's, so training them is unchanged. A drafter's
    own module takes them too (drafters/trained.py): at one row the kernel costs a half to a third
    of oneDNN's product on the model's shapes (docs/cpu.md)."""
    swaps = {nn.Linear: InvariantLinear, Conv1D: InvariantConv1D}
    for layer in module.modules():
        if type(layer) in swaps:
            layer.__class__ = swaps[type(layer)]
            layer._packed, layer._packed_of = None, None


def is_prepared(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, invariant_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # boolean masks, or None where causal order says it all


def key_lists(mask: torch.Tensor | None, rows: int, keys: int, causal: bool, batch: int,
              device: torch.device | str = "cpu") -> list[ops.KeyLists]:
    """Each batch row's :class:`~hasten.kernels.ops.KeyLists` from transformers' mask ([B or 1, 1,
    rows, >= keys], boolean or additive), or from causal order where it gave none. Memoised for
    the latest mask: every layer of a forward gets the same tensor."""
    last = getattr(_masks, "last", None)
    if mask is not None and last is not None and last[0] is mask and last[1] == (rows, keys, batch):
        return last[2]
    if mask is None:
        one = ops.KeyLists.causal(rows, keys, device) if causal and rows > 1 else ops.KeyLists.every(rows, keys, device)
        return [one] * batch
    original = mask
    mask = mask[:, 0, :, :keys]
    if mask.dtype != torch.bool:  # an additive mask: 0 where visible; anything else would be a bias
        visible = mask > torch.finfo(mask.dtype).min / 2
        if (mask[visible] != 0).any():
            raise ValueError("hasten's invariant attention takes masks, not additive biases")
        mask = visible
    lists = [ops.KeyLists.from_mask(mask[b if mask.shape[0] > 1 else 0]) for b in range(batch)]
    _masks.last = (original, (rows, keys, batch), lists)
    return lists


def invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, Q, D], key/value [B, H_kv, K, D] ->
    ([B, Q, H, D], None). Inside hasten's forwards each row attends over its key list with the
    invariant kernel; elsewhere (or for what it does not cover) transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    unsupported = (dropout or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None
                   or query.dtype not in DTYPES or key.dtype != query.dtype
                   or query.device.type not in ("cpu", "cuda"))
    if not forwards.is_active() or unsupported:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, rows, dim = query.shape
    keys = key.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    lists = key_lists(attention_mask, rows, keys, causal, batch, query.device)
    scale = scaling if scaling is not None else dim ** -0.5
    out = torch.empty(batch, rows, heads, dim, dtype=query.dtype, device=query.device)
    for b in range(batch):
        out[b] = attend(query[b].transpose(0, 1), key[b], value[b], lists[b], scale, kwargs.get("softcap"))
    return out, None
