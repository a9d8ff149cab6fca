"""hasten: make generative models faster without changing what they produce."""
from . import drafters
from .api import Engine, EngineOutput, load
from .engine.loop import GenerationOutput, generate
from .core.errors import HastenWarning
from .core.sampling import Sampling
from .core.stats import DecodeStats

from .version import __version__

__all__ = ["__version__", "DecodeStats", "Engine", "EngineOutput", "GenerationOutput", "HastenWarning", "Sampling", "drafters", "generate", "load"]
