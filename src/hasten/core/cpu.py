"""What this CPU can do, read from /proc/cpuinfo (the ground floor: no torch, no other floor)."""
from __future__ import annotations


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bfloat16() -> str | None:
    """The CPU's bfloat16 instructions by name (AMX, AVX512-BF16), or None without any."""
    flags = cpu_flags()
    found = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    return " and ".join(found) or None
