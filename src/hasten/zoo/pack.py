"""``python -m hasten.zoo.pack DIR...``: pack model directories in place into the zoo's shipped
form, or with ``--unpack`` write their float16 files back (see :mod:`hasten.zoo.packing`).

A drafter module trained into the zoo (``hasten train ... --out src/hasten/zoo/weights/<model>/<name>``)
ships after ``python -m hasten.zoo.pack src/hasten/zoo/weights/<model>/<name>``; the recipes pack
what they write themselves.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .packing import is_packed_file, pack, unpack_file


def unpack_in_place(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file() and is_packed_file(path):
            unpack_file(path, path.parent)
            path.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hasten.zoo.pack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--unpack", action="store_true", help="write the float16 files back, in place")
    args = parser.parse_args(argv)
    for directory in args.directories:
        if args.unpack:
            unpack_in_place(directory)
            print(f"{directory}: unpacked")
        else:
            written = pack(directory)
            print(f"{directory}: {len(written)} files packed, {sum(p.stat().st_size for p in written):,} bytes")


if __name__ == "__main__":
    main()
