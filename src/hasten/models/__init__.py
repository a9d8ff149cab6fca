"""Model adapters: the only place that knows how a model family is called."""
from .adapter import ModelAdapter

__all__ = ["ModelAdapter"]
