"""A file too large for one transfer travels as numbered parts beside a manifest (its name,
size and SHA-256, and each part's), and is put back together where it lands."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_SUFFIX = ".parts.json"
CHUNK = 1 << 22


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def part_name(name: str, index: int) -> str:
    return f"{name}.part{index + 1}"


def manifest_path(directory: Path, name: str) -> Path:
    return directory / (name + MANIFEST_SUFFIX)


def split(source: Path, directory: Path, parts: int) -> dict:
    """Cut ``source`` into ``parts`` files of (nearly) equal size in ``directory``, with its manifest."""
    size = source.stat().st_size
    each = -(-size // parts)
    directory.mkdir(parents=True, exist_ok=True)
    listed = []
    with open(source, "rb") as file:
        for index in range(parts):
            target = directory / part_name(source.name, index)
            target.write_bytes(file.read(each))
            listed.append({"file": target.name, "bytes": target.stat().st_size, "sha256": sha256_of(target)})
    manifest = {"name": source.name, "bytes": size, "sha256": sha256_of(source), "parts": listed}
    manifest_path(directory, source.name).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def find_manifest(directory: Path) -> dict | None:
    found = sorted(directory.glob("*" + MANIFEST_SUFFIX)) if directory.is_dir() else []
    return json.loads(found[0].read_text()) if found else None


def missing_parts(directory: Path, manifest: dict) -> list[str]:
    """The parts not (or not wholly) in ``directory``; a part's content is checked at assembly."""
    return [part["file"] for part in manifest["parts"]
            if not (directory / part["file"]).is_file() or (directory / part["file"]).stat().st_size != part["bytes"]]


def assemble(directory: Path, target_dir: Path) -> tuple[Path | None, str]:
    """(the whole file in ``target_dir``, how it went); None while parts are missing or wrong.
    A file already assembled there (same size) is used as it is."""
    manifest = find_manifest(directory)
    if manifest is None:
        return None, f"no {MANIFEST_SUFFIX} manifest in {directory}"
    target = target_dir / manifest["name"]
    if target.is_file() and target.stat().st_size == manifest["bytes"]:
        return target, f"{target.name} already assembled"
    missing = missing_parts(directory, manifest)
    if missing:
        have = len(manifest["parts"]) - len(missing)
        return None, f"{have} of {len(manifest['parts'])} parts of {manifest['name']} here (missing {', '.join(missing)})"
    target_dir.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with open(scratch, "wb") as out:
        for part in manifest["parts"]:
            data = (directory / part["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                scratch.unlink()
                return None, f"{part['file']} is damaged (SHA-256 differs from the manifest)"
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        scratch.unlink()
        return None, f"{manifest['name']} assembled with another SHA-256 than the manifest's"
    os.replace(scratch, target)
    return target, f"{target.name} assembled from {len(manifest['parts'])} parts"
