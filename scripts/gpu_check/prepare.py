"""``scripts/gpu-check --prepare``, on this machine: what the GPU machine lacks goes into .gpu/
(the wheels of missing packages, SmolLM2's GGUF cut into parts that fit beside the working
tree in one transfer each), and the run commands are printed (docs/gpu.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .model_parts import manifest_path, split
from .steps import ROOT, SMOLLM2

TRANSFER_LIMIT = 64 * 2**20  # what one command carries: the working tree and the carried paths
MARGIN = 2**20  # for files that appear in the tree before the commands are run
GPU_PYTHON = "3.12"
# Missing on the GPU machine and needed by the check: transformers reads GGUF with gguf (its own
# needs, numpy, pyyaml, requests and tqdm, are there). The version is requirements/lock.txt's.
WHEELS = ("gguf==0.19.0",)
COMMAND = "python3 scripts/gpu-check $OUT"


def travelling_bytes(root: Path = ROOT) -> int:
    """Bytes of what every command sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((root / name).stat().st_size for name in set(listed) if name and (root / name).is_file())


def download_wheels(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    platforms = [arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for arg in ("--platform", tag)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", GPU_PYTHON, "--implementation", "cp", *platforms, "-d", str(directory),
                    *WHEELS], check=True)
    return sorted(directory.glob("*.whl"))


def smallest_part_count(model_bytes: int, room_first: int, room_rest: int) -> int:
    """Fewest equal parts of which the first fits ``room_first`` and every other ``room_rest``."""
    count = 1
    while -(-model_bytes // count) > min(room_first, room_rest):
        count += 1
    return count


def find_smollm2() -> Path:
    sys.path.insert(0, str(ROOT / "src"))
    from hasten.zoo import real

    return real.resolve("smollm2-135m")


def commands(parts_dir: Path, manifest: dict) -> list[dict]:
    relative = parts_dir.relative_to(ROOT)
    runs = []
    for index, part in enumerate(manifest["parts"]):
        carry = [f"{relative}/{part['file']}"]
        if index == 0:
            carry = [f"{relative}/wheels", f"{relative}/{manifest_path(parts_dir, manifest['name']).name}", *carry]
        runs.append({"carry": carry, "command": COMMAND, "timeout_s": 600})
    return runs


def prepare(parts_dir: Path, gguf: Path | None = None) -> list[dict]:
    gguf = gguf or find_smollm2()
    if gguf.name != SMOLLM2:
        raise SystemExit(f"expected {SMOLLM2} (its name finds the drafters shipped for it), got {gguf}")
    wheels = download_wheels(parts_dir / "wheels")
    wheel_bytes = sum(p.stat().st_size for p in wheels)
    tree = travelling_bytes()
    room = TRANSFER_LIMIT - tree - MARGIN
    count = smallest_part_count(gguf.stat().st_size, room - wheel_bytes - 4096, room)
    for old in parts_dir.glob(f"{SMOLLM2}.part*"):
        old.unlink()
    manifest = split(gguf, parts_dir, count)
    runs = commands(parts_dir, manifest)
    (parts_dir / "commands.json").write_text(json.dumps(runs, indent=1) + "\n")
    print(f"working tree {tree:,} bytes; wheels {wheel_bytes:,} bytes ({', '.join(p.name for p in wheels)}); "
          f"{gguf.name} {gguf.stat().st_size:,} bytes in {count} parts of <= {manifest['parts'][0]['bytes']:,}")
    for number, run in enumerate(runs, 1):
        print(f"run {number}: carry={json.dumps(run['carry'])} command={run['command']!r} timeout_s={run['timeout_s']}")
    return runs
