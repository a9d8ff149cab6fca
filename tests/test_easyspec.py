"""EasySpec (layer-parallel drafting with KV calibration): exactness of the outputs, what the
fuzzy passes draft, the calibrated draft cache, and the settings' errors."""
import pytest
import torch

import hasten
from hasten.core.sampling import Sampling
from hasten.core.settings import from_pairs
from hasten.drafters import DraftModel, EasySpec, EasySpecSettings, create
from hasten.drafters.base import DraftContext, Drafter, TargetView
from hasten.models import cache as kv
from hasten.models.adapter import ModelAdapter
from hasten.models.layers import UnsupportedArchitecture
from helpers import returned_cache, tiny_model
from test_sampling_distribution import DEEP_LAW_SAMPLING, VOCAB as LAW_VOCAB, deep_tv

TARGET = tiny_model("llama", seed=0, num_hidden_layers=4)
DRAFT = tiny_model("llama", seed=1, num_hidden_layers=4)  # 4 layers: groupings to choose from
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]])

GROUPINGS = {
    "size 1 (exact)": dict(group_size=1),
    "size 2": dict(group_size=2),
    "size 3 (last group shorter)": dict(group_size=3),
    "one group of 4": dict(group_size=4),
    "explicit 0;1,2,3": dict(groups="0;1,2,3"),
    "size 2, threads": dict(group_size=2, concurrency="threads"),
    "size 4, parallel MLP": dict(group_size=4, parallel_mlp=True),
}


class Recorder(Drafter):
    """Passes everything to ``inner`` and keeps every proposal's tokens."""

    name = "recorder"

    def __init__(self, inner: Drafter):
        self.inner, self.proposals = inner, []

    def check_target(self, target):
        self.inner.check_target(target)

    def begin(self, ctx):
        return self.inner.begin(ctx)

    def propose(self, ctx):
        draft = self.inner.propose(ctx)
        self.proposals.append(draft.tokens)
        return draft

    def observe(self, ctx, result):
        self.inner.observe(ctx, result)


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
def test_greedy_output_equals_plain_decoding(grouping):
    reference = hasten.generate(TARGET, PROMPT, max_new_tokens=24).sequences
    for draft in (DRAFT, TARGET):  # a foreign draft (many rejections) and the target itself (many accepts)
        drafter = create("easyspec", model=draft, num_tokens=4, **GROUPINGS[grouping])
        out = hasten.generate(TARGET, PROMPT, drafter=drafter, max_new_tokens=24)
        assert out.sequences.tolist() == reference.tolist()


def test_the_target_as_its_own_exact_draft_is_always_accepted():
    out = hasten.generate(TARGET, PROMPT, drafter=EasySpec(TARGET, num_tokens=4, group_size=1), max_new_tokens=24,
                          draft_size="fixed")
    assert out.stats.drafted_tokens > 0 and out.stats.accepted_tokens == out.stats.drafted_tokens


def test_group_size_1_drafts_exactly_what_draft_model_drafts():
    proposals = []
    for drafter in (DraftModel(DRAFT, num_tokens=3), EasySpec(DRAFT, num_tokens=3, group_size=1)):
        recorder = Recorder(drafter)
        hasten.generate(TARGET, PROMPT, drafter=recorder, max_new_tokens=20, draft_size="fixed")  # the same depths
        proposals.append(recorder.proposals)
    assert len(proposals[0]) > 3 and proposals[0] == proposals[1]


def context(tokens, sampling=Sampling(), seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DraftContext(list(tokens), 10, sampling, generator, TargetView(ModelAdapter(TARGET), frozenset()))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0)], ids=["greedy", "sampled"])
def test_serial_and_threads_draft_the_same_tokens_and_q(sampling):
    drafts = []
    for concurrency in ("serial", "threads"):
        drafter = EasySpec(DRAFT, num_tokens=5, group_size=2, concurrency=concurrency)
        ctx = context(PROMPT[0].tolist(), sampling, seed=3)
        ctx.state = drafter.begin(ctx)
        first = drafter.propose(ctx)
        ctx.tokens.extend([first.tokens[0], 40])  # one accepted, then a bonus token
        drafts.append((first, drafter.propose(ctx)))
    for serial, threads in zip(*drafts):
        assert serial.tokens == threads.tokens
        if sampling.greedy:
            assert serial.probs is None and threads.probs is None
        else:
            torch.testing.assert_close(serial.probs, threads.probs, rtol=0, atol=1e-6)


def exact_cache(model, tokens):
    with torch.no_grad():
        return returned_cache(model(torch.tensor([tokens]), use_cache=True))


def test_calibration_replaces_fuzzy_entries_with_an_exact_forwards():
    drafter = EasySpec(DRAFT, num_tokens=4, group_size=4)
    ctx = context(PROMPT[0].tolist())
    ctx.state = drafter.begin(ctx)
    draft = drafter.propose(ctx)
    # after a proposal the cache holds the committed tokens exactly, then fuzzy entries for
    # the drafted tokens but the last: those differ from an exact forward's
    cache, exact = ctx.state.cache, ctx.state.exact
    reference = exact_cache(DRAFT, ctx.tokens + list(draft.tokens[:-1]))
    assert kv.length(cache) == len(ctx.tokens) + len(draft) - 1
    fuzzy_gap = max(float((mine.keys[..., exact:, :] - theirs.keys[..., exact:, :]).abs().max())
                    for mine, theirs in zip(cache.layers[1:], reference.layers[1:]))
    assert fuzzy_gap > 1e-3, "a group of 4 layers should draft fuzzily"
    # two drafted tokens accepted, then the bonus: the next proposal calibrates first
    ctx.tokens.extend([*draft.tokens[:2], 17])
    drafter.propose(ctx)
    committed = len(ctx.tokens)
    assert ctx.state.exact == committed
    reference = exact_cache(DRAFT, ctx.tokens)
    for mine, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(mine.keys[..., :committed, :], theirs.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values[..., :committed, :], theirs.values, rtol=1e-4, atol=1e-5)


def law_draft():
    model = tiny_model("llama", seed=5, num_hidden_layers=4, vocab_size=LAW_VOCAB, bos_token_id=0,
                       eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # opinionated, like the targets of test_sampling_distribution
        for layer in model.model.layers:  # attention updates large enough that skipping one matters
            layer.self_attn.v_proj.weight.mul_(10)
            layer.self_attn.o_proj.weight.mul_(10)
    return model


def test_fuzzy_q_differs_from_the_exact_q_of_the_law_test_draft():
    """So the law test below checks fuzzy drafts' q, not a draft that happens to be exact."""
    model = law_draft()
    fuzzy, exact = EasySpec(model, group_size=4), EasySpec(model, group_size=1)
    tokens = [1, 3, 5, 1, 3, 2]
    probs = []
    for drafter in (fuzzy, exact):
        cache = kv.new_cache(False)
        drafter.driver.forward(cache, tokens[:-1], exact=True)
        probs.append(DEEP_LAW_SAMPLING.probs(drafter.driver.forward(cache, tokens[-1:], exact=drafter is exact)))
    assert 0.5 * float((probs[0] - probs[1]).abs().sum()) > 0.1


def test_sampled_output_follows_the_target_law():
    tv, limit = deep_tv(EasySpec(law_draft(), num_tokens=3, group_size=4), DEEP_LAW_SAMPLING)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


# ---- settings and errors ------------------------------------------------------------------------
def test_groups_and_devices_parse_from_command_line_text():
    values = from_pairs(EasySpecSettings, ["groups=0,1;2,3", "devices=cpu,cpu", "concurrency=threads"])
    settings = EasySpecSettings(**values)
    assert settings.groups == ((0, 1), (2, 3)) and settings.devices == ("cpu", "cpu")
    assert settings.layer_groups(4) == ((0, 1), (2, 3))
    assert EasySpecSettings(group_size=3).layer_groups(4) == ((0, 1, 2), (3,))


@pytest.mark.parametrize("groups", ["0,1;2", "0,1;1,2,3", "1,0;2,3", "0,1;2,3;4", "0,2;1,3"])
def test_groups_that_do_not_cover_the_layers_in_order_are_refused(groups):
    with pytest.raises(ValueError, match="groups .* every layer of the draft"):
        EasySpec(DRAFT, groups=groups)


@pytest.mark.parametrize("kwargs, match", [
    (dict(groups="0,a"), "groups must look like"),
    (dict(group_size=0), "group_size"),
    (dict(concurrency="processes"), "concurrency must be one of"),
    (dict(devices="cuda:99"), "devices: 'cuda:99' does not exist"),
    (dict(devices=("cpu", "no-such-device")), "devices: 'no-such-device'"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EasySpec(DRAFT, **kwargs)


def test_spreading_over_devices_keeps_the_output():
    reference = hasten.generate(TARGET, PROMPT, max_new_tokens=12).sequences
    drafter = EasySpec(DRAFT, group_size=2, devices=("cpu", "cpu"))
    assert hasten.generate(TARGET, PROMPT, drafter=drafter, max_new_tokens=12).sequences.tolist() == reference.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CUDA streams run only on a GPU "
                    "(scripts/gpu-check)")
def test_streams_on_cuda_keep_the_output():
    target, draft = TARGET.to("cuda"), tiny_model("llama", seed=1, num_hidden_layers=4).to("cuda")
    prompt = PROMPT.to("cuda")
    try:
        reference = hasten.generate(target, prompt, max_new_tokens=12).sequences
        for group_size in (2, 4):
            drafter = EasySpec(draft, group_size=group_size, concurrency="streams")
            out = hasten.generate(target, prompt, drafter=drafter, max_new_tokens=12)
            assert out.sequences.tolist() == reference.tolist() and out.stats.drafted_tokens > 0
    finally:
        TARGET.to("cpu")  # the module's other tests use it on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without CUDA")
def test_streams_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="streams.*CUDA"):
        EasySpec(DRAFT, concurrency="streams")


def test_a_draft_the_layer_driver_cannot_reproduce_is_refused():
    with pytest.raises(UnsupportedArchitecture, match="Llama-family"):
        EasySpec(tiny_model("gpt2"))


def test_cost_model_on_known_layer_times():
    from hasten.bench.easyspec import fuzzy_pass_seconds

    times = {"embed": 0.5, "head": 0.5, "attention": [1.0, 2.0, 3.0, 4.0], "mlp": [1.0, 1.0, 1.0, 1.0]}
    pairs = ((0, 1), (2, 3))
    assert fuzzy_pass_seconds(times, ((0,), (1,), (2,), (3,)), 4, 0.0) == 15.0  # sequential: everything adds
    assert fuzzy_pass_seconds(times, pairs, 1, 0.0) == 15.0  # one device: grouping gains nothing
    assert fuzzy_pass_seconds(times, pairs, 2, 0.25) == 1 + (2 + 2 + 0.25) + (4 + 2 + 0.25)
    assert fuzzy_pass_seconds(times, ((0, 1, 2, 3),), 2, 0.0) == 1 + max(1 + 3, 2 + 4) + 4  # members dealt in turn
    assert fuzzy_pass_seconds(times, pairs, 2, 0.0, parallel_mlp=True) == 1 + 3 + 5  # whole layers as branches


def test_gemma3_sandwich_layers_and_sliding_windows():
    """Gemma 3 normalises each sublayer's output, mixes sliding and full attention and has a
    rotary table per layer kind; the exact draft (the target itself) is always accepted."""
    from test_gemma3 import PROMPT_LEN, tiny_gemma3
    from helpers import repetitive_prompt

    model = tiny_gemma3()
    prompt = repetitive_prompt(PROMPT_LEN, seed=1)  # longer than the sliding window
    reference = hasten.generate(model, prompt, max_new_tokens=20).sequences
    exact = hasten.generate(model, prompt, drafter=EasySpec(model, num_tokens=4, group_size=1), max_new_tokens=20,
                            draft_size="fixed")
    fuzzy = hasten.generate(model, prompt, drafter=EasySpec(model, num_tokens=4, group_size=3), max_new_tokens=20)
    assert exact.sequences.tolist() == fuzzy.sequences.tolist() == reference.tolist()
    assert exact.stats.drafted_tokens > 0 and exact.stats.accepted_tokens == exact.stats.drafted_tokens
