"""hasten's own warning category, so that callers, the CLI and tests can tell what hasten
says apart from what its dependencies say (a deprecation notice of transformers, say)."""
from __future__ import annotations


class HastenWarning(UserWarning):
    """Something hasten wants its user to know: outputs stay exact, but the run may not be
    what was meant (an untrained drafter, a draft model with another tokenizer, ...)."""
