"""The soak script's short mode (scripts/soak.py --short): a server under mixed requests, some
streamed, some cancelled mid-stream, some not drafting, at 8 clients: no error, memory and KV
bytes flat after warm-up, every completed answer the one decoded alone."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import save_checkpoint

pytest.importorskip("openai", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def test_the_soak_passes_in_short_mode(tmp_path):
    model = save_checkpoint(tmp_path / "model")
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--short", "--model", model, "--requests", "48",
                          "--clients", "8", "--max-batch", "4", "--draft-size", "fixed", "--memory-slack", "0.1",
                          "--kv-cache-mib", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["answers_differing_from_alone"] == 0 and report["memory_flat"]
    assert report["cancelled"] > 0 and report["plain_requests"] > 0 and report["streamed"] > 0
