"""EAGLE-3 (drafters/eagle3.py, export/eagle3.py): lossless in hasten's loop (greedy equality
at several depths, untrained and trained; the sampling law with chains 3 deep), the
training-time test's attention equals drafting's, and the export computes in vLLM's layout
what hasten drafts: vLLM's llama_eagle3 forward is written out here from
vllm/model_executor/models/llama_eagle3.py and llama.py (fused-add RMSNorms, the aux layers
as the residual entering layer k, concatenated low to high) and run from the exported files
alone. The real vLLM round trip is tests/test_eagle3_vllm.py (``-m vllm``)."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import hasten
from hasten.drafters.eagle3 import Eagle3, Eagle3Training, Eagle3TrainOptions, TrainingTimeTest
from hasten.drafters.eagle3_layer import Eagle3Layer, default_aux_layers
from hasten.drafters.nn import causal
from hasten.export import ExportError, export
from hasten.export.eagle3 import check_strictly

from helpers import distill_tiny, hf_greedy, repetitive_prompt, tiny_model, train_briefly
from test_sampling_distribution import DEEP_LAW_SAMPLING, TARGET, deep_tv

NEW = 24


def randomised(layer: Eagle3Layer, seed: int = 0, scale: float = 0.3) -> Eagle3Layer:
    """Weights a training run could leave (norms away from one), deterministic."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else noise * scale / p.shape[-1] ** 0.5)
    return layer.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    data = distill_tiny(target, root / "work")
    training = Eagle3Training(target, Eagle3TrainOptions(draft_vocab=40, ttt_steps=3))
    return train_briefly(training, data, root / "eagle3", steps=2), training


def test_a_run_started_from_trained_weights_goes_on_from_them(target, trained, tmp_path):
    """init_from: the module starts as the earlier run left it (its draft vocabulary too, though
    other data would pick another one), and a module for another target is refused."""
    from hasten.training.trainer import TrainSettings, train

    directory, training = trained
    data = distill_tiny(target, tmp_path / "work")
    earlier = Eagle3Layer.load(directory)
    settings = dict(steps=1, lr=1e-9, warmup_steps=1, batch_size=4)
    went_on = train(training, data, TrainSettings(**settings, init_from=str(directory)), tmp_path / "on",
                    progress=False).module
    fresh = train(training, data, TrainSettings(**settings), tmp_path / "fresh", progress=False).module
    assert went_on.config.draft_tokens == earlier.config.draft_tokens
    for name, weight in earlier.state_dict().items():
        assert torch.allclose(went_on.state_dict()[name], weight, atol=1e-6), name  # one step of lr 1e-9
        assert name.endswith("norm.weight") or not torch.allclose(fresh.state_dict()[name], weight, atol=1e-3), name
    wide = Eagle3Training(tiny_model("llama", num_hidden_layers=8, hidden_size=96), training.options)
    with pytest.raises(ValueError, match="do not fit"):
        train(wide, data, TrainSettings(**settings, init_from=str(directory)), tmp_path / "wide", progress=False)


# ---- lossless in hasten's loop ---------------------------------------------------------------------
def test_greedy_output_is_the_targets_untrained_at_several_depths(target):
    prompt = repetitive_prompt(20, seed=1)
    reference = hf_greedy(target, prompt, NEW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "untrained eagle3"
        for depth in (1, 2, 4):
            out = hasten.generate(target, prompt, drafter=Eagle3(depth=depth), max_new_tokens=NEW, draft_size="fixed")
            assert out.sequences.tolist() == reference.tolist()
            assert len(out.stats.drafted_at_depth) == depth and min(out.stats.drafted_at_depth) > 0  # chains of depth


def test_greedy_output_is_the_targets_trained_with_a_draft_vocabulary(target, trained):
    directory, training = trained
    layer = Eagle3Layer.load(directory)
    assert len(layer.config.draft_tokens) == 40 and list(layer.config.draft_tokens) == sorted(training.vocabulary)
    assert layer.config.accuracy is not None and len(layer.config.accuracy) == 3  # one row per TTT step
    for seed in (1, 2):
        prompt = repetitive_prompt(20, seed=seed)
        reference = hf_greedy(target, prompt, NEW)
        for depth in (2, 3):
            out = hasten.generate(target, prompt, drafter=Eagle3(weights=str(directory), depth=depth),
                                  max_new_tokens=NEW, draft_size="fixed")
            assert out.sequences.tolist() == reference.tolist()


def test_the_taps_leave_the_model_with_the_drafter_and_skip_forwards_with_riders(target):
    """The drafter hooks the user's model; the hooks go when the drafter does. A forward whose
    layers see more rows than it returns (another drafter's riders joining mid-way) is not recorded."""
    import gc

    from hasten.drafters.eagle3 import LayerTaps

    hooks = lambda: len(target.base_model._forward_hooks)  # noqa: E731
    before = hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "untrained eagle3"
        drafter = Eagle3()
        hasten.generate(target, repetitive_prompt(12, seed=2), drafter=drafter, max_new_tokens=4)
    assert hooks() == before + 1
    del drafter
    gc.collect()
    assert hooks() == before
    taps = LayerTaps(target, (1, 2, 3))
    try:
        close = target.base_model._forward_hooks[taps.handles[-1].id]
        width = target.config.hidden_size
        last = torch.zeros(1, 3, width)  # [B, T, H] what the forward returns
        taps._inputs = {1: torch.zeros(1, 3, width), 2: torch.zeros(1, 4, width), 3: torch.zeros(1, 4, width)}
        close(target.base_model, (), (last,))  # rows joined before layer 2
        assert len(taps.records) == 0
        with torch.no_grad():
            target(torch.tensor([[1, 2, 3]]))
        assert len(taps.records) == 1 and taps.records[0][1].shape == (3, 3 * width)
    finally:
        taps.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_taps_what_the_models_own_forward_hooks_bit_for_bit(dtype, monkeypatch):
    """The lean forward (models/lean.py) calls the taps itself, with the same rows the hooks
    see on the model's own forward: a prefill, then a tree block after it."""
    from hasten.core.tree import TokenTree
    from hasten.drafters.eagle3 import LayerTaps
    from hasten.models import cache as kv
    from hasten.models import invariant, lean
    from hasten.models.adapter import ModelAdapter

    model = tiny_model("llama", num_hidden_layers=8).to(dtype)
    assert invariant.prepare(model)
    prompt = repetitive_prompt(20, seed=3)
    runs = {}
    for use_lean in ("1", "0"):
        monkeypatch.setenv("HASTEN_LEAN_FORWARD", use_lean)
        taps = LayerTaps(model, (1, 4, 6))
        try:
            adapter = ModelAdapter(model)
            assert lean.usable(model, adapter._lean_modules) == (use_lean == "1")  # the taps' hooks leave it on
            _, states = adapter.start(prompt, hidden=True)
            out = adapter.forward([int(prompt[0, -1]), 5, 6, 7], TokenTree((-1, 0, 0)), hidden=True)
            runs[use_lean] = [(last.clone(), aux.clone()) for last, aux, _ in taps.records]
            assert torch.equal(runs[use_lean][0][0], states) and torch.equal(runs[use_lean][1][0], out.hidden)
        finally:
            taps.remove()
        assert getattr(model, lean.TAPS) == ()
    assert len(runs["1"]) == len(runs["0"]) == 2
    for (last, aux), (own_last, own_aux) in zip(runs["1"], runs["0"]):
        assert aux.shape == (last.shape[0], 3 * model.config.hidden_size)
        assert torch.equal(last, own_last) and torch.equal(aux, own_aux)


def counted_misses(monkeypatch) -> list[int]:
    """The rows of each lookup of the taps that missed (each miss runs the target over the
    committed tokens again), as the test runs."""
    from hasten.drafters import eagle3 as module

    misses, found = [], module.LayerTaps.features

    def counted(self, last, kept=()):
        try:
            return found(self, last, kept)
        except module.MissingFeatures:
            misses.append(len(last))
            raise

    monkeypatch.setattr(module.LayerTaps, "features", counted)
    return misses


@pytest.mark.parametrize("use_lean", ["1", "0"], ids=["lean-forward", "models-own-forward"])
def test_drafts_come_from_the_tapped_features_the_first_prompts_too(target, tmp_path, monkeypatch, use_lean):
    """Every committed row, the prompts' too, is found among the target's tapped forwards, on
    either forward: the drafter meets the target before a prompt is prefilled (check_target), so
    no forward over the prompt runs again, even for a fresh drafter's first prompt."""
    from hasten.drafters import eagle3 as module
    from hasten.models import lean

    monkeypatch.setenv("HASTEN_LEAN_FORWARD", use_lean)
    lean_runs = []
    real_run = lean.run
    monkeypatch.setattr(lean, "run", lambda *a, **k: lean_runs.append(1) or real_run(*a, **k))
    randomised(Eagle3Layer.for_target(target)).save(tmp_path)
    misses = counted_misses(monkeypatch)
    drafter = Eagle3(weights=str(tmp_path), depth=3)
    for seed in (1, 2):
        hasten.generate(target, repetitive_prompt(20, seed=seed), drafter=drafter, max_new_tokens=NEW,
                        draft_size="fixed")
    assert misses == []
    assert bool(lean_runs) == (use_lean == "1")


def test_a_draft_after_a_long_plain_stretch_finds_the_features_it_kept(target, tmp_path, monkeypatch):
    """The taps hold the latest few forwards only; where the planner keeps many plain steps in a
    row, the drafter keeps the committed rows' features as they come (Eagle3.observe), so a
    draft after the stretch runs no forward of the target over the committed tokens again."""
    from hasten.core.sizing import FixedSize
    from hasten.drafters import eagle3 as module

    class EveryTenth(FixedSize):  # plain steps but every tenth
        def begin(self, target, hindsight=False):
            return [0]

        def depth(self, state, limit, evidence=None):
            state[0] += 1
            return limit if state[0] % 10 == 0 else 0

    monkeypatch.setattr(module, "KEPT_FORWARDS", 3)
    randomised(Eagle3Layer.for_target(target)).save(tmp_path)
    drafter = Eagle3(weights=str(tmp_path), depth=3)
    misses = counted_misses(monkeypatch)
    for seed in (1, 2):
        prompt = repetitive_prompt(20, seed=seed)
        out = hasten.generate(target, prompt, drafter=drafter, max_new_tokens=NEW, draft_size=EveryTenth())
        assert torch.equal(out.sequences, hasten.generate(target, prompt, max_new_tokens=NEW).sequences)
        assert out.stats.drafted_tokens > 0
    assert misses == []  # every row found, so none recomputed


def test_sampled_continuations_follow_the_target_three_deep(tmp_path):
    """Chains of 3 accepted and rejected at depths 1 and 2 (checked), the first 3 tokens' law."""
    from hasten.core.stats import DecodeStats
    from test_sampling_distribution import PROMPT

    randomised(Eagle3Layer.for_target(TARGET), seed=3, scale=3.0).save(tmp_path)
    drafter = Eagle3(weights=str(tmp_path), depth=3)
    g, total = torch.Generator().manual_seed(1), DecodeStats()
    for _ in range(100):
        total = total + hasten.generate(TARGET, PROMPT, drafter=drafter, max_new_tokens=4, temperature=1.0, top_k=3,
                                        generator=g, draft_size="fixed").stats
    drafted, accepted = total.drafted_at_depth, total.accepted_at_depth
    assert len(accepted) >= 2 and all(0 < accepted[d] < drafted[d] for d in (0, 1))  # both fates at depths 1, 2
    tv, limit = deep_tv(drafter, DEEP_LAW_SAMPLING, samples=600)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


# ---- the training-time test ---------------------------------------------------------------------------
def test_training_time_test_attention_is_what_drafting_sees(target):
    """Step j of the training-time test at pair t computes what the drafting chain computes at
    depth j + 1 after the committed pairs 0..t (cache, positions t + j, attention over both)."""
    layer = randomised(Eagle3Layer.for_target(target), seed=5)
    g = torch.Generator().manual_seed(0)
    n, H = 7, layer.config.hidden_size
    fused = torch.randn(1, n, H, generator=g)  # fc(aux_t)
    tokens = torch.randn(1, n + 2, H, generator=g)  # token embeddings x_1 .. x_{n+2}
    steps, hidden, outputs = TrainingTimeTest(n), fused, []
    for j in range(3):
        hidden = layer.attend_and_mix(hidden, tokens[:, j : j + n], (torch.arange(n) + j)[None], steps.attend)
        outputs.append(hidden)
    from hasten.drafters.nn import KVCache

    for t in (0, 3, n - 1):
        cache = KVCache()
        out = layer(fused[:, : t + 1], tokens[:, : t + 1], torch.arange(t + 1)[None], causal(t + 1), cache, 0)
        cache.commit(t + 1)
        torch.testing.assert_close(out[:, t], outputs[0][:, t])
        hidden = out[:, t : t + 1]
        for j in (1, 2):
            hidden = layer(hidden, tokens[:, t + j : t + j + 1], torch.tensor([[t + j]]), None, cache, t + j)
            torch.testing.assert_close(hidden[:, 0], outputs[j][:, t], rtol=1e-5, atol=1e-5)


# ---- the export --------------------------------------------------------------------------------------
def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def vllm_eagle3_chain(config: dict, tensors: dict, aux: torch.Tensor, tokens: list[int], embed: torch.Tensor,
                      depth: int) -> list[int]:
    """vLLM's llama_eagle3 from the exported files alone: the first pass over every committed
    pair (aux [r, 3H] of the target's layers, tokens x_1..x_r), then ``depth - 1`` steps feeding the
    pre-norm output back; drafts are argmax of the draft vocabulary mapped through d2t."""
    eps, heads, kv, hd = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    w = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    qkv = torch.cat([w["layers.0.self_attn.q_proj.weight"], w["layers.0.self_attn.k_proj.weight"],
                     w["layers.0.self_attn.v_proj.weight"]])  # vLLM's QKVParallelLinear
    gate_up = torch.cat([w["layers.0.mlp.gate_proj.weight"], w["layers.0.mlp.up_proj.weight"]])
    inverse = 1.0 / config["rope_parameters"]["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    keys, values = [], []

    def layer(hidden, ids, positions):  # [n, H], [n], [n] -> (normed, prenorm)
        embeds = rms(embed[ids], w["layers.0.input_layernorm.weight"], eps)
        residual = hidden
        x = torch.cat([embeds, rms(hidden, w["layers.0.hidden_norm.weight"], eps)], -1)
        q, k, v = F.linear(x, qkv).split([heads * hd, kv * hd, kv * hd], -1)
        angles = positions[:, None].float() * inverse  # neox-style rotary
        cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
        rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin  # noqa: E731
        q, k, v = rot(q.view(-1, heads, hd)), rot(k.view(-1, kv, hd)), v.view(-1, kv, hd)
        keys.append(k), values.append(v)
        K, V = torch.cat(keys).repeat_interleave(heads // kv, 1), torch.cat(values).repeat_interleave(heads // kv, 1)
        past = len(K) - len(q)
        mask = torch.ones(len(q), len(K), dtype=torch.bool).tril(past)
        scores = torch.einsum("qhd,khd->hqk", q, K) / hd**0.5
        attended = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), V)
        residual = F.linear(attended.reshape(len(q), -1), w["layers.0.self_attn.o_proj.weight"]) + residual
        gate, up = F.linear(rms(residual, w["layers.0.post_attention_layernorm.weight"], eps), gate_up).chunk(2, -1)
        prenorm = F.linear(F.silu(gate) * up, w["layers.0.mlp.down_proj.weight"]) + residual
        return rms(prenorm, w["norm.weight"], eps), prenorm

    def draft(normed):
        index = F.linear(normed, w["lm_head.weight"]).argmax(-1)
        return int(index + (w["d2t"][index] if "d2t" in w else 0))

    r = len(aux)
    normed, prenorm = layer(F.linear(aux, w["fc.weight"]), torch.tensor(tokens[1 : r + 1]), torch.arange(r))
    out = [draft(normed[-1])]
    hidden = prenorm[-1:]
    for d in range(1, depth):
        normed, hidden = layer(hidden, torch.tensor([out[-1]]), torch.tensor([r - 1 + d]))
        out.append(draft(normed[-1]))
    return out


@pytest.mark.parametrize("format", ["vllm", "sglang"])
def test_exported_eagle3_drafts_in_vllms_layout_what_hasten_drafts(target, trained, tmp_path, format):
    directory, _ = trained
    layer = randomised(Eagle3Layer.load(directory), seed=7)  # trained two steps: still near its start
    layer.save(tmp_path / "drafter")
    exported = export(tmp_path / "drafter", format, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    layers = config.get("eagle_aux_hidden_state_layer_ids") or [
        k + 1 for k in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # SGLang counts outputs
    assert layers == list(default_aux_layers(8)) == [2, 4, 5]
    assert exported.usage
    prompt = repetitive_prompt(20, seed=3)[0].tolist()
    with torch.no_grad():
        states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states  # residual entering layer k
        aux = torch.cat([states[k][0, :-1] for k in layers], -1)  # [r, 3H]: the pairs before the root
        expected = vllm_eagle3_chain(config, tensors, aux, prompt, target.get_input_embeddings().weight, 4)
    drafts = hasten_chain(target, Eagle3(weights=str(tmp_path / "drafter"), depth=4), prompt)
    assert drafts == expected


def hasten_chain(target, drafter, tokens: list[int]) -> list[int]:
    """The first chain hasten's drafter proposes after the prompt ``tokens`` (its last token is the root)."""
    captured = []
    propose = drafter.propose_rows

    def spy(ctxs):
        drafts = propose(ctxs)
        if not captured:
            captured.append(list(drafts[0].tokens))
        return drafts

    drafter.propose_rows = spy
    hasten.generate(target, torch.tensor([tokens]), drafter=drafter, max_new_tokens=8, draft_size="fixed")
    return captured[0]


def test_the_strict_check_names_what_is_wrong(target, tmp_path):
    layer = randomised(Eagle3Layer.for_target(target, draft_tokens=tuple(range(0, 96, 2))))
    layer.save(tmp_path / "drafter")
    export(tmp_path / "drafter", "vllm", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    good = load_file(tmp_path / "out" / "model.safetensors")
    check_strictly(good, config, "vLLM")
    cases = {
        "missing: midlayer.hidden_norm.weight": {k: v for k, v in good.items() if k != "midlayer.hidden_norm.weight"},
        "unexpected: layers.0.mlp.up_proj.weight": {**good, "layers.0.mlp.up_proj.weight": good["midlayer.mlp.up_proj.weight"]},
        "wrong shape: fc.weight": {**good, "fc.weight": good["fc.weight"][:, :64]},
        "d2t .* torch.int32": {**good, "d2t": good["d2t"].int()},
        "d2t and t2d disagree": {**good, "d2t": good["d2t"] + 1},
        "t2d missing": {k: v for k, v in good.items() if k != "t2d"},
    }
    for message, tensors in cases.items():
        with pytest.raises(ExportError, match=message):
            check_strictly(tensors, config, "vLLM")


def test_export_refuses_eagle_naming_what_is_missing(target, tmp_path):
    from hasten.drafters.eagle import EagleLayer

    EagleLayer.for_target(target).save(tmp_path / "eagle")
    with pytest.raises(ExportError, match="SwiGLU.*three layers.*d2t/t2d.*hasten train eagle3"):
        export(tmp_path / "eagle", "vllm", tmp_path / "out")
    Eagle3Layer.for_target(target).save(tmp_path / "e3")
    with pytest.raises(ExportError, match="hasten exports eagle3 as vllm, sglang"):
        export(tmp_path / "e3", "speculators", tmp_path / "out")
    Eagle3Layer.for_target(tiny_model("llama")).save(tmp_path / "shallow")  # 2 layers: reads layers 0, 0, 1
    with pytest.raises(ExportError, match=r"target layers \[0, 0, 1\].*three distinct layers"):
        export(tmp_path / "shallow", "vllm", tmp_path / "out")
