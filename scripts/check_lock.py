"""Whether an environment holds exactly what a lock file names:

    .venv/bin/python scripts/check_lock.py requirements/lock.txt [more.lock ...]

Compares ``pip freeze`` of the running interpreter with the ``name==version`` lines of the
lock files; hasten itself (installed from this tree) is left out. Prints the differences and
exits 1 if there are any, else one line saying how many packages matched.
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
    differences = [f"  {name}: locked {locked.get(name, '-')}, installed {installed.get(name, '-')}"
                   for name in sorted(set(locked) | set(installed)) if locked.get(name) != installed.get(name)]
    if differences:
        print(f"the environment differs from {' + '.join(sys.argv[1:])}:", *differences, sep="\n")
        return 1
    print(f"environment matches {' + '.join(sys.argv[1:])}: {len(installed)} packages, every version as locked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
