"""Deterministic training corpus: the Python standard library's own source files.

The stdlib ships with every Python, so the zoo can be retrained offline anywhere.
The exact file set depends on the Python version; `training.json` records it.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Directories whose contents are test suites, GUI code or third-party packages rather than
# ordinary library code (also keeps out lib2to3/tests, whose data has deliberately broken files).
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib"})
HELDOUT_PERCENT = 3


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def all_files(root: Path | None = None) -> list[Path]:
    """Every *.py file under `root` (default: the stdlib), sorted by relative POSIX path."""
    root = stdlib_root() if root is None else Path(root)
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relative_path: str) -> bool:
    """Stable split by a hash of the relative path; Python's hash() is salted per process."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def _split(heldout: bool, root: Path | None) -> list[Path]:
    root = stdlib_root() if root is None else Path(root)
    return [p for p in all_files(root) if is_heldout(p.relative_to(root).as_posix()) == heldout]


def training_files(root: Path | None = None) -> list[Path]:
    return _split(False, root)


def heldout_files(root: Path | None = None) -> list[Path]:
    return _split(True, root)


def read_text(path: Path) -> str:
    # A few stdlib files are not valid UTF-8; replacing keeps every file usable and decodable.
    return Path(path).read_text(encoding="utf-8", errors="replace")
