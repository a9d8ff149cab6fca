"""Drafters, one file per method, all registered by name (see :func:`create`).

The drafter classes load on first use (PEP 562), as the registry does (``base.REGISTRY``):
importing one drafter, or this package, imports no other drafter and no model code
(:mod:`hasten.vllm` imports the drafters that need no model inside vLLM's environment).
"""
from importlib import import_module

from .base import REGISTRY, Draft, DraftContext, Drafter, StepResult, create, register

# public name -> the module that defines it
_EXPORTS = {
    "Chimera": "chimera", "ChimeraSettings": "chimera",
    "DraftModel": "draft_model", "DraftModelSettings": "draft_model",
    "Eagle": "eagle", "EagleSettings": "eagle",
    "Eagle3": "eagle3", "Eagle3Settings": "eagle3",
    "EagleVlm": "eagle_vlm", "EagleVlmSettings": "eagle_vlm",
    "EasySpec": "easyspec", "EasySpecSettings": "easyspec",
    "GAD": "gad", "GADSettings": "gad",
    "HiddenTransfer": "hidden_transfer", "HiddenTransferSettings": "hidden_transfer",
    "IAD": "iad", "IADSettings": "iad",
    "Lookahead": "lookahead", "LookaheadSettings": "lookahead",
    "LongSpec": "longspec", "LongSpecSettings": "longspec",
    "Medusa": "medusa", "MedusaHeads": "medusa", "MedusaSettings": "medusa",
    "PromptLookup": "prompt_lookup", "PromptLookupSettings": "prompt_lookup",
    "Suffix": "suffix", "SuffixSettings": "suffix",
    "TriForce": "triforce", "TriForceSettings": "triforce",
}

__all__ = ["REGISTRY", "Draft", "DraftContext", "Drafter", "StepResult", "create", "register", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    elif not name.startswith("_"):
        try:
            value = import_module(f".{name}", __name__)  # a submodule, as after an eager import
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":  # the submodule exists and lacks a dependency
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
