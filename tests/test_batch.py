"""Batched decoding and continuous batching: every row comes out exactly as it would alone.

Rows have ragged prompt lengths, accept different numbers of draft tokens per step, stop
at different steps (EOS, budget, stop strings), join a running batch and leave it
(finished or cancelled); the shared KV cache keeps each row's committed length (the
scripted drafter asserts it at every step) and stays compact. Sampling: each row of a
batch follows the plain model's law.
"""
import pytest
import torch

import hasten
from hasten.core.sampling import Sampling
from hasten.drafters import DraftModel, Lookahead, Medusa, PromptLookup, Suffix
from hasten.drafters.base import Draft, DraftContext, Drafter, create
from hasten.core.runtime import Capability, MissingCapability
from hasten.drafters.hidden_transfer import HiddenTransfer
from hasten.engine.batch import Request, Scheduler
from hasten.engine.stops import StopStrings
from hasten.models.batch import BatchAdapter
from hasten.models.packed_batch import PackedBatch
from helpers import CAUSAL_CONFIGS, VOCAB, hf_greedy, repetitive_prompt, tiny_model, tiny_tokenizer
from test_sampling_distribution import DEEP_LAW_SAMPLING, PROMPT, TARGET, bound, draft_model_3_deep, exact_law

ARCHS = sorted(CAUSAL_CONFIGS)
NEW = 20
DRAFT_LEN = 4


def prompts(seed: int = 0) -> list[torch.Tensor]:
    """Three prompts of different lengths (one of a single token), repetitive so lookups match."""
    return [repetitive_prompt(6, seed)[0], repetitive_prompt(30, seed + 1)[0], torch.tensor([5]),
            repetitive_prompt(14, seed + 2)[0]]


class RowScripted(Drafter):
    """Each row's reference continuation (found by its prompt), drafted with a planted
    error at position ``mode`` ("oracle": none, "adversarial": every token wrong). Checks
    the cache invariant of its row at every step."""

    name = "row_scripted"

    def __init__(self, references: list[list[int]], mode):
        self.references, self.mode = references, mode

    def begin(self, ctx: DraftContext):
        return next(ref for ref in self.references if ref[: len(ctx.tokens)] == ctx.tokens)

    def propose(self, ctx: DraftContext) -> Draft:
        assert ctx.target.cache_length == len(ctx.tokens) - 1, "the row's cache must hold its tokens but the root"
        reference = ctx.state
        assert ctx.tokens == reference[: len(ctx.tokens)]
        start = len(ctx.tokens)
        right = reference[start : start + min(DRAFT_LEN, ctx.max_depth)]
        wrong = lambda t: (t + 1) % VOCAB  # noqa: E731
        if self.mode == "oracle":
            return Draft.chain(right)
        if self.mode == "adversarial":
            return Draft.chain([wrong(t) for t in right])
        return Draft.chain([wrong(t) if i == self.mode else t for i, t in enumerate(right)])


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request):
    model = tiny_model(request.param)
    rows = prompts()
    references = [hf_greedy(model, row[None], NEW)[0].tolist() for row in rows]
    return model, rows, references


def assert_rows_equal(out, references):
    assert [row.tolist() for row in out.sequences] == references


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
def test_scripted_rows_equal_hf_greedy(arch_setup, mode):
    model, rows, references = arch_setup
    out = hasten.generate(model, rows, drafter=RowScripted(references, mode), max_new_tokens=NEW, draft_size="fixed")
    assert_rows_equal(out, references)
    if mode == "oracle":  # every row commits draft + bonus per step
        assert all(row.stats.steps == -(-row.stats.new_tokens // (DRAFT_LEN + 1)) for row in out.rows)
    if mode == "adversarial":
        assert out.stats.accepted_tokens == 0


@pytest.mark.parametrize("drafter", [None, PromptLookup(num_tokens=DRAFT_LEN), Lookahead(), Medusa(num_heads=3),
                                     "eagle", "eagle3", "chimera", "gad", "mixed", Suffix()],
                         ids=["plain", "prompt_lookup", "lookahead_tree", "medusa_tree_features", "eagle", "eagle3",
                              "chimera", "gad", "mixed", "suffix_tree"])
@pytest.mark.filterwarnings("ignore:no .* weights found")  # untrained feature drafters: exact, rarely right
def test_drafters_rows_equal_hf_greedy(arch_setup, drafter):
    model, rows, references = arch_setup
    if isinstance(drafter, str):
        drafter = create(drafter)
    assert_rows_equal(hasten.generate(model, rows, drafter=drafter, max_new_tokens=NEW), references)
    if drafter is not None and drafter.pool is not None:  # again: the rows now draft from each other's output
        assert_rows_equal(hasten.generate(model, rows, drafter=drafter, max_new_tokens=NEW), references)


def test_draft_model_rows_equal_hf_greedy(arch_setup):
    model, rows, references = arch_setup
    draft = tiny_model(model.config.model_type if model.config.model_type in CAUSAL_CONFIGS else "llama", seed=3)
    out = hasten.generate(model, rows, drafter=DraftModel(draft, num_tokens=3, adaptive=True), max_new_tokens=NEW)
    assert_rows_equal(out, references)


def test_padded_tensor_with_attention_mask_equals_the_list():
    model = tiny_model("llama")
    rows = prompts()[:2]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # left padding, as Hugging Face batches
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    by_mask = hasten.generate(model, ids, attention_mask=mask, drafter=PromptLookup(), max_new_tokens=NEW)
    by_list = hasten.generate(model, rows, drafter=PromptLookup(), max_new_tokens=NEW)
    assert [s.tolist() for s in by_mask.sequences] == [s.tolist() for s in by_list.sequences]


def test_rows_stop_at_their_own_eos_and_budget():
    model = tiny_model("qwen2")
    rows = prompts()
    alone = [hasten.generate(model, row[None], max_new_tokens=NEW, eos_token_id=[]).sequences[0].tolist() for row in rows]
    eos = alone[1][len(rows[1]) + 3]  # row 1 meets it at its 4th new token (others may meet it too)
    singles = [hasten.generate(model, row[None], drafter=PromptLookup(), max_new_tokens=NEW, eos_token_id=eos)
               for row in rows]
    batch = hasten.generate(model, rows, drafter=PromptLookup(), max_new_tokens=NEW, eos_token_id=eos)
    assert [s.tolist() for s in batch.sequences] == [s.sequences[0].tolist() for s in singles]
    assert len(batch.sequences[1]) <= len(rows[1]) + 4 and batch.rows[1].finish_reason == "stop"
    lengths = {len(s) - len(r) for s, r in zip(batch.sequences, rows)}
    assert len(lengths) > 1, "rows should have stopped at different steps"


def test_stop_strings_match_hf_generate():
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=4)
    prompt = torch.tensor([tokenizer.encode("def add(a, b):\n    return a")])
    full = hf_greedy(model, prompt, 24)[0, prompt.shape[1]:].tolist()
    text = tokenizer.decode(full)
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle of what it writes
    expected = hf_greedy(model, prompt, 24, stop_strings=[stop], tokenizer=tokenizer)[0].tolist()
    for drafter in (None, PromptLookup()):
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=24, stop_strings=[stop], tokenizer=tokenizer)
        assert out.sequences[0].tolist() == expected and out.finish_reason == "stop"
        batch = hasten.generate(model, [prompt[0], prompt[0][:5]], drafter=drafter, max_new_tokens=24,
                                stop_strings=[stop], tokenizer=tokenizer)
        assert batch.sequences[0].tolist() == expected


def test_stop_strings_text_side():
    stops = StopStrings(tiny_tokenizer(), ["END", "\n\n"])
    assert stops.cut("abc\n\nxyz END") == ("abc", True)
    assert stops.cut("abc") == ("abc", False)
    assert stops.safe_length("value = EN") == len("value = ")  # "EN" may still become "END"
    assert stops.safe_length("value = E\n") == len("value = E")
    assert stops.safe_length("done") == 4
    with pytest.raises(ValueError, match="empty"):
        StopStrings(None, [""])
    with pytest.raises(ValueError, match="tokenizer"):
        hasten.generate(tiny_model("llama"), torch.tensor([[3, 4]]), stop_strings=["x"])


# ---- continuous batching ------------------------------------------------------------------------
def alone(model, drafter, row, new=NEW, eos=None):
    return hasten.generate(model, row[None], drafter=drafter, max_new_tokens=new, eos_token_id=eos).sequences[0].tolist()


@pytest.mark.parametrize("arch", ["mistral", "llama"])
def test_rows_join_a_running_batch_and_leave_it(arch):
    """mistral: the padded batch (a sliding window of 16, measured per row), prompt lookup's
    chains; llama: the packed batch, lookahead's trees. Rows join every other step, mid-block
    for the rows running, and leave as they end."""
    model = tiny_model(arch)
    rows = prompts() + prompts(seed=7)
    drafter = PromptLookup(num_tokens=DRAFT_LEN) if arch == "mistral" else Lookahead()
    scheduler = Scheduler(model, drafter, max_batch=3)
    budgets = [NEW, 6, 30, 12, 3, NEW, 9, 25]
    out: dict[int, list[int]] = {}
    ids = [scheduler.submit(Request(rows[i].tolist(), budgets[i])) for i in range(2)]
    most, step = 0, 0
    while len(ids) < len(rows) or scheduler.has_work():
        if len(ids) < len(rows) and step % 2 == 1:  # a new request every other step
            ids.append(scheduler.submit(Request(rows[len(ids)].tolist(), budgets[len(ids)])))
        for update in scheduler.step():
            out.setdefault(update.row_id, []).extend(update.tokens)
        step += 1
        most = max(most, scheduler.running)
        if isinstance(scheduler.target, BatchAdapter):
            scheduler.target.flush()
            longest = int(scheduler.target.valid.sum(1).max()) if scheduler.running else 0
            assert scheduler.target.columns <= 2 * longest + 32 + 2 * DRAFT_LEN + 2, "holes must be compacted away"
            for row in scheduler.target.rows:
                assert int(scheduler.target.valid[row.slot].sum()) == row.length
        else:
            assert isinstance(scheduler.target, PackedBatch)
    assert len(ids) == len(rows) and most >= 2  # rows overlap (lookahead ends its rows sooner)
    for i, row_id in enumerate(ids):
        assert rows[i].tolist() + out[row_id] == alone(model, drafter, rows[i], budgets[i]), f"row {i}"


def test_cancel_running_and_waiting_rows_keeps_the_others_exact():
    model = tiny_model("llama")
    rows = prompts()
    scheduler = Scheduler(model, PromptLookup(), max_batch=2)
    ids = [scheduler.submit(Request(row.tolist(), NEW, eos_token_ids=frozenset())) for row in rows]
    out: dict[int, list[int]] = {}
    reasons = {}
    for step in range(200):
        if step == 2:
            scheduler.cancel(ids[0])  # running
            scheduler.cancel(ids[3])  # still waiting
        for update in scheduler.step():
            out.setdefault(update.row_id, []).extend(update.tokens)
            if update.finished:
                reasons[update.row_id] = update.finish_reason
        if not scheduler.has_work():
            break
    assert reasons[ids[0]] == reasons[ids[3]] == "cancelled" and out.get(ids[3], []) == []
    assert len(out[ids[0]]) < NEW
    for i in (1, 2):
        assert rows[i].tolist() + out[ids[i]] == alone(model, PromptLookup(), rows[i], eos=[])
    target = scheduler.target  # a llama batch packs its rows: what is left is only kept for later prompts
    assert target.rows == [] and len(target.arena.owned) == len(target.prefixes)


def test_max_tokens_in_flight_holds_rows_back():
    model = tiny_model("llama")
    rows = prompts()
    scheduler = Scheduler(model, None, max_batch=8, max_tokens_in_flight=80)
    ids = [scheduler.submit(Request(row.tolist(), NEW, eos_token_ids=frozenset())) for row in rows]  # reserves 26, 50, 21, 34 tokens: at most two fit
    seen = 0
    out = {}
    while scheduler.has_work():
        for update in scheduler.step():
            out.setdefault(update.row_id, []).extend(update.tokens)
        seen = max(seen, scheduler.running)
        assert sum(len(rows[ids.index(r)]) + NEW for r in scheduler._running) <= 80 or scheduler.running == 1
    assert seen == 2
    with pytest.raises(ValueError, match="max_tokens_in_flight"):
        scheduler.submit(Request(list(range(3, 70)), 20))


def test_scheduler_refuses_bad_requests_with_the_field_named():
    model = tiny_model("llama")
    scheduler = Scheduler(model)
    with pytest.raises(ValueError, match="input_ids"):
        scheduler.submit(Request([], 4))
    with pytest.raises(ValueError, match="vocabulary"):
        scheduler.submit(Request([VOCAB], 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        scheduler.submit(Request([3], -1))
    with pytest.raises(ValueError, match="max_new_tokens=600"):
        scheduler.submit(Request([3], 600))  # beyond the 512 positions
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(model, max_batch=0)
    assert not scheduler.has_work()


def test_batches_refuse_what_they_cannot_serve():
    with pytest.raises(ValueError, match="encoder-decoder"):
        hasten.generate(tiny_model("t5"), [torch.tensor([3, 4]), torch.tensor([5])], max_new_tokens=2)
    with pytest.raises(MissingCapability, match="riders, which the Hugging Face runtime does not provide in a batch") as refused:
        hasten.generate(tiny_model("llama"), [torch.tensor([3, 4, 3, 4]), torch.tensor([5])],
                        drafter=HiddenTransfer(), max_new_tokens=4)
    assert refused.value.missing == {Capability.RIDERS}  # refused by the batch's capabilities, before any forward
    with pytest.raises(ValueError, match="shape"):
        hasten.generate(tiny_model("llama"), torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match=r"input_ids\[1\]"):
        hasten.generate(tiny_model("llama"), [torch.tensor([3]), torch.tensor([[3]])])
    with pytest.raises(ValueError, match="causal LM"):
        BatchAdapter(tiny_model("bart"))


# ---- the sampling law, per row of a batch -------------------------------------------------------------
def test_each_row_of_a_batch_follows_the_target_law():
    """Two rows of the same prompt, a draft model 3 deep (rejections at depths 1-3 shape the
    first 3 tokens): both rows' samples together match the exact law within the bound."""
    sampling = DEEP_LAW_SAMPLING
    law = exact_law(TARGET, sampling, 3)
    counts = dict.fromkeys(law, 0)
    g = torch.Generator().manual_seed(99)
    drafter = draft_model_3_deep()
    samples = 0
    for _ in range(700):
        out = hasten.generate(TARGET, [PROMPT[0], PROMPT[0]], drafter=drafter, max_new_tokens=4,
                              temperature=sampling.temperature, top_k=sampling.top_k, generator=g)
        for row in out.sequences:
            counts[tuple(row[PROMPT.shape[1]:][:3].tolist())] += 1
            samples += 1
    tv = 0.5 * sum(abs(counts[k] / samples - law[k]) for k in law)
    assert tv < bound(law, samples), f"TV {tv:.3f} >= bound {bound(law, samples):.3f}"


def test_row_seeds_make_sampled_rows_reproducible():
    model = tiny_model("llama")
    sampling = Sampling(1.0)
    runs = []
    for _ in range(2):
        scheduler = Scheduler(model, PromptLookup())
        ids = [scheduler.submit(Request(row.tolist(), 8, sampling, seed=11)) for row in prompts()[:2]]
        out = scheduler.run()
        runs.append([out[i].tokens for i in ids])
    assert runs[0] == runs[1]


def test_a_prefill_budget_lets_long_prompts_in_a_few_per_step():
    model = tiny_model("llama")
    rows = [repetitive_prompt(20, seed)[0] for seed in range(4)]
    scheduler = Scheduler(model, PromptLookup(), max_batch=8, max_prefill_tokens=45)
    ids = [scheduler.submit(Request(row.tolist(), 6, eos_token_ids=frozenset())) for row in rows]
    admitted = []
    out: dict[int, list[int]] = {}
    while scheduler.has_work():
        for update in scheduler.step():
            out.setdefault(update.row_id, []).extend(update.tokens)
        admitted.append(scheduler.last_step.admitted)
    assert admitted[:2] == [2, 2]  # 20 + 20 tokens fit in 45, a third would not
    for row, row_id in zip(rows, ids):
        assert row.tolist() + out[row_id] == alone(model, PromptLookup(), row, 6, eos=[])
    lone = Scheduler(model, max_prefill_tokens=5)
    lone.submit(Request(rows[0].tolist(), 2))
    lone.step()
    assert lone.last_step.admitted == 1  # a prompt longer than the budget still gets in, alone
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Scheduler(model, max_prefill_tokens=0)
