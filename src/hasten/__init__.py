"""hasten: make generative models faster without changing what they produce."""
from . import drafters
from .api import Engine, EngineOutput, load
from .engine.loop import GenerationOutput, generate
from .engine.sampling import Sampling
from .engine.stats import DecodeStats

__version__ = "0.1.0"

__all__ = ["DecodeStats", "Engine", "EngineOutput", "GenerationOutput", "Sampling", "drafters", "generate", "load"]
