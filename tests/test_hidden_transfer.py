"""Hidden transfer: its placeholders ride on the verification forward.

The riders must not change what the target verifies (real-position logits, the cache
after commit), their logits must be those of placeholders run the slow way, each step
must cost exactly one target forward, and the output must stay the target's own: greedy
token for token, sampled in law.
"""
from functools import partial
import math
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import hasten
from hasten.core.sampling import Sampling, sample
from hasten.core.tree import TokenTree
from hasten.drafters.hidden_transfer import (
    HiddenTransfer, HiddenTransferTraining, HiddenTransferTrainOptions, Transfer,
)
from hasten.engine.verify import Acceptance, Verdict
from hasten.models.adapter import ModelAdapter, Riders
from hasten.models.layers import (
    UnsupportedArchitecture, decoder_layers, placeholder_logits_batch, replaced_hidden,
)
from helpers import generate_exactly, CAUSAL_CONFIGS, distill_tiny, hf_greedy, repetitive_prompt, tiny_model, train_briefly
from hasten.core.errors import HastenWarning
from test_sampling_distribution import PROMPT, TARGET, VOCAB

ARCHS = sorted(CAUSAL_CONFIGS)
NEW = 24
ZOO = Path(hasten.__file__).parent / "zoo" / "weights" / "code-tiny"


def random_transfer(hidden: int, count: int, seed: int = 0):
    """A fixed random map h -> [count] pseudo states (independent of the drafter's module)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(count, hidden, hidden, generator=g) / math.sqrt(hidden)  # [count, H, H]
    return lambda h: torch.einsum("...g,jhg->...jh", h, weights)  # [..., H] -> [..., count, H]


def opinionated(module: Transfer, seed: int) -> Transfer:
    """Random transfer weights, large enough that the riders guess differently from h."""
    torch.manual_seed(seed)
    for parameter in module.parameters():
        if parameter.ndim == 2:
            torch.nn.init.normal_(parameter, std=1.0 / math.sqrt(parameter.shape[1]))
    return module


def silently(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untrained weights: warned about in test_untrained_warns
        return make()


# ---- the forward with riders -------------------------------------------------------------------------
TREE = TokenTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])


def prefilled(model, context: list[int]) -> ModelAdapter:
    """An adapter that cached ``context`` but its last token (the root of the next block)."""
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([context]))
    return adapter


def slow_riders(model, sequence: list[int], layer: int, transfer, count: int) -> torch.Tensor:
    """Rider logits of the last token of ``sequence`` the slow way: a plain forward gives
    its input to ``layer``, then a plain causal forward of the sequence and ``count``
    placeholders whose input to ``layer`` is replaced. [count, vocab]."""
    ids = torch.tensor([sequence])
    anchor = model(ids, output_hidden_states=True).hidden_states[layer][0, -1]  # [H]
    pseudo = transfer(anchor)  # [count, H]

    def swap(hidden):  # [1, len + count, H]
        return torch.cat([hidden[:, : len(sequence)], pseudo[None].to(hidden.dtype)], dim=1)

    with replaced_hidden(model, layer, swap):
        return model(torch.cat([ids, torch.zeros(1, count, dtype=torch.long)], 1)).logits[0, len(sequence):]


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("arch", ARCHS)
def test_riders_leave_real_logits_alone_and_match_the_slow_way(arch, layer):
    model = tiny_model(arch)
    context = repetitive_prompt(24, seed=2)[0].tolist()  # longer than mistral's 16-token window
    block = [context[-1], 7, 11, 13, 17, 19, 23, 29, 31]  # the root, then one token per TREE node
    count = 3
    transfer = random_transfer(model.config.get_text_config().hidden_size, count)
    plain = prefilled(model, context).forward(block, TREE, hidden=True)
    ridden = prefilled(model, context).forward(block, TREE, hidden=True, riders=Riders(count, layer, transfer))
    assert torch.allclose(ridden.logits, plain.logits, atol=1e-5)
    assert torch.allclose(ridden.hidden, plain.hidden, atol=1e-5)
    assert ridden.riders.shape == (len(block), count, model.config.vocab_size)
    for node in (-1, 2, 3, 6, 7):  # the root, a leaf at depth 1, inner and deepest nodes
        path = [] if node < 0 else [block[i + 1] for i in TREE.ancestors(node)]
        expected = slow_riders(model, context + path, layer, transfer, count)
        assert torch.allclose(ridden.riders[node + 1], expected, atol=1e-4), node


def test_riders_on_a_chain_and_on_a_bare_root():
    model = tiny_model("llama")
    context = repetitive_prompt(12)[0].tolist()
    transfer = random_transfer(32, 2, seed=4)
    for block, tree in (([context[-1]], TokenTree.chain(0)), ([context[-1], 5, 6], TokenTree.chain(2)),
                        ([context[-1], 5], None)):
        out = prefilled(model, context).forward(block, tree, riders=Riders(2, 1, transfer))
        for b in range(len(block)):
            expected = slow_riders(model, context + block[1 : b + 1], 1, transfer, 2)
            assert torch.allclose(out.riders[b], expected, atol=1e-4)


@pytest.mark.parametrize("accepted", [(), (0,), (1, 5), (0, 3, 6)])
def test_commit_drops_every_rider_from_the_cache(accepted):
    """After commit the cache holds the committed tokens but the new root (the bonus
    token): exactly what a plain prefill of them caches."""
    model = tiny_model("qwen2")
    context = repetitive_prompt(12)[0].tolist()
    block = [context[-1], 7, 11, 13, 17, 19, 23, 29, 31]
    adapter = prefilled(model, context)
    start = adapter.cache_length
    adapter.forward(block, TREE, riders=Riders(3, 1, random_transfer(32, 3)))
    lengths = [layer.keys.shape[-2] for layer in adapter.cache.layers]
    assert lengths == [start + len(block), start + len(block) * 4]  # riders skip the layer below the replaced one
    adapter.commit(start, TREE, accepted)
    cached = context + [block[node + 1] for node in accepted]  # the bonus token becomes the next root
    assert adapter.cache_length == len(cached)
    reference = prefilled(model, cached + [0])
    for mine, theirs in zip(adapter.cache.layers, reference.cache.layers):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
        assert torch.allclose(mine.values, theirs.values, atol=1e-5)


def test_riders_refuse_encoder_decoders_and_bad_layers():
    adapter = ModelAdapter(tiny_model("t5"))
    adapter.start(repetitive_prompt(8))
    with pytest.raises(ValueError, match="encoder-decoder"):
        adapter.forward([0], None, riders=Riders(2, 0, random_transfer(32, 2)))
    adapter = prefilled(tiny_model("llama"), [5, 6, 7])
    with pytest.raises(ValueError, match="layer must be in"):
        adapter.forward([8], None, riders=Riders(2, 2, random_transfer(32, 2)))
    with pytest.raises(UnsupportedArchitecture, match="encoder-decoder"):
        decoder_layers(tiny_model("t5"))
    model = tiny_model("llama")
    model.model.extra = torch.nn.ModuleList(torch.nn.Identity() for _ in range(2))  # two candidate lists
    with pytest.raises(UnsupportedArchitecture, match="cannot find the decoder layers"):
        decoder_layers(model)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_training_form_reproduces_real_logits(arch):
    """Placeholders given the hidden states the real tokens have there reproduce their
    logits: the training form's mask and positions are those of the real sequence."""
    model = tiny_model(arch)
    ids = repetitive_prompt(24, seed=2)
    plain = model(ids, output_hidden_states=True)
    layer = 1
    truth = plain.hidden_states[layer][0]  # [T, H]
    anchors = torch.tensor([[3, 10, 19]])
    pseudo = lambda h: torch.stack([truth[a + 1 : a + 4] for a in anchors[0].tolist()])[None]  # noqa: E731
    logits = placeholder_logits_batch(model, ids, anchors, 3, layer, pseudo)  # [1, 3, 3, V]
    expected = torch.stack([plain.logits[0, a + 1 : a + 4] for a in anchors[0].tolist()])[None]
    assert torch.allclose(logits, expected, atol=1e-5)


# ---- one forward per step ---------------------------------------------------------------------------
def count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("sampled", [False, True])
def test_one_target_forward_per_step(tmp_path, sampled):
    model = tiny_model("llama")
    opinionated(Transfer.for_target(model, num_tokens=3), seed=1).save(tmp_path)
    calls, handle = count_forwards(model)
    try:
        out = hasten.generate(model, repetitive_prompt(16), drafter=HiddenTransfer(weights=str(tmp_path)),
                              max_new_tokens=30, eos_token_id=[], temperature=1.0 if sampled else 0.0,
                              generator=torch.Generator().manual_seed(0) if sampled else None,
                              draft_size="fixed")  # auto would first time the model's forwards, counted here too
    finally:
        handle.remove()
    assert out.stats.drafted_tokens > 0
    assert len(calls) == out.stats.steps + 1  # the prefill, then one forward per step


# ---- greedy: token-identical to Hugging Face ------------------------------------------------------
class ScriptedRiders(HiddenTransfer):
    """Hidden transfer whose rider logits are replaced by the reference continuation's
    tokens (``oracle``) or by wrong ones, never ranking the right one (``adversarial``),
    so the tree building and acceptance run at full and at no acceptance."""

    def __init__(self, reference: list[int], mode: str, **settings):
        super().__init__(**settings)
        self.reference, self.mode = reference, mode

    def observe(self, ctx, result):
        assert ctx.target.cache_length == len(ctx.tokens) - 1, "cache must hold the committed tokens but the root"
        if result.riders is not None:
            count, vocab = result.riders.shape
            root = len(ctx.tokens) - 1  # depth d + 1 of the next draft is the token at root + 1 + d
            right = torch.tensor([self.reference[min(root + 1 + d, len(self.reference) - 1)] for d in range(count)])
            scripted = torch.zeros(count, vocab)
            if self.mode == "oracle":
                scripted[torch.arange(count), right] = 1.0
            else:
                scripted[torch.arange(count), (right + 1) % vocab] = 1.0
                scripted[torch.arange(count), right] = -1e4
            result = replace(result, riders=scripted)
        super().observe(ctx, result)


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tmp_path_factory):
    model = tiny_model(request.param)
    prompt = repetitive_prompt(20, seed=1)
    root = tmp_path_factory.mktemp(request.param)
    trainable = HiddenTransferTraining(model, HiddenTransferTrainOptions(num_tokens=2, anchors=4))
    trained = train_briefly(trainable, distill_tiny(model, root / "work"), root / "trained", steps=3)
    opinionated(Transfer.for_target(model, num_tokens=3, layer=0), seed=2).save(root / "random")
    return model, prompt, hf_greedy(model, prompt, NEW), {"trained": trained, "random": root / "random"}


check = partial(generate_exactly, max_new_tokens=NEW)


def test_untrained_warns_and_stays_exact(setup):
    model, prompt, reference, _ = setup
    with pytest.warns(HastenWarning, match="untrained hidden_transfer"):
        stats = check(model, prompt, reference, HiddenTransfer())
    assert stats.drafted_tokens > 0


@pytest.mark.parametrize("weights", ["trained", "random"])
@pytest.mark.parametrize("settings", [dict(), dict(top_k=1, tree_size=2), dict(tree="[(0,), (1,), (0, 0)]")])
def test_greedy_equals_hugging_face(setup, weights, settings):
    model, prompt, reference, directories = setup
    assert HiddenTransfer.Module.load(directories["trained"]).config.target == "test"
    check(model, prompt, reference, HiddenTransfer(weights=str(directories[weights]), **settings))


@pytest.mark.parametrize("mode", ["oracle", "adversarial"])
def test_scripted_riders(setup, mode):
    model, prompt, reference, _ = setup
    chain_and_siblings = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"
    drafter = silently(lambda: ScriptedRiders(reference[0].tolist(), mode, num_tokens=3, tree=chain_and_siblings))
    stats = silently(lambda: check(model, prompt, reference, drafter))
    new = reference.shape[1] - prompt.shape[1]
    if mode == "oracle":  # the first step has no guesses yet; every later one commits 3 guesses and the bonus
        assert stats.steps == 1 + math.ceil((new - 1) / 4)
    else:
        assert stats.accepted_tokens == 0 and stats.drafted_tokens > 0 and stats.steps == new


def test_one_token_prompt_and_reuse_across_generations():
    model = tiny_model("mistral")
    drafter = silently(HiddenTransfer)
    for prompt in (torch.tensor([[5]]), repetitive_prompt(12), repetitive_prompt(30, seed=3)):
        silently(lambda: check(model, prompt, hf_greedy(model, prompt, NEW), drafter))


def test_refuses_encoder_decoders():
    with pytest.raises(ValueError, match="encoder-decoder"):
        silently(lambda: hasten.generate(tiny_model("t5"), repetitive_prompt(8), drafter=HiddenTransfer(),
                                         max_new_tokens=4))


@pytest.mark.parametrize("bad, match", [(dict(num_tokens=0), "num_tokens"), (dict(layer=-2), "layer"),
                                        (dict(tree_size=0), "tree_size"), (dict(num_tokens=True), "num_tokens")])
def test_settings_are_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        HiddenTransfer(**bad)


def test_layer_beyond_the_target_is_refused():
    with pytest.raises(ValueError, match="layer must be in"), pytest.warns(HastenWarning):
        hasten.generate(tiny_model("llama"), repetitive_prompt(8), drafter=HiddenTransfer(layer=5))


def test_shipped_weights():
    """zoo:code-tiny's transfer is found beside the model, small, and lossless."""
    if not (ZOO / "config.json").is_file():
        pytest.fail(f"zoo:code-tiny weights missing from {ZOO}")
    directory = ZOO / "hidden_transfer"
    assert sum(p.stat().st_size for p in directory.iterdir() if p.is_file()) < 2_000_000
    model = hasten.loading.load_model("zoo:code-tiny")
    prompt = torch.tensor([list(range(200, 264))])
    reference = hasten.generate(model, prompt, max_new_tokens=24).sequences
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)  # no "untrained" warning
        out = hasten.generate(model, prompt, drafter=HiddenTransfer(), max_new_tokens=24, draft_size="fixed")
    assert torch.equal(out.sequences, reference)
    assert out.stats.accepted_tokens > 0


# ---- sampling: the target's law ---------------------------------------------------------------------
SAMPLES = 1500
LENGTH = 4  # step 1 carries riders only, step 2 verifies depths 1-2 drafted from them, then the bonus
PEAKED = Sampling(0.8, top_k=5, top_p=0.9)


def exact_law(model, sampling: Sampling) -> torch.Tensor:
    """[VOCAB ** LENGTH]: the probability of each continuation of PROMPT (token-major order)."""
    law = torch.ones(1)
    prefixes = PROMPT
    for _ in range(LENGTH):
        probs = sampling.probs(model(prefixes).logits[:, -1])  # [prefixes, VOCAB]
        law = (law[:, None] * probs).flatten()
        following = torch.arange(VOCAB).repeat(len(prefixes))[:, None]
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), following], 1)
    return law


def tv_of_counts(counts: torch.Tensor, law: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - law).abs().sum())


def bound_for(law: torch.Tensor) -> float:
    """What exact samplers of SAMPLES draws stay under: the mean plus five standard
    deviations of the total variation of 100 of them, drawn straight from the law."""
    g = torch.Generator().manual_seed(0)
    tvs = torch.tensor([tv_of_counts(torch.bincount(torch.multinomial(law, SAMPLES, True, generator=g),
                                                    minlength=len(law)).float(), law) for _ in range(100)])
    return float(tvs.mean() + 5 * tvs.std())


def sampled_counts(drafter, sampling: Sampling, acceptance=None) -> tuple[torch.Tensor, int]:
    """Counts of each continuation over SAMPLES generations, and the draft tokens verified."""
    counts = torch.zeros(VOCAB**LENGTH)
    g = torch.Generator().manual_seed(1234)
    drafted = 0
    for _ in range(SAMPLES):
        out = hasten.generate(TARGET, PROMPT, drafter=drafter, max_new_tokens=LENGTH, generator=g,
                              temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                              lossy_acceptance=acceptance)
        index = 0
        for token in out.sequences[0, -LENGTH:].tolist():
            index = index * VOCAB + token
        counts[index] += 1
        drafted += out.stats.drafted_tokens
    return counts, drafted


class TrustTheDraft(Acceptance):
    """The control: accepts the first-child path whole, then samples from p."""

    lossless = False
    relaxes = "sampling"  # a lossy rule names the decoding it relaxes (engine/verify.py)

    def verify(self, tree, tokens, logits, q, sampling, generator):
        path, node = [], -1
        while tree.children[node + 1]:
            node = tree.children[node + 1][0]
            path.append(node)
        end = path[-1] + 1 if path else 0  # block index of the accepted path's end
        return Verdict(tuple(path), sample(sampling.probs(logits[end]), generator))


@pytest.fixture(scope="module")
def sampling_drafter(tmp_path_factory):
    directory = tmp_path_factory.mktemp("transfer")
    opinionated(Transfer.for_target(TARGET, num_tokens=2), seed=3).save(directory)
    return HiddenTransfer(weights=str(directory), tree_size=6)


@pytest.mark.parametrize("sampling", [Sampling(1.0), PEAKED])
def test_sampled_continuations_follow_the_target(sampling_drafter, sampling):
    law = exact_law(TARGET, sampling)
    counts, drafted = sampled_counts(sampling_drafter, sampling)
    assert drafted >= 2 * SAMPLES  # every generation verified a draft, most of them deeper than 1
    assert tv_of_counts(counts, law) < bound_for(law)


@pytest.mark.heavy  # 10 s; test_sampling_distribution.py catches a draft-trusting sampler in 4 s
def test_the_bound_catches_a_sampler_that_trusts_its_drafts(sampling_drafter):
    law = exact_law(TARGET, PEAKED)
    counts, _ = sampled_counts(sampling_drafter, PEAKED, acceptance=TrustTheDraft())
    assert tv_of_counts(counts, law) > bound_for(law)
