"""Find the drafter in a directory, write it in an engine's layout, or refuse naming what is missing."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..drafters.eagle3_layer import Eagle3Layer
from ..drafters.medusa import MedusaHeads
from ..zoo.packing import unpacked
from . import eagle3, medusa
from .layout import ExportError, Shape, check

FORMATS = ("vllm", "speculators", "sglang")
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclass(frozen=True)
class Exported:
    config: dict  # config.json
    tensors: dict[str, torch.Tensor]  # model.safetensors
    engine: str  # whose loader the layout is checked against
    layout: dict[str, Shape]  # the parameters that engine's module declares: name -> shape
    usage: str  # how the engine is told to load it
    # the strict check of the tensors (default: :func:`~.layout.check` against ``layout``, floating only)
    verify: Callable[[dict[str, torch.Tensor]], None] | None = None


def medusa_for_vllm(heads: MedusaHeads, target_lm_head: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> Exported:
    """``heads`` in vLLM's Medusa layout; ``target_lm_head`` [V, H] when the heads share the target's."""
    if heads.lm_heads is None and target_lm_head is None:
        raise ExportError("these Medusa heads share their target's LM head: the target is needed to copy it")
    config = medusa.vllm_config(heads)
    tensors = {name: t.detach().to(dtype).contiguous()
               for name, t in medusa.vllm_tensors(heads, target_lm_head).items()}
    usage = (f'speculative_config={{"method": "medusa", "model": OUT, '
             f'"num_speculative_tokens": {heads.config.num_heads}}}')
    return Exported(config, tensors, medusa.ENGINE, medusa.vllm_layout(config), usage)


def _medusa_vllm(directory: Path, target: str | None, dtype: torch.dtype) -> Exported:
    heads = MedusaHeads.load(directory)
    lm_head = None
    if heads.lm_heads is None:  # the heads share the target's LM head: the export carries a copy
        from ..loading import load_model

        target = target or heads.config.target
        if not target:
            raise ExportError(f"{directory} holds Medusa heads that share their target's LM head, and names no "
                              "target: give --target MODEL (the model they were trained for)")
        model = load_model(target)
        heads.check_fits(model)
        lm_head = model.get_output_embeddings().weight  # [V, H]
    return medusa_for_vllm(heads, lm_head, dtype)


def eagle3_for(layer: Eagle3Layer, format: str, dtype: torch.dtype = torch.float32) -> Exported:
    """``layer`` in ``format``'s (vllm, sglang) EAGLE-3 layout."""
    config = eagle3.config(layer, format, dtype)
    tensors, engine = eagle3.tensors(layer, dtype), eagle3.ENGINES[format]
    usage = {"vllm": 'speculative_config={"method": "eagle3", "model": OUT, "num_speculative_tokens": 3}',
             "sglang": "--speculative-algorithm EAGLE3 --speculative-draft-model-path OUT"}[format]
    return Exported(config, tensors, engine, {**eagle3.layout(config), **eagle3.index_layout(config)}, usage,
                    verify=lambda written: eagle3.check_strictly(written, config, engine))


def _eagle3(format: str) -> Callable[[Path, str | None, torch.dtype], Exported]:
    return lambda directory, target, dtype: eagle3_for(Eagle3Layer.load(directory), format, dtype)


# (drafter, format) -> writer(drafter directory, --target, dtype)
WRITERS: dict[tuple[str, str], Callable[[Path, str | None, torch.dtype], Exported]] = {
    ("medusa", "vllm"): _medusa_vllm,
    ("eagle3", "vllm"): _eagle3("vllm"),
    ("eagle3", "sglang"): _eagle3("sglang"),
}
# what keeps a drafter out of every engine's layout
REFUSALS = {
    "eagle": "hasten's EAGLE layer is not the layer vLLM and SGLang load: its MLP is GELU(up) then down, with "
             "biases, where theirs is a SwiGLU (gate, up, down) without biases, and it reads one top-layer "
             "feature, where EAGLE-3 reads three layers' features through `fc` and drafts over a draft vocabulary "
             "(d2t/t2d); no renaming makes one the other: train an EAGLE-3 layer instead (`hasten train eagle3`)",
}


def drafter_name(directory: Path) -> str:
    """The drafter whose ``<name>.json`` sits in ``directory``."""
    from ..drafters import REGISTRY

    found = [name for name in sorted(REGISTRY) if (directory / f"{name}.json").is_file()]
    if len(found) != 1:
        what = "no drafter's config" if not found else f"configs of several drafters ({', '.join(found)})"
        raise ExportError(f"{directory}: {what}; expected one trained drafter directory, such as `hasten train "
                          "medusa --out DIR` writes")
    return found[0]


def export(directory: str | Path, format: str, out: str | Path, target: str | None = None,
           dtype: torch.dtype = torch.float32) -> Exported:
    """Writes the drafter in ``directory`` (packed or not) into ``out`` in ``format``'s layout
    (:func:`write`)."""
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    directory = Path(directory)
    if not directory.is_dir():
        raise ExportError(f"{directory}: no such directory")
    name = drafter_name(directory)
    if name in REFUSALS:
        raise ExportError(f"cannot export {name} to {format}: {REFUSALS[name]}")
    writer = WRITERS.get((name, format))
    if writer is None:
        formats = [f for (n, f) in WRITERS if n == name]
        can = f"hasten exports {name} as {', '.join(formats)}" if formats else f"hasten exports no {name} drafter"
        raise ExportError(f"cannot export {name} to {format}: {can}")
    exported = writer(unpacked(directory), target, dtype)
    write(exported, out)
    return exported


def write(exported: Exported, out: str | Path) -> Path:
    """``config.json`` and ``model.safetensors`` into ``out``, checked strictly before and after writing."""
    verify = exported.verify or (lambda tensors: check(tensors, exported.layout, exported.engine))
    verify(exported.tensors)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(exported.tensors, out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(exported.config, indent=2) + "\n")
    verify(load_file(out / WEIGHTS_FILE))  # what landed on disk, read back
    return out
