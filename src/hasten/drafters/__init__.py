"""Drafters, one file per method, all registered by name (see :func:`create`)."""
from .base import REGISTRY, Draft, DraftContext, Drafter, StepResult, create, register
from .draft_model import DraftModel, DraftModelSettings
from .lookahead import Lookahead, LookaheadSettings
from .prompt_lookup import PromptLookup, PromptLookupSettings

__all__ = [
    "REGISTRY",
    "Draft",
    "DraftContext",
    "Drafter",
    "DraftModel",
    "DraftModelSettings",
    "Lookahead",
    "LookaheadSettings",
    "PromptLookup",
    "PromptLookupSettings",
    "StepResult",
    "create",
    "register",
]
