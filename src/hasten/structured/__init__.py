"""Structured output: the constraints a request may ask for, compiled by a grammar engine (an
optional extra: ``pip install 'hasten[structured]'``, which
``hasten[serve]`` includes). The decode loop's side is
:mod:`hasten.engine.constraint`; the protocol between them is :mod:`hasten.core.constraint`."""
from .specs import Choice, Grammar, JsonSchema, Regex, Spec

__all__ = ["Choice", "Grammar", "JsonSchema", "Regex", "Spec"]
