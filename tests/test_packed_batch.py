"""The packed batch (models/packed_batch.py): rows of different lengths, positions and blocks
(chains and trees) in one forward, each row's logits exactly (torch.equal) the ones it gets
decoded alone, in float32 and bfloat16, with rows joining and leaving mid-stream."""
import pytest
import torch

import hasten
from hasten.core.runtime import Capability
from hasten.core.tree import TokenTree
from hasten.drafters import PromptLookup, create
from hasten.drafters.base import REGISTRY
from hasten.models import invariant
from hasten.models.adapter import ModelAdapter
from hasten.models.arena import KVArena
from hasten.models.batch import BatchAdapter
from hasten.models.hf import HuggingFaceRuntime
from hasten.models.packed_batch import PackedBatch
from helpers import DEVICE, VOCAB, repetitive_prompt, tiny_model

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the packed batch runs hasten's CPU kernels")

TREE = TokenTree((-1, 0, 1, 0, -1, 4))  # siblings at depths 1 and 2
TREE_PATHS = [(), (0,), (0, 1), (3,), (4, 5)]  # accepted paths the script cycles through


def prepared(arch: str, dtype: torch.dtype):
    model = tiny_model(arch).to(dtype)
    assert invariant.prepare(model)
    return model


def script(row: int, steps: int) -> list[tuple[list[int], TokenTree | None, tuple[int, ...]]]:
    """Row ``row``'s blocks: (tokens, tree or None for a chain, accepted node path), mixing
    one-token steps, chains of several lengths and trees."""
    g = torch.Generator().manual_seed(100 + row)
    out = []
    for step in range(steps):
        kind = (row + step) % 3
        if kind == 0:  # a chain, partly accepted
            size = 1 + (row + 2 * step) % 6
            tokens = torch.randint(3, VOCAB, (size,), generator=g).tolist()
            out.append((tokens, None, tuple(range((step + row) % size))))
        elif kind == 1:  # a tree, one of its paths accepted
            tokens = torch.randint(3, VOCAB, (1 + len(TREE),), generator=g).tolist()
            out.append((tokens, TREE, TREE_PATHS[(step + row) % len(TREE_PATHS)]))
        else:  # a plain step
            out.append((torch.randint(3, VOCAB, (1,), generator=g).tolist(), None, ()))
    return out


def alone(model, prompt: list[int], blocks) -> list[torch.Tensor]:
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prompt]))
    logits = []
    for tokens, tree, accepted in blocks:
        start = adapter.cache_length
        logits.append(adapter.forward(tokens, tree).logits)
        adapter.commit(start, tree or TokenTree.chain(len(tokens) - 1), accepted)
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("defer", [False, True], ids=["prefilled", "deferred"])
def test_every_row_gets_its_own_logits_bit_for_bit(arch, dtype, defer):
    """``deferred``: a joining row's prompt runs in its first step's packed forward, before its
    block and beside the other rows' blocks, as the server's scheduler adds rows."""
    model = prepared(arch, dtype)
    # (prompt length, step it joins at, steps it runs): rows join and leave mid-stream
    rows = [(9, 0, 6), (23, 0, 3), (2, 1, 5), (40, 2, 4), (1, 3, 3), (15, 5, 2)]
    prompts = [repetitive_prompt(length, seed=i)[0].tolist() if length > 1 else [7] for i, (length, _, _) in
               enumerate(rows)]
    scripts = [script(i, steps) for i, (_, _, steps) in enumerate(rows)]
    expected = [alone(model, prompt, blocks) for prompt, blocks in zip(prompts, scripts)]
    batch = PackedBatch(model)
    live: dict[int, tuple[object, int]] = {}  # row -> (batch row, steps done)
    got = [[] for _ in rows]
    for step in range(8):
        for i, (_, joins, _) in enumerate(rows):
            if joins == step:
                live[i] = (batch.add(prompts[i], defer=defer)[0], 0)
                assert live[i][0].cache_length == len(prompts[i]) - 1
                assert len(live[i][0].deferred) == (len(prompts[i]) - 1 if defer else 0)
        order = sorted(live, reverse=bool(step % 2))  # any order of rows
        starts = {i: live[i][0].cache_length for i in order}
        outs = batch.forward_rows([live[i][0] for i in order], [scripts[i][live[i][1]][0] for i in order],
                                  [scripts[i][live[i][1]][1] for i in order], False)
        for i, out in zip(order, outs):
            row, done = live[i]
            tokens, tree, accepted = scripts[i][done]
            got[i].append(out.logits)
            row.commit(starts[i], tree or TokenTree.chain(len(tokens) - 1), accepted)
            live[i] = (row, done + 1)
            if done + 1 == len(scripts[i]):
                batch.remove(row)
                del live[i]
    assert not live and not batch.rows
    for i in range(len(rows)):
        assert len(got[i]) == len(expected[i])
        for a, b in zip(got[i], expected[i]):
            assert a.shape == b.shape and torch.equal(a, b), f"row {i}"


def test_prefill_logits_and_features_are_the_models_own():
    model = prepared("llama", torch.float32)
    prompt = repetitive_prompt(30)
    adapter = ModelAdapter(model)
    _, features = adapter.start(prompt, hidden=True, logits=True)
    batch = PackedBatch(model)
    batch.add(repetitive_prompt(12, seed=3)[0].tolist())
    row, packed_features = batch.add(prompt[0].tolist(), hidden=True, logits=True)
    assert torch.equal(row.prompt_logits, adapter.prompt_logits)
    assert torch.equal(packed_features, features)


def test_rows_that_outgrow_their_segments_move_and_keep_their_entries(monkeypatch):
    """Rows growing past their segments' slack, one leaving a hole: segments move, the store is
    compacted (moving rows already placed for the step) and grows, and every row's logits stay
    its own."""
    model = prepared("llama", torch.float32)
    compactions = []
    real = KVArena._compact
    monkeypatch.setattr(KVArena, "_compact", lambda self: (compactions.append(1), real(self)))
    batch = PackedBatch(model)  # a store of no set size: it grows only when the rows need it
    prompts = [repetitive_prompt(8 + 6 * i, seed=i)[0].tolist() for i in range(4)]
    rows = [batch.add(prompt)[0] for prompt in prompts]
    alone_rows = []
    for prompt in prompts:
        adapter = ModelAdapter(model)
        adapter.start(torch.tensor([prompt]))
        alone_rows.append(adapter)
    live = [0, 1, 2, 3]
    for step in range(14):
        if step == 3:  # a row leaves: a hole between the others
            batch.remove(rows[1])
            live.remove(1)
        blocks = {i: [3 + (step * 9 + j + i) % (VOCAB - 3) for j in range(9 if i != 3 else 3)] for i in live}
        starts = {i: rows[i].cache_length for i in live}
        outs = batch.forward_rows([rows[i] for i in live], [blocks[i] for i in live], [None] * len(live), False)
        for i, out in zip(live, outs):
            tree = TokenTree.chain(len(blocks[i]) - 1)
            rows[i].commit(starts[i], tree, tuple(range(len(blocks[i]) - 2)))
            want = alone_rows[i].forward(blocks[i], None).logits
            alone_rows[i].commit(starts[i], tree, tuple(range(len(blocks[i]) - 2)))
            assert torch.equal(out.logits, want), f"row {i} at step {step}"
    assert compactions


def test_the_store_reuses_freed_space_and_compacts_before_growing():
    arena = KVArena(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    a, b, c = object(), object(), object()
    arena.allocate(a, 10)
    arena.allocate(b, 10)
    arena.keys[0][:, 10:20] = 7.0
    capacity = arena.capacity
    arena.release(a)
    arena.allocate(c, 10)  # the freed space, no growth
    assert arena.segment(c).start == 0 and arena.capacity == capacity
    arena.release(c)
    arena.allocate(c, 4)
    arena.release(c)
    arena.allocate(c, 3)
    free = sum(s.size for s in arena.free)
    arena.allocate(a, free)  # fits only once b moves down: compaction, not growth
    assert arena.capacity == capacity and torch.all(arena.keys[0][:, arena.segment(b).start:][:, :10] == 7.0)


def test_the_runtime_packs_rows_unless_the_drafter_reads_the_models_cache():
    runtime = HuggingFaceRuntime(tiny_model("llama"))
    assert isinstance(runtime.batch(4), PackedBatch)
    # the feature drafters (Medusa, EAGLE, EAGLE-3's taps, Chimera): last hidden states, the lent LM head
    for method in ("medusa", "eagle", "eagle3", "chimera"):
        assert isinstance(runtime.batch(4, create(method).needs), PackedBatch), method
    assert isinstance(runtime.batch(4, frozenset({Capability.MODULES, Capability.KV_READ})), BatchAdapter)
    assert isinstance(runtime.batch(4, REGISTRY["triforce"].needs), BatchAdapter)  # KV read-back, query capture
    assert isinstance(HuggingFaceRuntime(tiny_model("gpt2")).batch(4), BatchAdapter)


def run_to_the_end(scheduler, prompts: list[list[int]], budget: int) -> tuple[dict[int, list[int]], list[int], int]:
    """Every prompt submitted, then stepped until done, checking that the fixed store never
    changes: each row's tokens by id, the ids, and the most rows that ran together."""
    from hasten.engine.batch import Request

    held = scheduler.target.held_bytes()
    ids = [scheduler.submit(Request(input_ids=p, max_new_tokens=budget)) for p in prompts]
    results, most_running = {}, 0
    while scheduler.has_work():
        for update in scheduler.step():
            results.setdefault(update.row_id, []).extend(update.tokens)
        most_running = max(most_running, scheduler.running)
        assert scheduler.target.held_bytes() == held and scheduler.target.arena.overflows == 0
    return results, ids, most_running


@pytest.mark.parametrize("rows_it_holds, max_batch", [(2, 4), (3, 2)])
def test_a_fixed_kv_store_holds_its_size_and_requests_wait_for_room(rows_it_holds, max_batch):
    """A scheduler with ``kv_cache_bytes``: the store is allocated once and never grows; a
    request joins only while every running row's segment fits (the others wait their turn),
    finished rows' entries serve later prompts from the room the running rows leave, a request
    that cannot fit alone is refused, and every row decodes as it does alone."""
    from hasten.engine.batch import Request, Scheduler
    from hasten.core.request import FieldError

    model = tiny_model("llama")
    entry_bytes = Scheduler(model, max_batch=1, kv_cache_bytes=1).target.arena.entry_bytes
    shared = repetitive_prompt(16, seed=99)[0].tolist()  # a system prompt: finished rows' entries get reused
    prompts = [shared + repetitive_prompt(n, seed=n)[0].tolist() for n in (20, 12, 26, 16, 9, 30)]
    budget = 12
    need = PackedBatch.entries_for(16 + 30 + budget)
    scheduler = Scheduler(model, max_batch=max_batch, kv_cache_bytes=rows_it_holds * need * entry_bytes)
    assert scheduler.target.kv_entries == rows_it_holds * need
    assert scheduler.target.held_bytes() == rows_it_holds * need * entry_bytes
    results, ids, most_running = run_to_the_end(scheduler, prompts, budget)
    assert most_running == min(rows_it_holds, max_batch)  # the store or max_batch, whichever holds fewer
    if rows_it_holds > max_batch:  # room beside the running rows: a finished row's entries copied, not prefilled
        assert scheduler.target.reused_tokens > 0
    for row_id, prompt in zip(ids, prompts):
        alone = hasten.generate(model, torch.tensor([prompt], device=DEVICE), max_new_tokens=budget).sequences
        assert results[row_id] == alone[0, len(prompt):].tolist()
    with pytest.raises(FieldError, match="kv-cache-mib"):
        scheduler.submit(Request(input_ids=[3 + i % (VOCAB - 3) for i in range(rows_it_holds * need)],
                                 max_new_tokens=1))
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Scheduler(model, max_batch=2, kv_cache_bytes=-1)


def test_a_batch_of_prompts_decodes_each_as_alone():
    model = tiny_model("llama")
    prompts = [repetitive_prompt(n, seed=n)[0] for n in (12, 30, 7)]
    batched = hasten.generate(model, prompts, drafter=PromptLookup(), max_new_tokens=24)
    for prompt, row in zip(prompts, batched.rows):
        single = hasten.generate(model, prompt[None], max_new_tokens=24)
        assert torch.equal(row.sequences, single.sequences)


def test_a_hooked_model_takes_its_own_forward_with_the_same_numbers():
    """A forward hook (a user's, a profiler's) rules the lean forward out: the rows run the
    model's own forward over their entries, with the same logits."""
    model = prepared("llama", torch.float32)
    prompts = [repetitive_prompt(12, seed=1)[0].tolist(), repetitive_prompt(20, seed=2)[0].tolist()]
    blocks, trees = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], [None, TREE]
    lean_batch = PackedBatch(model)
    lean_rows = [lean_batch.add(p)[0] for p in prompts]
    want = lean_batch.forward_rows(lean_rows, blocks, trees, False)
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        hooked = PackedBatch(model)
        rows = [hooked.add(p, defer=True)[0] for p in prompts]  # the prompts run first, through the same forward
        got = hooked.forward_rows(rows, blocks, trees, False)
        for row in rows:
            row.commit(row.cache_length - len(blocks[rows.index(row)]), trees[rows.index(row)] or TokenTree.chain(2), ())
        again = hooked.forward_rows(rows, [[3], [4]], [None, None], False)  # after the hooked blocks' entries
    finally:
        handle.remove()
    assert calls
    for a, b in zip(got, want):
        assert torch.equal(a.logits, b.logits)
    for row, block, tree in zip(lean_rows, blocks, trees):
        row.commit(row.cache_length - len(block), tree or TokenTree.chain(2), ())
    for a, b in zip(again, lean_batch.forward_rows(lean_rows, [[3], [4]], [None, None], False)):
        assert torch.equal(a.logits, b.logits)


def test_a_prompt_that_starts_as_a_finished_row_reuses_its_entries_with_the_same_numbers():
    """A finished row's entries (prompt and generated tokens) serve the next prompt that starts
    with them: its first decode step's logits equal a fresh prefill's; kept entries give way
    when running rows need their room."""
    model = prepared("llama", torch.float32)
    batch = PackedBatch(model)
    first = repetitive_prompt(60, seed=4)[0].tolist()  # 59 cached, then 6 generated: 64 reused
    row = batch.add(first)[0]
    for step in range(3):  # three decode steps: generated tokens are kept too
        start = row.cache_length
        batch.forward_rows([row], [[first[-1] if step == 0 else 9, 5, 6]], [None], False)
        row.commit(start, TokenTree.chain(2), (0,))
    history = list(row.tokens)
    batch.remove(row)
    assert len(batch.prefixes) == 1 and not batch.rows
    follow_up = history + [7, 8, 9, 10]  # a conversation's next turn: all of the history, then more
    again = batch.add(follow_up)[0]
    assert batch.reused_tokens == len(history) // 16 * 16 > len(first)
    got = batch.forward_rows([again], [[follow_up[-1], 3, 4]], [None], False)[0].logits
    assert torch.equal(got, alone(model, follow_up, [([follow_up[-1], 3, 4], None, ())])[0])
    history_segment = batch.arena.segment(batch.prefixes.find(history)[0])
    batch.remove(again)
    # the follow-up's entries serve every prefix the history's did: only they stay, and the
    # history's segment is free again
    assert len(batch.prefixes) == 1
    kept, covered = batch.prefixes.find(follow_up)
    assert covered == len(follow_up[:-1]) // 16 * 16 and kept.tokens == tuple(follow_up[:covered])
    assert batch.arena.segment(kept) is not history_segment
    assert all(segment is not history_segment for segment in batch.arena.owned.values())

    # a finished row that shares only the first blocks supersedes nothing: both stay findable
    branch = batch.add(history[:32] + [11] * 40)[0]
    batch.remove(branch)
    assert len(batch.prefixes) == 2
    assert batch.prefixes.find(follow_up)[0] is kept

    # kept entries give way to running rows before the store grows
    tight = PackedBatch(model)
    tight.remove(tight.add(first)[0])
    capacity = tight.arena.capacity
    assert len(tight.prefixes) == 1
    tight.add(repetitive_prompt(60, seed=5)[0].tolist())
    assert not tight.prefixes and tight.arena.capacity == capacity


@pytest.mark.parametrize("method", ["lookahead", "suffix"])
def test_rows_of_a_packed_batch_feed_the_shared_pool_once_each(method):
    """The server's scheduler over a packed batch: every row that ends (its budget spent, none
    asked, cancelled mid-stream, or left behind by a scheduler being replaced) ends its
    generation in the pool exactly once; a row with pool=False never touches it."""
    from hasten.api import make_drafter
    from hasten.engine.batch import Request, Scheduler

    drafter = make_drafter(method)
    scheduler = Scheduler(tiny_model("llama"), drafter, max_batch=8, draft_size="fixed")
    assert isinstance(scheduler.target, PackedBatch)
    prompts = [repetitive_prompt(n, seed=n)[0].tolist() for n in (12, 30, 7, 20, 16, 9)]
    budgets = [40, 10, 17, 0, 24]
    rows = [scheduler.submit(Request(p, b)) for p, b in zip(prompts[:5], budgets)]
    private = scheduler.submit(Request(prompts[5], 24, pool=False))
    generated = {row: [] for row in [*rows, private]}

    def take(updates):
        for update in updates:
            generated[update.row_id] += update.tokens

    take(scheduler.step())
    scheduler.cancel(rows[4])
    for _ in range(3):
        take(scheduler.step())
    assert scheduler.running  # some rows are left behind ...
    scheduler.abandon()  # ... by the server's worker, before it moves them to a fresh scheduler
    scheduler.abandon()  # a row's generation ends once, however often it is told
    pool = drafter.pool
    assert not pool.active and pool.finished == 5
    if method == "suffix":  # every token a pooled row generated is cached once, no prompt token
        assert pool.cached_tokens == sum(len(generated[row]) for row in generated if row != private)


def test_a_row_cropped_before_its_deferred_prompt_runs_keeps_the_rest_of_it():
    """Cropping a row whose prompt has not run yet drops the deferred tokens past the crop;
    its next forward runs what is left, with the logits of the shorter prompt decoded alone."""
    model = prepared("llama", torch.float32)
    prompt = repetitive_prompt(30, seed=6)[0].tolist()
    batch = PackedBatch(model)
    row = batch.add(prompt, defer=True)[0]
    assert row.cache_length == 29 and len(row.deferred) == 29
    row.crop(20)
    assert row.cache_length == 20 and len(row.deferred) == 20
    shorter = prompt[:21]  # 20 cached, then its root
    got = batch.forward_rows([row], [[shorter[-1], 3, 4]], [None], False)[0].logits
    assert torch.equal(got, alone(model, shorter, [([shorter[-1], 3, 4], None, ())])[0])
    assert not row.deferred and row.length == 23


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deferred_prompt_reports_its_states_with_the_rows_first_block(dtype):
    """With hidden states asked for, a row whose prompt runs in the step (deferred) gets the
    prompt's states too, bit for bit those of a prefill alone, and its block's logits and states
    are unchanged by them (the LM head reads the blocks' rows alone)."""
    model = prepared("llama", dtype)
    prompts = [repetitive_prompt(18, seed=7)[0].tolist(), repetitive_prompt(25, seed=8)[0].tolist()]
    blocks, trees = [[prompts[0][-1], 3, 4], [prompts[1][-1], 5]], [None, None]
    alone = PackedBatch(model)
    added = [alone.add(p, hidden=True) for p in prompts]  # prefilled alone, their states returned
    want = alone.forward_rows([row for row, _ in added], blocks, trees, True)
    deferred = PackedBatch(model)
    rows = [deferred.add(p, defer=True)[0] for p in prompts]
    got = deferred.forward_rows(rows, blocks, trees, True)
    for (_, states), a, b in zip(added, got, want):
        assert torch.equal(a.prompt_hidden, states)  # [T - 1, hidden]
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    assert all(out.prompt_hidden is None for out in want)
    plain = deferred.forward_rows(rows, [[6], [7]], [None, None], False)  # nothing deferred left, no states asked
    assert all(out.prompt_hidden is None and out.hidden is None for out in plain)
