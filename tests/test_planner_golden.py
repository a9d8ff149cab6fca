"""The draft planner decides as the code did before it was split out of the step: every
scenario of ``planner_trace`` (one row and batches, packed and padded, a flat and a steep cost
curve, auto and fixed sizing, three drafters) takes the same drafts, accepts the same tokens and
spends the same simulated seconds as the traces recorded at commit afc13c7, re-recorded once for
a change of decisions: exploration's back-off (2026-12-07; simulated seconds of the four traces it
changed: one-prompt_lookup-torch-auto 8.178 -> 8.092, one-lookahead-torch-auto 6.980 -> 7.113,
batch-prompt_lookup-padded 2.952 -> 2.984, batch-lookahead-packed 3.225 -> 3.228), and again for drafting
seconds priced per grade of evidence, each grade's first proposal left out (2026-12-07; twelve traces
change, simulated seconds -3.9% (batch-lookahead-packed 3.228 -> 3.102) to +1.6%
(batch-prompt_lookup_4_2-padded 2.838 -> 2.883), the rest within 0.7%), and again (2026-12-07, evening) for
drafting prices and the back-off of probes and explorations carried from one generation to the next, and a
batch row's drafting seconds its own (its grading and its share of the rows' proposals, where each row had been
charged every earlier row's proposal too): thirteen traces change, simulated seconds -2.5%
(batch-prompt_lookup-padded 2.986 -> 2.911) to +3.5% (batch-lookahead-padded 3.476 -> 3.597), the rest within
2.1%. Re-record with
``python tests/planner_trace.py`` only for a change meant to alter decisions."""
import json

import pytest

from planner_trace import GOLDEN, SCENARIOS, trace

RECORDED = json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[scenario[0] for scenario in SCENARIOS])
def test_the_planner_decides_as_recorded(scenario):
    recorded, now = RECORDED[scenario[0]], trace(*scenario)
    for number, (then, today) in enumerate(zip(recorded["steps"], now["steps"])):
        assert today == then, f"step {number} differs (rows: [index, depth asked, draft, parents, committed])"
    assert len(now["steps"]) == len(recorded["steps"])
    assert now["seconds"] == pytest.approx(recorded["seconds"], rel=1e-9, abs=1e-12)


def test_the_scenarios_exercise_every_decision():
    """The traces are worth holding: the cost-aware rule drafts on some steps and not on others,
    alone and in batches, and rows of one batch get different depths."""
    plain_somewhere = {"packed": False, "padded": False}  # a batch layout with a plain row in some trace
    for name, recorded in RECORDED.items():
        asked = [row[1] for step in recorded["steps"] for row in step]
        assert any(asked), name
        if "auto" in name:
            assert not all(asked), name
        if name.startswith("batch") and not all(asked):
            plain_somewhere[name.rsplit("-", 1)[1]] = True
    assert all(plain_somewhere.values())
    packed = RECORDED["batch-prompt_lookup-packed"]["steps"]
    assert any(len({row[1] for row in step}) > 1 for step in packed)
