"""PyTorch-facing calls of the row-invariant kernels (``invariant.c``): a packed linear layer
and attention over per-row key lists. Shapes are in the comments; every tensor lives on the CPU."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import DTYPE_CODES, library

TILE = 64  # output features per packed tile (invariant.c's TILE)
AMX_PAIRS = 16  # input pairs per AMX chunk: the AMX layout pads its pairs to a multiple (invariant.c's AMX_PAIRS)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def code(dtype: torch.dtype) -> int:
    return DTYPE_CODES[str(dtype).removeprefix("torch.")]


def bf16_dot() -> bool:
    """Whether bfloat16 layers use the CPU's bfloat16 dot-product instruction (AVX512-BF16):
    twice the products per instruction, rounded as the CPU rounds them, so the bits differ from
    CPUs without it (each row still depends on itself alone). ``HASTEN_BF16_DOT=0`` keeps
    the float32 multiply-add chain, whose bits every CPU shares."""
    return os.environ.get("HASTEN_BF16_DOT", "1") != "0" and bool(library().hasten_bf16_dot_available())


AMX_BY_DEFAULT = True  # docs/cpu.md, "AMX tiles for bfloat16 layers": the measurements behind it


def amx_enabled() -> bool:
    """Whether bfloat16 layers take AMX's tiles where the CPU has them (TDPBF16PS: 16 rows
    against 16 outputs an instruction, rounded as the tile unit rounds, so other bits than the
    dot product's; each row still depends on itself alone). Read when a weight is packed, so
    one process packs every layer alike and a lone row (plain decoding) gets the bits it gets in
    a batch or a verification block. ``HASTEN_AMX=0`` keeps the dot product, and
    ``HASTEN_BF16_DOT=0`` the float32 chain on every path."""
    return os.environ.get("HASTEN_AMX", "1" if AMX_BY_DEFAULT else "0") != "0"


def bf16_layouts() -> list[str]:
    """The layouts a bfloat16 weight can take on this CPU: ``amx`` (AMX tiles) where it has
    AMX-BF16, ``pairs`` (the dot product) where it has AVX512-BF16, and ``fma`` (the float32
    multiply-add chain, the contract's) everywhere."""
    built = library()
    return ["amx"] * bool(built.hasten_amx_available()) + ["pairs"] * bool(built.hasten_bf16_dot_available()) + ["fma"]


def bf16_layout() -> str:
    """The layout :func:`pack` gives a bfloat16 weight here, from the CPU and the environment."""
    if not bf16_dot():
        return "fma"
    return "amx" if amx_enabled() and "amx" in bf16_layouts() else "pairs"


@dataclass(frozen=True)
class Packed:
    """A linear layer's weight laid out for the kernel: ``data`` is [ceil(N / 64), K, 64]
    (each tile's 64 output features side by side for every input feature, zero-padded), or for
    the bfloat16 dot product [ceil(N / 64), ceil(K / 2), 64, 2] (input features in pairs), or
    for AMX the same with the pairs padded to a multiple of 16 (a B tile: 16 pairs x 16 outputs)."""

    data: torch.Tensor
    in_features: int
    out_features: int
    layout: str  # "fma" (the contract's float32 chain), "pairs" (the bfloat16 dot product) or "amx"

    @property
    def pairs(self) -> bool:
        return self.layout != "fma"


def pack(weight: torch.Tensor, layout: str | None = None) -> Packed:
    """``weight`` [N, K] in its own dtype, laid out once for :func:`linear`; ``layout`` (a
    bfloat16 weight's, one of :func:`bf16_layouts`; for comparisons) defaults to :func:`bf16_layout`."""
    weight = weight.detach().contiguous()
    out_features, in_features = weight.shape
    tiles = -(-out_features // TILE)
    if weight.dtype != torch.bfloat16:
        layout = "fma"
    elif layout is None:
        layout = bf16_layout()
    elif layout not in bf16_layouts():
        raise ValueError(f"this CPU has no {layout!r} bfloat16 layout (it has {bf16_layouts()})")
    if layout != "fma":
        pairs = -(-in_features // 2)
        if layout == "amx":
            pairs = -(-pairs // AMX_PAIRS) * AMX_PAIRS
        data = torch.empty(tiles, pairs, TILE, 2, dtype=weight.dtype)
        library().hasten_pack_bf16_pairs(weight.data_ptr(), out_features, in_features, pairs, data.data_ptr())
        return Packed(data, in_features, out_features, layout)
    padded = torch.zeros(tiles * TILE, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    data = padded.view(tiles, TILE, in_features).transpose(1, 2).contiguous()
    return Packed(data, in_features, out_features, layout)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` packed by :func:`pack`: [..., K] -> [..., N] in ``x``'s dtype,
    each row's numbers independent of every other row (invariant.c, "linear")."""
    rows = x.reshape(-1, packed.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.out_features, dtype=x.dtype)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    bias_pointer, bias_code = (None, 0) if bias is None else (bias.data_ptr(), code(bias.dtype))
    if packed.pairs:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"a bfloat16-pair layer takes bfloat16 inputs, got {x.dtype}")
        status = library().hasten_linear_bf16_pairs(
            rows.data_ptr(), rows.stride(0), packed.data.data_ptr(), packed.data.shape[1], packed.layout == "amx",
            bias_pointer, bias_code, out.data_ptr(), out.stride(0), rows.shape[0], packed.in_features,
            packed.out_features, torch.get_num_threads())
        if status != 0:
            raise MemoryError("linear kernel: out of memory") if status == -2 else RuntimeError(
                f"this CPU cannot run the {packed.layout!r} bfloat16 layout; pack the weight again")
    else:
        library().hasten_linear(
            rows.data_ptr(), rows.stride(0), code(rows.dtype), packed.data.data_ptr(), code(packed.data.dtype),
            bias_pointer, bias_code, out.data_ptr(), out.stride(0), code(out.dtype), rows.shape[0],
            packed.in_features, packed.out_features, torch.get_num_threads())
    return out.view(*x.shape[:-1], packed.out_features)


@dataclass(frozen=True)
class KeyLists:
    """Which cached keys each query row attends to, in order: ``start[r]`` up to (not
    including) ``prefix[r]``, then ``extra[offsets[r]:offsets[r + 1]]`` (increasing, each at or
    after ``prefix[r]``). A one-token step at position p sees 0..p; a chain block's row r
    after P cached keys sees 0..P + r; a tree row sees the cache and then its ancestors."""

    start: torch.Tensor  # [rows] int64
    prefix: torch.Tensor  # [rows] int64
    offsets: torch.Tensor | None = None  # [rows + 1] int64
    extra: torch.Tensor | None = None  # [extras] int64

    @staticmethod
    def causal(rows: int, keys: int, device: torch.device | str = "cpu") -> "KeyLists":
        """Row r of the last ``rows`` positions of ``keys`` sees every key up to its own."""
        prefix = torch.arange(keys - rows + 1, keys + 1, dtype=torch.int64, device=device)
        return KeyLists(torch.zeros(rows, dtype=torch.int64, device=device), prefix)

    @staticmethod
    def every(rows: int, keys: int, device: torch.device | str = "cpu") -> "KeyLists":
        """Every row sees all ``keys`` (one query, or attention without causal order)."""
        return KeyLists(torch.zeros(rows, dtype=torch.int64, device=device),
                        torch.full((rows,), keys, dtype=torch.int64, device=device))

    @staticmethod
    def from_mask(visible: torch.Tensor) -> "KeyLists":
        """From a boolean mask [rows, keys] (True: attends): each row's first run of visible
        keys, then the visible keys after it."""
        visible = visible.bool()
        rows, keys = visible.shape
        index = torch.arange(keys, device=visible.device)
        seen = visible.any(dim=-1)
        start = torch.where(seen, visible.int().argmax(dim=-1), torch.zeros(rows, dtype=torch.long, device=visible.device))
        after_start = index[None] >= start[:, None]
        gap = after_start & ~visible  # [rows, keys] hidden keys after the run began
        prefix = torch.where(gap.any(dim=-1), gap.int().argmax(dim=-1), torch.full((rows,), keys, device=visible.device))
        prefix = torch.where(seen, prefix, start)
        later = visible & (index[None] >= prefix[:, None])
        if not later.any():
            return KeyLists(start.to(torch.int64), prefix.to(torch.int64))
        counts = later.sum(dim=-1)
        offsets = torch.zeros(rows + 1, dtype=torch.int64, device=visible.device)
        offsets[1:] = counts.cumsum(0)
        extra = later.nonzero()[:, 1].to(torch.int64).contiguous()  # row-major: each row's in order
        return KeyLists(start.to(torch.int64), prefix.to(torch.int64), offsets, extra)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: KeyLists, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """query [rows, heads, D] (any strides with D contiguous), key/value [kv_heads, T, D] (D
    contiguous, the same strides) -> [rows, heads, D] in the query's dtype: each row's
    attention over its key list alone (invariant.c, "attention")."""
    rows, heads, dim = query.shape
    kv_heads = key.shape[0]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1 or key.stride() != value.stride():
        key, value = key.contiguous(), value.contiguous()
    out = torch.empty(rows, heads, dim, dtype=query.dtype)
    extra = keys.extra
    status = library().hasten_attention(
        query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), value.data_ptr(), key.stride(0),
        key.stride(1), out.data_ptr(), out.stride(0), out.stride(1), code(query.dtype), code(key.dtype), rows, heads,
        kv_heads, dim, keys.start.data_ptr(), keys.prefix.data_ptr(),
        None if keys.offsets is None else keys.offsets.data_ptr(), None if extra is None else extra.data_ptr(),
        float(scale), float(softcap or 0.0), torch.get_num_threads(), attention_on_amx(query, key))
    if status != 0:
        raise (MemoryError("attention kernel: out of memory") if status == -2 else
               RuntimeError("attention kernel: this CPU cannot run AMX's tiles") if status == -3 else
               ValueError(f"attention kernel: {heads} query heads do not group over {kv_heads} KV heads"))
    return out


def attention_on_amx(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether this attention takes AMX's tiles (invariant.c, "attention on AMX tiles"): bfloat16
    queries and keys, a head size that is a multiple of 32, on a CPU where bfloat16 layers take
    AMX (:func:`bf16_layout`), so one switch decides for every layer and attention of the process."""
    return (query.dtype == torch.bfloat16 and key.dtype == torch.bfloat16 and query.shape[-1] % 32 == 0
            and query.shape[-1] <= 512 and bf16_layout() == "amx")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama RMS norm of ``x`` [rows, n] with ``weight`` [n] in one call, its sum
    of squares in the kernel's own order (invariant.c, "rms norm"): returns (the rows normed, in
    the dtype ``weight * x`` has, and ``x``). With ``delta`` [rows, n], ``x + delta`` (rounded as
    PyTorch rounds it) is normed and returned as the second tensor: the residual stream's add."""
    rows, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()  # [n]: only its pointer is read
    out = torch.empty(rows, n, dtype=torch.promote_types(weight.dtype, x.dtype))
    residual, delta_pointer, delta_stride = x, None, 0
    if delta is not None:
        if delta.dtype != x.dtype or delta.shape != x.shape:
            raise ValueError(f"rms_norm: delta {tuple(delta.shape)} {delta.dtype} does not match x "
                             f"{tuple(x.shape)} {x.dtype}")
        if delta.stride(-1) != 1:
            delta = delta.contiguous()
        residual = torch.empty_like(x, memory_format=torch.contiguous_format)
        delta_pointer, delta_stride = delta.data_ptr(), delta.stride(0)
    status = library().hasten_rms_norm(
        x.data_ptr(), x.stride(0), delta_pointer, delta_stride, residual.data_ptr(), residual.stride(0),
        code(x.dtype), weight.data_ptr(), code(weight.dtype), out.data_ptr(), out.stride(0), code(out.dtype), rows, n,
        float(eps))
    if status != 0:
        raise MemoryError("rms_norm kernel: out of memory")
    return out, residual


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` for ``x`` [rows, heads, D] (any row and
    head strides, D contiguous) and ``cos``/``sin`` [rows, D] in ``x``'s dtype: PyTorch's own bits
    (each operation rounded as its CPU operators round it), in one call -> [rows, heads, D]."""
    rows, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape != (rows, dim) or sin.stride() != cos.stride():
        raise ValueError(f"rotary: cos/sin must be [{rows}, {dim}] {x.dtype} with the same strides")
    if cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(rows, heads, dim, dtype=x.dtype)
    status = library().hasten_rotary(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                     cos.stride(0), out.data_ptr(), out.stride(0), out.stride(1), code(x.dtype), rows,
                                     heads, dim)
    if status != 0:
        raise ValueError(f"rotary kernel: head size {dim} must be even and at most 512")
    return out
