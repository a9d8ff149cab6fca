"""Whether an environment holds exactly what a lock file names:

    .venv/bin/python scripts/check_lock.py requirements/lock.txt [more.lock ...]

Compares ``pip freeze`` of the running interpreter with the ``name==version`` lines of the
lock files (hasten itself, installed from this tree, is left out). A locked package missing
or at another version is a failure (exit 1). Packages the locks do not name are listed but
allowed: the opt-in installs (``make real``, ``make llamacpp``) add their own; a fresh
``make test`` environment has none.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PINNED = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        match = PINNED.match(line.strip())
        if match:
            found[canonical(match.group(1))] = match.group(2)
    return found


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    locked = {}
    for path in sys.argv[1:]:
        locked.update(pins(Path(path).read_text().splitlines()))
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], check=True, capture_output=True,
                            text=True).stdout.splitlines()
    installed = {name: version for name, version in pins(frozen).items() if name not in ("hasten", "pip")}
    differences = [f"  {name}: locked {version}, installed {installed.get(name, '-')}"
                   for name, version in sorted(locked.items()) if installed.get(name) != version]
    others = sorted(f"{name}=={version}" for name, version in installed.items() if name not in locked)
    names = " + ".join(sys.argv[1:])
    if differences:
        print(f"the environment differs from {names}:", *differences, sep="\n")
        return 1
    extra = f"; also installed, not locked (opt-in extras): {', '.join(others)}" if others else "; nothing else"
    print(f"environment matches {names}: {len(locked)} packages, every version as locked{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
