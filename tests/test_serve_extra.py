"""``pip install 'hasten[serve]'`` installs a server that answers every field docs/serve.md documents
(issue 58): the grammar engine behind response_format, tools and structured_outputs comes with it,
locked and hash-checked like the rest; ``hasten[structured]`` still names it alone."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_the_serve_extra_brings_the_grammar_engine_and_the_lock_pins_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    serve = names(extras["serve"])
    assert {"starlette", "uvicorn", "prometheus-client", "openai", "llguidance"} <= serve
    assert names(extras["structured"]) == {"llguidance"}  # the old name keeps working
    lock = (ROOT / "requirements" / "lock.txt").read_text()
    for name in serve:
        assert re.search(rf"^{re.escape(name)}==\S+ \\$", lock, re.MULTILINE | re.IGNORECASE), name
        assert re.search(rf"^{re.escape(name)}==\S+ \\\n\s+--hash=sha256:", lock, re.MULTILINE | re.IGNORECASE), name


def test_a_server_without_the_grammar_engine_says_what_to_install(monkeypatch):
    """A server that would refuse response_format and tools does not start half-installed: the
    one-line error names llguidance and the extra that brings it."""
    import importlib.util

    import pytest

    from hasten.arguments import SERVE_EXTRA, UserError
    from hasten.serve.cli import SERVER_MODULES
    from hasten.arguments import require_serve_extra

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llguidance" else found(name, *a))
    with pytest.raises(UserError, match=r"needs llguidance, which the serve extra installs") as refusal:
        require_serve_extra("serve", SERVER_MODULES)
    assert SERVE_EXTRA in str(refusal.value)
