"""Cheaper targets and draft models on a CPU: int8 linear layers, or bfloat16 weights.

``quantize(model, "int8")`` swaps every ``nn.Linear`` (and GPT-2's ``Conv1D``) for an
:class:`Int8Linear`: int8 weights with one scale per output feature, activations quantized
on the fly, PyTorch's packed int8 kernels (fbgemm/x86) doing the product.
``quantize(model, "bfloat16")`` casts the weights. The result is the model the user runs,
and hasten's contract is relative to it: greedy output equals that model's own plain
decoding (and Hugging Face ``generate`` on it), sampling follows its distribution.

Why not ``torch.ao.quantization.quantize_dynamic`` as it is: it quantizes the activations
with one scale for the whole input tensor, so a token's logits depend on which other
tokens share its forward. Verifying a block of draft tokens then gives other logits than
decoding them one at a time (about 6e-3 apart on a tiny model), and greedy output drifts
away from the model's own. :class:`Int8Linear` runs the same kernel but makes the
quantization per token: each row is divided by its own largest magnitude, so every row
lies in [-1, 1], and extra *anchor* columns (zero weights) give every row a 1 and a -1,
which pins the tensor's range to exactly [-1, 1] whatever the other rows are. Each row's quantization, its integer
product and its rescaling then depend on that row alone: a block gives each token
exactly the numbers it gets alone. The rest of the model must round alike too: an int8
model attends one query row at a time (see ``_row_attention``).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

KINDS = ("int8", "bfloat16")
INT8_MAX = 127
ANCHOR_COLUMNS = 8  # 1, -1 and zeros: 8 keeps the packed width a multiple of 8
TINY = 1e-30  # an all-zero row keeps a finite scale (its output is the bias either way)


def _prepack(weight: torch.Tensor):
    """[out, in] float weight -> PyTorch's packed int8 weight, one symmetric scale per output row."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX  # [out]
    zero = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # the quantized-tensor API warns of its move to torchao on every call
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(quantized, None)


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with W int8 (one scale per output feature) and x quantized per row at
    run time. Row-independent: each output row depends on its own input row only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight = weight.detach().float().contiguous()  # [out, in]
        self.out_features, self.in_features = weight.shape
        # zero weights for the anchor columns: they pin the input's range and add nothing
        self.packed = _prepack(torch.cat([weight, torch.zeros(self.out_features, ANCHOR_COLUMNS)], dim=1))
        anchor = torch.zeros(1, ANCHOR_COLUMNS)  # [1, anchor]: every row gets a 1 and a -1
        anchor[0, 0], anchor[0, 1] = 1.0, -1.0
        self.register_buffer("anchor", anchor, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())  # [out] or None

    @classmethod
    def of(cls, module: nn.Module) -> "Int8Linear":
        """From an ``nn.Linear`` (weight [out, in]) or a GPT-2 style ``Conv1D`` (weight [in, out])."""
        if isinstance(module, Conv1D):
            return cls(module.weight.t(), module.bias)
        return cls(module.weight, module.bias)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] the float32 weight this layer applies (dequantized on each read, for code
        that inspects a model's weights; ``forward`` never uses it)."""
        quantized, _ = torch.ops.quantized.linear_unpack(self.packed)
        return quantized.dequantize()[:, : self.in_features].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., in]
        rows = x.reshape(-1, self.in_features).float()  # [rows, in]
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=TINY)  # [rows, 1]
        unit = torch.cat([rows / scale, self.anchor.expand(rows.shape[0], -1)], dim=1)  # [rows, in + anchor] in [-1, 1]
        out = torch.ops.quantized.linear_dynamic(unit, self.packed, True)  # [rows, out]
        out = out.mul_(scale) if self.bias is None else torch.addcmul(self.bias, out, scale)
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize(model: nn.Module, kind: str) -> nn.Module:
    """``model`` with cheaper weights, modified in place and returned: ``"int8"`` replaces
    every ``nn.Linear`` and ``Conv1D`` (the LM head included) by an :class:`Int8Linear` and
    makes attention run row by row (CPU only; the packed weights live outside the state
    dict, so quantize after loading rather than saving an int8 model); ``"bfloat16"`` casts
    the model. Quantize a draft model the same way as its target if both should be cheap:
    each is then a different model from its original."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantization {kind!r}; known: {', '.join(KINDS)}")
    if kind == "bfloat16":
        return model.to(torch.bfloat16)
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("int8 quantization runs on the CPU (PyTorch's int8 kernels); move the model there first")
    if torch.backends.quantized.engine == "none":
        raise ValueError("this PyTorch build has no quantized engine (fbgemm, x86 or qnnpack) for int8 layers")
    _replace_linears(model.float())
    if callable(getattr(model, "set_attn_implementation", None)):
        _register_row_attention()
        model.set_attn_implementation(ROW_ATTENTION)
    return model


# ---- attention that treats every query row alike ------------------------------------------------
# PyTorch's attention kernels round a multi-token block's rows otherwise than a lone token's
# (about 1e-6), and per-token activation quantization turns such a difference into another
# rounding of an int8 activation now and then, which grows through the layers: on SmolLM2
# a block's logits were up to 5.9 off one-token steps with SDPA, and greedy output with a
# drafter left plain decoding's. Attending one query row at a time runs each row through
# the very operations, over the same keys, that a lone token runs through.
ROW_ATTENTION = "hasten_row_by_row"


def _row_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """query [b, heads, q, d], key/value [b, kv_heads, k, d] -> ([b, q, heads, d], None).
    Each row attends over the keys up to the last one it may see, as a lone token would; the
    mask is added only to rows that skip some of those keys (tree drafts), since adding its
    zeros changes nothing."""
    groups = query.shape[1] // key.shape[1]
    query = query * scaling
    key = key.repeat_interleave(groups, dim=1).transpose(2, 3)  # [b, heads, d, k]
    value = value.repeat_interleave(groups, dim=1)  # [b, heads, k, d]
    ends = [key.shape[-1]] * query.shape[2]
    masked = [False] * query.shape[2]
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[-1]]
        visible = (attention_mask > torch.finfo(attention_mask.dtype).min / 2).any(dim=0)[0]  # [q, k] over the batch
        last = visible.shape[-1] - visible.flip(-1).int().argmax(dim=-1)  # [q] one past each row's last key
        ends, masked = last.tolist(), (visible.sum(dim=-1) != last).tolist()
    rows = []
    for i, (end, hide) in enumerate(zip(ends, masked)):
        scores = torch.matmul(query[:, :, i : i + 1], key[..., :end])  # [b, heads, 1, end]
        if hide:
            scores = scores + attention_mask[:, :, i : i + 1, :end]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        rows.append(torch.matmul(probs, value[:, :, :end]))  # [b, heads, 1, d]
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


def _register_row_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROW_ATTENTION, _row_attention)
    AttentionMaskInterface.register(ROW_ATTENTION, eager_mask)  # additive float masks, as eager attention takes


def _replace_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, (nn.Linear, Conv1D)):
            setattr(module, name, Int8Linear.of(child))
        else:
            _replace_linears(child)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(module, Int8Linear) for module in model.modules())
