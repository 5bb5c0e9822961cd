"""The "mma64" byte order of packed MXFP4 weights (weights/mma_layout.py): a permutation
inside each 64-row x 128-k tile, checked against the formula its docstring states, its
inverse, its guards, and every consumer that reads values (reference, loader, layer)."""
import pytest
import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig
from dsv4_moe import reference as ref
from dsv4_moe.layers import choose_routed_layout
from dsv4_moe.testing import random_layer_weights
from dsv4_moe.weights.mma_layout import convert_layout, from_mma64, mma64_supported, to_mma64
from dsv4_moe.weights.prepare import place_expert
from dsv4_moe.weights.tensors import RoutedExpertWeights


def _stored_offset(n: int, j: int, kh: int) -> int:
    """Byte offset of (row n, byte j) in one expert, from the docstring's digits."""
    t, nn = divmod(n, 64)
    b, jj = divmod(j, 64)
    nb = [(nn >> i) & 1 for i in range(6)]   # n0..n5
    kb = [(jj >> i) & 1 for i in range(6)]   # k0..k5
    r = (kb[5] << 3) | (nb[5] << 2) | (nb[4] << 1) | nb[2]
    c = ((nb[1] << 7) | (nb[0] << 6) | (kb[2] << 5) | (kb[1] << 4) | (kb[4] << 3) | (kb[3] << 2)
         | (nb[3] << 1) | kb[0])
    return t * 64 * kh + b * 4096 + r * 256 + c


def test_to_mma64_matches_the_documented_formula():
    n, kh = 128, 192                      # 2 row tiles x 3 K blocks
    w = torch.arange(n * kh, dtype=torch.int64)
    codes = (w * 2654435761 % 251).to(torch.uint8).reshape(1, n, kh)   # distinct-ish bytes
    z = to_mma64(codes).reshape(-1)
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        i = int(torch.randint(0, n, (1,), generator=g))
        j = int(torch.randint(0, kh, (1,), generator=g))
        assert z[_stored_offset(i, j, kh)] == codes[0, i, j], (i, j)
    # a permutation: every byte kept, none duplicated
    assert torch.equal(torch.sort(z).values, torch.sort(codes.reshape(-1)).values)


@pytest.mark.parametrize("shape", [(64, 64), (3, 192, 128), (2, 2, 64, 192)], ids=["2d", "3d", "4d"])
def test_round_trip_and_shape(shape):
    w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    z = to_mma64(w)
    assert z.shape == w.shape and z.dtype == torch.uint8 and not torch.equal(z, w)
    assert torch.equal(from_mma64(z), w)
    assert convert_layout(w, "nk", "nk") is w
    assert torch.equal(convert_layout(z, "mma64", "nk"), w)


def test_guards_name_the_value():
    assert mma64_supported(7168, 384)[0] and mma64_supported(768, 7168)[0]   # Pro-TP8: I = 384 fits
    assert not mma64_supported(96, 4096)[0] and not mma64_supported(4096, 2880)[0]   # K = 2880: 22.5 blocks
    with pytest.raises(ValueError, match="N=96"):
        to_mma64(torch.zeros(96, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K=96"):
        to_mma64(torch.zeros(64, 48, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        to_mma64(torch.zeros(64, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="target='tiled'"):
        convert_layout(torch.zeros(64, 64, dtype=torch.uint8), "nk", "tiled")


def _routed(e=4, h=256, i=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g)
    gus = torch.randint(118, 125, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    dn = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g)
    dns = torch.randint(118, 125, (e, h, i // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return RoutedExpertWeights(gu, gus, dn, dns, first_expert=0, num_experts=e)


def test_routed_weights_layout_field():
    r = _routed()
    z = r.with_layout("mma64")
    assert z.layout == "mma64" and r.layout == "nk" and z.gate_up_scale is r.gate_up_scale
    assert torch.equal(z.with_layout("nk").gate_up, r.gate_up) and torch.equal(z.with_layout("nk").down, r.down)
    assert z.with_layout("mma64") is z
    with pytest.raises(ValueError, match="layout='row'"):
        RoutedExpertWeights(r.gate_up, r.gate_up_scale, r.down, r.down_scale, layout="row")
    with pytest.raises(ValueError, match="'mma64'"):   # checkpoint bytes only go into 'nk' weights
        place_expert(z, 0, {})


def test_reference_reads_either_layout_the_same():
    r = _routed()
    t, k = 5, 3
    g = torch.Generator().manual_seed(3)
    q, sa = ref.act_quant(torch.randn(t, 256, generator=g).bfloat16())
    ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(t)]).sort(1).values
    tw = torch.rand(t, k, generator=g)
    a = ref.routed_forward(q, sa, tw, ids, r, 10.0)
    b = ref.routed_forward(q, sa, tw, ids, r.with_layout("mma64"), 10.0)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_layer_layout_choice_and_explain():
    cfg = MoEConfig.flash().replace(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8, name="tiny")
    w = random_layer_weights(cfg, layer_idx=5, seed=0)
    auto = DeepseekV4MoE(cfg, w)                          # CPU: keeps the checkpoint order
    assert auto.routed_layout == "nk" and "kept" in auto.explain(4)
    forced = DeepseekV4MoE(cfg, w, routed_layout="mma64")
    assert forced.routed.layout == "mma64" and w.routed.layout == "nk"   # the caller's weights untouched
    assert not torch.equal(forced.routed.gate_up, w.routed.gate_up)
    assert "routed weights in layout 'mma64'" in forced.explain(4)
    x = torch.randn(6, 256).bfloat16()
    assert torch.equal(auto(x).view(torch.int16), forced(x).view(torch.int16))
    with pytest.raises(ValueError, match="routed_layout='fast'"):
        DeepseekV4MoE(cfg, w, routed_layout="fast")
    odd = cfg.replace(moe_intermediate_size=96, name="odd")   # I = 96: down K not whole 128-blocks
    wo = random_layer_weights(odd, layer_idx=5, seed=0)
    # on CUDA "auto" would keep "nk" for this shape and say why (device type checked first on CPU)
    assert choose_routed_layout(wo.routed)[0] == "nk"
    with pytest.raises(ValueError, match="K=96"):
        DeepseekV4MoE(odd, wo, routed_layout="mma64")


def test_set_routed_layout_in_place():
    cfg = MoEConfig.flash().replace(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8, name="tiny")
    w = random_layer_weights(cfg, layer_idx=5, seed=1)
    layer = DeepseekV4MoE(cfg, w)
    x = torch.randn(4, 256).bfloat16()
    before = layer(x)
    assert layer.set_routed_layout("mma64") is layer
    assert layer.routed.layout == "mma64" and layer.routed_gate_up.data_ptr() != w.routed.gate_up.data_ptr()
    assert torch.equal(layer.routed.with_layout("nk").down, w.routed.down)
    assert torch.equal(layer(x).view(torch.int16), before.view(torch.int16))
    layer.set_routed_layout("auto")              # on the CPU "auto" keeps what it has
    assert layer.routed_layout == "mma64"
    layer.set_routed_layout("nk")
    assert torch.equal(layer.routed.gate_up, w.routed.gate_up)
    with pytest.raises(ValueError, match="routed_layout='x'"):
        layer.set_routed_layout("x")


def test_auto_takes_mma64e_on_cuda():
    """On CUDA "auto" takes "mma64e" (session 20: bitwise "mma64" on the H200 and faster) and
    says why; a width without whole tiles keeps "nk" naming the GEMM; "mma64" (the A/B twin)
    and "mma64e" can be forced anywhere; the CPU keeps what it has."""
    import types

    from dsv4_moe.layers import choose_routed_layout

    def fake(device, i):
        return types.SimpleNamespace(gate_up=types.SimpleNamespace(device=torch.device(device)), hidden=4096,
                                     intermediate=i, layout="nk")

    layout, why = choose_routed_layout(fake("cuda", 2048))
    assert layout == "mma64e" and "auto on CUDA" in why and "'mma64': same bits" in why, why
    layout, why = choose_routed_layout(fake("cuda", 96))
    assert layout == "nk" and why.startswith("kept: down"), why
    assert choose_routed_layout(fake("cuda", 2048), "mma64") == ("mma64", "requested")
    assert choose_routed_layout(fake("cpu", 2048), "mma64e") == ("mma64e", "requested")
    assert choose_routed_layout(fake("cpu", 2048))[0] == "nk"


def test_enc_search_agrees_with_the_mma64e_layout():
    """scripts/enc_search.py: no re-encoding converts a word in 3 shifts + 4 LOP3, and the
    rotation set the "mma64e" layout uses (outputs W, rotr 12, rotr 2 ^ rotr 6, rotr 2 ^ rotr 8)
    is among the 4-shift solutions it finds."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import enc_search

    from dsv4_moe.weights import mma_layout as ml

    assert enc_search.search(3, 1) == []
    sols = enc_search.search(4, 5)
    rots = (("rot", 2), ("rot", 6), ("rot", 8), ("rot", 12))
    assert any(extra == rots for extra, _ in sols), sols
    # the layout's outputs as (source shifts) sets; sources 0..4 = W, rotr 2, 6, 8, 12
    shift_of = {0: 0, 1: 2, 2: 6, 3: 8, 4: 12}
    found = []
    for extra, outs in sols:
        if extra == rots:
            found.append(sorted(tuple(sorted({shift_of[i]} if f == "x" else {shift_of[j]} if f == "y"
                                             else {shift_of[i], shift_of[j]})) for f, i, j in outs))
    assert sorted(tuple(sorted(s)) for s in ml._ENC_OUTPUTS) in found, (ml._ENC_OUTPUTS, found)
