"""Print, as one JSON line, the machine the GPU check runs on: Python, torch and CUDA, the GPU,
and the versions of the packages hasten reads (None: missing). ``--require-cuda``: exit 1
without a CUDA device, after printing."""
from __future__ import annotations

import json
import platform
import sys
from importlib import metadata

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "gguf", "numpy", "diffusers")


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def describe() -> dict:
    import torch

    info = {"python": platform.python_version(), "machine": platform.machine(),
            "packages": {name: version(name) for name in PACKAGES},
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info.update(gpu=properties.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=round(properties.total_memory / 2**30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    import hasten

    info["hasten_from"] = hasten.__file__
    return info


def main() -> int:
    info = describe()
    print(json.dumps(info))
    if "--require-cuda" in sys.argv[1:] and not info["cuda_available"]:
        print("no CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
