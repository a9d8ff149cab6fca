"""Cost-aware draft sizing (``draft_size="auto"``) on the llama.cpp backend: the cost curve
is llama.cpp's own (timed once per GGUF file, threads and machine, cached on disk), and
auto sizing only cuts drafts, so greedy output still equals llama.cpp's own greedy
decoding. No test asserts a timing: curves are injected, and the one real calibration's
numbers are only checked for shape. The scripted drafters (always right, always wrong) run on a
clock that charges each llama.cpp forward the recorded curve's time, so the rule's choices follow
the curve and the acceptance alone."""
from __future__ import annotations

import json

import pytest
import torch

import hasten
from hasten.drafters import Lookahead, PromptLookup
from hasten.drafters.base import StepResult
from hasten.engine import calibration
from hasten.engine.calibration import CostCurve
from hasten.engine.sequence import Sequence
from hasten.engine.sizing import CostAwareSize
from hasten.models.llamacpp import LlamaCppModel, LlamaCppTarget
from helpers import ScriptedDrafter

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed: pip install 'hasten[llamacpp]' (see docs/cpu.md)")
from test_llamacpp import NEW, llama_cpp_greedy, repetitive, tiny, tiny_gguf  # noqa: E402,F401  (fixtures)

FLAT = CostCurve((1, 64), (1.0, 1.0))
# llama.cpp's Q4_0 kernels on one CPU thread (SmolLM2-135M): rows four at a time, a leftover row
# costs a whole single step, so a block of 2 costs 2 steps and a block of 4 only 3
CHUNKED = CostCurve(tuple(range(1, 17)), tuple(3.0 * (n // 4) + (n % 4) for n in range(1, 17)))
# a block of k tokens costs k single steps: even a draft that is always right only ties with plain decoding
LINEAR = CostCurve(tuple(range(1, 17)), tuple(float(n) for n in range(1, 17)))
# the packaged SmolLM2 Q4_1 under llama.cpp, as measured (seconds): a block of 2 costs 1.97 steps,
# of 4 3.15 and of 8 5.18, so deep drafts pay when they are accepted and cost dearly when not
SMOLLM2_Q4_1 = CostCurve((1, 2, 3, 4, 8), (11.7e-3, 23.1e-3, 34.4e-3, 36.9e-3, 60.6e-3))
LONG = 200  # new tokens: room for the sizing rule's evidence and for a few of its probes


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


# ---- the rule on llama.cpp, with a scripted drafter of known acceptance and a recorded curve --------
class CurveClock:
    """The decode loop's clock for a test: time passes only in the llama.cpp forwards, each taking
    the recorded curve's seconds for its block. The rule then prices what the curve says, not the
    tiny model's microseconds (next to which the loop's own Python, counted as drafting, weighs
    a fifth of a forward) nor a busy machine's swings; drafting costs nothing, as a scripted
    drafter's microseconds next to SmolLM2's 12 ms forward nearly do."""

    def __init__(self, curve: CostCurve):
        self.curve, self.now = curve, 0.0

    def __call__(self) -> float:
        return self.now

    def priced(self, forward):
        """``forward`` (LlamaCppTarget.forward), charging the curve's seconds for each block."""
        def forward_at_recorded_cost(target, block, *args, **kwargs):
            self.now += self.curve(len(block))
            return forward(target, block, *args, **kwargs)
        return forward_at_recorded_cost


@pytest.fixture
def recorded_cost(monkeypatch):
    """Call with a curve: from then on the loop's steps take that curve's time; returns the clock."""
    def install(curve: CostCurve) -> CurveClock:
        clock = CurveClock(curve)
        monkeypatch.setattr(Sequence, "clock", staticmethod(clock))
        monkeypatch.setattr(LlamaCppTarget, "forward", clock.priced(LlamaCppTarget.forward))
        return clock
    return install


class LoggedScriptedDrafter(ScriptedDrafter):
    """A scripted drafter (always right or always wrong) that writes down how deep each step drafted
    (0: the sizing rule chose a plain step)."""

    def __init__(self, reference: list[int], num_tokens: int, mode: str):
        super().__init__(reference, num_tokens, mode)
        self.depths: list[int] = []

    def observe(self, ctx, result: StepResult) -> None:
        self.depths.append(result.max_depth)


def scripted_auto_run(tiny, tiny_gguf, clock: CurveClock, mode: str):
    """Greedy decoding of :data:`LONG` tokens with a scripted drafter (``mode``: "oracle", always
    right, or "adversarial", always wrong) sized by the cost-aware rule on the clock's curve; checks
    the output against llama.cpp's own greedy and returns (stats, the drafter's depth per step)."""
    prompt = repetitive(tiny.vocab_size, seed=0)
    reference = llama_cpp_greedy(tiny_gguf, prompt, LONG, 512)
    drafter = LoggedScriptedDrafter(prompt + reference, 4, mode)  # up to 4 deep, as a fixed size drafts it
    out = hasten.generate(tiny, torch.tensor([prompt]), drafter=drafter, max_new_tokens=LONG, eos_token_id=[],
                          draft_size=CostAwareSize(clock.curve))
    assert out.sequences[0, len(prompt):].tolist() == reference  # lossless whatever the rule chose
    return out.stats, drafter.depths


def test_drafts_that_are_never_accepted_are_refused_once_the_rule_has_evidence(tiny, tiny_gguf, recorded_cost):
    """SmolLM2's curve, on which a right draft 4 deep would pay (5 tokens for 3.66 steps), and a
    drafter that is always wrong: after its first draft (chosen on the prior alone) the rule runs
    plain steps but for probes that re-measure acceptance, one token deep (the shallowest depth
    that could show a gain) and, as each fails, further apart (64 plain steps at most). A fixed
    depth would draft 4 tokens a step and take 3.66 times as long as plain decoding."""
    clock = recorded_cost(SMOLLM2_Q4_1)
    stats, depths = scripted_auto_run(tiny, tiny_gguf, clock, "adversarial")
    assert stats.accepted_tokens == 0 and stats.steps == LONG
    probes = [depth for depth in depths[1:] if depth]
    assert probes and set(probes) == {1}, "probes are one token deep"
    assert stats.drafted_tokens <= 0.03 * stats.steps, "drafted positions: under 3% of the steps"
    plain_decoding = LONG * SMOLLM2_Q4_1(1)
    assert clock.now <= 1.03 * plain_decoding, "priced by the curve, the failed drafts cost under 3%"


def test_a_drafter_that_is_always_right_gets_its_drafts_used(tiny, tiny_gguf, recorded_cost):
    """SmolLM2's curve and a drafter that is always right: a quarter of the text at least comes
    from its drafts (how deep they settle: the next test)."""
    stats, _ = scripted_auto_run(tiny, tiny_gguf, recorded_cost(SMOLLM2_Q4_1), "oracle")
    assert stats.accepted_tokens == stats.drafted_tokens >= LONG / 4


def test_a_drafter_that_is_always_right_drafts_3_deep_or_more_once_the_rule_has_evidence(tiny, tiny_gguf,
                                                                                          recorded_cost):
    """SmolLM2's curve: 4 tokens cost 3.15 steps, 5 tokens 3.66: a draft 4 deep that is always
    accepted is worth 1.37 plain steps' tokens per second. (The exploration draw, which looks
    only at depths up to 1 on this curve, once replaced a deeper best depth by a plain step
    about half the time.)"""
    _, depths = scripted_auto_run(tiny, tiny_gguf, recorded_cost(SMOLLM2_Q4_1), "oracle")
    settled = depths[len(depths) // 2:]  # the rule has its evidence: the drafter is always right
    assert min(settled) >= 3, f"drafted depths once settled: {settled}"


def test_where_a_block_of_k_costs_k_steps_even_a_drafter_that_is_always_right_is_refused(tiny, tiny_gguf,
                                                                                       recorded_cost):
    """No draft can gain (at best it ties with a plain step), so the rule never drafts, not even
    a probe: the curve alone decides, whatever the acceptance."""
    stats, depths = scripted_auto_run(tiny, tiny_gguf, recorded_cost(LINEAR), "oracle")
    assert stats.drafted_tokens == 0 and stats.steps == LONG
    assert set(depths) == {0}
