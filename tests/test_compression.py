"""python -m hasten.bench.compression: the SpecKV/SpecPC table with needle accuracy, on tiny models.

Nothing here asserts a timing; the zoo models and the real table are the lead's to run.
"""
import hasten
from hasten.bench.compression import FULL, HEADER, POLICIES, measure
from hasten.bench.tasks import Task

from helpers import repetitive_prompt, tiny_model


def test_table_has_needle_accuracy_next_to_agreement_and_speed_for_every_policy():
    model, draft = tiny_model("llama"), tiny_model("llama", seed=1)
    prompts = [repetitive_prompt(120, seed) for seed in range(2)]
    needle_prompt = repetitive_prompt(100, seed=5)
    full = hasten.generate(model, needle_prompt, max_new_tokens=4, eos_token_id=[]).sequences[0, 100:].tolist()
    needles = [  # one the full cache continues with, one it does not
        (Task("needle-1", "needle", "-", expected_ids=tuple(full)), needle_prompt),
        (Task("needle-2", "needle", "-", expected_ids=tuple((t + 1) % 96 for t in full)), needle_prompt),
    ]
    seen = []
    rows = measure(model, draft, prompts, needles, budgets=[48], new=6, report=seen.append)
    assert seen == rows
    assert [(r.policy, r.budget, r.lossy) for r in rows] == [(FULL, None, False)] + [
        (name, 48, True) for name in POLICIES]
    exact = rows[0]
    assert (exact.prefix_agreement, exact.agreement, exact.needle_accuracy, exact.speed) == (1.0, 1.0, 0.5, None)
    for row in rows[1:]:
        assert 0 <= row.prefix_agreement <= row.agreement <= 1
        assert row.needle_accuracy in (0.0, 0.5) and row.speed > 0  # the wrong needle never matches
        assert row.markdown().startswith(f"| {row.policy} (LOSSY) | 48 |")
    assert exact.markdown() == f"| {FULL} | - | 1.00 | 1.00 | 0.50 | - |"
    assert "needle accuracy" in HEADER and HEADER.count("|") == 2 * (1 + 6)


def test_without_needles_the_column_is_empty():
    model, draft = tiny_model("llama"), tiny_model("llama", seed=1)
    rows = measure(model, draft, [repetitive_prompt(80)], [], budgets=[40], new=4,
                   policies={"SnapKV": POLICIES["SnapKV"]})
    assert [r.needle_accuracy for r in rows] == [None, None]
    assert rows[1].markdown().split(" | ")[4] == "-"
