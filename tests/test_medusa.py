"""Medusa: greedy output is token-identical to Hugging Face greedy generate whatever the
heads guess (untrained, trained, scripted trees with the right branch anywhere), and
sampled output keeps the target's law."""
from functools import partial
import warnings

import pytest
import torch

import hasten
from hasten.drafters.candidates import sparse_tree
from hasten.drafters.medusa import (
    Medusa, MedusaHeads, MedusaSettings, MedusaTraining, MedusaTrainOptions,
)
from hasten.core.sampling import Sampling
from hasten.core.errors import HastenWarning
from helpers import (
    generate_exactly, ours,
    CAUSAL_CONFIGS, ScriptedDrafter, distill_tiny, hf_greedy, repetitive_prompt, save_checkpoint, tiny_model, train_briefly,
)
from test_sampling_distribution import BOUND, PROMPT, empirical_tv, peaky_model

ARCHS = sorted(CAUSAL_CONFIGS)
NEW = 24


def train_heads(model, out_dir, steps=5, **options):
    """Heads trained for a few steps on the model's own continuations, saved to out_dir."""
    trainable = MedusaTraining(model, MedusaTrainOptions(**{"num_heads": 3, **options}))
    return train_briefly(trainable, distill_tiny(model, out_dir / "work"), out_dir, steps)


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tmp_path_factory):
    model = tiny_model(request.param)
    prompt = repetitive_prompt(20, seed=1)
    heads_dir = train_heads(model, tmp_path_factory.mktemp(request.param))
    return model, prompt, hf_greedy(model, prompt, NEW), heads_dir


check = partial(generate_exactly, max_new_tokens=NEW)


# ---- real heads ------------------------------------------------------------------------------
def test_untrained_heads(setup):
    model, prompt, reference, _ = setup
    with pytest.warns(HastenWarning, match="untrained medusa drafter"):
        stats = check(model, prompt, reference, Medusa(num_heads=3))
    assert stats.drafted_tokens > 0


def test_trained_heads(setup):
    model, prompt, reference, heads_dir = setup
    heads = MedusaHeads.load(heads_dir)
    assert any(block.linear.weight.abs().sum() > 0 for block in heads.blocks)  # training moved them
    assert heads.config.accuracy is not None and len(heads.config.accuracy) == 3
    for settings in (dict(), dict(tree="[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"), dict(top_k=1, tree_size=3)):
        check(model, prompt, reference, Medusa(weights=str(heads_dir), **settings))


def test_own_lm_heads(tmp_path):
    model = tiny_model("qwen2")
    prompt = repetitive_prompt(20, seed=2)
    heads_dir = train_heads(model, tmp_path, share_lm_head=False)
    heads = MedusaHeads.load(heads_dir)
    assert not heads.config.share_lm_head and heads.lm_heads is not None
    check(model, prompt, hf_greedy(model, prompt, NEW), Medusa(weights=str(heads_dir)))


def test_untrained_head_repeats_the_target_prediction():
    model = tiny_model("llama")
    hidden = model(repetitive_prompt(8), output_hidden_states=True).hidden_states[-1][0]  # [T, H]
    for share in (True, False):
        heads = MedusaHeads.for_target(model, 2, share_lm_head=share)
        assert torch.allclose(heads(hidden, model.lm_head), model.lm_head(hidden).expand(2, -1, -1))


def test_one_token_prompt_drafts_nothing_at_first():
    model = tiny_model("gpt2")
    prompt = torch.tensor([[5]])
    with pytest.warns(HastenWarning):
        check(model, prompt, hf_greedy(model, prompt, NEW), Medusa(num_heads=2))


def test_heads_beside_the_model_are_found(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", arch="llama")
    model = hasten.loading.load_model(checkpoint)
    train_heads(model, tmp_path / "model" / "medusa")
    engine = hasten.load(checkpoint, "medusa")
    plain = hasten.load(checkpoint, "autoregressive")
    prompt = "def add(a, b):\n    return a + b\n\ndef add("
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)  # no "untrained" warning
        assert engine.generate(prompt, max_new_tokens=20).token_ids == plain.generate(prompt, max_new_tokens=20).token_ids
    assert engine.drafter.module.config.target == "test"


def test_warns_once_per_target():
    model = tiny_model("llama")
    drafter = Medusa()
    with pytest.warns(HastenWarning) as record:
        for _ in range(3):
            hasten.generate(model, repetitive_prompt(8), drafter=drafter, max_new_tokens=4)
    assert len(ours(record)) == 1


def test_settings_and_shapes_are_checked(tmp_path):
    assert MedusaSettings(tree="[(0,), (0, 1)]").tree == ((0,), (0, 1))
    for bad, match in [(dict(tree="[(0, 1)]"), "parent"), (dict(tree="nonsense"), "tree"), (dict(tree=[(-1,)]), "ranks"),
                       (dict(top_k=0), "top_k"), (dict(num_heads=0), "num_heads"), (dict(tree_size=0), "tree_size")]:
        with pytest.raises(ValueError, match=match):
            Medusa(**bad)
    with pytest.raises(FileNotFoundError, match="no medusa weights"):
        Medusa(weights=str(tmp_path))
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="deep but the drafter guesses only 2 levels"), pytest.warns(HastenWarning):
        hasten.generate(model, repetitive_prompt(8), drafter=Medusa(num_heads=2, tree=[(0,), (0, 0), (0, 0, 0)]))
    MedusaHeads.for_target(tiny_model("llama", hidden_size=16, num_attention_heads=2), 2).save(tmp_path / "small")
    with pytest.raises(ValueError, match="do not fit"):
        hasten.generate(model, repetitive_prompt(8), drafter=Medusa(weights=str(tmp_path / "small")))


def test_sparse_tree_keeps_the_likeliest_paths():
    accuracy = [[0.9, 0.05], [0.8, 0.1]]
    assert sparse_tree(accuracy, 3) == ((0,), (0, 0), (0, 1))
    tree = sparse_tree([[0.5, 0.3, 0.1]] * 4, 20)
    assert len(tree) == 20 and all(path[:-1] in tree for path in tree if len(path) > 1)


# ---- scripted trees -----------------------------------------------------------------------------
class TreeScript(ScriptedDrafter):
    """A Medusa-style tree whose *right branch* follows the ranks in ``right``: the node at
    depth d on it holds the reference token, every other node a wrong one (siblings stay
    distinct). ``right_depth`` says how deep the right branch is really right: all of it
    (None), none (0, an all-wrong tree) or down to a planted error after depth j."""

    def __init__(self, reference, paths, right, right_depth=None):
        super().__init__(reference, len(right), "oracle")
        self.paths = sorted(set(paths), key=lambda p: (len(p), p))  # the node order of TokenTree.from_paths
        self.right = tuple(right)
        self.right_depth = len(right) if right_depth is None else right_depth

    def propose(self, ctx):
        truth = super().propose(ctx).tokens  # checks the cache invariant, gives the reference continuation
        tokens = []
        for path in self.paths:
            depth = len(path)
            reference = truth[depth - 1] if depth <= len(truth) else 0  # deeper nodes are cut by the loop
            right = path == self.right[:depth] and depth <= self.right_depth
            tokens.append(reference if right else (reference + 1 + path[-1]) % ctx.target.vocab_size)
        return hasten.drafters.Draft(tuple(tokens), hasten.core.tree.TokenTree.from_paths(self.paths))


FULL = [p for a in range(3) for p in [(a,)] + [(a, b) for b in range(3)] + [(a, b, c) for b in range(3) for c in range(3)]]
LOPSIDED = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2, 0), (2, 0, 0), (2, 0, 0, 0)]
TREES = {
    "full-top": (FULL, (0, 0, 0)),
    "full-last": (FULL, (2, 2, 2)),
    "full-mixed": (FULL, (1, 0, 2)),
    "lopsided-deep": (LOPSIDED, (2, 0, 0, 0)),
    "lopsided-short": (LOPSIDED, (0, 1)),
}
CASES = [(name, depth) for name, (_, right) in TREES.items() for depth in range(len(right) + 1)]


@pytest.mark.parametrize("tree, right_depth", CASES, ids=[f"{n}-right{d}" for n, d in CASES])
def test_scripted_trees(setup, tree, right_depth):
    model, prompt, reference, _ = setup
    paths, right = TREES[tree]
    stats = check(model, prompt, reference, TreeScript(reference[0].tolist(), paths, right, right_depth))
    # every step accepts the right part of the branch and adds the bonus token (the last step
    # commits what is left: the budget, or up to a stop token inside the accepted path)
    assert stats.steps == -(-stats.new_tokens // (right_depth + 1))
    assert stats.new_tokens - stats.steps <= stats.accepted_tokens <= right_depth * stats.steps


# ---- sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tree, sampling", [
    ("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]", Sampling(1.0)),
    (None, Sampling(0.8, top_k=5, top_p=0.9)),
])
def test_sampled_continuations_follow_the_target(tmp_path, tree, sampling):
    target = peaky_model(0)
    heads = MedusaHeads.for_target(target, 2)
    torch.manual_seed(3)
    for block in heads.blocks:  # opinionated random heads: drafts that are sometimes right, sometimes not
        torch.nn.init.normal_(block.linear.weight, std=2.0)
    heads.save(tmp_path)
    drafter = Medusa(weights=str(tmp_path), tree=tree, tree_size=6)
    hasten.generate(target, PROMPT, drafter=drafter, max_new_tokens=2)
    assert len(drafter.tree.tree) == 6
    assert empirical_tv(target, drafter, sampling) < BOUND


def test_the_no_weights_warning_says_where_it_looked():
    model = tiny_model("llama")  # built in memory: no directory to look beside
    with pytest.warns(HastenWarning, match="the model was not loaded from a directory"):
        hasten.generate(model, torch.tensor([[5, 6, 7]]), drafter=Medusa(), max_new_tokens=3)
