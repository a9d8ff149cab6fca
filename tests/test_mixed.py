"""The mixed drafter (drafters/mixed.py): a copy and a trained drafter's guess in one tree,
lossless (greedy equality alone and in a packed batch, the sampling law three deep), each step
graded by the copy's match, and only the pairs it can run accepted."""
import pytest
import torch

import hasten
from hasten.core.request import Request
from hasten.core.runtime import Capability
from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from hasten.drafters import Draft
from hasten.drafters.base import DraftContext, TargetView
from hasten.drafters.eagle3_layer import Eagle3Layer
from hasten.drafters.mixed import PREDICTOR_ONLY, Mixed
from hasten.drafters.prompt_lookup import PromptLookup
from hasten.engine.batch import Scheduler
from hasten.models.packed_batch import PackedBatch

from helpers import hf_greedy, repetitive_prompt, tiny_model
from test_eagle3 import randomised
from test_sampling_distribution import DEEP_LAW_SAMPLING, PROMPT, TARGET, deep_tv

NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def weights(target, tmp_path_factory):
    directory = tmp_path_factory.mktemp("eagle3")
    randomised(Eagle3Layer.for_target(target)).save(directory)
    return str(directory)


class Trees:
    """The trees the drafter proposed (a spy on Mixed.propose_rows, which the step calls)."""

    def __init__(self, monkeypatch):
        self.seen: list[TokenTree] = []
        real = Mixed.propose_rows

        def spied(drafter, ctxs):
            drafts = real(drafter, ctxs)
            self.seen.extend(draft.tree for draft in drafts)
            return drafts

        monkeypatch.setattr(Mixed, "propose_rows", spied)


def test_union_shares_the_paths_both_drafts_hold():
    copy = Draft.chain([5, 6, 7])
    guess = Draft.chain([5, 6, 9])  # agrees for two tokens, then branches
    merged = copy.union(guess)
    assert merged.tokens == (5, 6, 7, 9) and merged.tree.parents == (-1, 0, 1, 1)
    other = Draft.chain([8, 6])  # agrees on nothing: a second branch from the root
    assert copy.union(other).tokens == (5, 6, 7, 8, 6) and copy.union(other).tree.parents == (-1, 0, 1, -1, 3)
    assert copy.union(copy) == copy  # the same path once
    empty = Draft.chain([])
    assert empty.union(guess) is guess and copy.union(empty) is copy
    sampled = Draft.chain([4], probs=torch.full((1, 10), 0.1))
    assert sampled.union(copy) is sampled  # a drafted law cannot be merged: the first draft stays


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_is_the_targets_with_copies_and_guesses_in_one_tree(target, weights, dtype, monkeypatch):
    model = target.to(dtype)
    trees = Trees(monkeypatch)
    drafter = Mixed(weights=weights)
    try:
        for seed in (1, 2):
            prompt = repetitive_prompt(24, seed=seed)
            reference = hf_greedy(model, prompt, NEW) if dtype == torch.float32 else \
                hasten.generate(model, prompt, max_new_tokens=NEW).sequences  # plain decoding, same kernels
            out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, draft_size="fixed")
            assert out.sequences.tolist() == reference.tolist()
    finally:
        target.float()
    assert any(not tree.is_chain for tree in trees.seen)  # a copy and a guess that disagreed: two branches


def test_rows_of_a_packed_batch_equal_each_row_alone(target, weights):
    drafter = Mixed(weights=weights)
    prompts = [repetitive_prompt(16 + 4 * i, seed=i)[0].tolist() for i in range(3)]
    alone = [hasten.generate(target, torch.tensor([p]), drafter=drafter, max_new_tokens=NEW).sequences[0].tolist()
             for p in prompts]
    scheduler = Scheduler(target, drafter, max_batch=3)
    ids = [scheduler.submit(Request(p, NEW)) for p in prompts]
    assert isinstance(scheduler.target, PackedBatch)  # the predictor's features come from the packed forward
    results = scheduler.run()
    for i, row_id in enumerate(ids):
        assert prompts[i] + results[row_id].tokens == alone[i], f"row {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_drafts_its_rows_together_and_each_row_what_it_drafts_alone(target, weights, dtype, monkeypatch):
    """The step asks the drafter for all of its rows at once (Drafter.propose_rows): EAGLE-3 runs its
    layer once for every row's catch-up and once per depth for every row's chain, and on hasten's
    row-invariant kernels each row's chain is the one it drafts alone, after the same tokens."""
    from hasten.drafters.eagle3 import Eagle3

    chains, calls = {}, []
    real = Eagle3.draft_rows

    def spied(drafter, ctxs):
        drafts = real(drafter, ctxs)
        calls.append(len(ctxs))
        for ctx, draft in zip(ctxs, drafts):
            chains.setdefault(tuple(ctx.tokens), []).append(list(draft.tokens))
        return drafts

    monkeypatch.setattr(Eagle3, "draft_rows", spied)
    prompts = [repetitive_prompt(16 + 4 * i, seed=i)[0].tolist() for i in range(3)]

    def served(rows: int) -> dict:
        """Every chain drafted, by the tokens it followed, the prompts served ``rows`` at a time (the
        predictor beside every copy, guess_below=99, as deep as it goes: fixed)."""
        chains.clear()
        scheduler = Scheduler(target, Mixed(weights=weights, guess_below=99), max_batch=rows, draft_size="fixed")
        for prompt in prompts:
            scheduler.submit(Request(prompt, NEW))
        scheduler.run()
        return dict(chains)

    target.to(dtype)
    try:
        alone = served(1)
        assert set(calls) == {1}
        calls.clear()
        together = served(3)
    finally:
        target.float()
    assert max(calls) == 3 and sum(calls) > 3 * NEW // 4  # the rows drafted together, step after step
    assert any(chain for drafted in together.values() for chain in drafted)
    assert all(alone.get(tokens) == drafted for tokens, drafted in together.items())


def test_a_server_row_prefills_in_the_steps_and_reuses_a_cached_prefix(target, weights, monkeypatch):
    """The predictor drafts without the prompt's states (Drafter.drafts_without_prompt_features),
    so a row joining a packed batch is never prefilled alone: its prompt runs in the steps beside
    the other rows (its states reported), and a prompt a finished row began reuses its entries.
    Every answer is still its text alone, the predictor guesses, and the target never runs again
    for missing features."""
    from test_eagle3 import counted_misses

    drafter = Mixed(weights=weights)
    prompts = [repetitive_prompt(20, seed=seed)[0].tolist() for seed in (3, 4)]
    alone = [hasten.generate(target, torch.tensor([p]), drafter=drafter, max_new_tokens=NEW).sequences[0].tolist()
             for p in prompts]
    misses, hidden_asked, guesses = counted_misses(monkeypatch), [], []
    add, guess = PackedBatch.add, drafter.predictor.draft_rows

    def spied_add(batch, tokens, hidden=False, **options):
        hidden_asked.append(hidden)
        return add(batch, tokens, hidden=hidden, **options)

    def spied_guess(ctxs):
        drafts = guess(ctxs)
        guesses.extend(len(draft) for draft in drafts)
        return drafts

    monkeypatch.setattr(PackedBatch, "add", spied_add)
    monkeypatch.setattr(drafter.predictor, "draft_rows", spied_guess)
    scheduler = Scheduler(target, drafter, max_batch=2)
    first = [scheduler.submit(Request(p, NEW)) for p in prompts]
    results = scheduler.run()
    again = scheduler.submit(Request(prompts[0], NEW))  # the same prompt: a finished row left its entries
    results.update(scheduler.run())
    assert hidden_asked and not any(hidden_asked) and scheduler.target.reused_tokens > 0
    for row_id, prompt, reference in zip([*first, again], [*prompts, prompts[0]], [*alone, alone[0]]):
        assert prompt + results[row_id].tokens == reference
    assert misses == [] and max(guesses) > 0


def test_a_batch_that_prefills_at_once_still_gives_the_prompts_states(target, weights, monkeypatch):
    """Where the batch prefills a joining prompt at once (a padded batch: ``defers_prompts`` False),
    the row still asks for the prompt's states: skipping them would only lose the predictor its context."""
    drafter = Mixed(weights=weights)
    hidden_asked, add = [], PackedBatch.add

    def spied_add(batch, tokens, hidden=False, **options):
        hidden_asked.append(hidden)
        return add(batch, tokens, hidden=hidden, **options)

    monkeypatch.setattr(PackedBatch, "add", spied_add)
    monkeypatch.setattr(PackedBatch, "defers_prompts", False)
    scheduler = Scheduler(target, drafter, max_batch=2)
    prompt = repetitive_prompt(20, seed=5)[0].tolist()
    row_id = scheduler.submit(Request(prompt, NEW))
    hidden_asked.clear()  # what calibration added
    tokens = scheduler.run()[row_id].tokens
    assert hidden_asked == [True]
    alone = hasten.generate(target, torch.tensor([prompt]), drafter=drafter, max_new_tokens=NEW).sequences[0].tolist()
    assert prompt + tokens == alone


def test_each_step_is_graded_by_the_copys_match(target, weights):
    """No match: the predictor's grade; a match: prompt lookup's grade, one up."""
    drafter, lookup = Mixed(weights=weights), PromptLookup()

    class Row:
        vocab_size, encoder_decoder, model = target.config.vocab_size, False, target

    def context(tokens):
        view = TargetView(Row(), frozenset({Capability.FEATURES, Capability.MODULES}))
        return DraftContext(list(tokens), 4, Sampling(), None, view)

    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 1, 2, 3]):
        ctx, plain = context(tokens), context(tokens)
        ctx.state, plain.state = drafter.begin(ctx), lookup.begin(plain)
        expected = lookup.evidence(plain)
        assert drafter.evidence(ctx) == (PREDICTOR_ONLY if expected == 0 else expected + 1)
    assert expected > 0  # the second sequence repeats "1 2 3"


def test_sampled_continuations_follow_the_target_three_deep(tmp_path):
    randomised(Eagle3Layer.for_target(TARGET), seed=3, scale=3.0).save(tmp_path)
    tv, limit = deep_tv(Mixed(weights=str(tmp_path)), DEEP_LAW_SAMPLING, samples=600)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


@pytest.mark.parametrize("settings", [dict(retrieval="eagle3"), dict(predictor="prompt_lookup")])
def test_only_a_copier_and_a_trained_predictor_pair_up(settings):
    with pytest.raises(ValueError, match="mixed: "):
        Mixed(**settings)


def test_a_sure_copy_is_drafted_alone_without_the_predictors_cost(target, weights, monkeypatch):
    """Copies graded ``guess_below`` or higher skip the predictor; below it, both draft."""
    from hasten.drafters.eagle3 import Eagle3

    calls = {"mixed": 0, "predictor": 0}
    real_mixed, real_predictor = Mixed.propose_rows, Eagle3.propose_rows

    def mixed(drafter, ctxs):
        calls["mixed"] += len(ctxs)
        return real_mixed(drafter, ctxs)

    def predictor(drafter, ctxs):
        calls["predictor"] += len(ctxs)
        return real_predictor(drafter, ctxs)

    monkeypatch.setattr(Mixed, "propose_rows", mixed)
    monkeypatch.setattr(Eagle3, "propose_rows", predictor)
    prompt = repetitive_prompt(32, seed=4)
    outputs = {}
    for guess_below in (0, 99):  # 0: every copy alone; 99: the predictor beside every copy
        calls.update(mixed=0, predictor=0)
        drafter = Mixed(weights=weights, guess_below=guess_below)
        outputs[guess_below] = hasten.generate(target, prompt, drafter=drafter, max_new_tokens=NEW,
                                               draft_size="fixed").sequences.tolist()
        if guess_below == 0:
            assert 0 < calls["predictor"] < calls["mixed"]  # steps without a copy still guess
        else:
            assert calls["predictor"] == calls["mixed"]
    assert outputs[0] == outputs[99] == hf_greedy(target, prompt, NEW).tolist()


# ---- the default method: mixed where trained EAGLE-3 weights are found -------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two copies of one tiny checkpoint: one with EAGLE-3 weights beside it, one without."""
    from helpers import save_checkpoint
    from hasten.loading import as_model

    bare = save_checkpoint(tmp_path_factory.mktemp("bare"))
    trained = save_checkpoint(tmp_path_factory.mktemp("trained"))
    randomised(Eagle3Layer.for_target(as_model(trained, torch.float32, None))).save(f"{trained}/eagle3")
    return bare, trained


def test_the_default_is_mixed_for_a_model_with_eagle3_weights_and_copying_without(checkpoints):
    bare, trained = checkpoints
    prompt = "def add(a, b):\n    return a + b\n\ndef add("
    plain = hasten.load(trained, "autoregressive", dtype="float32").generate(prompt, max_new_tokens=20)
    chosen = {}
    for path in (bare, trained):
        engine = hasten.load(path, dtype="float32")  # no method named: the default
        chosen[path] = engine.method
        assert engine.generate(prompt, max_new_tokens=20).token_ids == plain.token_ids
    assert chosen == {bare: "prompt_lookup", trained: "mixed"}
    saved = Eagle3Layer.load(f"{trained}/eagle3").state_dict()
    used = engine.drafter.predictor.module.state_dict()  # the trained path's engine: the saved weights guessed
    assert saved.keys() == used.keys() and all(torch.equal(saved[k], used[k]) for k in saved)


def test_settings_without_a_method_name_are_refused_before_loading(checkpoints):
    with pytest.raises(ValueError, match="belong to a named method"):
        hasten.load("/no/such/model", num_tokens=4)  # which method's num_tokens? never guessed
    with pytest.raises(ValueError, match="takes no draft model"):
        hasten.load("/no/such/model", draft="/no/such/draft")


def test_generate_names_the_method_the_default_chose(checkpoints, cli):
    bare, trained = checkpoints
    for path, method in ((bare, "prompt_lookup"), (trained, "mixed")):
        code, out, err = cli("generate", "--model", path, "--prompt", "def add(", "--max-new-tokens", "8",
                             "--dtype", "float32")
        assert code == 0 and f"[{method}]" in err, err
    code, _, err = cli("generate", "--model", bare, "--prompt", "x", "--method-arg", "num_tokens=4")
    assert code == 2 and "belong to a named method" in err
