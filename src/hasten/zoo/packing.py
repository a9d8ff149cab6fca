"""How the zoo's weights ship: packed to about a third of their float16 size, unpacked once into
the cache as the float16 Hugging Face files every loader reads.

In the package a weights file ``X.safetensors`` ships as ``X.q8.safetensors.xz``: each floating
matrix as int8 with one float32 scale per row (row maximum / 127), vectors and small tensors
as they are, the whole file lzma-compressed; ``tokenizer.json`` ships as ``tokenizer.json.xz``
(lossless). Every other file ships as it is. :func:`unpacked` turns such a directory (its
subdirectories too: a model's drafter modules) into ``<cache>/zoo-unpacked/<key>/<name>/``
with the original file names, float16 tensors and the same directory name, once per content
(``key`` is a hash of the packed files). Why: the repository must fit one 64 MiB transfer to a
GPU machine (docs/gpu.md), and every install carries these files. What it costs is measured in
docs/training.md ("How the zoo ships"): int8 rows move held-out losses by under 0.001 nats.

``python -m hasten.zoo.pack DIR...`` packs directories in place (what the recipes do after
saving); ``--unpack`` writes the float16 files back.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save

from ..core import paths

PACKED_TENSORS = ".q8.safetensors.xz"  # replaces ".safetensors"
PACKED_TEXT = ".xz"
TEXT_FILES = ("tokenizer.json",)  # compressed losslessly
FORMAT = "hasten-q8-rows/1"
SMALLEST_QUANTISED = 4096  # elements: smaller tensors (and every vector) keep their own dtype
LZMA_PRESET = 9
CACHE_DIR = "zoo-unpacked"
DONE_FILE = ".unpacked"  # written last: a directory without it is an interrupted unpacking


# ---- tensors ----------------------------------------------------------------------------------
def quantised(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dim() >= 2 and tensor.numel() >= SMALLEST_QUANTISED


def quantise(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """int8 rows + float32 scales for the matrices, the rest unchanged; and the metadata that
    restores names and dtypes."""
    out, dtypes = {}, {}
    for name, tensor in tensors.items():
        if not quantised(tensor):
            out[name] = tensor.contiguous()
            continue
        rows = tensor.float().reshape(tensor.shape[0], -1)  # [rows, columns]
        scale = rows.abs().amax(dim=1) / 127  # [rows]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        out[f"q8:{name}"] = torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8).reshape(tensor.shape)
        out[f"scale:{name}"] = scale.contiguous()
        dtypes[name] = str(tensor.dtype).removeprefix("torch.")
    # one metadata entry: safetensors writes several in varying order, and a file must not change
    # when its tensors do not
    return out, {"hasten": json.dumps({"format": FORMAT, "dtypes": dtypes}, sort_keys=True)}


def dequantise(stored: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
    record = json.loads(metadata.get("hasten", "{}"))
    if record.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file (format {record.get('format')!r})")
    dtypes = record["dtypes"]
    out = {name: tensor for name, tensor in stored.items() if not name.startswith(("q8:", "scale:"))}
    for name, dtype in dtypes.items():
        q8, scale = stored[f"q8:{name}"], stored[f"scale:{name}"]
        rows = q8.reshape(q8.shape[0], -1).float() * scale[:, None]
        out[name] = rows.reshape(q8.shape).to(getattr(torch, dtype))
    return out


def packed_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    stored, metadata = quantise(tensors)
    return lzma.compress(save(stored, metadata=metadata), preset=LZMA_PRESET)


def unpacked_tensors(data: bytes) -> dict[str, torch.Tensor]:
    raw = lzma.decompress(data)
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return dequantise(load(raw), header.get("__metadata__", {}))


def packed_name(path: Path) -> Path:
    """Where ``path`` (a .safetensors or tokenizer file) ships packed."""
    if path.name.endswith(".safetensors"):
        return path.with_name(path.name.removesuffix(".safetensors") + PACKED_TENSORS)
    return path.with_name(path.name + PACKED_TEXT)


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of the weights file ``path`` (``X.safetensors``), read from it or, where only
    the packed ``X.q8.safetensors.xz`` is there, from that (FileNotFoundError if neither)."""
    path = Path(path)
    if path.is_file():
        return load_file(path)
    packed = packed_name(path)
    if packed.is_file():
        return unpacked_tensors(packed.read_bytes())
    raise FileNotFoundError(f"no {path.name} (or {packed.name}) in {path.parent}")


def write_packed(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Write ``tensors`` (rounded to float16 first, as the zoo's files always were) packed, where a
    weights file ``path`` (``X.safetensors``) would go; returns the file written."""
    half = {name: t.detach().cpu().half().contiguous() if t.is_floating_point() else t.detach().cpu().contiguous()
            for name, t in tensors.items()}
    return write_atomically(packed_name(Path(path)), packed_bytes(half))


def write_atomically(target: Path, data: bytes) -> Path:
    """``data`` into ``target`` through a temporary file, so no reader sees half a file."""
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, target)
    return target


def has_tensors(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_file() or packed_name(path).is_file()


# ---- directories ------------------------------------------------------------------------------
def packable(path: Path) -> bool:
    return path.is_file() and (path.name.endswith(".safetensors") or path.name in TEXT_FILES)


def pack(directory: str | os.PathLike) -> list[Path]:
    """Pack ``directory`` (and its subdirectories) in place; returns the packed files written."""
    written = []
    for path in sorted(Path(directory).rglob("*")):
        if not packable(path):
            continue
        if path.name.endswith(".safetensors"):
            data = packed_bytes(load_file(path))
        else:
            data = lzma.compress(path.read_bytes(), preset=LZMA_PRESET)
        written.append(write_atomically(packed_name(path), data))
        path.unlink()
    return written


def is_packed_file(path: Path) -> bool:
    return path.name.endswith(PACKED_TENSORS) or any(path.name == name + PACKED_TEXT for name in TEXT_FILES)


def original_name(path: Path) -> str:
    if path.name.endswith(PACKED_TENSORS):
        return path.name.removesuffix(PACKED_TENSORS) + ".safetensors"
    return path.name.removesuffix(PACKED_TEXT)


def unpack_file(path: Path, destination: Path) -> Path:
    """Write the packed file ``path`` unpacked into the directory ``destination``."""
    target = destination / original_name(path)
    if path.name.endswith(PACKED_TENSORS):
        target.write_bytes(save(unpacked_tensors(path.read_bytes()), metadata={"format": "pt"}))
    else:
        target.write_bytes(lzma.decompress(path.read_bytes()))
    return target


def unpack_into(source: Path, target: Path) -> None:
    """Write ``source``'s files into ``target`` (a new directory), packed ones unpacked."""
    for path in sorted(source.rglob("*")):
        if not path.is_file() or path.name.endswith(".tmp"):
            continue
        destination = target / path.relative_to(source).parent
        destination.mkdir(parents=True, exist_ok=True)
        if is_packed_file(path):
            unpack_file(path, destination)
        else:
            shutil.copyfile(path, destination / path.name)


def is_packed(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` itself holds packed files (its subdirectories are not searched: a
    model's own weights sit at its top, a module's at its)."""
    directory = Path(directory)
    return directory.is_dir() and any(is_packed_file(p) for p in directory.iterdir() if p.is_file())


_keys: dict[tuple, str] = {}  # (path, size, mtime) of every file -> content key, per process


def content_key(directory: Path) -> str:
    """A hash of every file's relative path and bytes (memoised by size and mtime: hashing the
    packed files costs ~10 ms per model, once per process)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    signature = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if signature not in _keys:
        digest = hashlib.sha256(FORMAT.encode())
        for path in files:
            digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        _keys[signature] = digest.hexdigest()[:16]
    return _keys[signature]


def unpacked(directory: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> Path:
    """A directory of plain Hugging Face files for ``directory``: itself when nothing in it is
    packed, else its unpacked copy in the cache (written on first use; same directory name)."""
    directory = Path(directory)
    if not is_packed(directory):
        return directory
    root = Path(cache_root) if cache_root is not None else paths.cache_root()
    entry = root / CACHE_DIR / content_key(directory)
    target = entry / directory.name
    if (target / DONE_FILE).is_file():
        return target
    scratch = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        unpack_into(directory, scratch / directory.name)
        (scratch / directory.name / DONE_FILE).write_text(str(directory.resolve()) + "\n")
        if entry.exists():  # an interrupted earlier attempt, or another process's finished one
            if (target / DONE_FILE).is_file():
                return target
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(scratch, entry)
        except OSError:  # another process got there first
            if not (target / DONE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target

