"""One seed, one text, through every door: a seeded sampled request resolves its draft sizing
the same way (unset: auto, but fixed for seeded sampling) in Engine.generate, a batch of one,
a row of a larger batch, the scheduler the server uses, and the command line."""
import json

import pytest
import torch

import hasten
from hasten.engine.batch import Request, Scheduler
from hasten.engine.sizing import CostAwareSize, FixedSize, SizingChoice
from hasten.core.sampling import Sampling
from helpers import save_checkpoint

PROMPT = "def add(a, b):\n    return a + b\n" * 2
OTHER = "for i in range(10):\n    print(i)\n"
OPTIONS = dict(max_new_tokens=16, temperature=0.9, top_k=20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("request"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    return hasten.load(checkpoint, "prompt_lookup")  # draft_size unset: the users' default


def test_unset_sizing_is_auto_except_for_seeded_sampling():
    choice = SizingChoice(None)
    assert isinstance(choice.for_request(sampled=False, seeded=False), CostAwareSize)
    assert isinstance(choice.for_request(sampled=True, seeded=False), CostAwareSize)
    assert isinstance(choice.for_request(sampled=True, seeded=True), FixedSize)
    assert choice.for_request(sampled=False, seeded=False) is choice.for_request(sampled=True, seeded=False)
    explicit = SizingChoice("auto")  # asked for by name: auto even for a seed
    assert isinstance(explicit.for_request(sampled=True, seeded=True), CostAwareSize)
    with pytest.raises(ValueError, match="draft_size must be 'auto' or 'fixed'"):
        SizingChoice("deep")


def test_the_same_seed_gives_the_same_text_through_every_door(engine, checkpoint, cli):
    alone = engine.generate(PROMPT, seed=5, **OPTIONS)
    assert engine.generate(PROMPT, seed=5, **OPTIONS).token_ids == alone.token_ids  # run to run
    assert engine.generate_batch([PROMPT], seed=5, **OPTIONS)[0].token_ids == alone.token_ids  # a batch of one
    assert engine.generate_batch([PROMPT, OTHER], seed=5, **OPTIONS)[0].token_ids == alone.token_ids  # row 0 of two

    scheduler = Scheduler(engine.runtime, engine.drafter, max_batch=2, draft_size=engine.draft_size)  # as the server
    ids = engine.encode(PROMPT)[0].tolist()
    other = engine.encode(OTHER)[0].tolist()
    sampling = Sampling(OPTIONS["temperature"], OPTIONS["top_k"])
    row = scheduler.submit(Request(ids, OPTIONS["max_new_tokens"], sampling, seed=5))
    scheduler.submit(Request(other, OPTIONS["max_new_tokens"], sampling))  # unseeded: auto, beside it
    tokens = []
    while scheduler.has_work():
        tokens += [t for update in scheduler.step() if update.row_id == row for t in update.tokens]
    assert tokens == alone.token_ids

    code, out, err = cli("generate", "--model", checkpoint, "--method", "prompt_lookup", "--prompt", PROMPT,
                         "--max-new-tokens", "16", "--temperature", "0.9", "--top-k", "20", "--seed", "5", "--json")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == alone.token_ids


def test_refusals_carry_their_field_and_code(engine):
    from hasten.core.errors import FieldError

    scheduler = Scheduler(engine.runtime, engine.drafter, max_tokens_in_flight=50)
    ids = engine.encode(PROMPT)[0].tolist()
    context = engine.runtime.context_length
    cases = [(Request([], 4), "input_ids", "invalid_value"),
             (Request(ids, -1), "max_new_tokens", "invalid_value"),
             (Request(ids, context), "max_new_tokens", "context_length_exceeded"),
             (Request(ids, 40), "max_new_tokens", "over_capacity"),
             (Request(ids, 4, seed=1.5), "seed", "invalid_value"),
             (Request(ids, 4, pool="no"), "pool", "invalid_value")]
    for request, field, code in cases:
        with pytest.raises(FieldError) as refusal:
            scheduler.submit(request)
        assert (refusal.value.field, refusal.value.code) == (field, code)
        assert field in str(refusal.value) or field == "input_ids"  # the library's own name for it
        assert "max_tokens" in refusal.value.render("max_tokens") or field != "max_new_tokens"


def test_every_door_resolves_an_unset_draft_size_by_the_same_rule(engine, monkeypatch):
    """hasten.generate, the Scheduler, the bench's runner and Engine.generate all leave
    draft_size unset by default, and all resolve it through SizingChoice: auto for greedy
    decoding, fixed for seeded sampling."""
    from hasten.bench.runner import hasten_method

    chosen = []
    resolve = SizingChoice.for_request

    def spy(self, sampled, seeded):
        rule = resolve(self, sampled, seeded)
        chosen.append(type(rule).__name__)
        return rule

    monkeypatch.setattr(SizingChoice, "for_request", spy)
    ids = engine.encode(PROMPT)
    hasten.generate(engine.model, ids, drafter=engine.drafter, max_new_tokens=4)
    scheduler = Scheduler(engine.runtime, engine.drafter, max_batch=1)
    scheduler.submit(Request(ids[0].tolist(), 4, Sampling()))
    scheduler.run()
    hasten_method("prompt_lookup", engine.model).run(ids, 4)
    engine.generate(PROMPT, max_new_tokens=4)
    assert chosen == ["CostAwareSize"] * 4
    hasten.generate(engine.model, ids, drafter=engine.drafter, max_new_tokens=4, temperature=0.9,
                    generator=torch.Generator().manual_seed(5))
    assert chosen[-1] == "FixedSize"


def test_a_request_that_turns_drafting_off_decodes_plainly_through_every_door(engine):
    """One field (Request.speculate), read where a sequence is made: the same text, no drafts,
    one token a step, alone (Engine.generate) and as a row beside drafting rows."""
    drafting = engine.generate(PROMPT, max_new_tokens=24)
    plain = engine.generate(PROMPT, max_new_tokens=24, speculate=False)
    assert plain.token_ids == drafting.token_ids
    assert drafting.stats.drafted_tokens > 0 and plain.stats.drafted_tokens == 0 and plain.stats.steps == 24
    scheduler = Scheduler(engine.runtime, engine.drafter, max_batch=2, draft_size=engine.draft_size)
    ids = engine.encode(PROMPT)[0].tolist()
    rows = {scheduler.submit(Request(ids, 24, speculate=speculate)): speculate for speculate in (True, False)}
    results = scheduler.run()
    for row, speculate in rows.items():
        assert results[row].tokens == drafting.token_ids
        assert (results[row].stats.drafted_tokens > 0) == speculate


def test_a_request_out_of_the_pool_neither_reads_nor_writes_it_through_every_door(checkpoint):
    """One field (Request.pool), carried to the drafter's context where a sequence is made:
    the same text, and the shared pool untouched, alone (Engine.generate) and as a row."""
    engine = hasten.load(checkpoint, "suffix", draft_size="fixed")
    first = engine.generate(PROMPT, max_new_tokens=16)
    saved, stats = json.dumps(engine.pool.to_json()), engine.pool.stats()
    assert engine.generate(PROMPT, max_new_tokens=16, pool=False).token_ids == first.token_ids
    scheduler = Scheduler(engine.runtime, engine.drafter, max_batch=2, draft_size="fixed")
    ids = engine.encode(PROMPT)[0].tolist()
    scheduler.submit(Request(ids, 16, pool=False))
    assert scheduler.run()[0].tokens == first.token_ids
    assert json.dumps(engine.pool.to_json()) == saved and engine.pool.stats() == stats
    scheduler.submit(Request(ids, 16))
    assert scheduler.run()[1].tokens == first.token_ids
    assert engine.pool.stats().requests == stats.requests + 1 and engine.pool.stats().hits > stats.hits


def test_a_request_is_checked_once_at_admission(engine, monkeypatch):
    """Every door hands its request to the decode loop, which checks it once (the one place
    max_new_tokens is checked against the model)."""
    checks = []
    real = Request.check
    monkeypatch.setattr(Request, "check", lambda self, runtime: (checks.append(1), real(self, runtime)))
    engine.generate(PROMPT, max_new_tokens=4)
    assert len(checks) == 1
    engine.generate_batch([PROMPT, OTHER], max_new_tokens=4)
    assert len(checks) == 3


def test_hasten_generate_takes_what_the_engine_takes(engine):
    """seed, stop, speculate and pool mean the same to hasten.generate as to Engine: one builder
    (engine/requests.py) makes both doors' requests."""
    from hasten.engine.loop import generate

    ids = engine.encode(PROMPT)
    alone = engine.generate(PROMPT, seed=5, **OPTIONS)
    direct = generate(engine.model, ids, drafter=engine.drafter, seed=5, **OPTIONS)
    assert direct.sequences[0, ids.shape[1]:].tolist() == alone.token_ids
    rows = engine.generate_batch([PROMPT, OTHER], seed=5, **OPTIONS)
    batch = generate(engine.model, [ids[0], engine.encode(OTHER)[0]], drafter=engine.drafter, seed=5, **OPTIONS)
    assert [row.sequences[0, len(prompt):].tolist() for row, prompt in zip(batch.rows, (ids[0], engine.encode(OTHER)[0]))] \
        == [row.token_ids for row in rows]  # row i seeded seed + i, as Engine.generate_batch

    greedy = dict(max_new_tokens=24)
    spoken = engine.generate(PROMPT, **greedy)
    plain = generate(engine.model, ids, drafter=engine.drafter, speculate=False, pool=False, **greedy)
    assert plain.sequences[0, ids.shape[1]:].tolist() == spoken.token_ids
    assert plain.stats.drafted_tokens == 0 and plain.stats.steps == len(spoken.token_ids)

    text = engine.tokenizer.decode(spoken.token_ids)
    cut = text[len(text) // 2: len(text) // 2 + 3]
    by_stop = generate(engine.model, ids, stop=cut, tokenizer=engine.tokenizer, **greedy)
    by_hf_name = generate(engine.model, ids, stop_strings=[cut], tokenizer=engine.tokenizer, **greedy)
    assert by_stop.sequences.tolist() == by_hf_name.sequences.tolist()
    assert by_stop.finish_reason == "stop"
    with pytest.raises(ValueError, match="stop or stop_strings"):
        generate(engine.model, ids, stop=cut, stop_strings=cut, tokenizer=engine.tokenizer)
    with pytest.raises(ValueError, match="seed .* or generator"):
        generate(engine.model, ids, seed=1, generator=torch.Generator().manual_seed(1))


def test_a_request_is_built_from_a_sampling_or_its_settings_not_both():
    from hasten.engine.requests import request_from

    built = request_from([1, 2], 4, temperature=0.7, top_k=5, min_p=0.1, stop="x", tokenizer=object())
    assert (built.sampling.temperature, built.sampling.top_k, built.sampling.min_p) == (0.7, 5, 0.1)
    assert built.stop.strings == ("x",)
    assert request_from([1, 2], 4, sampling=built.sampling).sampling is built.sampling
    with pytest.raises(ValueError, match="not both"):
        request_from([1, 2], 4, sampling=built.sampling, temperature=0.5)
    with pytest.raises(TypeError, match="seed"):
        request_from([1, 2], 4, seed="5")
