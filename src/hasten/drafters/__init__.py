"""Drafters, one file per method, all registered by name (see :func:`create`)."""
from .base import REGISTRY, Draft, DraftContext, Drafter, StepResult, create, register
from .chimera import Chimera, ChimeraSettings
from .draft_model import DraftModel, DraftModelSettings
from .eagle import Eagle, EagleSettings
from .eagle3 import Eagle3, Eagle3Settings
from .eagle_vlm import EagleVlm, EagleVlmSettings
from .easyspec import EasySpec, EasySpecSettings
from .gad import GAD, GADSettings
from .hidden_transfer import HiddenTransfer, HiddenTransferSettings
from .iad import IAD, IADSettings
from .lookahead import Lookahead, LookaheadSettings
from .longspec import LongSpec, LongSpecSettings
from .medusa import Medusa, MedusaHeads, MedusaSettings
from .prompt_lookup import PromptLookup, PromptLookupSettings
from .triforce import TriForce, TriForceSettings

__all__ = [
    "REGISTRY",
    "Chimera",
    "ChimeraSettings",
    "EasySpec",
    "EasySpecSettings",
    "Eagle",
    "EagleSettings",
    "Eagle3",
    "Eagle3Settings",
    "EagleVlm",
    "EagleVlmSettings",
    "GAD",
    "GADSettings",
    "HiddenTransfer",
    "HiddenTransferSettings",
    "IAD",
    "IADSettings",
    "Draft",
    "DraftContext",
    "Drafter",
    "DraftModel",
    "DraftModelSettings",
    "Lookahead",
    "LookaheadSettings",
    "LongSpec",
    "LongSpecSettings",
    "Medusa",
    "TriForce",
    "TriForceSettings",
    "MedusaHeads",
    "MedusaSettings",
    "PromptLookup",
    "PromptLookupSettings",
    "StepResult",
    "create",
    "register",
]
