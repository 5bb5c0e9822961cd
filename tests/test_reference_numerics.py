"""Reference quantisers and GEMMs against hand-worked golden cases (bit-exact), and the
GEMMs against an independent dequantise-then-matmul computation."""

import pytest
import torch

from dsv4_moe import reference as R
from dsv4_moe.reference.quant import scale_to_e8m0_bits
from dsv4_moe.testing import random_fp8_block_weight, random_mxfp4_weight
from dsv4_moe.weights.formats import (dequant_fp8_block, dequant_mxfp4, e2m1_codes_to_float, e8m0_to_float32,
                                      pack_e2m1, unpack_e2m1)


def _row(values, k=128):
    x = torch.zeros(1, k, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("amax,scale", [(448.0, 1.0), (450.0, 2.0), (224.0, 0.5), (448.0 * 2 ** -10, 2 ** -10),
                                        (1.0, 2 ** -8), (0.0, 2.0 ** -22)],
                         ids=["exact_448", "just_above", "half", "pow2_small", "one", "all_zero_floor"])
def test_act_quant_scale_boundaries(amax, scale):
    q, s = R.act_quant(_row([amax]))
    assert s.dtype == torch.float32 and s.shape == (1, 1)
    assert s.item() == scale, (amax, s.item(), scale)


def test_act_quant_floor_is_1e4():
    # amax below the floor gets the floor's scale: 2^ceil(log2(1e-4 / 448)) = 2^-22
    _, s = R.act_quant(_row([1e-6]))
    assert s.item() == 2.0 ** -22


def test_act_quant_ties_round_to_even_and_saturation():
    # s = 1 (amax 448): e4m3 spacing in [16, 32) is 2, so 17 and 19 are ties -> 16 and 20;
    # in [256, 448] spacing is 32: 272 is a tie between 256 and 288 -> 256 (even mantissa).
    q, s = R.act_quant(_row([448.0, 17.0, 19.0, -17.0, 272.0, -448.0, 0.5, 0.001953125]))
    assert s.item() == 1.0
    got = q.float()[0, :8].tolist()
    assert got == [448.0, 16.0, 20.0, -16.0, 256.0, -448.0, 0.5, 0.001953125]


def test_act_quant_groups_and_partial_last_group():
    x = torch.zeros(2, 300)
    x[0, 0] = 448.0        # group 0 of row 0: s = 1
    x[0, 130] = 896.0      # group 1: s = 2
    x[0, 299] = 1.0        # group 2 (44 wide): s = 2^-8
    x[1, 5] = -3.5         # row 1 group 0: 3.5/448 = 2^-7 exactly -> s = 2^-7
    q, s = R.act_quant(x.to(torch.bfloat16))
    assert s.shape == (2, 3)
    assert s[0].tolist() == [1.0, 2.0, 2.0 ** -8]
    assert s[1, 0].item() == 2.0 ** -7
    assert q.float()[0, 130].item() == 448.0 and q.float()[0, 299].item() == 256.0
    assert q.float()[1, 5].item() == -448.0


def test_act_quant_nan_inf():
    x = _row([1.0, float("nan"), 2.0])
    q, s = R.act_quant(x)
    assert s.item() == 2.0 ** -7  # NaN ignored in amax (fmaxf semantics): amax = 2
    assert torch.isnan(q.float()[0, 1]) and q.float()[0, 2].item() == 256.0
    x = _row([1.0, float("inf")])
    q, s = R.act_quant(x)
    assert s.item() == float("inf")  # the group's scale is inf: the e8m0 byte is 0xFF (NaN)
    assert scale_to_e8m0_bits(s).view(torch.uint8).item() == 255


def test_e2m1_all_codes_and_nibble_order():
    assert e2m1_codes_to_float(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    # byte 0x71: low nibble 1 (0.5) is k = 0, high nibble 7 (6.0) is k = 1
    assert unpack_e2m1(torch.tensor([[0x71]], dtype=torch.uint8)).tolist() == [[1, 7]]
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


def test_e8m0_bytes():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float32(b)
    assert v[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert torch.isnan(v[6])
    # torch's own e8m0 dtype agrees on the normal range
    assert torch.equal(b[1:6].view(torch.float8_e8m0fnu).float(), v[1:6])


def test_fp8_gemm_hand_case():
    # q = 1 everywhere, w = 2 everywhere, K = 256 (two blocks) with different scales per block
    q = torch.ones(2, 256).to(torch.float8_e4m3fn)
    w = torch.full((3, 256), 2.0).to(torch.float8_e4m3fn)
    sa = torch.tensor([[1.0, 0.5], [2.0, 1.0]])
    sw = torch.tensor([[1.0, 4.0]])
    out = R.fp8_gemm(q, sa, w, sw)
    # row 0: 128*2*1*1 + 128*2*0.5*4 = 256 + 512; row 1: 512 + 1024
    assert out.float().tolist() == [[768.0] * 3, [1536.0] * 3]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_fp8_gemm_matches_dequantised_matmul():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 384, generator=g).to(torch.bfloat16)
    q, sa = R.act_quant(x)
    w, sw = random_fp8_block_weight(200, 384, generator=g)  # N not a multiple of 128
    out = R.fp8_gemm(q, sa, w, sw)
    xq = q.double() * sa.double().repeat_interleave(128, 1)
    ref = xq @ dequant_fp8_block(w, sw).double().T
    assert _rel(out, ref) < 4e-3  # bf16 output rounding only
    # a wrong scale (one block's exponent off by one) is caught by the same bound
    sw_bad = sw.view(torch.uint8).clone(); sw_bad[0, 1] += 1
    bad = R.fp8_gemm(q, sa, w, sw_bad.view(torch.float8_e8m0fnu))
    assert _rel(bad, ref) > 4e-2


def test_fp4_gemm_matches_dequantised_matmul():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=g).to(torch.bfloat16)
    q, sa = R.act_quant(x)
    w4, sw = random_mxfp4_weight((96, 256), generator=g)
    out = R.fp4_gemm(q, sa, w4, sw)
    xq = q.double() * sa.double().repeat_interleave(128, 1)
    ref = xq @ dequant_mxfp4(w4, sw).double().T
    assert _rel(out, ref) < 4e-3
    # swapped nibble order is caught
    b = w4.view(torch.uint8)
    swapped = ((b >> 4) | (b << 4)).to(torch.uint8)
    assert _rel(R.fp4_gemm(q, sa, swapped, sw), ref) > 0.3


def test_swiglu_clamp_is_one_sided_on_gate():
    gu = torch.tensor([[-30.0, 30.0, 5.0, 5.0], [20.0, -20.0, 3.0, 3.0]]).to(torch.bfloat16)  # I = 2
    h = R.swiglu(gu, 10.0)
    # gate -30 is NOT clamped from below: silu(-30) * 5 (tiny, negative); gate 30 -> 10
    g = torch.tensor([[-30.0, 10.0], [10.0, -20.0]])
    u = torch.tensor([[5.0, 5.0], [3.0, 3.0]])
    assert torch.equal(h, torch.nn.functional.silu(g) * u)
    # up is clamped on both sides
    h2 = R.swiglu(torch.tensor([[1.0, 1.0, 50.0, -50.0]]).to(torch.bfloat16), 10.0)
    s1 = torch.nn.functional.silu(torch.tensor(1.0))
    assert torch.equal(h2, torch.stack([s1 * 10, s1 * -10])[None])


def test_swiglu_route_weight_before_rounding():
    gu = torch.randn(4, 256).to(torch.bfloat16)
    w = torch.tensor([0.5, 1.5, 2.0, 0.1])
    assert torch.equal(R.swiglu(gu, 10.0, w), R.swiglu(gu, 10.0) * w[:, None])


def test_route_topk_and_hash():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(16, 64, generator=g) * 0.1).to(torch.bfloat16)
    bias = torch.zeros(16); bias[3] = 100.0  # expert 3 always selected, with its UNBIASED score
    tw, ids = R.route(x, w, bias, None, None, 4, 2.5)
    assert (ids == 3).any(dim=1).all()
    assert torch.equal(ids, ids.sort(dim=1).values)
    scores = torch.sqrt(torch.nn.functional.softplus((x.double() @ w.double().T).float()))
    expect = scores.gather(1, ids)
    expect = expect / expect.sum(1, keepdim=True) * 2.5
    torch.testing.assert_close(tw, expect, rtol=1e-6, atol=0)
    tid2eid = torch.randint(0, 16, (32, 4), generator=g)
    ids_in = torch.tensor([0, 5, 31, 5, 2])
    _, hids = R.route(x, w, None, tid2eid, ids_in, 4, 1.5)
    assert torch.equal(hids, tid2eid[ids_in].sort(dim=1).values)
    with pytest.raises(ValueError, match="input_ids"):
        R.route(x, w, None, tid2eid, None, 4, 1.5)
    # clear errors, not a raw IndexError / matmul shape error (session 45's audit)
    for bad in ([0, 32, 1, 1, 1], [0, -1, 1, 1, 1]):
        with pytest.raises(ValueError, match=r"input_ids in \[-?\d+, \d+\]: expected ids in \[0, 32\)"):
            R.route(x, w, None, tid2eid, torch.tensor(bad), 4, 1.5)
    with pytest.raises(ValueError, match=r"x.shape=\(5, 128\) and weight.shape=\(16, 64\)"):
        R.route(torch.randn(5, 128).to(torch.bfloat16), w, bias, None, None, 4, 2.5)


def test_finalize_order_and_locality():
    y = torch.tensor([[[1.0, 2.0]], [[1e-3, 0.0]], [[-1.0, 5.0]]]).permute(1, 0, 2).to(torch.bfloat16)  # [T=1,k=3,H=2]
    ids = torch.tensor([[0, 4, 9]])
    acc = R.finalize(y, ids, first_expert=0, num_local=8)  # expert 9 is not local
    assert acc.tolist() == [[1.0 + float(torch.tensor(1e-3).to(torch.bfloat16)), 2.0]]


def test_bf16_diff_stats_equal_infinities_and_recipe_names():
    """Equal infinities are no difference (inf - inf was NaN, counted as infinite ulps, so a tensor
    failed against its own clone); a real difference still counts; an unknown recipe is named."""
    from dsv4_moe.testing import assert_bf16_close, bf16_diff_stats

    a = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), 2.0]).to(torch.bfloat16)
    st = assert_bf16_close(a, a.clone(), "layer")
    assert st == {"mismatch_frac": 0.0, "max_ulp": 0.0, "rel_l2": 0.0, "max_abs": 0.0}
    b = a.clone()
    b[1] = 3.0
    assert bf16_diff_stats(b, a)["max_ulp"] == float("inf")
    b = a.clone()
    b[4] = torch.tensor(2.0).to(torch.bfloat16).view(torch.int16).add(1).view(torch.bfloat16)
    assert bf16_diff_stats(b, a)["max_ulp"] > 0
    with pytest.raises(ValueError, match="recipe='nope': expected one of"):
        assert_bf16_close(a, a, "nope")


def test_reference_entry_points_name_bad_arguments():
    """The reference's public functions refuse mismatched inputs with a ValueError naming them (raw
    torch errors before: a broadcast error, an out-of-bounds gather, an IndexError), and moe_forward
    refuses a config that describes another layer than its weights (it ran silently)."""
    from dsv4_moe import MoEConfig
    from dsv4_moe.testing import random_layer_weights

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(16, 64, generator=g) * 0.1).to(torch.bfloat16)
    for args, match in (((x, w, torch.zeros(8), None, None, 4, 1.5), r"bias.shape=\(8,\): expected \[16\]"),
                        ((x, w, torch.zeros(16), None, None, 17, 1.5), r"top_k=17: expected an int in \[1, 16\]"),
                        ((x, w, torch.zeros(16), None, None, 0, 1.5), r"top_k=0"),
                        ((x, w, torch.zeros(16), None, None, 2.0, 1.5), r"top_k=2.0"),
                        ((x, w, None, torch.full((4, 2), 19), torch.tensor([0, 1, 2]), 2, 1.5),
                         r"tid2eid gives expert ids in \[19, 19\].*expected ids in \[0, 16\)"),
                        ((x, w, None, torch.zeros(4, 2, dtype=torch.long), torch.tensor([0.0, 1.0, 2.0]), 2, 1.5),
                         r"input_ids.dtype=torch.float32")):
        with pytest.raises(ValueError, match=match):
            R.route(*args)
    y = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"finalize: y \(3, 4, 64\), topk_ids \(3, 2\)"):
        R.finalize(y, torch.zeros(3, 2, dtype=torch.long), 0, 16)
    cfg = MoEConfig.tiny()
    lw = random_layer_weights(cfg, layer_idx=1)
    xt = torch.randn(2, cfg.hidden_size).to(torch.bfloat16)
    for bad, match in ((cfg.replace(hidden_size=512), "config.hidden_size=512 but the gate weight's H is 256"),
                       (cfg.replace(n_routed_experts=32), "config.n_routed_experts=32 but the gate weight's E is 16")):
        with pytest.raises(ValueError, match=match):
            R.moe_forward(xt, None, lw, bad)
    with pytest.raises(TypeError, match="config: expected a MoEConfig"):
        R.moe_forward(xt, None, lw, {"hidden_size": 256})
    q, sa = R.act_quant(xt)
    with pytest.raises(ValueError, match="routed_forward: q"):
        R.routed_forward(q, sa, torch.ones(2, 6), torch.zeros(2, 5, dtype=torch.long), lw.routed, 10.0)


def test_testing_helpers_name_bad_arguments(tmp_path):
    """The synthetic-weight helpers refuse what they used to take silently or fail on deep inside torch:
    a K that is not whole MXFP4 groups (a column was dropped), NaN scale bytes, a non-config, a seed
    out of range, a truthy string for hash_layer, a layer the config lacks, a device torch cannot make;
    write_checkpoint names a layers argument that is not a list."""
    from dsv4_moe import MoEConfig
    from dsv4_moe.testing import random_layer_weights, random_mxfp4_weight
    from dsv4_moe.weights import write_checkpoint

    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="K=33 must be a positive multiple of 32"):
        random_mxfp4_weight((4, 33), generator=g)
    with pytest.raises(ValueError, match=r"scale_range=\(255, 255\)"):
        random_mxfp4_weight((4, 64), generator=g, scale_range=(255, 255))
    cfg = MoEConfig.tiny()
    for kw, err, match in (({"config": None}, TypeError, "config: expected a MoEConfig"),
                           ({"seed": 2 ** 62}, ValueError, "seed=4611686018427387904"),
                           ({"seed": 1.5}, ValueError, "seed=1.5"),
                           ({"hash_layer": "no"}, TypeError, "hash_layer='no'"),
                           ({"layer_idx": 5}, ValueError, "5"),
                           ({"device": "bogus"}, ValueError, "device='bogus'"),
                           ({"device": "meta"}, ValueError, "device='meta'")):
        args = {"config": cfg, **kw}
        with pytest.raises(err, match=match):
            random_layer_weights(args.pop("config"), **args)
    with pytest.raises(TypeError, match="layers=1: expected an iterable"):
        write_checkpoint(tmp_path / "x", cfg, layers=1)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["hash_layer", "topk_layer"])
def test_quantised_layer_tracks_the_unquantised_layer(layer_idx):
    """The whole quantised reference (FP8 activations, MXFP4 / FP8 weights, bf16 rounding points)
    against the same layer with quantisation switched off (its dequantised weights, fp32
    activations), which tests/test_reference_oracle.py ties to transformers. Only the activation
    quantisation separates them (rel L2 ~0.05); each negative control - a routed_scaling_factor off
    by 1.25x, the shared expert dropped, one expert's down scales doubled, the clamps removed -
    is outside the bound on the same inputs, so a wiring error of that size in moe_forward (which
    every kernel is tested against) cannot hide here."""
    import dataclasses

    from dsv4_moe.config import MoEConfig
    from dsv4_moe.testing import TOLERANCES, random_layer_weights
    from dsv4_moe.weights.tensors import RoutedExpertWeights, SharedExpertWeights

    cfg = MoEConfig(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=6,
                    routed_scaling_factor=2.5, num_hidden_layers=2, num_hash_layers=1, vocab_size=64)
    bound = TOLERANCES["quantised_vs_unquantised"].max_rel_l2
    w = random_layer_weights(cfg, layer_idx=layer_idx, seed=1)
    g = torch.Generator().manual_seed(layer_idx)
    x = (torch.randn(40, cfg.hidden_size, generator=g) * 4.0).to(torch.bfloat16)  # clamps active
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    want = R.moe_forward_unquantised(x, ids, w, cfg, torch.float32)

    def rel(got):
        return ((got.float() - want).norm() / want.norm()).item()

    assert rel(R.moe_forward(x, ids, w, cfg)) <= bound
    s, r = w.shared, w.routed
    _, routed_ids = R.route(x, w.router.weight, w.router.bias, w.router.tid2eid, ids, 6, 2.5)
    e = int(routed_ids.flatten().mode().values)  # the most used expert
    down_scale = r.down_scale.view(torch.uint8).clone()
    down_scale[e] += 1
    wrong = {
        "routed_scaling_factor x1.25": (w, dataclasses.replace(cfg, routed_scaling_factor=2.5 * 1.25)),
        "no shared expert": (dataclasses.replace(w, shared=SharedExpertWeights(
            s.gate_up, s.gate_up_scale, torch.zeros_like(s.down), s.down_scale)), cfg),
        f"expert {e}'s down scales x2": (dataclasses.replace(w, routed=RoutedExpertWeights(
            r.gate_up, r.gate_up_scale, r.down, down_scale.view(torch.float8_e8m0fnu),
            first_expert=r.first_expert, num_experts=r.num_experts)), cfg),
        "no clamps": (w, dataclasses.replace(cfg, swiglu_limit=1e30)),
    }
    for what, (wi, ci) in wrong.items():
        assert rel(R.moe_forward(x, ids, wi, ci)) > 1.5 * bound, what
