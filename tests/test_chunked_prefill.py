"""Chunked prefill (models/packed_batch.py ``feed``, engine/batch.py ``max_num_batched_tokens``):
a long prompt joins a running packed batch in chunks over several steps while the other rows
keep decoding, each step within its token budget, and every row's tokens and logits are,
bit for bit (torch.equal), those it gets decoded alone, in float32, bfloat16 and float16:
chunks of any size, trees on the other rows, greedy and seeded sampling, a prompt whose start
the prefix cache holds, a row cancelled mid-prefill. Then serve-bench's TTFT and ITL from a
scripted stream, and the long prompt it sends into a level."""
import asyncio
from types import SimpleNamespace

import pytest
import torch

import hasten
from hasten.bench import serve_load
from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from hasten.drafters.base import Draft, DraftContext, Drafter
from hasten.engine import sequence as sequence_module
from hasten.engine.batch import Request, Scheduler
from hasten.models.packed_batch import PackedBatch
from helpers import DEVICE, VOCAB, repetitive_prompt, save_checkpoint, tiny_model
from test_packed_batch import alone, prepared, script

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the packed batch runs hasten's CPU kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def prompt_of(length: int, seed: int) -> list[int]:
    return repetitive_prompt(length, seed=seed)[0].tolist()


# ---- the packed batch: chunks beside other rows' blocks ------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_prompt_fed_in_chunks_gets_the_numbers_of_a_prefill_in_one_piece(arch, dtype):
    """Two long prompts join mid-stream and are fed in chunks of uneven sizes (1 token, 7, 16,
    a forward of chunks alone, two rows' chunks in one forward) beside rows decoding chains
    and trees; then each decodes its own script. Every block's logits, the decoding rows'
    while the chunks ride beside them and the chunked rows' after, equal the row decoded alone
    (one prefill in one piece, then its blocks one forward each)."""
    model = prepared(arch, dtype)
    prompts = [prompt_of(14, 0), prompt_of(26, 1), prompt_of(61, 2), prompt_of(45, 3)]
    scripts = [script(i, steps) for i, steps in enumerate((9, 7, 4, 4))]
    expected = [alone(model, prompt, blocks) for prompt, blocks in zip(prompts, scripts)]
    # per step: {row: chunk size} fed to the rows in prefill (step 4: a forward of chunks alone)
    feeds = {1: {2: 1}, 2: {2: 7}, 3: {2: 16, 3: 5}, 4: {3: 17}, 5: {2: 20, 3: 1}}
    batch = PackedBatch(model)
    rows, done, got = {}, {}, {i: [] for i in range(4)}
    for step in range(12):
        if step == 1:
            rows[2] = batch.add(prompts[2], defer=True)[0]
        if step == 3:
            rows[3] = batch.add(prompts[3], defer=True)[0]
        for i, count in feeds.get(step, {}).items():
            batch.feed(rows[i], count)
        if step == 0:
            rows[0] = batch.add(prompts[0], defer=True)[0]
            rows[1] = batch.add(prompts[1], defer=True)[0]
        # rows 2 and 3 decode only once they are no longer fed (their rest runs before their first block)
        stepping = [i for i in sorted(rows, reverse=bool(step % 2))
                    if done.get(i, 0) < len(scripts[i]) and (i < 2 or step > 5)]
        if step == 4:
            stepping = []  # a forward of chunks alone
        starts = {i: rows[i].cache_length for i in stepping}
        outs = batch.forward_rows([rows[i] for i in stepping], [scripts[i][done.get(i, 0)][0] for i in stepping],
                                  [scripts[i][done.get(i, 0)][1] for i in stepping], False)
        for i, out in zip(stepping, outs):
            tokens, tree, accepted = scripts[i][done.get(i, 0)]
            got[i].append(out.logits)
            rows[i].commit(starts[i], tree or TokenTree.chain(len(tokens) - 1), accepted)
            done[i] = done.get(i, 0) + 1
        if step in (1, 2, 3):  # fed but not yet decoding: its cached length moved by exactly the chunk
            assert rows[2].length == sum(feeds[s].get(2, 0) for s in range(1, step + 1))
    assert rows[3].prompt_due == 0 and rows[2].length > len(prompts[2])
    for i in range(4):
        assert len(got[i]) == len(expected[i]), f"row {i}"
        for number, (a, b) in enumerate(zip(got[i], expected[i])):
            assert a.shape == b.shape and torch.equal(a, b), f"row {i}, block {number}"


def test_feed_takes_a_count_of_the_rows_deferred_prompt():
    batch = PackedBatch(prepared("llama", torch.float32))
    row = batch.add(prompt_of(20, 0), defer=True)[0]
    for bad in (0, 20, True, 2.0):
        with pytest.raises(ValueError, match="count"):
            batch.feed(row, bad)
    batch.feed(row, 19)
    row.crop(5)  # a crop shortens what was fed with the prompt
    assert row.fed == 5 and batch.forward_rows([], [], [], False) == [] and row.length == 5
    other = PackedBatch(batch.model)
    with pytest.raises(ValueError, match="not in this batch"):
        other.feed(row, 1)


def test_a_hooked_model_runs_chunks_through_its_own_forward_with_the_same_numbers():
    """A forward hook rules the lean forward out: a fed chunk runs through the model's own
    forward over the row's entries, and the row's first block then gets a whole prefill's logits."""
    model = prepared("llama", torch.float32)
    prompts, blocks = [prompt_of(12, 5), prompt_of(32, 6)], [[5, 6, 7], [8, 9, 10]]
    handle = model.register_forward_hook(lambda *_: None)
    try:
        batch = PackedBatch(model)
        running, joining = (batch.add(p, defer=True)[0] for p in prompts)
        batch.feed(joining, 13)
        first = batch.forward_rows([running], [blocks[0]], [None], False)[0].logits
        assert joining.length == 13 and joining.prompt_due == len(prompts[1]) - 1 - 13
        then = batch.forward_rows([joining], [blocks[1]], [None], False)[0].logits
    finally:
        handle.remove()
    assert torch.equal(first, alone(model, prompts[0], [(blocks[0], None, ())])[0])
    assert torch.equal(then, alone(model, prompts[1], [(blocks[1], None, ())])[0])


# ---- the scheduler: a budget per step ------------------------------------------------------------
class LookupTree(Drafter):
    """Deterministic trees from the row's own tokens (so a row drafts alike alone and in a batch):
    per level, the token that followed the last earlier occurrence of the path's last token and a
    sibling one above it; the path goes on under the first."""

    name = "lookup_tree"

    def __init__(self):  # no settings
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        tokens, parents, parent, history = [], [], -1, list(ctx.tokens)
        for _ in range(min(3, ctx.max_depth)):
            last = history[-1]
            follow = next((history[i + 1] for i in range(len(history) - 2, -1, -1) if history[i] == last),
                          (last + 1) % VOCAB)
            tokens += [follow, (follow + 1) % VOCAB]
            parents += [parent, parent]
            parent = len(tokens) - 2
            history.append(follow)
        return Draft(tuple(tokens), TokenTree(tuple(parents)))


class Recorded:
    """Every row's verification logits by prompt, step by step (``Sequence.check`` watched)."""

    def __init__(self, monkeypatch):
        self.logits: dict[tuple[int, ...], list[torch.Tensor]] = {}
        real = sequence_module.Sequence.check

        def check(sequence, draft, out):
            self.logits.setdefault(tuple(sequence.request.input_ids), []).append(out.logits.clone())
            return real(sequence, draft, out)

        monkeypatch.setattr(sequence_module.Sequence, "check", check)


# (prompt, budget, sampled, step it is submitted at): a long prompt alone first (chunk-only
# forwards), rows joining beside it, a second long prompt while the first is still in prefill
ROWS = [(prompt_of(64, 10), 10, False, 0), (prompt_of(12, 11), 26, False, 1), (prompt_of(20, 12), 26, True, 1),
        (prompt_of(90, 13), 12, True, 4), (prompt_of(50, 14), 14, False, 5), (prompt_of(9, 15), 18, False, 6)]
BUDGET = 16  # tokens per step: a decoding row's root each, then prompt tokens


def sampling_of(sampled: bool) -> Sampling:
    return Sampling(0.9, top_k=40) if sampled else Sampling(0.0)


def decoded_alone(model, prompt, budget, sampled, seed):
    """The row's tokens decoded alone (one prefill in one piece), with the same drafter and seed."""
    out = hasten.generate(model, torch.tensor([prompt]), drafter=LookupTree(), max_new_tokens=budget,
                          draft_size="fixed", eos_token_id=[], seed=seed if sampled else None,
                          **({"temperature": 0.9, "top_k": 40} if sampled else {}))
    return out.sequences[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_rows_join_mid_stream_and_every_row_is_its_own_alone(dtype, monkeypatch):
    """Each step runs at most the budget (a root per decoding row, then prompt tokens), and a row
    with prompt left to run gets some every step; a row in prefill is never planned, drafts
    nothing and commits nothing; every row's tokens and every step's logits, greedy and sampled,
    beside tree drafts, equal the row decoded alone."""
    model = tiny_model("llama").to(dtype)
    recorded = Recorded(monkeypatch)
    scheduler = Scheduler(model, LookupTree(), max_batch=4, draft_size="fixed", max_num_batched_tokens=BUDGET)
    assert isinstance(scheduler.target, PackedBatch)
    planned: set[int] = set()  # the rows the planner saw this step
    real_plan = scheduler.planner.plan
    monkeypatch.setattr(scheduler.planner, "plan", lambda rows: (planned.update(map(id, rows)), real_plan(rows)))
    ids, out, step, beside, accepted = {}, {}, 0, 0, 0
    while len(ids) < len(ROWS) or scheduler.has_work():
        for i, (prompt, budget, sampled, at) in enumerate(ROWS):
            if at == step:
                ids[scheduler.submit(Request(prompt, budget, sampling_of(sampled), eos_token_ids=frozenset(),
                                             seed=100 + i if sampled else None))] = i
        planned.clear()
        updates = scheduler.step()
        info = scheduler.last_step
        assert info.prompt_tokens + info.batch_size <= BUDGET
        waiting_prompts = [e for e in scheduler._running.values() if e.row.prompt_due]
        if waiting_prompts or info.prompt_tokens:
            assert info.prompt_tokens >= 1  # progress: a row in prefill gets a chunk every step
        for entry in waiting_prompts:  # still in prefill: not planned, nothing drafted or committed
            assert id(entry.sequence) not in planned and entry.sequence.stats.steps == 0
            assert not entry.sequence.generated
        beside += bool(waiting_prompts and info.batch_size)  # a prompt in prefill while other rows decode
        for update in updates:
            out.setdefault(update.row_id, []).extend(update.tokens)
            accepted += update.finished and update.stats.accepted_tokens
        step += 1
    assert step > 12 and beside >= 5 and accepted  # the long prompts took several steps beside drafting rows
    first = recorded.logits
    monkeypatch.undo()
    recorded = Recorded(monkeypatch)
    for row_id, i in ids.items():
        prompt, budget, sampled, _ = ROWS[i]
        assert out[row_id] == decoded_alone(model, prompt, budget, sampled, 100 + i), f"row {i}"
        steps, mine = recorded.logits[tuple(prompt)], first[tuple(prompt)]
        assert len(steps) == len(mine), f"row {i}"
        for number, (a, b) in enumerate(zip(mine, steps)):
            assert torch.equal(a, b), f"row {i}, step {number}"


def test_the_prefix_cache_serves_chunked_rows_and_keeps_a_cancelled_rows_chunks():
    """A row cancelled mid-prefill leaves the chunks it cached for the next prompt that starts
    the same way; a prompt that starts as a finished row is chunked past the entries it copies;
    both decode as they do alone."""
    model = tiny_model("llama")
    scheduler = Scheduler(model, LookupTree(), max_batch=2, draft_size="fixed", max_num_batched_tokens=8)
    long = prompt_of(70, 20)
    first = scheduler.submit(Request(long, 6, eos_token_ids=frozenset()))
    for _ in range(5):  # five chunks of 8: 40 entries cached
        assert not scheduler.step()
    scheduler.cancel(first)
    assert scheduler.step()[0].finish_reason == "cancelled"
    assert len(scheduler.target.prefixes) == 1
    again = scheduler.submit(Request(long, 6, eos_token_ids=frozenset()))
    got = scheduler.run()[again].tokens
    assert scheduler.target.reused_tokens == 32  # the whole blocks of the cancelled row's 40
    assert got == decoded_alone(model, long, 6, False, 0)
    follow_up = long + got + prompt_of(30, 21)  # its history, then a new turn: copied, then chunked
    third = scheduler.submit(Request(follow_up, 6, eos_token_ids=frozenset()))
    assert scheduler.run()[third].tokens == decoded_alone(model, follow_up, 6, False, 0)
    assert scheduler.target.reused_tokens == 32 + (len(long) + len(got) - 1) // 16 * 16


def test_without_a_budget_a_joining_prompt_runs_whole_in_its_first_step():
    model = tiny_model("llama")
    scheduler = Scheduler(model, None, max_batch=2)
    scheduler.submit(Request(prompt_of(40, 1), 4))
    assert len(scheduler.step()[0].tokens) == 1 and scheduler.last_step.prompt_tokens == 39


def test_the_budget_is_checked_once_with_its_field_named():
    model = tiny_model("llama")
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            Scheduler(model, max_num_batched_tokens=bad)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= max_batch \(8\)"):
        Scheduler(model, max_batch=8, max_num_batched_tokens=7)


def test_the_server_flag_sets_the_budget(tmp_path, cli, monkeypatch):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app))
    path = save_checkpoint(tmp_path / "ckpt")
    fixed = ("--draft-size", "fixed", "--kv-cache-mib", "1")  # (no calibration of the batch's cost; a small store)
    assert cli("serve", "--model", path, "--max-batch", "4", *fixed)[0] == 0
    assert seen["app"].state.service.worker.scheduler.max_num_batched_tokens == 256  # the default
    code, _, err = cli("serve", "--model", path, "--max-batch", "600", "--max-num-batched-tokens", "600", *fixed)
    assert code == 0, err
    assert seen["app"].state.service.worker.scheduler.max_num_batched_tokens == 600
    code, _, err = cli("serve", "--model", path, "--max-batch", "8", "--max-num-batched-tokens", "4")
    assert code == 2 and "--max-num-batched-tokens must be >= 8" in err


# ---- serve-bench: TTFT and ITL from the stream ---------------------------------------------------
def chunk(text: str | None, completion_tokens: int | None):
    """An event of a completions stream: a choice with ``text`` (None: the usage-only last event)."""
    choices = [] if text is None else [SimpleNamespace(text=text)]
    usage = None if completion_tokens is None else SimpleNamespace(completion_tokens=completion_tokens,
                                                                      prompt_tokens=7)
    return SimpleNamespace(choices=choices, usage=usage, model_extra={})


class ScriptedClient:
    """A completions client whose stream for each prompt is a script of (seconds, event); the
    clock moves to an event's time as it is read. ``calls`` records each request as it is made."""

    def __init__(self, scripts: dict[str, list], clock: list[float]):
        self.scripts, self.clock, self.calls = scripts, clock, []
        self.completions = SimpleNamespace(create=self.create)

    async def create(self, prompt, **options):
        self.calls.append((prompt, self.clock[0]))
        assert options["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        begun = self.clock[0]

        async def events():
            for at, event in self.scripts[prompt]:
                await asyncio.sleep(0)
                self.clock[0] = max(self.clock[0], begun + at)
                yield event

        return events()


def test_ttft_itl_and_tpot_come_from_the_streams_events(monkeypatch):
    """TTFT: to the first text. ITL: each later event's gap shared by the tokens it brought
    (the running usage's rise since the last text; tokens whose text was held back arrive with
    the next text). TPOT: first to last text over the tokens after the first."""
    clock = [100.0]
    monkeypatch.setattr(serve_load.time, "perf_counter", lambda: clock[0])
    script = [(0.05, chunk("", 0)),  # an opening event with no text
              (0.25, chunk("a", 1)),  # first text: TTFT 0.25
              (0.35, chunk("bcd", 4)),  # 3 tokens after 0.1 s: three waits of 1/30 s
              (0.45, chunk("", 5)),  # a token whose text is held back
              (1.45, chunk("ef", 6)),  # it arrives with this one after a 1.1 s stall: two waits of 0.55
              (1.50, chunk(None, 6))]  # the usage event
    client = ScriptedClient({"p": script}, clock)
    outcome = asyncio.run(serve_load.one_request(client, "m", "p", False, 16, 0.0))
    assert outcome.error is None and outcome.text == "abcdef" and outcome.completion_tokens == 6
    assert outcome.ttft == pytest.approx(0.25) and outcome.latency == pytest.approx(1.5)
    assert outcome.waits == pytest.approx([0.1 / 3] * 3 + [0.55] * 2)
    assert outcome.tpot == pytest.approx(1.2 / 5)
    summary = serve_load.summarize([outcome], 1, 2.0)  # (rounded to the microsecond)
    assert summary["itl_seconds"]["p50"] == pytest.approx(0.1 / 3, abs=1e-6)
    assert summary["itl_seconds"]["p99"] == pytest.approx(0.55, abs=1e-6)  # the stall shows in the tail
    assert summary["tpot_seconds"]["p50"] == pytest.approx(0.24, abs=1e-6)
    assert summary["ttft_seconds"]["p50"] == pytest.approx(0.25, abs=1e-6)
    # a server that sends no running usage: each text event counts one token
    bare = [(0.2, chunk("a", None)), (0.3, chunk("b", None)), (0.6, chunk("cd", None)), (0.7, chunk(None, 4))]
    outcome = asyncio.run(serve_load.one_request(ScriptedClient({"q": bare}, clock), "m", "q", False, 16, 0.0))
    assert outcome.waits == pytest.approx([0.1, 0.3]) and outcome.tpot == pytest.approx(0.4 / 3)


def test_the_long_prompt_joins_once_the_level_streams_and_is_reported_apart(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(serve_load.time, "perf_counter", lambda: clock[0])
    steady = [(0.1 * k, chunk("x", k)) for k in range(1, 6)] + [(0.6, chunk(None, 5))]
    long = [(2.0, chunk("y", 1)), (2.1, chunk("z", 2)), (2.2, chunk(None, 2))]
    client = ScriptedClient({"a": steady, "b": steady, "LONG": long}, clock)
    summary, answered = asyncio.run(serve_load.run_level(client, "m", ["a", "b"], 2, 4, 8, 0.0, False, "LONG"))
    assert [prompt for prompt, _ in client.calls][:2] == ["a", "b"] and len(client.calls) == 5
    (_, joined_at), = [(p, at) for p, at in client.calls if p == "LONG"]
    assert joined_at > 0  # after a stream's first text, not with the level's first requests
    assert summary["requests"] == 4 and summary["output_tokens"] == 20  # the long prompt is not in the level
    joined = summary["long_prompt"]  # (the streams share one clock: the long one's end may be read later)
    assert joined["prompt_tokens"] == 7 and joined["completion_tokens"] == 2 and joined["error"] is None
    assert joined["ttft_seconds"] == pytest.approx(2.0, abs=1e-6) and joined["latency_seconds"] >= 2.2 - 1e-6
    table = serve_load.table({"servers": [{"name": "s", "model": "m", "method": None}], "model": "m", "method": None,
                              "max_tokens": 8, "long_prompt": 2048, "levels": [{"concurrency": 2, **summary}]})
    assert "A prompt of about 2048 tokens joined each level" in table
    assert "- 2 clients: 7 prompt tokens, TTFT 2000.0 ms, end-to-end " in table


def test_long_text_opens_with_its_own_line_and_grows_with_chars():
    text = serve_load.long_text(["one", "two"], 50, 3)
    assert text.startswith("Document 3:\n") and "one\n\ntwo" in text
    assert len(serve_load.long_text(["one", "two"], 500, 3)) - len(text) == 450


def test_serve_bench_sends_a_long_prompt_into_a_chunking_server(cli, tmp_path):
    """End to end: a server whose steps run at most 8 tokens (4 rows), a level of two clients and
    a long prompt joining it, sized to about 60 tokens by the server's own count; the long
    prompt's answer is the one decoded alone."""
    pytest.importorskip("openai", reason="hasten[serve] is not installed")
    pytest.importorskip("uvicorn", reason="hasten[serve] is not installed")
    import json

    from hasten.serve.app import ServeOptions, create_app, scheduler_factory
    from test_serve import KEY, NAME, PROMPTS, TEMPLATE, start_server, stop_server
    from hasten.api import Engine, make_drafter
    from helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    engine = Engine(tiny_model("llama"), tokenizer, make_drafter("prompt_lookup"), "prompt_lookup", draft_size="fixed")
    app = create_app(engine, scheduler_factory(engine, max_batch=4, max_num_batched_tokens=8), ServeOptions(NAME, KEY))
    assert app.state.service.worker.scheduler.max_num_batched_tokens == 8
    server, thread, url = start_server(app)
    try:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]))
        out = tmp_path / "load.json"
        code, table, err = cli("serve-bench", "--url", f"{url}/v1", "--api-key", KEY, "--concurrency", "2",
                               "--requests", "2", "--max-tokens", "8", "--prompts", str(prompts),
                               "--long-prompt", "60", "--out", str(out))
        assert code == 0, err
        (level,) = json.loads(out.read_text())["levels"]
        assert level["errors"] == 0 and level["itl_seconds"]["p50"] > 0 and level["tpot_seconds"]["p50"] > 0
        joined = level["long_prompt"]
        assert joined["error"] is None and 50 <= joined["prompt_tokens"] <= 70 and joined["ttft_seconds"] > 0
        assert "A prompt of about 60 tokens joined each level" in table
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        long = serve_load.long_text(PROMPTS, 120, 7)
        answer = client.completions.create(model=NAME, prompt=long, max_tokens=12, temperature=0)
        assert answer.usage.prompt_tokens > 8  # chunked: more than one step's budget
        assert answer.choices[0].text == engine.generate(long, max_new_tokens=12).text
    finally:
        stop_server(server, thread)
