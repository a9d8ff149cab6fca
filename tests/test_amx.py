"""AMX's bfloat16 tiles (kernels/invariant.c, "AMX"): a row's bits are its own whatever rows ride
beside it, its place in a tile, the call's size or the threads; the product is close to the exact
one; inside a model a packed batch's rows equal lone rows and a block's positions one-token steps,
so speculative decoding writes plain decoding's text on this path. The row check is shown to
catch a reduction whose order depends on the rows. Skipped where the CPU has no AMX (the AMD EPYC
machines): the dot-product and float32 paths there are tests/test_invariant.py's."""
import pytest
import torch

import hasten
from hasten import kernels
from hasten.drafters import PromptLookup
from hasten.kernels import ops
from hasten.models import invariant
from helpers import DEVICE, ScriptedDrafter, TreeScriptedDrafter, repetitive_prompt

pytestmark = [
    pytest.mark.skipif(DEVICE.type != "cpu", reason="the AMX path is the CPU's"),
    pytest.mark.skipif(kernels.library() is None, reason=f"hasten's kernels could not be built: {kernels.unavailable()}"),
]
needs_amx = pytest.mark.skipif(kernels.library() is None or "amx" not in ops.bf16_layouts(),
                               reason="this CPU (or its kernel) has no AMX-BF16 tiles")


def mismatches(fn, x: torch.Tensor, sizes) -> list[tuple[int, int]]:
    """(size, shift) of every batch whose rows differ from the same rows alone: the first ``size``
    rows of ``x``, rolled by ``shift``, so each row takes every position of each size."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    found = []
    for size in sizes:
        for shift in range(size):
            order = torch.roll(torch.arange(size), shift)
            if not torch.equal(fn(x[order]), alone[order]):
                found.append((size, shift))
    return found


def bf16_case(in_features: int, out_features: int, rows: int, seed: int, cancelling: bool = False):
    """weight [out, in], bias [out], x [rows, in]; ``cancelling``: a product of +65536 in the first
    32 inputs (AMX's first chunk) and one of -65536 in the next, so that the float32 sum's rounding
    on the way, which another order of the chunks changes, shows in the bfloat16 result."""
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * 0.05
    bias = torch.randn(out_features) * 0.1
    x = torch.randn(rows, in_features)
    if cancelling:
        x[:, 0], weight[:, 0], x[:, 32], weight[:, 32] = 256.0, 256.0, 256.0, -256.0
    return weight.bfloat16(), bias.bfloat16(), x.bfloat16()


@needs_amx
@pytest.mark.parametrize("in_features,out_features", [(77, 150), (576, 192), (1537, 130)])
def test_amx_rows_are_their_own_in_every_batch_and_position(in_features, out_features):
    """Odd K (a padded pair and a padded chunk) and N (part tiles); batches of 1 to 40 rows (1 to
    3 A tiles, with zero rows), every row in every position."""
    weight, bias, x = bf16_case(in_features, out_features, 40, in_features, cancelling=True)
    packed = ops.pack(weight, "amx")
    sizes = range(2, 41) if in_features < 600 else (2, 15, 16, 17, 33, 40)
    assert mismatches(lambda rows: ops.linear(rows, packed, bias), x, sizes) == []
    before = torch.get_num_threads()
    try:  # tiles split over two threads: each output is still one thread's fixed chain
        torch.set_num_threads(2)
        two = ops.linear(x, packed, bias)
        torch.set_num_threads(1)
        assert torch.equal(two, ops.linear(x, packed, bias))
    finally:
        torch.set_num_threads(before)


def test_the_row_check_catches_a_reduction_that_depends_on_the_rows():
    """The same check, on the same inputs, fails a product whose order of 32-input chunks depends
    on the batch's size (as a library kernel's blocking can), rounded to bfloat16 as the kernel
    rounds: a pass above means something."""
    weight, _, x = bf16_case(77, 150, 40, 77, cancelling=True)

    def chunks_by_batch_size(rows):  # [M, K] -> [M, N]
        products = rows.float()[:, None, :] * weight.float()[None]  # [M, N, K], exact
        chunks = [products[..., k : k + 32].sum(-1) for k in range(0, rows.shape[1], 32)]
        acc = torch.zeros(rows.shape[0], weight.shape[0])
        for chunk in (chunks if rows.shape[0] % 2 else chunks[1:] + chunks[:1]):
            acc = acc + chunk
        return acc.bfloat16()

    assert mismatches(chunks_by_batch_size, x, range(2, 8))


@needs_amx
@pytest.mark.parametrize("in_features,out_features", [(576, 200), (1536, 64), (37, 70)])
def test_amx_product_is_close_to_the_exact_one(in_features, out_features):
    from test_invariant import assert_close_to_exact

    weight, bias, x = bf16_case(in_features, out_features, 20, 1)
    packed = ops.pack(weight, "amx")
    assert packed.data.shape[1] % 16 == 0  # pairs padded to whole chunks
    assert_close_to_exact(ops.linear(x, packed, bias), x, weight, bias)
    assert_close_to_exact(ops.linear(x[:1], packed, None), x[:1], weight)


@pytest.fixture
def amx_on(monkeypatch):
    """Every bfloat16 layer packed from here on takes AMX's tiles."""
    monkeypatch.setenv("HASTEN_AMX", "1")
    monkeypatch.delenv("HASTEN_BF16_DOT", raising=False)
    assert ops.bf16_layout() == "amx"


def assert_on_amx(model) -> None:
    packed = [m._packed for m in model.modules() if isinstance(m, invariant.InvariantLinear) and m._packed is not None]
    fused = [m.__dict__["_hasten_invariant_fused"][1] for m in model.modules() if "_hasten_invariant_fused" in m.__dict__]
    assert packed and all(p.layout == "amx" for p in packed + fused)


@needs_amx
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("defer", [False, True], ids=["prefilled", "deferred"])
def test_packed_batch_rows_equal_lone_rows_on_amx(amx_on, arch, defer):
    from test_packed_batch import prepared, test_every_row_gets_its_own_logits_bit_for_bit as check_rows

    check_rows(arch, torch.bfloat16, defer)
    model = prepared(arch, torch.bfloat16)
    hasten.generate(model, repetitive_prompt(12), max_new_tokens=2)
    assert_on_amx(model)


@needs_amx
def test_block_positions_equal_one_token_steps_on_amx(amx_on):
    from test_invariant import test_block_positions_equal_one_token_steps_bit_for_bit as check_block

    check_block("llama", torch.bfloat16)


@needs_amx
def test_speculative_greedy_equals_plain_greedy_on_amx(amx_on):
    from test_invariant import prepared_model

    model = prepared_model("llama", torch.bfloat16)
    prompt = repetitive_prompt(20, seed=1)
    reference = hasten.generate(model, prompt, max_new_tokens=24).sequences  # plain decoding, on AMX
    assert_on_amx(model)
    drafters = [ScriptedDrafter(reference[0].tolist(), 4, mode) for mode in ("oracle", "adversarial", 2)]
    drafters += [TreeScriptedDrafter(reference[0].tolist(), 4, 3, 2, 1), PromptLookup()]
    for drafter in drafters:
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=24, draft_size="fixed")
        assert out.sequences.tolist() == reference.tolist(), type(drafter).__name__


@pytest.mark.parametrize("layout", ["amx", "pairs"])
def test_the_bfloat16_paths_round_as_the_contract_rounds(layout):
    """acc + bias rounded to bfloat16 16 lanes at a time: nearest even, NaN kept quiet with its
    payload, as f32_to_bf16 (the scalar tail) does; over random float32 bit patterns, zeros,
    infinities and denormals, and a width that leaves a tail."""
    if layout not in ops.bf16_layouts():
        pytest.skip(f"this CPU has no {layout!r} bfloat16 layout")
    out_features = 64 * 5 + 13
    bits = torch.randint(-2**31, 2**31 - 1, (out_features,), generator=torch.Generator().manual_seed(5))
    bias = bits.to(torch.int32).view(torch.float32).clone()
    bias[:7] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3.0000002])
    x, weight = torch.zeros(3, 40).bfloat16(), torch.zeros(out_features, 40).bfloat16()  # acc = +0
    got = ops.linear(x, ops.pack(weight, layout), bias).view(torch.int16).to(torch.int64) & 0xFFFF
    u = (torch.zeros(out_features) + bias).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # acc + bias
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    want = torch.where(nan, (u >> 16) | 0x40, ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16) & 0xFFFF
    assert nan.any() and torch.equal(got, want.expand_as(got))


@needs_amx
def test_attention_on_amx_gives_every_row_its_own_bits_close_to_the_float32_contract(monkeypatch):
    """Attention over bfloat16 keys takes AMX's tiles where bfloat16 layers do: a prefill's run of
    rows, decode rows over separate lists and tree rows (extra keys) each get the bits they get
    alone, and the result is the float32 contract's within bfloat16 rounding. With HASTEN_AMX=0 the
    float32 path runs (and gives other bits)."""
    torch.manual_seed(0)
    k, v = torch.randn(3, 300, 64).to(torch.bfloat16), torch.randn(3, 300, 64).to(torch.bfloat16)
    q = (torch.randn(70, 9, 64) * 2).to(torch.bfloat16)
    starts, ends = torch.tensor([0, 40, 100]), torch.tensor([33, 130, 250])
    mask = torch.zeros(4, 300, dtype=torch.bool)
    mask[:, :120] = True
    for r in range(4):
        mask[r, 120 + torch.arange(r + 1) * 2] = True
    cases = [(q, ops.KeyLists.causal(70, 250)), (q[:3], ops.KeyLists(starts, ends)),
             (q[:4], ops.KeyLists.from_mask(mask))]
    assert ops.attention_on_amx(q, k)
    for query, lists in cases:
        together = ops.attention(query, k, v, lists, 0.125)
        for r in range(query.shape[0]):
            alone = ops.KeyLists(lists.start[r:r + 1], lists.prefix[r:r + 1],
                                 None if lists.offsets is None else lists.offsets[r:r + 2] - lists.offsets[r],
                                 None if lists.extra is None else lists.extra[lists.offsets[r]:lists.offsets[r + 1]])
            assert torch.equal(ops.attention(query[r:r + 1], k, v, alone, 0.125), together[r:r + 1]), r
        monkeypatch.setenv("HASTEN_AMX", "0")
        assert not ops.attention_on_amx(query, k)
        contract = ops.attention(query, k, v, lists, 0.125)
        monkeypatch.delenv("HASTEN_AMX")
        assert not torch.equal(contract, together)
        assert torch.allclose(together.float(), contract.float(), atol=2e-2, rtol=2e-2)
