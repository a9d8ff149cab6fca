"""Drafters, one file per method, all registered by name (see :func:`create`)."""
from .base import REGISTRY, Draft, DraftContext, Drafter, StepResult, create, register
from .draft_model import DraftModel, DraftModelSettings
from .lookahead import Lookahead, LookaheadSettings
from .medusa import Medusa, MedusaHeads, MedusaSettings
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
    "Medusa",
    "MedusaHeads",
    "MedusaSettings",
    "PromptLookup",
    "PromptLookupSettings",
    "StepResult",
    "create",
    "register",
]
