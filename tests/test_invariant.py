"""Half-precision forwards invariant by construction (models/invariant.py, kernels/invariant.c):
every position of a verification block, chain or tree, gets exactly the logits a one-token step
gets, so speculative decoding writes plain decoding's text in bfloat16 and float16 too.

The kernels are checked on their own (rows, row counts, threads, instruction paths, against a
float64 reference) and inside tiny Llama, Qwen2, Gemma (1, 2 and 3) and GPT-2 models, bit for bit;
then greedy output of every registered drafter against hasten's own plain decoding in bfloat16."""
import hashlib
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import hasten
from hasten import kernels
from hasten.core.tree import TokenTree
from hasten.drafters.base import REGISTRY, create
from hasten.kernels import ops
from hasten.models import cache as kv
from hasten.models import forwards, invariant
from hasten.models.adapter import ModelAdapter
from helpers import DEVICE, VOCAB, ScriptedDrafter, TreeScriptedDrafter, assert_scripted_stats, repetitive_prompt, tiny_model

pytestmark = [
    pytest.mark.skipif(DEVICE.type != "cpu", reason="the invariant kernels are the CPU's"),
    pytest.mark.skipif(kernels.library() is None, reason=f"hasten's kernels could not be built: {kernels.unavailable()}"),
]
HALF = [torch.bfloat16, torch.float16]


# ---- the kernels alone -------------------------------------------------------------------------
def each_row_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
@pytest.mark.parametrize("in_features,out_features", [(576, 200), (1536, 64), (37, 70)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_rows_are_independent_of_their_block_and_threads(dtype, in_features, out_features, threads):
    torch.manual_seed(in_features)
    weight, bias = (torch.randn(out_features, in_features) * 0.05).to(dtype), (torch.randn(out_features) * 0.1).to(dtype)
    x = torch.randn(64, in_features).to(dtype)
    packed_weight = ops.pack(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        alone = each_row_alone(lambda rows: ops.linear(rows, packed_weight, bias), x)
        for rows in (1, 2, 3, 5, 6, 7, 8, 13, 64):
            assert torch.equal(ops.linear(x[:rows], packed_weight, bias), alone[:rows]), rows
        torch.set_num_threads(3 - threads)
        assert torch.equal(ops.linear(x, packed_weight, bias), alone)
    finally:
        torch.set_num_threads(before)
    assert_close_to_exact(alone, x, weight, bias)


def assert_close_to_exact(out, x, weight, bias=None):
    """Within the output's rounding plus a float32 accumulation's error bound of the exact product."""
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T  # [rows, out]
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}[out.dtype]
    assert ((out.double() - reference).abs() <= ulp * reference.abs() + x.shape[1] * 2**-24 * magnitude + 1e-30).all()


def causal(rows: int, keys: int) -> ops.KeyLists:
    return ops.KeyLists.causal(rows, keys)


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
def test_attention_rows_get_what_a_lone_row_over_the_same_keys_gets(dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, keys, rows = 9, 3, 64, 150, 40  # 40 rows: two work items of rows
    k, v = torch.randn(kv_heads, keys, dim).to(dtype), torch.randn(kv_heads, keys, dim).to(dtype)
    q = torch.randn(rows, heads, dim).to(dtype)
    out = ops.attention(q, k, v, causal(rows, keys), 0.125)
    alone = torch.cat([ops.attention(q[r : r + 1], k, v, causal(1, keys - rows + r + 1), 0.125) for r in range(rows)])
    assert torch.equal(out, alone)
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    reference = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().repeat_interleave(3, 0),
                                               v.double().repeat_interleave(3, 0), attn_mask=mask, scale=0.125)
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    assert (out.double() - reference.transpose(0, 1)).abs().max() < tolerance
    softcapped = ops.attention(q, k, v, causal(rows, keys), 0.125, softcap=2.0)
    assert not torch.equal(softcapped, out)
    assert torch.equal(softcapped[-1:], ops.attention(q[-1:], k, v, causal(1, keys), 0.125, softcap=2.0))


def test_a_tree_row_gets_what_a_step_over_its_path_gets():
    torch.manual_seed(1)
    past, parents = 37, [-1, 0, 0, 1, 1, 2, 3, 6, 6, 0]
    size = len(parents)
    k, v = torch.randn(2, past + size, 16).bfloat16(), torch.randn(2, past + size, 16).bfloat16()
    q = torch.randn(size, 4, 16).bfloat16()
    ancestors = torch.eye(size, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    visible = torch.cat([torch.ones(size, past, dtype=torch.bool), ancestors], dim=1)
    tree = ops.attention(q, k, v, ops.KeyLists.from_mask(visible), 0.25)
    for node in range(size):
        path = torch.cat([torch.arange(past), past + ancestors[node].nonzero()[:, 0]])  # what a step sees, in order
        step = ops.attention(q[node : node + 1], k[:, path].contiguous(), v[:, path].contiguous(),
                             causal(1, len(path)), 0.25)
        assert torch.equal(tree[node], step[0]), node
    padded = ops.KeyLists(torch.tensor([5]), torch.tensor([past]))  # a batch row's left padding
    assert torch.equal(ops.attention(q[:1], k, v, padded, 0.25),
                       ops.attention(q[:1], k[:, 5:past].contiguous(), v[:, 5:past].contiguous(), causal(1, past - 5), 0.25))


def exact_values(count: int, salt: int) -> torch.Tensor:
    """Numbers every machine makes alike (no random generator): multiples of 1/512 in [-1, 1)."""
    index = torch.arange(count, dtype=torch.int64)
    return (((index * 2654435761 + salt * 40503) % 1024) - 512).float() / 512


def path_digest() -> str:
    """The kernels' bits on fixed inputs, as a hash: linear and attention in every dtype."""
    digest = hashlib.sha256()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w, b = exact_values(150 * 77, 1).view(150, 77).to(dtype), exact_values(150, 2).to(dtype)
        x = exact_values(9 * 77, 3).view(9, 77).to(dtype)
        digest.update(ops.linear(x, ops.pack(w), b).float().numpy().tobytes())
        k, v = exact_values(2 * 90 * 24, 4).view(2, 90, 24).to(dtype), exact_values(2 * 90 * 24, 5).view(2, 90, 24).to(dtype)
        q = (3 * exact_values(5 * 6 * 24, 6)).view(5, 6, 24).to(dtype)
        digest.update(ops.attention(q, k, v, ops.KeyLists.causal(5, 90), 0.2, softcap=5.0).float().numpy().tobytes())
    return digest.hexdigest()


# path_digest() with HASTEN_BF16_DOT=0, measured on the 2-core AMD EPYC development VM (AVX-512, AVX2 and
# portable paths alike); the kernels' arithmetic is IEEE operations only, so every machine must give it
MACHINE_INDEPENDENT_DIGEST = "0ad205404029f1be545faf759e7c6b59a2c61b2f96b7c7a7a3e23920db4b8c05"


def test_every_instruction_path_gives_the_same_bits(monkeypatch):
    """AVX-512, AVX2 and portable C perform the same IEEE operations (the bfloat16 dot product,
    which rounds as the CPU does, is off here)."""
    monkeypatch.setenv("HASTEN_BF16_DOT", "0")
    digests = {}
    for path in (0, 1, 2):
        try:
            with kernels.forced_path(path):
                digests[path] = path_digest()
        except ValueError:  # a CPU without that path
            continue
    assert 0 in digests and len(set(digests.values())) == 1, digests
    if MACHINE_INDEPENDENT_DIGEST is not None:
        assert digests[0] == MACHINE_INDEPENDENT_DIGEST  # this machine gives the development machine's bits


def test_every_instruction_path_gives_the_same_attention_at_a_models_head_size(monkeypatch):
    """Head size 64 (SmolLM2's, Llama's 128 alike) takes the wide value loops (two queries
    sharing each value load); a prefill's run of rows and decode rows over separate lists, with
    groups of 3 and 8 query heads, give the portable path's bits on every path."""
    runs = []
    for heads, kv_heads in ((9, 3), (8, 1)):
        k = exact_values(kv_heads * 120 * 64, 7).view(kv_heads, 120, 64)
        v = exact_values(kv_heads * 120 * 64, 8).view(kv_heads, 120, 64)
        prefill = ((3 * exact_values(40 * heads * 64, 9)).view(40, heads, 64), ops.KeyLists.causal(40, 120))
        starts = torch.tensor([0, 30, 70])
        decode = ((3 * exact_values(3 * heads * 64, 10)).view(3, heads, 64),
                  ops.KeyLists(starts, starts + torch.tensor([25, 40, 50]), None, None))
        runs += [(q, k, v, lists) for q, lists in (prefill, decode)]
    outputs = {}
    for path in (0, 1, 2):
        try:
            with kernels.forced_path(path):
                outputs[path] = [ops.attention(q, k, v, lists, 0.125) for q, k, v, lists in runs]
        except ValueError:  # a CPU without that path
            continue
    for path, got in outputs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outputs[0])), f"path {path}"


@pytest.mark.skipif(not ops.bf16_dot(), reason="this CPU has no AVX512-BF16")
def test_the_bfloat16_dot_product_keeps_rows_independent():
    torch.manual_seed(2)
    weight, x = (torch.randn(130, 1537) * 0.05).bfloat16(), torch.randn(20, 1537).bfloat16()  # odd K: a padded pair
    dot = ops.pack(weight)
    assert dot.pairs
    alone = each_row_alone(lambda rows: ops.linear(rows, dot, None), x)
    for rows in (1, 4, 7, 8, 20):
        assert torch.equal(ops.linear(x[:rows], dot, None), alone[:rows])
    assert_close_to_exact(alone, x, weight)


# ---- inside models -----------------------------------------------------------------------------
GEMMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
FAMILIES = {
    "llama": lambda: tiny_model("llama"),
    "qwen2": lambda: tiny_model("qwen2"),
    "gpt2": lambda: tiny_model("gpt2"),  # Conv1D layers
    "gemma": lambda: tf.AutoModelForCausalLM.from_config(tf.GemmaConfig(**GEMMA)),
    "gemma2": lambda: tf.AutoModelForCausalLM.from_config(tf.Gemma2Config(**GEMMA, sliding_window=16)),  # soft-capping
    "gemma3": lambda: tf.AutoModelForCausalLM.from_config(tf.Gemma3TextConfig(**GEMMA, sliding_window=16)),
}
TREE = TokenTree((-1, 0, 0, 1, 1, 2, 3, 6, -1, 8))


def prepared_model(family: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval().to(dtype)
    assert invariant.prepare(model)
    return model


def steps_along(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Plain decoding's logits for each of ``tokens`` fed one at a time after ``prompt``: [len, vocab]."""
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prompt]))
    return torch.stack([adapter.forward([token], None).logits[0] for token in tokens])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["float32", "bfloat16", "float16"])
def test_block_positions_equal_one_token_steps_bit_for_bit(family, dtype):
    model = prepared_model(family, dtype)
    generator = torch.Generator().manual_seed(3)
    for cached in (1, 17, 70):
        prompt = torch.randint(3, VOCAB, (cached + 1,), generator=generator).tolist()
        tokens = torch.randint(3, VOCAB, (64,), generator=generator).tolist()
        block = [prompt[-1], *tokens]
        adapter = ModelAdapter(model)
        adapter.start(torch.tensor([prompt]))
        steps = steps_along(model, prompt, block)  # [65, vocab]
        for size in (1, 2, 7, 65):  # chains of 0 to 64 draft tokens
            assert torch.equal(adapter.forward(block[:size], None).logits, steps[:size]), (cached, size)
            kv.crop(adapter.cache, cached)
        nodes = tokens[: len(TREE)]
        logits = adapter.forward([prompt[-1], *nodes], TREE).logits
        for node in range(len(TREE)):
            path = [n for n in range(len(TREE)) if TREE.block_mask[node + 1, n + 1]]  # the node's ancestors and itself
            along = steps_along(model, prompt, [prompt[-1], *(nodes[n] for n in path)])
            assert torch.equal(logits[node + 1], along[-1]), (cached, node)
        kv.crop(adapter.cache, cached)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outside_hasten_the_model_runs_pytorchs_kernels(dtype):
    model = prepared_model("llama", dtype)
    plain = tiny_model("llama").to(dtype)
    ids = repetitive_prompt(20)
    assert torch.equal(model(ids).logits, plain(ids).logits)  # F.linear and sdpa, as before prepare
    with forwards.active():
        assert not torch.equal(model(ids).logits, plain(ids).logits)  # the invariant kernels
    assert {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__} == {"InvariantLinear"}


def test_a_changed_weight_is_packed_again_and_the_cost_key_names_the_kernels():
    from hasten.models.hf import HuggingFaceRuntime

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    layer.__class__, layer._packed, layer._packed_of = invariant.InvariantLinear, None, None
    x = torch.randn(4, 16)
    with forwards.active():
        first = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)
        second = layer(x)
    assert torch.allclose(second - layer.bias, 2 * (first - layer.bias), atol=1e-5)
    key = HuggingFaceRuntime(tiny_model("llama")).cost_key()
    assert key["linear"] == ["InvariantLinear"] and key["kernels"] == invariant.kernel_path()


def test_where_invariant_forwards_do_not_apply(monkeypatch):
    from hasten.models.quantize import quantize

    int8 = quantize(tiny_model("llama"), "int8")  # its own row-by-row attention and int8 layers stay
    assert not invariant.prepare(int8) and not any(isinstance(m, invariant.InvariantLinear) for m in int8.modules())
    model = tiny_model("llama")
    monkeypatch.setattr(invariant, "_available_bytes", lambda: 1000)  # no room for the packed copies
    assert not invariant.prepare(model) and "quarter of the available memory" in invariant.unavailable(model)
    monkeypatch.undo()
    assert invariant.prepare(model)
    monkeypatch.setattr(invariant, "_available_bytes", lambda: 0)  # the copies made since took the room
    assert invariant.prepare(model)  # prepared before: it stays prepared
    monkeypatch.setenv("HASTEN_INVARIANT", "0")
    assert not invariant.prepare(tiny_model("llama").to(torch.bfloat16))
    assert invariant.unavailable() == "HASTEN_INVARIANT=0"


# ---- greedy output: every drafter against hasten's own plain decoding in bfloat16 --------------------
NEW, DRAFT_LEN = 24, 4
TRAINING_FREE = sorted(name for name, cls in REGISTRY.items() if cls.Training is None)
TRAINED = sorted(name for name, cls in REGISTRY.items() if cls.Training is not None)


@pytest.fixture(scope="module")
def bf16_setup():
    model = prepared_model("llama", torch.bfloat16)
    prompt = repetitive_prompt(20, seed=1)
    reference = hasten.generate(model, prompt, max_new_tokens=NEW).sequences  # plain decoding, same kernels
    return model, prompt, reference


def check(model, prompt, reference, drafter):
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, draft_size="fixed")
    assert out.sequences.tolist() == reference.tolist()
    return out


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
def test_scripted_chains_and_trees_in_bfloat16(bf16_setup, mode):
    model, prompt, reference = bf16_setup
    out = check(model, prompt, reference, ScriptedDrafter(reference[0].tolist(), DRAFT_LEN, mode))
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)
    error_at = {"oracle": None, "adversarial": 0}.get(mode, mode)
    out = check(model, prompt, reference, TreeScriptedDrafter(reference[0].tolist(), DRAFT_LEN, 3, 2, error_at))
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)


@pytest.mark.parametrize("name", TRAINING_FREE)
def test_training_free_drafters_in_bfloat16(bf16_setup, name):
    model, prompt, reference = bf16_setup
    if REGISTRY[name].needs_draft_model:
        settings = {"group_size": 1} if name == "easyspec" else {}
        for draft in (prepared_model("llama", torch.bfloat16), tiny_model("llama", seed=7).to(torch.bfloat16)):
            check(model, prompt, reference, create(name, model=draft, **settings))
    else:
        check(model, prompt, reference, create(name))


@pytest.mark.parametrize("name", TRAINED)
def test_trained_drafters_with_untrained_weights_in_bfloat16(bf16_setup, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no weights found": untrained on purpose
        check(*bf16_setup, create(name))


# ---- the sampling law in bfloat16: drafts accepted and rejected at depths 1 to 3 ---------------------
def test_sampling_with_a_tree_3_deep_follows_the_bfloat16_target(monkeypatch):
    import test_sampling_distribution as law

    target = law.peaky_model(0).to(torch.bfloat16)
    assert invariant.prepare(target)
    monkeypatch.setattr(law, "TARGET", target)
    tv, limit = law.deep_tv(law.RankedTreeDrafter(target, law.TREE_SAMPLING), law.TREE_SAMPLING)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_instruction_path_gives_the_same_norm_and_rotary(dtype):
    """The norm's and the rotary embedding's AVX-512 and AVX2 builds are the portable code
    compiled for wider registers: the same bits on every path, tails (widths not a multiple of
    16) and the residual add included."""
    torch.manual_seed(3)
    norms = [((torch.randn(5, width) * 4).to(dtype), (torch.randn(width) + 1).to(dtype), torch.randn(5, width).to(dtype))
             for width in (576, 100)]
    angles = torch.randn(6, 64) * 30
    qk, cos, sin = torch.randn(6, 12, 64).to(dtype), angles.cos().to(dtype), angles.sin().to(dtype)
    outputs = {}
    for path in (0, 1, 2):
        try:
            with kernels.forced_path(path):
                got = [part for x, weight, delta in norms for part in ops.rms_norm(x, weight, 1e-5, delta)]
                outputs[path] = got + [ops.rotary(qk, cos, sin)]
        except ValueError:  # a CPU without that path
            continue
    assert 0 in outputs
    for path, got in outputs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outputs[0])), f"path {path}"
