"""Hardware-aware draft sizing (engine/sizing.py): the rule's choices on injected cost
curves, the calibration cache (engine/calibration.py), and losslessness (greedy equality,
sampled law) with auto sizing. No test times anything: cost curves are given, and the one
real calibration's numbers are never asserted."""
import functools
from types import SimpleNamespace

import pytest
import torch

import hasten
from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from hasten.drafters import DraftModel, Lookahead, PromptLookup
from hasten.engine import calibration
from hasten.engine.calibration import CostCurve
from hasten.core.estimate import AcceptanceCounts
from hasten.core.pricing import StepPrice
from hasten.engine.sizing import CostAwareSize, FixedSize, SizingState, sizing_rule
from helpers import ScriptedDrafter, TreeScriptedDrafter, hf_greedy, repetitive_prompt, tiny_model
from test_sampling_distribution import TARGET, bound, exact_law, peaky_model, sampled_law_tv

FLAT = CostCurve((1, 64), (1.0, 1.0))
STEEP = CostCurve((1, 2, 4, 8, 16), (1.0, 1.1, 1.4, 2.5, 5.0))  # a CPU-like curve: deep drafts cost
LINEAR = CostCurve((1, 2, 4, 8, 16), (1.0, 2.0, 4.0, 8.0, 16.0))  # every position costs a full forward


def observe_steps(rule, state, steps, depth, accepted, seconds_per_depth=0.0):
    """``steps`` steps of a chain drafter whose drafts are accepted ``accepted`` deep."""
    for _ in range(steps):
        chosen = rule.depth(state, depth)
        rule.observe(state, TokenTree.chain(chosen), min(accepted, chosen), seconds_per_depth * chosen, 1.0)


def known_state(curve, acceptance, depth=8):
    """A state as if ``acceptance`` had been measured at every depth over many steps."""
    counts = AcceptanceCounts(trials_by={None: [1000.0] * depth}, hits_by={None: [1000.0 * acceptance] * depth},
                              width=[1.0] * depth, reach=depth)
    return SizingState(counts, StepPrice(curve, scale=1.0), probe_gap=4)


def test_zero_acceptance_and_costly_drafting_means_no_draft():
    rule = CostAwareSize(FLAT)
    state = rule.begin(None)
    chosen = []
    for _ in range(60):  # a drafter that is never right and costs 0.2 forwards per level
        depth = rule.depth(state, 10)
        chosen.append(depth)
        rule.observe(state, TokenTree.chain(depth), 0, 0.2 * depth, 1.0)
    rates = rule.rates(state, 10)
    assert max(range(len(rates)), key=rates.__getitem__) == 0
    # plain steps but for rare probes and cheap exploratory drafts: drafting wastes <= 5% of the time
    wasted = sum(0.2 * depth for depth in chosen[-30:])
    assert chosen[-30:].count(0) >= 24 and wasted <= 0.05 * (30 + wasted)


def test_plain_steps_probe_now_and_then_and_back_off_after_failures():
    rule = CostAwareSize(FLAT, probe_gap=3, explore_scale=0.0)  # probes alone (no exploratory drafts)
    state = rule.begin(None)
    chosen = []
    for _ in range(160):  # a drafter that is never right
        depth = rule.depth(state, 10)
        chosen.append(depth)
        rule.observe(state, TokenTree.chain(depth), 0, 0.2 * depth, 1.0)
    assert set(chosen[20:]) == {0, 1}  # plain steps, and probes one deep
    probes = [i for i, depth in enumerate(chosen) if depth and i >= 20]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]  # plain steps between probes
    assert len(gaps) >= 2 and min(gaps) >= 3
    assert gaps == sorted(gaps) and gaps[-1] >= 2 * gaps[0]  # a failed probe doubles the gap


def test_a_successful_probe_brings_drafting_back():
    rule = CostAwareSize(FLAT, probe_gap=2)
    state = rule.begin(None)
    observe_steps(rule, state, 10, depth=4, accepted=0, seconds_per_depth=0.05)
    depths = []
    for _ in range(40):  # the drafter now guesses right whenever it drafts
        depth = rule.depth(state, 4)
        depths.append(depth)
        rule.observe(state, TokenTree.chain(depth), depth, 0.05 * depth, 1.0)
    assert depths[-1] == 4


BUMPY = CostCurve((1, 2, 4, 8, 16), (1.0, 1.65, 1.5, 1.75, 2.25))  # SmolLM2 (float32) on one CPU core


def first_failure_then_always_right(rule, seed=0, steps=30):
    state = rule.begin(None)
    state.draws.seed(seed)
    depths = []
    for step in range(steps):
        depth = rule.depth(state, 10)
        depths.append(depth)
        rule.observe(state, TokenTree.chain(depth), 0 if step == 0 else depth, 0.0, BUMPY(depth + 1))
    return depths


def test_one_early_failure_does_not_silence_a_good_drafter_where_exploring_is_cheap():
    probes_only = first_failure_then_always_right(CostAwareSize(BUMPY, explore_scale=0.0))
    assert probes_only[1:10] == [0] * 9  # one failure: the estimate falls and plain steps follow
    for seed in range(5):
        explored = first_failure_then_always_right(CostAwareSize(BUMPY), seed)
        assert min(explored[4:]) >= 8  # exploratory drafts soon find the drafter is right


def test_exploration_backs_off_from_a_drafter_that_is_never_right():
    """Where a failed draft costs little (a flat curve, drafting 3% of a step a level), the
    optimistic draws would keep choosing drafts of a drafter that is never right (drafting 6% of
    a step a level), each a small loss: 96 of 250 steps before the back-off. Each failed
    exploratory draft doubles the wait for the next, so only a handful are drafted (a drafter
    right at once still drafts on nearly every step)."""
    def drafted_steps(right: bool) -> int:
        rule = CostAwareSize(FLAT)
        state = rule.begin(None)
        depths = []
        for _ in range(300):
            depth = rule.depth(state, 6)
            depths.append(depth)
            rule.observe(state, TokenTree.chain(depth), depth if right else 0, 0.06 * depth, 1.0)
        return sum(1 for depth in depths[50:] if depth)

    assert drafted_steps(right=False) <= 10
    assert drafted_steps(right=True) >= 240


def test_no_exploration_where_a_failed_draft_costs_more_than_a_plain_step():
    rule = CostAwareSize(CHUNKED)  # llama.cpp Q4_0 on one CPU core: a block of 2 costs 2.04 steps
    state = known_state(CHUNKED, 0.5, depth=15)
    assert rule.exploring(state, rule.seconds_of(state, list(range(16)))) == (0.0, 0)
    state = known_state(STEEP, 0.5)
    assert rule.exploring(state, rule.seconds_of(state, list(range(9))))[1] == 5  # a block of 6 costs 1.95 steps, 7 2.2


def test_full_acceptance_on_a_flat_curve_drafts_as_deep_as_allowed():
    rule = CostAwareSize(FLAT)
    state = rule.begin(None)
    assert rule.depth(state, 6) == 6  # the first step sees how deep the drafter goes
    observe_steps(rule, state, 10, depth=6, accepted=6)
    assert rule.depth(state, 6) == 6
    assert rule.depth(state, 20) == 13  # up to twice the deepest seen (+1): reach can grow


def test_a_steep_cost_curve_picks_an_intermediate_depth():
    rule = CostAwareSize(STEEP)
    chosen = rule.depth(known_state(STEEP, 0.8), 8)
    assert 1 < chosen < 8
    rates = rule.rates(known_state(STEEP, 0.8), 8)
    assert rates[chosen] == max(rates)
    assert rule.depth(known_state(LINEAR, 0.8), 8) == 0  # a full forward per node never pays at 0.8
    assert rule.depth(known_state(FLAT, 0.8), 8) == 8


def test_acceptance_is_conditional_on_the_parent_depth():
    rule = CostAwareSize(FLAT, decay=1.0, prior_weight=0.0)  # counts only, no pseudo-steps
    state = rule.begin(None)
    rule.depth(state, 4)
    rule.observe(state, TokenTree.chain(4), 1, 0.0, 1.0)  # depth 1 accepted, depth 2 rejected
    assert state.counts.trials == [1.0, 1.0, 0.0, 0.0]  # depths 3 and 4 were never tried
    assert state.counts.hits == [1.0, 0.0, 0.0, 0.0]


def test_tree_widths_are_estimated_per_depth():
    rule = CostAwareSize(FLAT)
    state = rule.begin(None)
    tree = TokenTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1)])  # 3 nodes at depth 1, 2 at depth 2
    for _ in range(30):
        rule.depth(state, 2)
        rule.observe(state, tree, 1, 0.0, 1.0)
    assert state.counts.width == pytest.approx([3.0, 2.0], abs=0.01)


def test_a_drafter_with_a_node_budget_is_charged_at_most_its_largest_draft():
    rule = CostAwareSize(LINEAR)
    state = known_state(LINEAR, 0.9, depth=2)
    state.counts.width, state.counts.most_nodes = [6.0, 6.0], 12  # drafts cut at depth 2 spent a 12-node budget there
    rates = rule.rates(state, 6)
    accept = rule.estimator.acceptances(state.counts, 6)
    assert accept == pytest.approx([0.9] * 6, abs=0.01)  # measured at depths 1-2; deeper ones borrow depth 2's
    tokens = 1 + sum(torch.tensor(accept).cumprod(0).tolist())
    assert rates[6] == pytest.approx(tokens / LINEAR(13))  # 12 nodes + the root, not 36 + 1


def test_drafting_cost_is_fitted_as_fixed_plus_per_depth():
    rule = CostAwareSize(FLAT)
    state = rule.begin(None)
    rule.depth(state, 4)
    rule.observe(state, TokenTree.chain(4), 0, 9.0, 1.0)  # the first proposal read the whole prompt
    assert state.price.draft_cost() == (0.0, 0.0)  # ... so it does not count
    rule.observe(state, TokenTree.chain(4), 0, 0.7, 1.0)
    assert state.price.draft_cost() == pytest.approx((0.0, 0.7 / 4))  # one depth seen: all of it per depth
    for depth in (1, 2, 3, 4, 2, 1):
        rule.observe(state, TokenTree.chain(depth), 0, 0.3 + 0.1 * depth, 1.0)
    assert state.price.draft_cost() == pytest.approx((0.3, 0.1))


def test_drafting_cost_is_fitted_per_grade_each_grades_first_proposal_left_out():
    """A mixed drafter copies at some grades (cheap) and runs a predictor at others: each grade is
    priced by its own proposals once it has some, else by all of them; the first proposal at a
    grade (a predictor catching up with the whole prompt) is not a step's cost."""
    rule = CostAwareSize(FLAT)
    state = rule.begin(None)
    for grade, seconds in ((3, 0.5), (1, 9.0), (3, 0.4), (1, 2.0), (3, 0.4), (1, 2.0)):
        rule.depth(state, 4, evidence=grade)
        rule.observe(state, TokenTree.chain(4), 0, seconds, 1.0)
    assert state.price.draft_cost(3) == pytest.approx((0.0, 0.1))  # its own: 0.4 s for 4 deep
    assert state.price.draft_cost(1) == pytest.approx((0.0, 0.5))  # 2.0 s, the first 9.0 s left out
    assert state.price.draft_cost(2)[1] == pytest.approx(state.price.draft_cost()[1])  # not seen: every grade's
    assert 0.1 < state.price.draft_cost()[1] < 0.5


def test_a_new_generation_prices_drafting_at_what_it_cost_in_the_ones_before():
    """A server's rows are short: were each generation's drafting priced at nothing until timed
    (its first proposal is not), a drafter that does not pay would draft again at every new row."""
    rule = CostAwareSize(FLAT)
    earlier = rule.begin(None)
    for depth, seconds in ((4, 9.0), (1, 0.4), (2, 0.5), (3, 0.6), (1, 0.4)):  # the first read the whole prompt
        rule.drafted(earlier, None, [1] * depth, seconds)
    later = rule.begin(None)
    assert later.price.draft_cost() == pytest.approx((0.3, 0.1))  # the same fit, before any proposal of its own
    assert later.price.drafting.sums[0] == pytest.approx(1.0)  # worth one proposal: its own soon outweigh it
    assert CostAwareSize(FLAT).begin(None).price.draft_cost() == (0.0, 0.0)  # a rule with no history: nothing known


def test_probes_and_explorations_back_off_across_generations():
    """A drafter that was never right in the generations before is not probed and explored afresh
    at every new one: a new generation starts from the back-off the latest one reached."""
    rule = CostAwareSize(FLAT, probe_gap=2)

    def drafted_steps(state, steps=40):
        drafted = 0
        for _ in range(steps):
            depth = rule.depth(state, 10)
            drafted += depth > 0
            rule.observe(state, TokenTree.chain(depth), 0, 0.2 * depth, 1.0)
        return drafted

    first = drafted_steps(rule.begin(None))
    for _ in range(5):
        drafted_steps(rule.begin(None))
    later = rule.begin(None)
    assert later.probe_gap > 2 and later.explore_wait == later.explore_gap > 0
    assert drafted_steps(later) < first


def test_a_new_generation_waits_for_its_probe_where_the_ones_before_backed_off():
    """A generation's first draft may run a trained drafter over the whole prompt (1-2k tokens on
    Spec-Bench's summaries): where the generations before found no depth that pays and backed
    their probes off, a new one starts plain and probes only after as many plain steps."""
    rule = CostAwareSize(FLAT, probe_gap=2, explore_scale=0.0)
    assert rule.depth(rule.begin(None), 10) > 0  # no history: the first step probes at once
    for _ in range(6):  # generations whose drafts never get a token accepted
        observe_steps(rule, rule.begin(None), 40, depth=10, accepted=0, seconds_per_depth=0.2)
    later = rule.begin(None)
    gap, depths = later.probe_gap, []
    assert gap > 2  # the back-off the generations before reached
    for _ in range(gap + 1):
        depth = rule.depth(later, 10)
        depths.append(depth)
        rule.observe(later, TokenTree.chain(depth), 0, 0.2 * depth, 1.0)
    assert depths == [0] * gap + [1]  # plain steps, then a probe one deep


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve((1, 2, 4), (1.0, 2.0, 3.0))
    assert curve(3) == pytest.approx(2.5)
    assert curve(8) == pytest.approx(5.0)
    assert curve(0) == 1.0


def test_a_curve_and_a_batch_cost_price_an_array_as_they_price_each_size():
    """The batch plan prices every row's options at once: the same numbers, bit for bit, as one
    size at a time, below the first point, between points, on them, past the last, and on a
    curve that dips."""
    import numpy as np

    from hasten.core.cost import BatchCost

    sizes = np.array([0.0, 0.5, 1.0, 1.7, 2.0, 3.3, 4.0, 7.9, 64.0, 101.5])
    for curve in (CostCurve((1, 2, 4), (1.0, 2.0, 3.0)), CostCurve((3,), (0.7,)),
                  CostCurve((1, 4, 5, 8), (1.0, 1.0, 1.6, 0.9)), CPU_BATCH):
        assert curve(sizes).tolist() == [curve(float(size)) for size in sizes]
        price = BatchCost(CostCurve((1, 8, 32), (1.1, 1.5, 4.0)), 0.0005, 96).pricer(curve, 6)
        keys = sizes * 150.0
        assert price(sizes, keys).tolist() == [price(float(p), float(k)) for p, k in zip(sizes, keys)]


def test_sizing_rule_names():
    assert isinstance(sizing_rule("fixed"), FixedSize)
    assert isinstance(sizing_rule("auto"), CostAwareSize)
    with pytest.raises(ValueError, match="auto"):
        sizing_rule("deep")


# ---- the calibration cache -------------------------------------------------------------------------------
def test_calibration_is_written_once_and_reused_per_model_and_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMO", {})
    runs = []
    real = calibration.calibrate
    monkeypatch.setattr(calibration, "calibrate", lambda model: runs.append(model) or real(model, sizes=(1, 4), reps=1))
    model = tiny_model("llama")
    first = calibration.load_or_calibrate(model)
    files = list((tmp_path / "cost").glob("*.json"))
    assert len(runs) == 1 and len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    calibration._MEMO.clear()  # as a new process would: the file alone must answer
    assert calibration.load_or_calibrate(model) == first
    assert len(runs) == 1 and files[0].stat().st_mtime_ns == stamp
    calibration.load_or_calibrate(tiny_model("llama", num_hidden_layers=1))  # another model: its own curve
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # other threads: another curve
        calibration.load_or_calibrate(model)
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 3 and len(list((tmp_path / "cost").glob("*.json"))) == 3


def test_a_damaged_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMO", {})
    monkeypatch.setattr(calibration, "calibrate", lambda model: STEEP)
    model = tiny_model("llama")
    path = calibration.cost_file(calibration.calibration_key(model))
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert calibration.load_or_calibrate(model) == STEEP
    assert '"sizes"' in path.read_text()


# ---- losslessness with auto sizing -----------------------------------------------------------------------
NEW = 40


def auto(curve=STEEP):
    return CostAwareSize(curve, probe_gap=2)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompt():
    return repetitive_prompt(24)


@pytest.fixture(scope="module")
def reference(target, prompt):
    return hf_greedy(target, prompt, NEW)


def drafters(reference):
    ref = reference[0].tolist()
    return {
        "prompt_lookup": PromptLookup(num_tokens=8),
        "lookahead": Lookahead(),
        "draft_model": DraftModel(tiny_model("llama", seed=1), num_tokens=5),
        "oracle": ScriptedDrafter(ref, 8, "oracle"),
        "adversarial": ScriptedDrafter(ref, 8, "adversarial"),
        "error_at_2": ScriptedDrafter(ref, 8, 2),
        "tree": TreeScriptedDrafter(ref, depth=4, width=3, error_at=3),
    }


@pytest.mark.parametrize("name", ["prompt_lookup", "lookahead", "draft_model", "oracle", "adversarial",
                                  "error_at_2", "tree"])
@pytest.mark.parametrize("curve", [FLAT, STEEP, LINEAR], ids=["flat", "steep", "linear"])
def test_greedy_output_is_unchanged_by_auto_sizing(target, prompt, reference, name, curve):
    drafter = drafters(reference)[name]
    out = hasten.generate(target, prompt, drafter=drafter, max_new_tokens=NEW, draft_size=auto(curve))
    assert out.sequences.tolist() == reference.tolist()


def test_auto_sizing_skips_drafting_for_a_drafter_that_is_always_wrong(target, prompt, reference):
    drafter = ScriptedDrafter(reference[0].tolist(), 8, "adversarial")
    rule = CostAwareSize(LINEAR, probe_gap=4)
    out = hasten.generate(target, prompt, drafter=drafter, max_new_tokens=NEW, draft_size=rule)
    assert out.sequences.tolist() == reference.tolist()
    assert drafter.calls < out.stats.steps // 2  # most steps were plain: no proposal at all
    fixed = ScriptedDrafter(reference[0].tolist(), 8, "adversarial")
    hasten.generate(target, prompt, drafter=fixed, max_new_tokens=NEW, draft_size="fixed")
    assert fixed.calls == NEW - 1  # every step but the last (whose budget is 1) drafted


def test_auto_sizing_drafts_the_whole_budget_for_an_oracle_on_a_flat_curve(target, prompt, reference):
    drafter = ScriptedDrafter(reference[0].tolist(), 8, "oracle")
    out = hasten.generate(target, prompt, drafter=drafter, max_new_tokens=NEW, draft_size=auto(FLAT))
    assert out.sequences.tolist() == reference.tolist()
    # deep drafts from the first step on (8 + the bonus: 5 steps), a little shallower while
    # the acceptance estimate climbs from its prior, never a plain step
    assert out.stats.steps <= 7 and out.stats.drafted_at_depth[0] == out.stats.steps


def test_sampled_law_is_unchanged_by_auto_sizing(monkeypatch):
    sampling = Sampling(1.0, top_k=3)
    rule = CostAwareSize(STEEP, probe_gap=1)
    monkeypatch.setattr(hasten, "generate", functools.partial(hasten.generate, draft_size=rule))
    samples = 600
    tv = sampled_law_tv(TARGET, DraftModel(peaky_model(5), num_tokens=3), sampling, 2, 4, samples)
    assert tv < bound(exact_law(TARGET, sampling, 2), samples)


def test_engine_and_load_take_draft_size(tmp_path, monkeypatch):
    from hasten.api import Engine
    from helpers import tiny_tokenizer

    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMO", {})
    monkeypatch.setattr(calibration, "calibrate", lambda model: STEEP)  # no timing in tests
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    fixed = hasten.load(model, "prompt_lookup", tokenizer=tokenizer, draft_size="fixed")
    assert not list((tmp_path / "cost").glob("*.json"))  # fixed sizes need no calibration
    engine = hasten.load(model, "prompt_lookup", tokenizer=tokenizer)  # unset: auto
    assert fixed.draft_size == "fixed" and engine.draft_size is None
    assert list((tmp_path / "cost").glob("*.json"))  # calibrated at load
    prompt = "def add(a, b):\n    return a + b\n" * 3
    assert engine.generate(prompt, max_new_tokens=24).token_ids == fixed.generate(prompt, max_new_tokens=24).token_ids
    sampled = dict(max_new_tokens=24, temperature=0.9, seed=5)  # seeded sampling: unset means fixed, reproducible
    assert engine.generate(prompt, **sampled).token_ids == fixed.generate(prompt, **sampled).token_ids
    with pytest.raises(ValueError, match="draft_size"):
        Engine(model, tokenizer, None, "autoregressive", draft_size="deep")


# ---- the command line and the benchmark ------------------------------------------------------------------
@pytest.fixture
def no_calibration(tmp_path, monkeypatch):
    """Auto sizing with a given cost curve (tests never time the machine) and a private cache."""
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "_MEMO", {})
    monkeypatch.setattr(calibration, "calibrate", lambda model: STEEP)


def test_generate_takes_draft_size(tmp_path, no_calibration, capsys):
    import json

    from hasten.cli import main
    from helpers import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "ckpt")
    outputs = {}
    for size in ("auto", "fixed"):
        code = main(["generate", "--model", checkpoint, "--prompt", "def add(a, b):\n    return a + b\n" * 2,
                     "--max-new-tokens", "12", "--draft-size", size, "--json"])
        record = json.loads(capsys.readouterr().out)
        assert code == 0 and record["draft_size"] == size
        outputs[size] = record["token_ids"]
    assert outputs["auto"] == outputs["fixed"]
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", checkpoint, "--prompt", "x", "--draft-size", "deep"])
    assert exited.value.code == 2 and "--draft-size" in capsys.readouterr().err


def test_bench_times_each_method_with_each_sizing(target, prompt, no_calibration):
    from hasten.bench.cli import draft_sizes
    from hasten.bench.runner import hasten_method, run_bench
    from hasten.bench.tasks import Task
    from hasten.arguments import UserError

    sizes = draft_sizes("auto,fixed")
    assert sizes == ["auto", "fixed"]
    with pytest.raises(UserError, match="draft-size"):
        draft_sizes("auto,deep")
    methods = [hasten_method("autoregressive", target)]
    methods += [hasten_method("prompt_lookup", target, None, size, "prompt_lookup" if size == "auto" else
                              "prompt_lookup@fixed") for size in sizes]
    results = run_bench(methods, [Task("t-1", "copy", "")], [prompt], 16, repeats=1, progress=False)
    rows = {row["method"]: row for row in results["by_task"][0]["rows"]}
    assert set(rows) == {"autoregressive", "prompt_lookup", "prompt_lookup@fixed"}
    assert {m["name"]: m.get("draft_size") for m in results["methods"]} == {
        "autoregressive": None, "prompt_lookup": "auto", "prompt_lookup@fixed": "fixed"}


# ---- batches: one plan for all rows ------------------------------------------------------------------
def planned_depth(curve, acceptances, limit=8):
    rule = CostAwareSize(curve)
    states = [known_state(curve, acceptance) for acceptance in acceptances]
    for state in states:
        rule.share(state, len(states))
    rule.plan(states, [limit] * len(states), [None] * len(states))
    depths = {rule.depth(state, limit) for state in states}
    assert len(depths) == 1, "every row of a batch drafts to the planned depth"
    return depths.pop()


def test_a_batch_drafts_deep_when_the_forward_is_flat_and_not_when_every_position_costs():
    assert planned_depth(FLAT, [0.8] * 16) == 8  # a GPU at small batch: positions are free
    assert planned_depth(LINEAR, [0.8] * 16) == 0  # every position a full forward: drafting cannot pay
    one = planned_depth(STEEP, [0.8])  # the same curve, one row: the forward's knee is far away
    many = planned_depth(STEEP, [0.8] * 8)  # eight rows reach the steep part 8x sooner
    assert one > many


def test_a_few_good_rows_do_not_make_the_whole_batch_pay_for_padding():
    curve = CostCurve((1, 16, 64, 256), (1.0, 1.2, 3.0, 12.0))
    good_alone = planned_depth(curve, [0.9] * 2)
    mixed = planned_depth(curve, [0.9] * 2 + [0.05] * 14)
    assert good_alone > 0 and mixed < good_alone


def test_a_batch_waits_for_every_row_to_have_drafted_once():
    rule = CostAwareSize(LINEAR)
    fresh, known = CostAwareSize(LINEAR).begin(None), known_state(LINEAR, 0.1)
    for state in (fresh, known):
        rule.share(state, 2)
    rule.plan([fresh, known], [6, 6], [None, None])
    assert rule.depth(fresh, 6) == 6  # not drafted yet: see how deep it goes


def test_batched_auto_sizing_stays_lossless():
    model = tiny_model("qwen2")
    prompts = [repetitive_prompt(12, seed)[0] for seed in range(3)]
    references = [hf_greedy(model, p[None], 24)[0].tolist() for p in prompts]
    rule = CostAwareSize(STEEP)
    out = hasten.generate(model, prompts, drafter=PromptLookup(), max_new_tokens=24, draft_size=rule)
    assert [s.tolist() for s in out.sequences] == references


# ---- a chunked cost curve: llama.cpp's Q4_0 kernels on one CPU thread --------------------------------------
# SmolLM2-135M Q4_0, 1 thread, measured once (seconds / a single token's): rows go four at a time and a
# leftover row costs about a whole step, so a block of 2 costs 2 steps but a block of 4 only 3
CHUNKED = CostCurve(tuple(range(1, 17)), (1.0, 2.04, 3.23, 2.98, 4.12, 4.13, 5.27, 4.69, 5.84, 6.11, 7.26, 7.03,
                                          8.27, 8.28, 9.47, 8.57))


def test_the_probe_is_the_shallowest_depth_that_could_pay():
    rule = CostAwareSize(FLAT)
    assert rule.probe_depth(known_state(FLAT, 0.0), 8) == 1
    assert rule.probe_depth(known_state(CHUNKED, 0.0, depth=15), 15) == 3  # 2 drafts in 3.23 steps: never a gain
    assert rule.probe_depth(known_state(LINEAR, 0.0), 8) == 0  # no depth can pay: nothing to probe for


def test_on_a_chunked_curve_a_drafter_never_right_gets_plain_steps_and_rare_probes_three_deep():
    rule = CostAwareSize(CHUNKED, probe_gap=3)
    state = rule.begin(None)
    chosen = []
    for _ in range(200):
        depth = rule.depth(state, 15)
        chosen.append(depth)
        rule.observe(state, TokenTree.chain(depth), 0, 0.0, CHUNKED(depth + 1))
    assert chosen[0] == 3  # the first draft: the prior (0.5) never pays here, so a probe's depth
    assert set(chosen[20:]) == {0, 3} and chosen[20:].count(0) >= 0.9 * 180


def test_on_a_chunked_curve_a_drafter_always_right_drafts_deep():
    rule = CostAwareSize(CHUNKED)
    state = rule.begin(None)
    chosen = []
    for _ in range(30):
        depth = rule.depth(state, 15)
        chosen.append(depth)
        rule.observe(state, TokenTree.chain(depth), depth, 0.0, CHUNKED(depth + 1))
    assert chosen[0] == 3 and chosen[-1] >= 7  # reach grows past the costly block of 5 to 8 and more


def test_an_empty_proposal_is_not_a_failed_probe():
    rule = CostAwareSize(FLAT, probe_gap=2, probe_share=0.03)  # probes often enough to see them here
    state = rule.begin(None)
    observe_steps(rule, state, 40, depth=4, accepted=0, seconds_per_depth=0.2)  # never right: plain steps
    while rule.depth(state, 4) == 0:
        rule.observe(state, TokenTree.chain(0), 0, 0.0, 1.0)
    gap = state.probe_gap
    rule.observe(state, TokenTree.chain(0), 0, 0.0, 1.0)  # the drafter had no match: nothing was tried
    assert state.probe_gap == gap and rule.depth(state, 4) > 0  # so the next step probes again


def run_graded_steps(rule, state, steps, limit=15):
    """A chain drafter whose drafts graded 3 (every fourth step) are always right and those
    graded 1 always wrong; returns the depths chosen per grade and tokens per forward cost."""
    chosen, tokens, cost = {1: [], 3: []}, 0, 0.0
    for i in range(steps):
        grade = 3 if i % 4 == 0 else 1
        depth = rule.depth(state, limit, grade if rule.uses_evidence else None)
        chosen[grade].append(depth)
        accepted = depth if grade == 3 else 0
        rule.observe(state, TokenTree.chain(depth), accepted, 0.0, CHUNKED(depth + 1))
        tokens, cost = tokens + accepted + 1, cost + CHUNKED(depth + 1)
    return chosen, tokens / cost


def test_evidence_classes_keep_their_own_acceptance():
    rule = CostAwareSize(CHUNKED)
    chosen, rate = run_graded_steps(rule, rule.begin(None), 200)
    assert min(chosen[3][10:]) >= 7  # the sure class drafts deep ...
    assert chosen[1][20:].count(0) >= 0.9 * len(chosen[1][20:])  # ... the unsure one gets plain steps

    class Ungraded(CostAwareSize):  # the same rule, not told the grades: one pooled estimate
        uses_evidence = False

    ungraded = Ungraded(CHUNKED)
    _, pooled_rate = run_graded_steps(ungraded, ungraded.begin(None), 200)
    assert rate > 1.3 * pooled_rate  # grades turn a mix that never pays pooled into one that does
    assert pooled_rate < 1.05  # pooled, drafting barely beats (or loses to) plain steps


@pytest.mark.parametrize("curve", [STEEP, CHUNKED], ids=["cheap probes", "probes dearer than a step"])
def test_an_unseen_evidence_class_is_explored_at_once_where_a_probe_is_cheap(curve):
    """Where a failed probe costs less than a plain step, a grade never drafted gets a probe's
    depth at once; where it costs more (llama.cpp on a CPU: a block of 4 costs 3 steps), it
    waits for the probes like any other grade."""
    rule = CostAwareSize(curve, explore_scale=0.0)
    state = rule.begin(None)
    for _ in range(40):  # grade 1: always wrong, so plain steps follow
        depth = rule.depth(state, 15, 1)
        rule.observe(state, TokenTree.chain(depth), 0, 0.0, 1.0)
    assert rule.depth(state, 15, 1) == 0
    probe = rule.probe_depth(state, 15)
    assert probe == (1 if curve is STEEP else 3)
    if curve is STEEP:
        assert rule.depth(state, 15, 2) >= probe  # a grade never drafted: at least a probe, without waiting
    else:
        assert rule.is_steep(state, 15) and rule.depth(state, 15, 2) == 0


def test_prompt_lookup_grades_its_copy_by_how_long_the_match_is():
    from hasten.drafters.base import DraftContext
    from hasten.drafters import ngram as pl

    def graded(tokens, source=None):
        drafter = PromptLookup(num_tokens=4)
        ctx = DraftContext(list(tokens), 4, Sampling(), None, None, source)
        ctx.state = drafter.begin(ctx)
        grade = drafter.evidence(ctx)
        draft = drafter.propose(ctx)
        fresh = PromptLookup(num_tokens=4)
        ctx2 = DraftContext(list(tokens), 4, Sampling(), None, None, source)
        ctx2.state = fresh.begin(ctx2)
        assert draft.tokens == fresh.propose(ctx2).tokens  # grading first never changes the draft
        return grade, draft.tokens

    text = list(range(10, 40))  # 30 distinct tokens
    assert graded(text) == (pl.NO_MATCH, ())
    assert graded([9, 1, 2, 3, 50, 60, 70, 80, 1, 2, 3]) == (pl.SHORT_MATCH, (50, 60, 70, 80))
    assert graded(text[:12] + [99] + text[:10]) == (pl.MEDIUM_MATCH, (*text[10:12], 99, text[0]))  # 10 match
    assert graded(text + [99] + text[:20]) == (pl.LONG_MATCH, tuple(text[20:24]))
    assert graded([99, 98], source=text[:20] + [7, 8]) == (pl.NO_MATCH, ())
    assert graded(text[:17], source=text + [7]) == (pl.LONG_MATCH, tuple(text[17:21]))  # the encoder input


def test_lookahead_grades_its_draft_by_suffix_length_and_repeats():
    from hasten.drafters.base import DraftContext

    def graded(tokens):
        drafter = Lookahead()
        target = SimpleNamespace(vocab_size=100)  # what a drafter reads of the target here
        ctx = DraftContext(list(tokens), 6, Sampling(), None, target)
        ctx.state = drafter.begin(ctx)
        grade, draft = drafter.evidence(ctx), drafter.propose(ctx)
        fresh = DraftContext(list(tokens), 6, Sampling(), None, target)
        fresh.state = drafter.begin(fresh)
        assert draft.tokens == drafter.propose(fresh).tokens  # grading first never changes the draft
        return grade, draft.tokens[:1]

    assert graded([1, 2, 3, 4, 5]) == (0, ())  # nothing recurs
    assert graded([7, 1, 8, 1]) == (1, (8,))  # a 1-token suffix, followed once
    assert graded([7, 1, 8, 1, 8, 6, 1]) == (2, (8,))  # ... followed twice
    # queries are at most max_prefix (2, the reference's max_query_length) tokens long
    assert graded([1, 2, 3, 4, 5, 1, 2, 3]) == (3, (4,))  # a 2-token query, followed once
    assert graded([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]) == (4, (4,))  # ... followed twice


def test_an_unset_draft_size_is_auto_but_fixed_for_seeded_sampling():
    from hasten.engine.sizing import default_size

    assert default_size(None, sampled=False, seeded=True) == "auto"  # greedy: the text is the same either way
    assert default_size(None, sampled=True, seeded=False) == "auto"
    assert default_size(None, sampled=True, seeded=True) == "fixed"  # a seed must give the same text every run
    assert default_size("auto", sampled=True, seeded=True) == "auto"  # asked for: kept
    assert isinstance(sizing_rule(None), CostAwareSize)


# ---- a packed batch: each row's depth from the whole step's cost ------------------------------------------
CPU_BATCH = CostCurve((1, 4, 8, 16, 32, 64, 128), (1.0, 1.0, 1.26, 2.0, 3.5, 6.6, 13.0))  # SmolLM2-like, one thread


def packed_states(acceptances: list[float], depth: int = 8) -> list[SizingState]:
    states = [known_state(CPU_BATCH, a, depth) for a in acceptances]
    for state in states:
        state.price.packed = True
    return states


def plan(states, contexts=None, others=0):
    rule = CostAwareSize(CPU_BATCH)
    rule.plan(states, [8] * len(states), [None] * len(states), others, 0, contexts or [0] * len(states))
    return [state.cap for state in states]


def test_a_packed_batch_drafts_deep_when_light_and_not_at_all_when_heavy():
    assert plan(packed_states([0.8]))[0] >= 4  # one row: positions are nearly free
    assert plan(packed_states([0.8] * 4))[0] >= 1
    assert plan(packed_states([0.8] * 32)) == [0] * 32  # 32 rows: a draft position costs what a row's step does


def test_a_packed_batch_drafts_for_the_rows_likely_to_be_right_first():
    caps = plan(packed_states([0.95, 0.3, 0.95, 0.3] + [0.5] * 4))
    assert min(caps[0], caps[2]) > 0 and abs(caps[0] - caps[2]) <= 1 and caps[1] == caps[3] == 0
    assert min(caps[0], caps[2]) >= max(caps[4:])


def test_draft_positions_on_a_long_cache_cost_their_attention():
    from hasten.core.cost import BatchCost

    states = packed_states([0.9, 0.9])
    cost = BatchCost(CostCurve((1, 64), (1.0, 1.0)), 0.002, 96)  # a position over 1,000 cached keys: 2 forwards
    for state in states:
        state.price.batch_cost = cost
    short, long = plan(states, contexts=[100, 2000])
    assert short > long


def test_the_packed_plan_never_drafts_when_drafts_are_never_right():
    assert plan(packed_states([0.0] * 4)) == [0] * 4


def test_the_packed_plan_drafts_only_where_it_beats_plain_decoding_by_more_than_the_models_error():
    """Eight rows right 70% of the time: one draft token each would pay a little, less than
    ``BATCH_MARGIN``, so the batch runs plain; rows right 90% of the time clear it and draft."""
    from hasten.core import sizing

    assert plan(packed_states([0.7] * 8)) == [0] * 8
    sizing_margin = sizing.BATCH_MARGIN
    try:
        sizing.BATCH_MARGIN = 0.0  # without the margin the same rows would draft: the margin decided
        assert any(plan(packed_states([0.7] * 8)))
    finally:
        sizing.BATCH_MARGIN = sizing_margin
    assert all(plan(packed_states([0.9] * 8)))


def probes_in(rows: int, steps: int = 64) -> int:
    """Probes a packed batch of ``rows`` rows, each right a tenth of the time (they run plain),
    runs in ``steps`` steps of the plan (each step as the loop runs it: the plan, then each row's
    depth)."""
    states = packed_states([0.1] * rows)
    rule = CostAwareSize(CPU_BATCH)
    probes = 0
    for state in states:
        state.price.rows = rows
    for _ in range(steps):
        rule.plan(states, [8] * rows, [None] * rows, 0, 0, [0] * rows)
        probes += sum(state.probing for state in states)
        for state in states:
            rule.depth(state, 8)
    return probes


def test_a_packed_batch_probes_its_plain_rows_by_what_a_probe_costs_in_its_step():
    """Rows that run plain probe now and then; a probe's position costs more of a row's share
    of the step in a full batch than in a small one, so a full batch probes each row rarely
    (failed probes at most ``probe_share`` of the time)."""
    assert probes_in(2) / 2 > 2 * probes_in(32) / 32
    assert probes_in(32) / (32 * 64) <= 1 / 16


def test_the_packed_plans_ceiling_skips_only_searches_that_would_end_in_plain_decoding(monkeypatch):
    """The packed plan skips its search where even its ceiling (every row's best gain at its
    best gain per position, for the forward those positions cost) cannot beat plain decoding by
    the margin: over batches of many sizes, acceptances and cache lengths, on a rising curve and
    one that dips (llama.cpp's four-row kernels), the plans with the skip equal the plans
    searched in full, and some batches are not searched at all."""
    import math
    import random

    from hasten.core.cost import BatchCost

    dipping = CostCurve((1, 4, 5, 8, 16, 32, 64), (1.0, 1.0, 1.6, 1.3, 2.0, 3.5, 6.6))
    draws = random.Random(7)
    real_ceiling, real_pricer = StepPrice.batch_ceiling, StepPrice.batch_pricer

    def plan_of(curve, acceptances, contexts, cost, search_all: bool) -> tuple[list[int], int]:
        """The rows' depths, and how many forwards the plan priced."""
        states = [known_state(curve, a, 8) for a in acceptances]
        for state in states:
            state.price.packed, state.price.batch_cost = True, cost
        priced = []
        monkeypatch.setattr(StepPrice, "batch_ceiling",
                            (lambda self, *args: math.inf) if search_all else real_ceiling)

        def counted_pricer(self, rows):
            price = real_pricer(self, rows)
            return lambda *args: priced.append(args) or price(*args)

        monkeypatch.setattr(StepPrice, "batch_pricer", counted_pricer)
        CostAwareSize(curve).plan(states, [8] * len(states), [None] * len(states), 0, 0, contexts)
        return [state.cap for state in states], len(priced)

    skips = drafted = 0
    for curve in (CPU_BATCH, dipping):
        for cost in (None, BatchCost(CostCurve((1, 8, 32), (1.1, 1.5, 4.0)), 0.0005, 96)):
            for rows in (1, 2, 3, 5, 8, 16, 32):
                for _ in range(3):
                    acceptances = [draws.choice([0.0, 0.1, 0.5, 0.7, 0.9, 0.99]) for _ in range(rows)]
                    contexts = [draws.randrange(0, 3000) for _ in range(rows)]
                    caps, priced = plan_of(curve, acceptances, contexts, cost, search_all=False)
                    full_caps, full_priced = plan_of(curve, acceptances, contexts, cost, search_all=True)
                    assert caps == full_caps, (rows, acceptances)
                    skips += priced < full_priced
                    drafted += any(caps)
    assert skips >= 3 and drafted >= 10  # both kinds of batch were planned
    caps, priced = plan_of(CPU_BATCH, [0.5] * 32, [0] * 32, None, search_all=False)
    assert caps == [0] * 32
    assert priced < 2 * 32  # plain's price, the ceiling's few, the step and each row's probe wait; a search prices 32 x 8


def test_the_calibrated_curves_are_read_once_per_model_by_a_rule(monkeypatch):
    """A server begins a sizing state per request: the rule reads the model's calibrated curves
    once (each read computes the calibration key and reads a file), and a model object that
    cannot be weakly referenced is still served, read each time."""
    from hasten.engine import sizing as engine_sizing

    reads = []
    monkeypatch.setattr(engine_sizing, "load_or_calibrate", lambda model: reads.append(("curve", model)) or STEEP)
    monkeypatch.setattr(engine_sizing, "load_or_calibrate_batch", lambda model: reads.append(("batch", model)) or None)
    rule = engine_sizing.sizing_rule("auto")

    class Model:  # as a module or a runtime object: hashable by identity, weakly referable
        pass

    model, other = Model(), Model()
    for _ in range(3):
        assert rule.costs.curve_for(SimpleNamespace(model=model)) is STEEP
        rule.costs.batch_cost_for(SimpleNamespace(model=model))
    rule.costs.curve_for(SimpleNamespace(model=other))
    assert reads == [("curve", model), ("batch", model), ("curve", other)]
    plain = SimpleNamespace()  # compared by value, so not hashable
    rule.costs.curve_for(SimpleNamespace(model=plain))
    rule.costs.curve_for(SimpleNamespace(model=plain))
    assert reads[3:] == [("curve", plain), ("curve", plain)]
