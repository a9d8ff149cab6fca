"""hasten's own warning category, so that callers, the CLI and tests can tell what hasten
says apart from what its dependencies say (a deprecation notice of transformers, say)."""
from __future__ import annotations


class HastenWarning(UserWarning):
    """Something hasten wants its user to know: outputs stay exact, but the run may not be
    what was meant (an untrained drafter, a draft model with another tokenizer, ...)."""


class FieldError(ValueError):
    """A refusal about one input: ``field`` (the library's name for it), ``code`` (stable,
    for programs) and a message for people, in which ``{field}`` stands for the field's name.
    Layers above show it in their own words with :meth:`render` (the server with its API's
    field names) instead of rewriting the English text."""

    def __init__(self, field: str, code: str, message: str):
        self.field, self.code, self.template = field, code, message
        super().__init__(self.render(field))

    def render(self, name: str) -> str:
        """The message with the field called ``name``."""
        return self.template.replace("{field}", name)
