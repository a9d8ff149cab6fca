"""``hasten export DRAFTER_DIR --format vllm --out DIR``."""
from __future__ import annotations

import argparse
import json
import sys

from ..arguments import writable_directory
from ..loading import as_dtype
from .export import FORMATS, export


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", metavar="DRAFTER_DIR",
                        help="a trained drafter's directory (what `hasten train NAME --out DIR` wrote; packed or not)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the engine layout to write")
    parser.add_argument("--out", required=True, metavar="DIR", help="where config.json and model.safetensors go")
    parser.add_argument("--target", metavar="MODEL",
                        help="the model the drafter was trained for, when its LM head must be copied "
                        "(default: the target its config names)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="dtype of the written tensors (default float32; the engine casts to its own)")


def run(args: argparse.Namespace) -> int:
    out = writable_directory(args.out)
    exported = export(args.drafter, args.format, out, args.target, as_dtype(args.dtype))
    size = sum(t.numel() * t.element_size() for t in exported.tensors.values())
    print(f"hasten export: {len(exported.tensors)} tensors ({size / 1e6:.1f} MB) in {exported.engine}'s layout, "
          f"checked name by name, in {out}", file=sys.stderr)
    print(f"load it with {exported.usage.replace('OUT', json.dumps(str(out)))}")
    return 0


COMMANDS = [("export", "write a trained drafter in the layout vLLM loads (checked strictly)", add_arguments, run)]
