"""Row-invariant kernels for CUDA, in Triton: a linear layer, attention over per-row key lists and
an RMS norm, each giving a row the numbers it gets alone, whatever the other rows.

Libraries pick their GPU kernels by shape: cuBLAS chooses tiles and splits the reduction over K
(split-K) by the number of rows, PyTorch's reductions choose their launch by the tensor's shape,
flash attention splits the keys by the number of queries. A verification block of k rows then
rounds otherwise than k one-token steps (on an H100 in bfloat16, 2 to 5 of 7 Spec-Bench outputs
per method left plain decoding; docs/benchmarks.md, "GPU: the second run"). These kernels fix
everything the order of a row's reduction depends on (as the published batch-invariant kernels
do): one tile shape whatever the rows (rows are padded into tiles of ``BLOCK_ROWS``), the whole
K reduced by one program in K order (no split-K), each attention row by one program over its own
key list in blocks of ``BLOCK_KEYS`` counted from the list's start, each norm row by one program.

Triton comes with PyTorch's CUDA builds; :func:`available` says whether it imports.
``TRITON_INTERPRET=1`` runs the same kernels on the CPU (tests/test_invariant_cuda.py), which
checks their arithmetic, not the GPU's rounding.
"""
from __future__ import annotations

import functools

import torch

from .ops import KeyLists

BLOCK_ROWS, BLOCK_OUT, BLOCK_IN = 16, 64, 64  # the linear kernel's one tile shape
BLOCK_KEYS = 64  # keys per attention block, counted from each row's list start


@functools.cache
def available() -> str | None:
    """None when Triton imports, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"Triton is not installed ({error})"
    return None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # the row count is not specialised (Triton compiles a variant for the value 1 otherwise): one
    # compiled kernel for every block size
    @triton.jit(do_not_specialize=["rows"])
    def linear_kernel(x, w, b, y, rows, outs, ins, x_row, w_row, y_row, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        r = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, ins, BK):
            k = k0 + kk
            a = tl.load(x + r[:, None] * x_row + k[None, :], mask=(r[:, None] < rows) & (k[None, :] < ins), other=0.0)
            wt = tl.load(w + n[None, :] * w_row + k[:, None], mask=(n[None, :] < outs) & (k[:, None] < ins), other=0.0)
            if IEEE:  # float32 inputs: full float32 products, not TF32
                acc = tl.dot(a, wt, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, wt, acc)
        if HAS_BIAS:
            acc = acc + tl.load(b + n, mask=n < outs, other=0.0).to(tl.float32)[None, :]
        tl.store(y + r[:, None] * y_row + n[None, :], acc.to(y.dtype.element_ty),
                 mask=(r[:, None] < rows) & (n[None, :] < outs))

    @triton.jit
    def attention_kernel(q, k, v, o, start, prefix, offsets, extra, q_row, q_head, kv_head, kv_pos, o_row, o_head,
                         group, dim, scale, softcap, HAS_EXTRA: tl.constexpr, SOFTCAP: tl.constexpr,
                         D: tl.constexpr, BT: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // group
        first = tl.load(start + row)
        run = tl.load(prefix + row) - first
        e0 = 0
        n = run
        if HAS_EXTRA:
            e0 = tl.load(offsets + row)
            n = run + tl.load(offsets + row + 1) - e0
        d = tl.arange(0, D)
        dm = d < dim
        qv = tl.load(q + row * q_row + head * q_head + d, mask=dm, other=0.0).to(tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for i0 in range(0, n, BT):
            i = i0 + tl.arange(0, BT)
            im = i < n
            j = first + i
            if HAS_EXTRA:
                j = tl.where(i < run, j, tl.load(extra + e0 + i - run, mask=im & (i >= run), other=0))
            kt = tl.load(k + kvh * kv_head + j[:, None] * kv_pos + d[None, :], mask=im[:, None] & dm[None, :],
                         other=0.0).to(tl.float32)
            s = tl.sum(kt * qv[None, :], axis=1) * scale  # [BT]
            if SOFTCAP:
                t = tl.exp(-2.0 * tl.abs(s / softcap))
                s = softcap * tl.where(s < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t)
            s = tl.where(im, s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=0))
            shrink = tl.exp(best - new_best)
            p = tl.exp(s - new_best)
            vt = tl.load(v + kvh * kv_head + j[:, None] * kv_pos + d[None, :], mask=im[:, None] & dm[None, :],
                         other=0.0).to(tl.float32)
            total = total * shrink + tl.sum(p, axis=0)
            acc = acc * shrink + tl.sum(p[:, None] * vt, axis=0)
            best = new_best
        out = tl.where(total > 0, acc / total, 0.0)
        tl.store(o + row * o_row + head * o_head + d, out.to(o.dtype.element_ty), mask=dm)

    @triton.jit
    def rms_norm_kernel(x, w, y, width, x_row, y_row, eps, B: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, B)
        cm = c < width
        h = tl.load(x + row * x_row + c, mask=cm, other=0.0).to(tl.float32)
        normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / width + eps)
        weight = tl.load(w + c, mask=cm, other=0.0)
        out = weight * normed.to(y.dtype.element_ty)  # in the model's dtype, as transformers does
        tl.store(y + row * y_row + c, out, mask=cm)

    return linear_kernel, attention_kernel, rms_norm_kernel


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``: [..., K] with weight [N, K] -> [..., N], each row alone."""
    import triton

    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows.shape[0], BLOCK_ROWS), triton.cdiv(out_features, BLOCK_OUT))
    _kernels()[0][grid](rows, weight, weight if bias is None else bias, out, rows.shape[0], out_features, in_features,
                        rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                        IEEE=x.dtype == torch.float32, BM=BLOCK_ROWS, BN=BLOCK_OUT, BK=BLOCK_IN)
    return out.view(*x.shape[:-1], out_features)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: KeyLists, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """query [rows, heads, D], key/value [kv_heads, T, D] (D contiguous, the same strides) ->
    [rows, heads, D]: each row over its key list in order (``keys`` on the query's device)."""
    import triton

    rows, heads, dim = query.shape
    kv_heads = key.shape[0]
    if heads % kv_heads:
        raise ValueError(f"attention kernel: {heads} query heads do not group over {kv_heads} KV heads")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1 or key.stride() != value.stride():
        key, value = key.contiguous(), value.contiguous()
    out = torch.empty(rows, heads, dim, dtype=query.dtype, device=query.device)
    extra = keys.extra is not None
    _kernels()[1][(rows, heads)](
        query, key, value, out, keys.start, keys.prefix, keys.offsets if extra else keys.start,
        keys.extra if extra else keys.start, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        out.stride(0), out.stride(1), heads // kv_heads, dim, float(scale), float(softcap or 1.0),
        HAS_EXTRA=extra, SOFTCAP=bool(softcap), D=triton.next_power_of_2(dim), BT=BLOCK_KEYS)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMS norm of each row of ``x`` [..., width] alone: float32 statistics,
    the product with ``weight`` in ``x``'s dtype."""
    import triton

    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    _kernels()[2][(rows.shape[0],)](rows, weight, out, width, rows.stride(0), out.stride(0), float(eps),
                                    B=triton.next_power_of_2(width))
    return out.view(x.shape)
