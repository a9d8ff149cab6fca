"""Cost-aware draft sizing (``draft_size="auto"``) on the llama.cpp backend: the cost curve
is llama.cpp's own (timed once per GGUF file, threads and machine, cached on disk), and
auto sizing only cuts drafts, so greedy output still equals llama.cpp's own greedy
decoding. No test asserts a timing: curves are injected, and the one real calibration's
numbers are only checked for shape."""
from __future__ import annotations

import json

import pytest
import torch

import hasten
from hasten.drafters import Lookahead, PromptLookup
from hasten.engine import calibration
from hasten.engine.calibration import CostCurve
from hasten.engine.sizing import CostAwareSize
from hasten.models.llamacpp import LlamaCppModel

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed: pip install 'hasten[llamacpp]' (see docs/cpu.md)")
from test_llamacpp import NEW, llama_cpp_greedy, repetitive, tiny, tiny_gguf  # noqa: E402,F401  (fixtures)

FLAT = CostCurve((1, 64), (1.0, 1.0))
# llama.cpp's Q4_0 kernels on one CPU thread (SmolLM2-135M): rows four at a time, a leftover row
# costs a whole single step, so a block of 2 costs 2 steps and a block of 4 only 3
CHUNKED = CostCurve(tuple(range(1, 17)), tuple(3.0 * (n // 4) + (n % 4) for n in range(1, 17)))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMO", {})
    return tmp_path


def test_the_llama_cpp_cost_curve_is_timed_once_per_file_and_threads(tiny, tiny_gguf, private_cache, monkeypatch):
    timed = []
    timing_blocks = LlamaCppModel.timing_blocks
    monkeypatch.setattr(LlamaCppModel, "timing_blocks",
                        lambda self, *args: timed.append(self.threads) or timing_blocks(self, *args))
    curve = calibration.load_or_calibrate(tiny)
    assert curve.sizes[:16] == tuple(range(1, 17))  # every size up to 16: llama.cpp's kernels are chunked
    assert all(seconds > 0 for seconds in curve.seconds)
    files = list((private_cache / "cost").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["backend"] == "llama.cpp"
    calibration._MEMO.clear()  # as a new process would: the file alone answers
    assert calibration.load_or_calibrate(tiny) == curve and timed == [1]
    other = LlamaCppModel(tiny_gguf, threads=2, context=512)  # the same file on 2 threads: its own curve
    try:
        calibration.load_or_calibrate(other)
    finally:
        other.close()
    assert timed == [1, 2] and len(list((private_cache / "cost").glob("*.json"))) == 2


@pytest.mark.parametrize("drafter", [lambda: PromptLookup(num_tokens=8), lambda: Lookahead()],
                         ids=["prompt_lookup", "lookahead"])
@pytest.mark.parametrize("curve", [None, FLAT, CHUNKED], ids=["calibrated", "flat", "chunked"])
def test_greedy_with_auto_sizing_equals_llama_cpp_greedy(tiny, tiny_gguf, private_cache, drafter, curve):
    rule = "auto" if curve is None else CostAwareSize(curve, probe_gap=2)  # "auto": the file's own curve
    for seed in range(2):
        prompt = repetitive(tiny.vocab_size, seed=seed)
        out = hasten.generate(tiny, torch.tensor([prompt]), drafter=drafter(), max_new_tokens=NEW,
                              eos_token_id=[], draft_size=rule)
        assert out.sequences[0, len(prompt):].tolist() == llama_cpp_greedy(tiny_gguf, prompt, NEW, 512), f"seed {seed}"
        if curve is FLAT:  # free depth: the drafts reach llama.cpp
            assert out.stats.drafted_tokens > 0


def test_a_llama_cpp_batch_with_auto_sizing_decodes_each_row_as_llama_cpp_alone(tiny, tiny_gguf, private_cache):
    from hasten.engine.batch import Request, Scheduler

    scheduler = Scheduler(tiny, PromptLookup(num_tokens=6), max_batch=3, draft_size=CostAwareSize(CHUNKED))
    prompts = [repetitive(tiny.vocab_size, 16 + 4 * i, seed=i) for i in range(4)]
    ids = [scheduler.submit(Request(p, NEW, eos_token_ids=frozenset())) for p in prompts]
    out: dict[int, list[int]] = {}
    while scheduler.has_work():
        for update in scheduler.step():
            out.setdefault(update.row_id, []).extend(update.tokens)
    for row_id, prompt in zip(ids, prompts):
        assert out[row_id] == llama_cpp_greedy(tiny_gguf, prompt, NEW, 512), f"row {row_id}"
