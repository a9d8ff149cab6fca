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
