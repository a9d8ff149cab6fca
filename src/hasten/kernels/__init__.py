"""hasten's own CPU kernels, built from C source on first use and loaded through ctypes.

``invariant.c`` holds the row-invariant linear layer and attention (its header states the
arithmetic each output element gets). It is compiled once per machine and source version by
the system's C compiler (``$CC``, else ``cc``) into hasten's cache folder (``$HASTEN_CACHE``,
else ~/.cache/hasten: ``kernels/``), which takes about a second and needs no Python headers
and no PyTorch build tools. :func:`library` returns None, with :func:`unavailable` saying why,
where no compiler works: callers then keep PyTorch's own kernels (and say so).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from ..core.paths import cache_root

SOURCE = Path(__file__).with_name("invariant.c")
# -ffp-contract=off: no multiply-add is fused unless the source says fmaf, so every path (and
# every compiler) performs the operations the source writes; -fno-math-errno lets fmaf vectorize
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
PATHS = {2: "AVX-512F", 1: "AVX2 + FMA + F16C", 0: "portable C"}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_error: str | None = None
_loaded = False

_p, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "hasten_kernel_path": ([], _int),
    "hasten_set_kernel_path": ([_int], _int),
    "hasten_bf16_dot_available": ([], _int),
    "hasten_amx_available": ([], _int),
    # w, N, K, pairs, out
    "hasten_pack_bf16_pairs": ([_p, _i64, _i64, _i64, _p], None),
    # x, sx, w, pairs, amx, bias, bt, y, sy, M, K, N, threads
    "hasten_linear_bf16_pairs": ([_p, _i64, _p, _i64, _int, _p, _int, _p, _i64, _i64, _i64, _i64, _int], _int),
    # x, sx, xt, w, wt, bias, bt, y, sy, yt, M, K, N, threads
    "hasten_linear": ([_p, _i64, _int, _p, _int, _p, _int, _p, _i64, _int, _i64, _i64, _i64, _int], None),
    # q, q_row, q_head, k, v, kv_head, kv_pos, out, o_row, o_head, dtype, kv_dtype, rows, heads, kv_heads, dim,
    # start, prefix, extra_offsets, extra, scale, softcap, threads, amx
    "hasten_attention": ([_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i64, _int, _int, _i64, _i64, _i64, _i64,
                          _p, _p, _p, _p, _f32, _f32, _int, _int], _int),
    # x, sx, delta, sd, residual_out, sr, dtype, w, wt, out, so, ot, rows, n, eps
    "hasten_rms_norm": ([_p, _i64, _p, _i64, _p, _i64, _int, _p, _int, _p, _i64, _int, _i64, _i64, _f32], _int),
    # x, sx_row, sx_head, cos, sin, sc, out, so_row, so_head, dtype, rows, heads, D
    "hasten_rotary": ([_p, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, _int, _i64, _i64, _i64], _int),
}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _target(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), *version, platform.machine()]).encode())
    return cache_root() / "kernels" / f"invariant-{key.hexdigest()[:16]}.so"


def _build() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC, or install cc / gcc / clang)")
    target = _target(compiler)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # built aside, moved in whole
            built = Path(scratch) / target.name
            result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    for name, (arguments, result_type) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, result_type
    return library


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on the first call), or None where they cannot be built."""
    global _library, _error, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                try:
                    _library = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    _error = str(error)
                _loaded = True
    return _library


def unavailable() -> str | None:
    """Why :func:`library` is None (None while it is not)."""
    library()
    return _error


@contextlib.contextmanager
def forced_path(path: int) -> Iterator[None]:
    """Within it, the kernels take instruction path ``path`` (2 AVX-512F, 1 AVX2, 0 portable C;
    not one the CPU lacks): for tests showing that every path gives the same bits."""
    if library().hasten_set_kernel_path(path) != 0:
        raise ValueError(f"this CPU cannot run the kernels' {PATHS.get(path, path)} path")
    try:
        yield
    finally:
        library().hasten_set_kernel_path(-1)


def instruction_path() -> str:
    """Which of the kernels' paths runs on this CPU (they give the same bits; only speed differs)."""
    built = library()
    return "unavailable" if built is None else PATHS[built.hasten_kernel_path()]
