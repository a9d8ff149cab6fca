"""hasten's declared dependencies (pyproject.toml), rewritten for one install:

    python scripts/dependencies.py --lowest test gguf serve    # each at its declared lower bound
    python scripts/dependencies.py --latest test gguf serve    # names only: the newest releases

torch keeps its pin either way (this machine serves one CPU wheel; an unpinned torch pulls
CUDA). ``make test-oldest`` and ``make test-latest`` install what this prints.
"""
from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.\-]+)\s*(.*)$")
KEPT_AS_IS = {"torch"}


def declared(extras: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        found += project["optional-dependencies"][extra]
    unique = {}
    for requirement in found:
        name, _ = REQUIREMENT.match(requirement).groups()
        unique.setdefault(name.lower(), requirement)
    return list(unique.values())


def rewrite(requirement: str, mode: str) -> str:
    name, spec = REQUIREMENT.match(requirement).groups()
    if name.lower() in KEPT_AS_IS:
        return requirement
    if mode == "latest":
        return name
    lower = re.search(r">=\s*([^,\s]+)", spec)
    if lower is None:
        raise SystemExit(f"{requirement!r} declares no lower bound (>=): pyproject must say what it was tested with")
    return f"{name}=={lower.group(1)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--lowest", dest="mode", action="store_const", const="lowest")
    mode.add_argument("--latest", dest="mode", action="store_const", const="latest")
    parser.add_argument("extras", nargs="*", help="optional-dependency groups to include")
    args = parser.parse_args()
    print(" ".join(rewrite(r, args.mode) for r in declared(args.extras)))


if __name__ == "__main__":
    main()
