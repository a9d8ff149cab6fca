"""hasten: make generative models faster without changing what they produce.

The names below load on first use (PEP 562), so ``import hasten.vllm`` inside vLLM's own
environment, or ``hasten --version``, does not import torch models and transformers first.
"""
from importlib import import_module
from importlib.util import find_spec

from .version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "Choice": ".structured",
    "DecodeStats": ".core.stats",
    "Engine": ".api",
    "EngineOutput": ".api",
    "GenerationOutput": ".engine.loop",
    "Grammar": ".structured",
    "HastenWarning": ".core.errors",
    "JsonSchema": ".structured",
    "Regex": ".structured",
    "Sampling": ".core.sampling",
    "drafters": ".drafters",
    "generate": ".engine.loop",
    "load": ".api",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(_EXPORTS[name], __name__)
        value = module if name == "drafters" else getattr(module, name)
    elif not name.startswith("_") and find_spec(f"{__name__}.{name}") is not None:
        value = import_module(f".{name}", __name__)  # a subpackage, as after an eager import (hasten.loading)
    else:
        raise AttributeError(f"module 'hasten' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
