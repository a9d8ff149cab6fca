"""Feature-level drafters (EAGLE, Chimera, hidden transfer, GAD): greedy output is
token-identical to Hugging Face greedy generate, untrained or trained, on every tiny
causal architecture; sampled output keeps the target's law; one drafter serves
interleaved generations; the shared layers (KV cache), tree builders, the settings and
the shipped weights are checked on their own (hidden transfer's riders: test_hidden_transfer.py)."""
from functools import partial
import warnings
from pathlib import Path

import pytest
import torch

import hasten
from hasten.drafters.candidates import CombinationTree, GrowingTree, TreeSettings, dynamic_tree, sparse_tree
from hasten.drafters.chimera import Chimera, ChimeraModel, ChimeraTraining, ChimeraTrainOptions
from hasten.drafters.eagle import Eagle, EagleLayer, EagleSettings, EagleTraining, EagleTrainOptions
from hasten.core import settings as settings_io
from hasten.drafters.medusa import Medusa
from hasten.drafters.nn import Block, KVCache, causal
from hasten.drafters.trained import WEIGHTS_FILE
from hasten.zoo.packing import packed_name
from hasten.drafters.gad import GAD, GADModel, GADTraining, GADTrainOptions
from hasten.drafters.hidden_transfer import (
    HiddenTransfer, HiddenTransferTrainOptions, Transfer,
)
from hasten.core.sampling import Sampling
from hasten.training.distill import DistillSettings, distill
from hasten.core.errors import HastenWarning
from helpers import (
    generate_exactly, opinionated, ours,
    CAUSAL_CONFIGS, SEQ2SEQ_CONFIGS, TRAIN_TEXT, distill_tiny, hf_greedy, train_briefly, repetitive_prompt, save_checkpoint, tiny_model, tiny_tokenizer,
)
from test_sampling_distribution import BOUND, TARGET, empirical_tv

ARCHS = sorted(CAUSAL_CONFIGS)
NEW = 24
TOKENIZER = tiny_tokenizer()

# name -> (drafter class, training recipe, small training options, settings variants to try when trained)
DRAFTERS = {
    "eagle": (Eagle, EagleTraining, EagleTrainOptions(), [dict(), dict(depth=2, top_k=2, total_tokens=3)]),
    "chimera": (Chimera, ChimeraTraining, ChimeraTrainOptions(num_heads=3),
                [dict(), dict(tree="[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]")]),
    "gad": (GAD, GADTraining, GADTrainOptions(block=3, window=4, anchors=4), [dict(), dict(top_k=2, tree_size=6)]),
}


def train_drafter(name, model, data, out_dir, steps=3):
    """The drafter's module trained for a few steps on the model's own continuations."""
    _, training, options, _ = DRAFTERS[name]
    return train_briefly(training(model, options), data, out_dir, steps)


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tmp_path_factory):
    model = tiny_model(request.param)
    prompt = repetitive_prompt(20, seed=1)
    root = tmp_path_factory.mktemp(request.param)
    data = distill_tiny(model, root / "work")
    trained = {name: train_drafter(name, model, data, root / name) for name in DRAFTERS}
    return model, prompt, hf_greedy(model, prompt, NEW), trained


check = partial(generate_exactly, max_new_tokens=NEW)


# ---- greedy equality ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_untrained(setup, name):
    model, prompt, reference, _ = setup
    with pytest.warns(HastenWarning, match=f"untrained {name}"):
        stats = check(model, prompt, reference, DRAFTERS[name][0]())
    assert stats.drafted_tokens > 0


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_trained(setup, name):
    model, prompt, reference, trained = setup
    drafter_cls, _, _, variants = DRAFTERS[name]
    module = drafter_cls.Module.load(trained[name])
    assert module.config.target == "test"
    for settings in variants:
        check(model, prompt, reference, drafter_cls(weights=str(trained[name]), **settings))


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_one_token_prompt(name):
    model = tiny_model("gpt2")
    prompt = torch.tensor([[5]])
    with pytest.warns(HastenWarning):
        check(model, prompt, hf_greedy(model, prompt, NEW), DRAFTERS[name][0]())


@pytest.mark.parametrize("arch", sorted(SEQ2SEQ_CONFIGS))
def test_gad_drafts_chains_for_encoder_decoders(arch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(20, seed=1)
    with pytest.warns(HastenWarning):
        check(model, prompt, hf_greedy(model, prompt, NEW), GAD(top_k=3))  # a tree setting still drafts chains


@pytest.mark.parametrize("drafter_cls", [Eagle, Chimera, HiddenTransfer], ids=["eagle", "chimera", "hidden_transfer"])
def test_tree_drafters_refuse_encoder_decoders(drafter_cls):
    with pytest.raises(ValueError, match="encoder-decoder"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hasten.generate(tiny_model("t5"), repetitive_prompt(8), drafter=drafter_cls(), max_new_tokens=4)


def test_reused_across_generations_and_prompts():
    model = tiny_model("mistral")
    drafters = [cls() for cls, *_ in DRAFTERS.values()]
    with pytest.warns(HastenWarning) as record:
        for seed in range(3):
            prompt = repetitive_prompt(12 + 2 * seed, seed=seed)
            reference = hf_greedy(model, prompt, 16)
            for drafter in drafters:
                out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=16)
                assert out.sequences.tolist() == reference.tolist()
    assert len(ours(record)) == len(drafters)  # one "untrained" warning per drafter and target


class WatchedEagle(Eagle):
    """Keeps the context of its last proposal, to look at the generation's state."""

    def draft(self, ctx):
        self.last = ctx
        return super().draft(ctx)


def test_eagle_cache_follows_the_committed_tokens():
    """At the last proposal of a generation, the loop's features are the target's own
    features of every committed token but the root, whatever was accepted on the way,
    and EAGLE's committed keys and values are those of one causal pass over them."""
    model = tiny_model("llama")
    drafter = WatchedEagle(depth=3, top_k=2, total_tokens=5)
    with pytest.warns(HastenWarning):
        out = hasten.generate(model, repetitive_prompt(12), drafter=drafter, max_new_tokens=20)
    ctx, tokens = drafter.last, out.sequences
    assert ctx.tokens == tokens[0].tolist()  # the loop's own list, read by the drafter
    hidden = model(tokens, output_hidden_states=True).hidden_states[-1][0]  # [T, H]
    features = ctx.features
    assert len(features) == tokens.shape[1] - 1
    assert torch.allclose(features, hidden[:-1], atol=1e-4)
    cache, n = ctx.state.cache, len(features)
    assert 0 < cache.length <= n  # what was committed when the last draft was made
    whole = KVCache()
    with torch.no_grad():
        drafter.module(features[None], model.get_input_embeddings()(tokens[:, 1:]), torch.arange(n)[None],
                       causal(n), whole, 0)
    whole.commit(n)
    for mine, full in zip(cache.view(), whole.view()):  # keys, values: [1, heads, length, head_dim]
        assert torch.allclose(mine, full[:, :, : cache.length], atol=1e-5)


def test_weights_beside_the_model_are_found(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", arch="llama")
    model = hasten.loading.load_model(checkpoint)
    data = distill(model, TOKENIZER, TRAIN_TEXT, DistillSettings(samples=4, prompt_tokens=8, gen_tokens=8), tmp_path / "work",
                   source="test", progress=False)
    train_drafter("eagle", model, data, tmp_path / "model" / "eagle", steps=1)
    files = {p.name for p in (tmp_path / "model" / "eagle").iterdir()}
    assert {"eagle.json", WEIGHTS_FILE} <= files
    prompt = "def add(a, b):\n    return a + b\n\ndef add("
    plain = hasten.load(checkpoint, "autoregressive").generate(prompt, max_new_tokens=16).token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)  # no "untrained" warning
        engine = hasten.load(checkpoint, "eagle", depth=3)
        assert engine.generate(prompt, max_new_tokens=16).token_ids == plain
    assert engine.drafter.module.config.target == "test"


# ---- sampling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, sampling", [
    ("eagle", Sampling(1.0)),
    ("chimera", Sampling(0.8, top_k=5, top_p=0.9)),
    ("gad", Sampling(1.0, top_k=6)),
])
def test_sampled_continuations_follow_the_target(tmp_path, name, sampling):
    drafter_cls = DRAFTERS[name][0]
    opinionated(drafter_cls.Module.for_target(TARGET), seed=3).save(tmp_path)
    settings = {"eagle": dict(depth=2, top_k=3, total_tokens=6), "gad": dict(top_k=2, tree_size=6)}.get(name, dict(tree_size=6))
    drafter = drafter_cls(weights=str(tmp_path), **settings)
    assert empirical_tv(TARGET, drafter, sampling) < BOUND


# ---- the shared tree builders ----------------------------------------------------------------------
def scripted_expand(vocab, seed):
    """An 'autoregressive drafter' whose next-token law depends on the whole path."""
    def expand(nodes, grown: GrowingTree):
        rows = []
        for node in nodes:
            path, at = [], node
            while at >= 0:
                path.append(grown.tokens[at])
                at = grown.parents[at]
            g = torch.Generator().manual_seed(seed + hash(tuple(path)) % 10_000)
            rows.append((torch.randn(vocab, generator=g) * 3).log_softmax(-1))
        return torch.stack(rows)
    return expand


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_tree_keeps_the_most_probable_nodes(seed):
    vocab, depth, top_k, total = 12, 4, 3, 10
    first = (torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3).log_softmax(-1)
    expand = scripted_expand(vocab, seed)
    seen: dict[tuple, float] = {}  # every candidate the builder created: path -> cumulative log-prob

    def recording(nodes, grown):
        out = expand(nodes, grown)
        for node in range(len(grown.tokens)):
            path, at = [], node
            while at >= 0:
                path.append(grown.tokens[at])
                at = grown.parents[at]
            seen[tuple(reversed(path))] = grown.scores[node]
        return out

    tokens, tree = dynamic_tree(first, recording, depth, top_k, total)
    assert len(tokens) == total
    for i, parent in enumerate(tree.parents):  # parents before children
        assert parent < i
    for kids in tree.children:  # siblings distinct
        assert len({tokens[k] for k in kids}) == len(kids)
    paths = [tuple(tokens[n] for n in tree.ancestors(i)) for i in range(len(tokens))]
    # scores recomputed from the laws: each node's cumulative log-prob along its path
    score = {}
    for path in paths:
        total_logp, prefix = 0.0, ()
        for token in path:
            if not prefix:
                logp = first
            else:
                grown = GrowingTree()
                parent = -1
                for t in prefix:
                    parent = grown.add(t, parent, 0.0)
                logp = expand([parent], grown)[0]
            total_logp += float(logp[token])
            prefix += (token,)
        score[path] = total_logp
    kept = sorted(score.values(), reverse=True)
    # nothing left out scores higher than the worst node kept (ties aside)
    left_out = [s for p, s in seen.items() if p not in score]
    assert not left_out or max(left_out) <= min(kept) + 1e-5
    # the first level holds the top-k tokens of the first law, best first
    assert [tokens[k] for k in tree.children[0]][:1] == [int(first.argmax())]
    assert max(tree.depths) <= depth


def test_dynamic_tree_expands_only_the_most_confident_frontier():
    vocab = 6
    first = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]).log()
    calls = []

    def expand(nodes, grown):
        calls.append([grown.tokens[n] for n in nodes])
        return torch.tensor([0.7, 0.2, 0.05, 0.03, 0.01, 0.01]).log().expand(len(nodes), vocab)

    tokens, tree = dynamic_tree(first, expand, depth=3, top_k=2, total_tokens=5)
    assert calls[0] == [0, 1]  # the two most probable first-level nodes
    assert calls[1] == [0, 0]  # level 2: paths (0, 0) and (1, 0) (0.35, 0.21) beat (0, 1) (0.10)
    # best five: (0) .5, (1) .3, (0,0) .35, (1,0) .21, (0,0,0) .245
    paths = sorted(tuple(tokens[n] for n in tree.ancestors(i)) for i in range(len(tokens)))
    assert paths == [(0,), (0, 0), (0, 0, 0), (1,), (1, 0)]


def test_combination_tree():
    tree = CombinationTree(((0,), (1,), (0, 0), (0, 1)))
    assert tree.width == 2 and tree.depth == 2
    assert tree.tokens([[7, 8], [3, 4]]) == (7, 8, 3, 4)
    assert tree.tree.parents == (-1, -1, 0, 0)
    chosen = CombinationTree.choose(TreeSettings(top_k=2, tree_size=3), [[0.9, 0.05], [0.8, 0.1]], levels=2)
    assert chosen.paths == ((0,), (0, 0), (0, 1))
    assert sparse_tree([[1.0], [0.5, 0.4]], 10) == ((0,), (0, 0), (0, 1))  # a one-rank level: one node
    assert len(sparse_tree([[0.0, 0.0], [0.0, 0.0]], 3)) == 3  # unmeasured (all-zero) accuracies still give a tree
    with pytest.raises(ValueError, match="only 1 levels"):
        CombinationTree.choose(TreeSettings(tree="[(0,), (0, 0)]"), None, levels=1)


# ---- settings, files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, bad, match", [
    (Eagle, dict(depth=0), "depth"), (Eagle, dict(top_k=-1), "top_k"), (Eagle, dict(total_tokens="x"), "total_tokens"),
    (Eagle, dict(weights=3), "weights"), (Eagle, dict(nonsense=1), None),
    (Chimera, dict(tree="[(0, 1)]"), "parent"), (Chimera, dict(tree="nonsense"), "tree"),
    (Chimera, dict(num_heads=0), "num_heads"), (Chimera, dict(tree_size=0), "tree_size"),
    (HiddenTransfer, dict(num_tokens=0), "num_tokens"), (HiddenTransfer, dict(layer=-2), "layer"),
    (GAD, dict(block=0), "block"), (GAD, dict(top_k=0), "top_k"),
])
def test_settings_are_validated(cls, bad, match):
    if match is None:
        with pytest.raises(TypeError, match="no setting"):
            cls(**bad)
    else:
        with pytest.raises(ValueError, match=match):
            cls(**bad)


def test_settings_from_the_command_line():
    assert settings_io.from_pairs(EagleSettings, ["depth=3"]) == {"depth": 3}  # --method-arg values are text
    with pytest.raises(ValueError, match="depth"):
        EagleSettings(depth="3")  # ... typed once, by the converter; the dataclass takes typed values only
    with pytest.raises(ValueError, match="top_k"):
        Chimera(top_k=True)  # an int is never a bool
    assert Chimera(tree="[(0,), (0, 1), (0, 0)]").settings.tree == ((0,), (0, 1), (0, 0))
    bad_options = [(EagleTrainOptions, dict(mlp_ratio=0), "mlp_ratio"), (GADTrainOptions, dict(window=0), "window"),
                   (HiddenTransferTrainOptions, dict(layer=-3), "layer"), (ChimeraTrainOptions, dict(decay=0), "decay")]
    for options, bad, match in bad_options:
        with pytest.raises(ValueError, match=match):
            options(**bad)


def test_save_load_and_shape_checks(tmp_path):
    model = tiny_model("llama")
    for module_cls in (EagleLayer, ChimeraModel, Transfer, GADModel):
        module = opinionated(module_cls.for_target(model), seed=1)
        module.save(tmp_path / module.name)
        loaded = module_cls.load(tmp_path / module.name)
        assert loaded.config == module.config
        for (name, a), (_, b) in zip(module.state_dict().items(), loaded.state_dict().items()):
            assert torch.allclose(a.half().float(), b), name  # stored as float16
    with pytest.raises(FileNotFoundError, match="no eagle weights"):
        Eagle(weights=str(tmp_path / "nowhere"))
    EagleLayer.for_target(tiny_model("llama", hidden_size=16, num_attention_heads=2)).save(tmp_path / "small")
    with pytest.raises(ValueError, match="do not fit"):
        hasten.generate(model, repetitive_prompt(8), drafter=Eagle(weights=str(tmp_path / "small")))
    with pytest.raises(ValueError, match="layer must be in"), pytest.warns(HastenWarning):
        hasten.generate(model, repetitive_prompt(8), drafter=HiddenTransfer(layer=5))


def test_weights_are_read_once_while_their_files_stay_and_each_load_is_its_own_copy(tmp_path):
    model = tiny_model("llama")
    first = opinionated(EagleLayer.for_target(model), seed=1)
    first.save(tmp_path / "eagle")
    a, b = EagleLayer.load(tmp_path / "eagle"), EagleLayer.load(tmp_path / "eagle")
    assert a is not b and a.fc.weight.data_ptr() != b.fc.weight.data_ptr()  # a drafter may cast or change its own
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    a.fc.weight.data.zero_()
    assert not torch.equal(EagleLayer.load(tmp_path / "eagle").fc.weight, a.fc.weight)
    second = opinionated(EagleLayer.for_target(model), seed=2)
    second.save(tmp_path / "eagle")  # new files (retrained): read again
    again = EagleLayer.load(tmp_path / "eagle")
    assert torch.equal(again.fc.weight, second.fc.weight.half().float())
    assert not torch.equal(again.fc.weight, b.fc.weight)


ZOO = Path(hasten.__file__).parent / "zoo" / "weights" / "code-tiny"
TRAINED = {**{name: entry[0] for name, entry in DRAFTERS.items()}, "medusa": Medusa}


@pytest.fixture(scope="module")
def zoo_model():
    assert (ZOO / "config.json").is_file(), f"the zoo model is missing from {ZOO}"
    model = hasten.loading.load_model("zoo:code-tiny")
    prompt = torch.tensor([list(range(200, 264))])
    return model, prompt, hasten.generate(model, prompt, max_new_tokens=12).sequences


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_shipped_weights(zoo_model, name):
    """Every trained drafter ships weights for zoo:code-tiny: small (< 2 MB, no work
    files), in the one layout, found beside the zoo model, lossless. A missing file fails."""
    directory = ZOO / name
    shipped = {f"{name}.json", packed_name(Path(WEIGHTS_FILE)).name}  # packed: hasten.zoo.packing
    assert shipped <= {p.name for p in directory.iterdir()}, f"shipped {name} files missing"
    assert sum(p.stat().st_size for p in directory.iterdir() if p.is_file()) < 2_000_000
    assert not (directory / "work").exists()
    model, prompt, reference = zoo_model
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)  # no "untrained" warning: the weights beside the model are found
        out = hasten.generate(model, prompt, drafter=TRAINED[name](), max_new_tokens=12, draft_size="fixed")
    assert torch.equal(out.sequences, reference)
    assert out.stats.accepted_tokens > 0


def test_a_missing_weights_file_fails(tmp_path):
    """A config without its weights next to the target is an error, not an untrained drafter."""
    checkpoint = save_checkpoint(tmp_path / "model", arch="llama")
    EagleLayer.for_target(hasten.loading.load_model(checkpoint)).save(tmp_path / "model" / "eagle")
    (tmp_path / "model" / "eagle" / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="no eagle weights"):
        hasten.load(checkpoint, "eagle").generate("def add(", max_new_tokens=4)


# ---- one drafter, many generations ---------------------------------------------------------------------
def interleaved_runs(model, drafter, prompts, new):
    """Generations of ``prompts`` on one drafter, advanced one step each in turn."""
    from hasten.core.request import Request
    from hasten.core.stats import DecodeStats
    from hasten.engine.loop import decode
    from hasten.engine.verify import acceptance_rule
    from hasten.models.hf import runtime_of

    runtime = runtime_of(model)
    sampling = Sampling()
    stats = [DecodeStats() for _ in prompts]
    runs = {i: decode(runtime, Request(prompt[0].tolist(), new, sampling), drafter, stats[i], acceptance_rule(sampling))
            for i, prompt in enumerate(prompts)}
    outputs = [[] for _ in prompts]
    while runs:
        for i, run in list(runs.items()):
            step = next(run, None)
            if step is None:
                del runs[i]
            else:
                outputs[i].extend(step)
    return outputs, stats


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_interleaved_generations_equal_sequential_ones(tmp_path, name):
    """Per-generation state lives in what begin() returns: two generations advanced in
    turn on one drafter draft exactly what each drafts alone (same tokens, same drafts
    accepted at the same depths)."""
    model = tiny_model("llama")
    drafter_cls = TRAINED[name]
    opinionated(drafter_cls.Module.for_target(model), seed=2).save(tmp_path)  # drafts that depend on the state
    drafter = drafter_cls(weights=str(tmp_path))
    prompts = [repetitive_prompt(14, seed=3), repetitive_prompt(9, seed=4)]
    together, together_stats = interleaved_runs(model, drafter, prompts, 20)
    for i, prompt in enumerate(prompts):
        alone, (alone_stats,) = interleaved_runs(model, drafter, [prompt], 20)
        assert together[i] == alone[0] == hf_greedy(model, prompt, 20)[0, prompt.shape[1]:].tolist()
        for field in ("steps", "drafted_tokens", "accepted_tokens", "accepted_at_depth"):
            assert getattr(together_stats[i], field) == getattr(alone_stats, field), field
    assert sum(s.drafted_tokens for s in together_stats) > 0


# ---- the drafter layers' KV cache ------------------------------------------------------------------------
def test_cached_block_equals_a_full_causal_pass():
    """Feeding a Block chunk by chunk through a KVCache, with scratch rows written past the
    committed ones and then overwritten, gives what one causal pass over everything gives."""
    torch.manual_seed(0)
    block = opinionated(Block(32, 2, 64), seed=5)
    x = torch.randn(1, 23, 32)
    positions = torch.arange(23)[None]
    full = block(x, positions, causal(23))  # [1, 23, 32]
    cache = KVCache(capacity=4)  # small, so that it grows several times
    pieces, start = [], 0
    for size in (5, 1, 7, 3, 7):
        end = start + size
        # a draft's scratch first: garbage rows past the committed length, attended and forgotten
        scratch = torch.randn(1, 3, 32)
        block(scratch, torch.arange(start, start + 3)[None], causal(3, start), cache, start)
        assert cache.length == start and cache.end == start + 3
        pieces.append(block(x[:, start:end], positions[:, start:end], causal(size, start), cache, start))
        cache.commit(end)
        start = end
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)
    assert cache.length == cache.end == 23
    # tree levels: each level written after the previous one's scratch sees it
    level1 = block(x[:, :2], torch.tensor([[23, 23]]), None, cache, 23)
    level2 = block(x[:, 2:3], torch.tensor([[24]]), torch.tensor([[[True] * 23 + [True, False, True]]]), cache, 25)
    assert level1.shape == (1, 2, 32) and level2.shape == (1, 1, 32) and cache.end == 26 and cache.length == 23
    with pytest.raises(ValueError, match="outside"):
        block(x[:, :1], torch.tensor([[30]]), None, cache, 30)  # a gap after the valid rows
    with pytest.raises(ValueError, match="outside"):
        block(x[:, :1], torch.tensor([[3]]), None, cache, 3)  # inside the committed rows
    cache.truncate(10)
    assert cache.length == cache.end == 10
