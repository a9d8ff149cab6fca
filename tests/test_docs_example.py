"""The drafter written out in docs/architecture.md works as the page says: registered by name,
configurable, and lossless like every other drafter."""
import re
from pathlib import Path

import hasten
from hasten.drafters import REGISTRY
from helpers import hf_greedy, repetitive_prompt, tiny_model

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_documented_drafter_runs_and_is_lossless():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    code = next(block for block in blocks if "class RepeatLast(Drafter)" in block)
    namespace: dict = {}
    try:
        exec(compile(code, str(PAGE), "exec"), namespace)
        drafter = hasten.drafters.create("repeat_last", num_tokens=3)
        model = tiny_model("llama")
        prompt = repetitive_prompt(12)
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=16)
        assert out.sequences.tolist() == hf_greedy(model, prompt, 16).tolist()
        assert out.stats.drafted_tokens > 0
    finally:
        REGISTRY.pop("repeat_last", None)  # keep the registry as other tests expect it
