"""GGUF checkpoints (llama.cpp's one-file format), read through transformers.

Reading a GGUF means dequantising every tensor and rebuilding the tokenizer from the file's
vocabulary: 15-90 s for a 100-300M-parameter model on a small CPU. So the first load writes
the result as a plain Hugging Face directory (config, float32 safetensors, tokenizer) under
the cache, and every later load reads that directory in a few seconds.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from ..core.paths import cache_root

SUFFIX = ".gguf"
NEEDED = ("gguf", "accelerate")  # transformers reads GGUF with both
INSTALL_HINT = "pip install 'hasten[gguf]'  (that is: pip install gguf accelerate)"
DONE_FILE = "hasten-gguf.json"  # written last: a directory without it is an interrupted conversion


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The .gguf file ``path`` names: the file itself, or the only one in a directory that is
    not already a Hugging Face checkpoint. None when ``path`` is no GGUF checkpoint."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path} holds {len(found)} .gguf files ({names}): name the one to load")
    return found[0] if found else None


def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def require_packages() -> None:
    missing = missing_packages()
    if missing:
        raise ValueError(f"loading a .gguf file needs the package(s) {', '.join(missing)}: {INSTALL_HINT}")


def cache_dir_for(gguf_file: Path, root: Path | None = None) -> Path:
    """``<root>/gguf/<file stem>-<key>``; the key changes whenever the file's size or
    modification time does, so an edited or replaced file is converted again (hashing
    hundreds of MB on every load would cost more than the load it saves)."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return (root or cache_root()) / "gguf" / f"{gguf_file.stem}-{key}"


def say(message: str) -> None:
    print(f"hasten: {message}", file=sys.stderr, flush=True)


def cached_checkpoint(gguf_file: str | os.PathLike, root: Path | None = None,
                      log: Callable[[str], None] = say) -> Path:
    """The Hugging Face directory holding ``gguf_file`` dequantised, converting it on first use."""
    gguf_file = Path(gguf_file)
    target = cache_dir_for(gguf_file, root)
    if (target / DONE_FILE).is_file():
        return target
    require_packages()
    try:
        convert(gguf_file, target, log)
    except (OSError, ValueError, KeyError, NotImplementedError) as err:  # what transformers raises for a bad file
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{gguf_file} could not be read as a GGUF checkpoint: {first_line}") from err
    return target


def convert(gguf_file: Path, target: Path, log: Callable[[str], None] = say) -> None:
    """Dequantise ``gguf_file`` into the Hugging Face directory ``target`` (float32 safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    size_mb = gguf_file.stat().st_size / 2**20
    log(f"first load of {gguf_file.name} ({size_mb:.0f} MB): dequantising it once into {target} "
        "(15-120 s on a small CPU; later loads take seconds)")
    scratch = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    folder, name = str(gguf_file.parent), gguf_file.name
    start = time.perf_counter()
    try:
        log("[1/3] reading the tokenizer ...")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        log(f"[2/3] dequantising the weights ... ({time.perf_counter() - start:.0f} s so far)")
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        model = auto.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **dense_weights())
        forget_quantizer(model)
        log(f"[3/3] writing safetensors ... ({time.perf_counter() - start:.0f} s so far)")
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        record = {"source": str(gguf_file.resolve()), "bytes": gguf_file.stat().st_size,
                  "seconds": round(time.perf_counter() - start, 1), "architecture": type(model).__name__,
                  "parameters": sum(p.numel() for p in model.parameters())}
        (scratch / DONE_FILE).write_text(json.dumps(record, indent=1) + "\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(scratch, target)
        except OSError:  # another process finished the same conversion first: keep its copy
            if not (target / DONE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"done in {time.perf_counter() - start:.0f} s: {record['architecture']}, "
        f"{record['parameters'] / 1e6:.1f}M parameters")


def dense_weights() -> dict:
    """Ask for plain dense tensors even where a GGUF matmul kernel is installed (newer
    transformers can keep the blocks packed, which neither saves nor drafts like a dense model)."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantise
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def forget_quantizer(model) -> None:
    """The weights are dense float tensors now; drop the GGUF loader's record of the file's
    quantisation so the model saves (and later loads) as an ordinary checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        if getattr(quantizer, "packed_modules", None):
            raise ValueError("transformers kept this GGUF's weights packed; hasten needs them dequantised")
        quantizer.remove_quantization_config(model)
