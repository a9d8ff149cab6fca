"""Verification blocks through packed weights: a block of k tokens for about the price of one.

On a CPU a decode step of a small float32 model is nearly all weight reading. PyTorch's
``F.linear`` (MKL) reads a layer's weights once for one row, but for 2 to 16 rows it takes a
path that costs far more: on SmolLM2-135M, one thread, a forward of 6 tokens cost 1.8x a
forward of one (docs/benchmarks.md, "Spec-Bench"), so a draft had to be accepted deep to pay.
oneDNN with the weights reordered once into its blocked layout (what vLLM's CPU linear layers
do; ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the ops PyTorch's own
compiler uses when it freezes a CPU model) streams them once for every row of a block: on the
same model a 6-token forward costs about what a one-token step costs.

What stays exactly as it was: a forward of **one** row (plain decoding's step) and every
prefill go through ``F.linear``, the kernel Hugging Face ``generate`` runs, so hasten's plain
decoding keeps ``generate``'s bits. Only a verification block's rows (two or more) use the
packed weights. Those rows never had a one-row step's bits: MKL rounds a block's rows otherwise
than one row too (both about 5e-5 apart from one-row logits on SmolLM2, measured), which is why
token identity with plain decoding is a float32 promise (docs/fidelity.md, "Precision") and
not a bitwise one. Greedy equality is tested with the packed path on (tests/test_packed.py).

Which layers: every ``torch.nn.Linear`` (exactly that class: int8 and other replacements keep
their own kernels) of a float32 model on the CPU with at least ``MIN_PACKED_WEIGHTS`` weights,
when PyTorch has oneDNN. The packed copy
costs memory equal to the linear weights; it is made on a layer's first block and made again
if its weight changes. ``HASTEN_PACKED_BLOCKS=0`` turns it off (for comparisons); it is off
where a model's linear weights would take more than a quarter of the memory available.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# the largest block the packed layout is tuned for (the kernel takes any number of rows)
PACKED_ROWS = 16
# Layers with fewer weights keep F.linear: oneDNN's call costs about 14 us more, which a layer
# whose weights sit in the cache does not win back (a 256 x 256 layer, 6 rows, one thread: 33 us
# packed, 26 us F.linear; 576 x 576: 71 us against 100 us)
MIN_PACKED_WEIGHTS = 1 << 16
_decode = threading.local()  # .on: this thread is running a decode step's forward


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs a decode step's multi-row inputs on its oneDNN-packed weight.
    Set on a model's layers by :func:`prepare` (the module's class changes, nothing else: the
    same parameters, state dict and one-row results)."""

    _packed: torch.Tensor | None
    _packed_of: tuple[int, int] | None  # (data_ptr, version) of the weight the packed copy was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if getattr(_decode, "on", False) and x.numel() > x.shape[-1]:  # a decode forward of 2+ rows
            return packed_linear(x, self.packed_weight(), self.bias)
        return F.linear(x, self.weight, self.bias)

    def packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        if self._packed is None or self._packed_of != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)
            self._packed_of = key
        return self._packed


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with ``weight`` reordered by ``_reorder_linear_weight`` ([..., in] -> [..., out])."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def supported() -> bool:
    """Whether this PyTorch has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def eligible(model: nn.Module) -> bool:
    """Whether ``model``'s verification blocks can run on packed weights: float32 on the CPU,
    oneDNN present, not turned off, and room for the copy."""
    if os.environ.get("HASTEN_PACKED_BLOCKS", "1") == "0" or not supported():
        return False
    layers = _layers(model)
    if layers and all(type(m) is PackedLinear for m in layers):  # prepared before: its copies count as room taken
        return True
    if not layers or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in layers):
        return False
    needed = sum(m.weight.numel() * 4 for m in layers)
    available = _available_bytes()
    return available is None or needed <= available // 4


def prepare(model: nn.Module) -> bool:
    """Give ``model``'s linear layers the packed path (idempotent); returns whether it has it."""
    if not eligible(model):
        return False
    for module in _layers(model):
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            module._packed, module._packed_of = None, None
    return True


def _layers(model: nn.Module) -> list[nn.Linear]:
    """The layers worth packing: exactly nn.Linear (or already packed), large enough."""
    return [m for m in model.modules()
            if type(m) in (nn.Linear, PackedLinear) and m.weight.numel() >= MIN_PACKED_WEIGHTS]


@contextlib.contextmanager
def decode_forward(active: bool = True) -> Iterator[None]:
    """Within it, this thread's forwards of two or more rows use the packed weights."""
    before = getattr(_decode, "on", False)
    _decode.on = active
    try:
        yield
    finally:
        _decode.on = before
