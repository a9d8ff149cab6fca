"""What differs between the transformers releases hasten supports, decided once per class.

transformers 5.24 renamed the cache keyword of every Llama-family forward (model, decoder
layer and attention alike) from ``past_key_values`` to ``cache``; the old name still works
until 5.40 but warns on every call. hasten passes its cache under whichever name the
module's ``forward`` declares, read from its signature once per class, so no release sees a
deprecated keyword from hasten and no per-call lookup runs in the decode loop.
"""
from __future__ import annotations

import functools
import inspect

from torch import nn

NEW_CACHE_KEYWORD = "cache"  # transformers >= 5.24
OLD_CACHE_KEYWORD = "past_key_values"


@functools.cache
def cache_keyword(module_class: type[nn.Module]) -> str:
    """The keyword under which ``module_class.forward`` takes its KV cache."""
    try:
        parameters = inspect.signature(module_class.forward).parameters  # follows functools.wraps
    except (TypeError, ValueError):  # a forward without a readable signature: the name every release accepts
        return OLD_CACHE_KEYWORD
    return NEW_CACHE_KEYWORD if NEW_CACHE_KEYWORD in parameters else OLD_CACHE_KEYWORD


def cache_argument(module: nn.Module, cache) -> dict:
    """``{keyword: cache}`` for a call of ``module``: ``module(ids, **cache_argument(module, cache))``."""
    return {cache_keyword(type(module)): cache}
