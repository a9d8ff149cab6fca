"""Constrained rows in a packed batch (models/packed_batch.py, the lean forward): rows under a JSON
schema, a regex and a choice, drafting chains and trees with planted errors, beside free rows,
greedy and sampled, in one forward and one verification pass per step
(:func:`~hasten.engine.verify.verify_all`, each constrained row's logits masked before it): each
row writes exactly what it writes alone, the greedy ones plain constrained decoding from the
definition."""
import pytest
import torch

import hasten
from hasten.core.sampling import Sampling
from hasten.drafters.base import EMPTY_DRAFT, Draft, DraftContext, Drafter
from hasten.engine import sequence
from hasten.engine.batch import Request, Scheduler
from hasten.models.packed_batch import PackedBatch
from helpers import DEVICE, ScriptedDrafter, TreeScriptedDrafter

pytest.importorskip("llguidance")

from test_constraint import EOS, NEW, PROMPT_TEXT, SPECS, model, reference, tokenizer  # noqa: E402, F401 (fixtures)

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the packed batch runs hasten's CPU kernels")

# each row: (prompt prefix, constraint, its scripted drafts, sampled); every prefix is its own, so
# a row's drafter is found by its prompt
ROWS = [
    ('{"name": "bo", "age": 7, "ok": false} ', "json", lambda ref: TreeScriptedDrafter(ref, 4, 3, 1, 2), False),
    ("12-no-abc ", "regex", lambda ref: ScriptedDrafter(ref, 4, 1), False),
    ("yes no ", "choice", lambda ref: ScriptedDrafter(ref, 4, "oracle"), False),
    ("", None, lambda ref: TreeScriptedDrafter(ref, 3, 2, 0, 0), False),
    ("maybe ", "json", None, True),  # forced text its only drafts
    ("no ", None, None, True),
]


class PerRow(Drafter):
    """Each row drafted by the scripted drafter of its own reference, found by its prompt; a row
    without one drafts nothing (a constrained one still gets its forced text)."""

    name = "per_row"

    def __init__(self, drafters: list[ScriptedDrafter]):
        self.drafters = drafters

    def begin(self, ctx: DraftContext):
        return next((d for d in self.drafters if d.reference[: len(ctx.tokens)] == ctx.tokens), None)

    def propose(self, ctx: DraftContext) -> Draft:
        return EMPTY_DRAFT if ctx.state is None else ctx.state.propose(ctx)


def request(model, tokenizer, prompt: list[int], name: str | None, sampled: bool, seed: int) -> Request:
    constraint = None if name is None else SPECS[name].compile(tokenizer, model.config.vocab_size)
    sampling = Sampling(temperature=0.9, top_p=0.95) if sampled else Sampling()
    return Request(prompt, NEW, sampling, seed=seed if sampled else None, eos_token_ids=frozenset({EOS}),
                   constraint=constraint)


def test_a_packed_batch_of_constrained_and_free_rows_writes_each_as_alone(model, tokenizer, monkeypatch):
    prompts = [tokenizer.encode(prefix + PROMPT_TEXT) for prefix, *_ in ROWS]
    greedy = {}  # row -> plain (constrained) greedy decoding, from the definition
    for i, (prompt, (_, name, _, sampled)) in enumerate(zip(prompts, ROWS)):
        if sampled:
            continue
        if name is None:
            out = hasten.generate(model, torch.tensor([prompt]), max_new_tokens=NEW, eos_token_id=EOS)
            greedy[i] = out.sequences[0, len(prompt):].tolist()
        else:
            greedy[i] = reference(model, tokenizer, torch.tensor([prompt]), SPECS[name])
    drafter = PerRow([script(prompts[i] + greedy[i]) for i, (_, _, script, _) in enumerate(ROWS) if script])

    def alone(i: int) -> list[int]:
        scheduler = Scheduler(model, drafter, max_batch=1, draft_size="fixed")
        row = scheduler.submit(request(model, tokenizer, prompts[i], ROWS[i][1], ROWS[i][3], seed=i))
        return scheduler.run()[row].tokens

    expected = [greedy[i] if i in greedy else alone(i) for i in range(len(ROWS))]

    verified = []  # the rows of each verification pass
    verify_all = sequence.verify_all
    monkeypatch.setattr(sequence, "verify_all", lambda rules, rows: verified.append(len(rows)) or verify_all(rules, rows))
    scheduler = Scheduler(model, drafter, max_batch=len(ROWS), draft_size="fixed")
    assert isinstance(scheduler.target, PackedBatch)
    rows = [scheduler.submit(request(model, tokenizer, prompt, name, sampled, seed=i))
            for i, (prompt, (_, name, _, sampled)) in enumerate(zip(prompts, ROWS))]
    results = scheduler.run()
    assert [results[row].tokens for row in rows] == expected
    assert verified[0] == len(ROWS)  # one pass for every row of a step
    assert sum(results[row].stats.forced_tokens for row in rows) > 0
