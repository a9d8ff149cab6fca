"""Where hasten keeps what it builds from other files (GGUF conversions, cost curves, the zoo's
unpacked weights): one rule for every floor."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$HASTEN_CACHE, else ~/.cache/hasten."""
    configured = os.environ.get("HASTEN_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "hasten"
