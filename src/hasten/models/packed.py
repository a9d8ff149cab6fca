"""Every forward hasten runs of a float32 CPU model goes through oneDNN-packed weights.

On a CPU a decode step of a small float32 model is nearly all weight reading. PyTorch's
``F.linear`` (MKL) reads a layer's weights once for one row, but for 2 to 16 rows it takes a
path that costs far more: on SmolLM2-135M, one thread, a forward of 6 tokens cost 1.8x a
forward of one (docs/benchmarks.md, "Spec-Bench"), so a draft had to be accepted deep to pay;
and MKL's one-row product does not use a second thread at all (58 ms a step on one thread and on
two). oneDNN with the weights reordered once into its blocked layout (what vLLM's CPU linear
layers do; ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the ops
PyTorch's own compiler uses when it freezes a CPU model) streams them once for every row of a
block, and uses every thread for one row: on the same model a one-token step costs 55 ms on one
thread and 41 ms on two, a 279-token prefill 763 and 439 ms where MKL took 835 and 503 ms
(docs/cpu.md).

So hasten's forwards (prefill, one-token steps and verification blocks alike) run every large
``torch.nn.Linear`` on its packed weight; outside them (a Hugging Face ``generate`` of the same
model object, training) the layer is ``F.linear`` as before. The packed kernel rounds otherwise
than MKL (about 5e-6 apart per layer, 5e-5 on SmolLM2's logits), which is why token identity
with ``generate`` is a float32 promise (docs/fidelity.md, "Precision") and not a bitwise one, as
it already was for a block's rows under MKL. One thing it gains: for layers with 576 inputs the
packed kernel gives a row the same bits whether it comes alone or in a block of up to 64 (measured;
not for 1,536 inputs, where one row takes another kernel). Greedy equality with ``generate`` is
tested with the packed path on (tests/test_packed.py).

Which layers: every ``torch.nn.Linear`` (exactly that class: int8 and other replacements keep
their own kernels) of a float32 model on the CPU with at least ``MIN_PACKED_WEIGHTS`` weights,
when PyTorch has oneDNN. The packed copy costs memory equal to the linear weights; it is made on
a layer's first forward and made again if its weight changes. ``HASTEN_PACKED_BLOCKS=0`` turns it
off (for comparisons); it is off where a model's linear weights would take more than a quarter of
the memory available.
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
_active = threading.local()  # .on: this thread is running one of hasten's forwards


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs hasten's forwards on its oneDNN-packed weight. Set on a
    model's layers by :func:`prepare` (the module's class changes, nothing else: the same
    parameters and state dict, and ``F.linear``'s results outside :func:`active`)."""

    _packed: torch.Tensor | None
    _packed_of: tuple[int, int] | None  # (data_ptr, version) of the weight the packed copy was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if getattr(_active, "on", False):
            return packed_linear(x, self.packed_weight(), self.bias)
        return F.linear(x, self.weight, self.bias)

    def packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        if self._packed is None or self._packed_of != key:
            with torch.no_grad():
                self._packed = pack(weight.detach())
            self._packed_of = key
        return self._packed


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's blocked layout, for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with ``weight`` reordered by ``_reorder_linear_weight`` ([..., in] -> [..., out])."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      other: torch.Tensor) -> torch.Tensor:
    """``other + (x @ W.T + b)`` in one call, the addition done on the kernel's float32 result
    (so the bits of the two steps; [..., in] -> [..., out])."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, bias, "add")


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
    """Whether ``model``'s forwards can run on packed weights: float32 on the CPU,
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


def is_active() -> bool:
    """Whether this thread is inside one of hasten's forwards (:func:`active`)."""
    return getattr(_active, "on", False)


@contextlib.contextmanager
def active(on: bool = True) -> Iterator[None]:
    """Within it, this thread's forwards use the packed weights (hasten's forwards)."""
    before = getattr(_active, "on", False)
    _active.on = on
    try:
        yield
    finally:
        _active.on = before
