"""mxfp4_grouped_gemm and routed_experts_forward under TRITON_INTERPRET=1 vs the reference.

The kernel folds the per-32 weight scale into bf16 weights and sums each 128-wide
activation block in one MMA (fp32 operands under the interpreter, whose bf16 dot is
broken), then rounds to bf16 with RNE on the bits (the interpreter's cast truncates);
the bound below (<= 0.1 % of elements, each <= 1 bf16 ulp) leaves room only for an
in-block summation-order flip. Negative controls show the
same bound catches swapped nibbles and a scale off by one 32-group.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_moe import reference as ref  # noqa: E402
from dsv4_moe.testing import assert_bf16_close  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig, mxfp4_grouped_gemm, select_config  # noqa: E402
from dsv4_moe.kernels.routed_experts import routed_experts_forward  # noqa: E402
from dsv4_moe.weights.tensors import RoutedExpertWeights  # noqa: E402

MAX_FRAC, MAX_ULP = 1e-3, 1


def _weights(e, n, k, g):
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(118, 125, (e, n, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return w, s


def _ids(t, k, e, g):
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).sort(1).values


def _ulp_diff(a, b):
    ai = a.view(torch.int16).int()
    bi = b.view(torch.int16).int()
    return (ai - bi).abs()


def _assert_close(out, exp, what):
    d = _ulp_diff(out, exp)
    frac = (d != 0).float().mean().item()
    assert frac <= MAX_FRAC and d.max().item() <= MAX_ULP, (
        f"{what}: {frac:.4%} of elements differ, max {d.max().item()} bf16 ulp; first at "
        f"{torch.nonzero(d)[0].tolist() if frac else None}")


def _per_route_reference(q, sa, w, s, ids, gather):
    """Row r of the expected output: fp4_gemm of route r's input row with its expert."""
    t, k = ids.shape
    rows = []
    for r in range(t * k):
        e = ids.flatten()[r].item()
        i = r // k if gather else r
        rows.append(ref.fp4_gemm(q[i:i + 1], sa[i:i + 1], w[e], s[e]))
    return torch.cat(rows)


@pytest.mark.parametrize("t,k,bm", [(1, 3, 16), (5, 4, 16), (33, 6, 32)])
def test_gate_up_gather_vs_reference(t, k, bm):
    g = torch.Generator().manual_seed(t)
    e, h, n = 8, 256, 256
    w, s = _weights(e, n, h, g)
    q, sa = ref.act_quant(torch.randn(t, h, generator=g).bfloat16())
    ids = _ids(t, k, e, g)
    a = moe_align(ids.int(), e, 0, bm)
    out = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=GemmConfig(bm, 128))
    exp = _per_route_reference(q, sa, w, s, ids, gather=True)
    _assert_close(out[a.route_rows.long()], exp, "gate_up")
    # negative controls: the same bound must reject swapped nibbles and shifted scales
    w_sw = ((w & 0xF) << 4) | (w >> 4)
    _assert_far(out[a.route_rows.long()], _per_route_reference(q, sa, w_sw, s, ids, True), "swapped nibbles")
    s_sh = torch.roll(s.view(torch.uint8), 1, dims=2).view(torch.float8_e8m0fnu)
    _assert_far(out[a.route_rows.long()], _per_route_reference(q, sa, w, s_sh, ids, True), "shifted scales")


def _assert_far(out, wrong, what):
    d = _ulp_diff(out, wrong)
    assert (d != 0).float().mean().item() > 0.5, f"{what} not detected by the bound"


def test_down_i384_scatter_vs_reference():
    # K = I = 384: 12 weight-scale groups over 3 activation blocks, not a power of two
    g = torch.Generator().manual_seed(7)
    e, t, k, kk, n = 8, 6, 4, 384, 128
    w, s = _weights(e, n, kk, g)
    ids = _ids(t, k, e, g)
    ids[:, 0] = 9  # slot 0 goes to another rank's expert: never written
    a = moe_align(ids.int(), e, 0, 16)
    q, sa = ref.act_quant(torch.randn(a.max_rows, kk, generator=g).bfloat16())
    sentinel = torch.full((t * k, n), 7.0, dtype=torch.bfloat16)
    out = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=False, scatter_out=True, out=sentinel.clone(),
                             config=GemmConfig(16, 128))
    local = ids.flatten() < e
    rows = a.route_rows.long()[local]
    exp = torch.cat([ref.fp4_gemm(q[i:i + 1], sa[i:i + 1], w[ei], s[ei])
                     for i, ei in zip(rows.tolist(), ids.flatten()[local].tolist())])
    _assert_close(out[local], exp, "down K=384")
    assert torch.equal(out[~local], sentinel[~local]), "non-local slots must not be written"


@pytest.mark.parametrize("t", [1, 5])
def test_routed_forward_vs_reference(t):
    g = torch.Generator().manual_seed(11 + t)
    e, h, i, k = 8, 256, 128, 3
    gu, gus = _weights(e, 2 * i, h, g)
    dn, dns = _weights(e, h, i, g)
    routed = RoutedExpertWeights(gu, gus, dn, dns, first_expert=2, num_experts=12)  # owns 2..9
    x = torch.randn(t, h, generator=g).bfloat16() * 4  # large enough that the clamp (L=10) is active
    q, sa = ref.act_quant(x)
    ids = _ids(t, k, 12, g)
    tw = torch.rand(t, k, generator=g)
    y = routed_experts_forward(q, sa, tw, ids, routed, 10.0)
    yr = ref.routed_forward(q, sa, tw, ids, routed, 10.0)
    local = ref.local_mask(ids, 2, e)
    # two GEMMs with an FP8 requantisation between them: an in-block order flip in gate_up
    # can move one FP8 code of h, so the composed result uses the "layer" recipe.
    assert_bf16_close(y[local], yr[local], "layer", "routed_forward", t=t)


def test_zero_tokens_no_launch_and_guards():
    g = torch.Generator().manual_seed(0)
    w, s = _weights(4, 64, 64, g)
    a = moe_align(torch.empty(0, 2, dtype=torch.int32), 4, 0, 16)
    q = torch.empty(0, 64, dtype=torch.float8_e4m3fn)
    out = mxfp4_grouped_gemm(q, torch.empty(0, 1), w, s, a, gather_a=True, scatter_out=True)
    assert out.shape == (0, 64)
    a = moe_align(torch.zeros(2, 2, dtype=torch.int32), 4, 0, 16)
    q, sa = ref.act_quant(torch.randn(2, 64).bfloat16())
    with pytest.raises(ValueError, match="q"):
        mxfp4_grouped_gemm(q.float(), sa, w, s, a, gather_a=True, scatter_out=True)
    with pytest.raises(ValueError, match="sa"):
        mxfp4_grouped_gemm(q, sa.double(), w, s, a, gather_a=True, scatter_out=True)
    with pytest.raises(ValueError, match="w4"):
        mxfp4_grouped_gemm(q, sa, w[:, :, :16], s, a, gather_a=True, scatter_out=True)
    with pytest.raises(ValueError, match="sw"):
        mxfp4_grouped_gemm(q, sa, w, s[:, :, :1], a, gather_a=True, scatter_out=True)
    with pytest.raises(ValueError, match="block_m"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=True, config=GemmConfig(32, 64))


def test_select_config_decode_vs_prefill():
    c = select_config(6, 256, 4096, 4096)                    # Flash T=1: one route per program
    assert (c.kind, c.block_m, c.asm) == ("gemv", 1, True)
    assert select_config(6, 256, 4096, 2048).block_n == 64   # down: shorter K, wider tile
    assert select_config(6, 384, 768, 7168).unroll == 4 and c.unroll == 1  # only very long K unrolls
    assert (select_config(16 * 6, 256, 4096, 4096).kind, select_config(16 * 6, 256, 4096, 4096).block_m) == ("tile", 16)
    assert select_config(1024 * 6, 256, 4096, 4096).kind == "swap"
    assert select_config(4096 * 6, 256, 4096, 4096).block_m == 64
    assert select_config(63 * 256, 256, 4096, 4096).block_m == 32  # crossover at 64 rows per expert
    from dsv4_moe.kernels.routed_experts import routed_configs

    def shape(*sz):  # zero-size storage: only the shapes matter to routed_configs
        return torch.zeros(1, 1, 1, dtype=torch.uint8).expand(*sz)
    flash = RoutedExpertWeights(shape(256, 4096, 2048), shape(256, 4096, 128), shape(256, 4096, 1024),
                                shape(256, 4096, 64), first_expert=0, num_experts=256)
    pro_tp8 = RoutedExpertWeights(shape(384, 768, 3584), shape(384, 768, 224), shape(384, 7168, 192),
                                  shape(384, 7168, 12), first_expert=0, num_experts=384)
    for layer in (flash, pro_tp8):
        for t in (1, 2, 3, 4, 5, 8, 16, 256, 1024, 4096):  # gate_up and down always share one alignment
            up, down = routed_configs(t * 6, layer)
            assert up.block_m == down.block_m and up.kind == down.kind, (t, up, down)
    assert routed_configs(4 * 6, flash)[0].kind == "tile"      # T=4: the MMA body passes the GEMV on Flash
    assert routed_configs(4 * 6, pro_tp8)[0].kind == "gemv"    # but not on the long-K Pro-TP8 gate_up


@pytest.mark.parametrize("flags", [dict(a_split=False, scale_bcast=False), dict(a_split=True, scale_bcast=False),
                                   dict(a_split=False, scale_bcast=True), dict(w_kn=True, scale_bcast=False)],
                         ids=["plain", "a_split", "scale_bcast", "w_kn"])
def test_layout_flags_match_default(flags):
    """Every load layout of the kernel computes the same bits as the default one."""
    g = torch.Generator().manual_seed(4)
    w, s = _weights(4, 128, 256, g)
    q, sa = ref.act_quant(torch.randn(5, 256, generator=g).bfloat16())
    ids = _ids(5, 3, 4, g)
    a = moe_align(ids.int(), 4, 0, 16)
    base = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=GemmConfig(16, 64))
    other = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=GemmConfig(16, 64, **flags))
    rows = a.route_rows.long()
    assert torch.equal(base[rows].view(torch.int16), other[rows].view(torch.int16))


@pytest.mark.parametrize("kind,bm,split,unroll", [("swap", 16, 1, 1), ("swap", 16, 3, 1), ("gemv", 1, 1, 1),
                                                 ("gemv", 1, 2, 1), ("gemv", 1, 1, 2), ("gemv", 1, 2, 2)],
                         ids=["swap", "swap-splitk", "gemv", "gemv-splitk", "gemv-unroll2", "gemv-splitk-unroll2"])
def test_other_bodies_vs_reference(kind, bm, split, unroll):
    """The swapped-operand and GEMV bodies (and their exact split-K) against the reference,
    gate_up (gathered rows) and down (K=384, scatter, a non-local route never written)."""
    g = torch.Generator().manual_seed(21)
    e, t, k, h, n = 8, 5, 3, 384, 128
    w, s = _weights(e, n, h, g)
    q, sa = ref.act_quant(torch.randn(t, h, generator=g).bfloat16() * 3)
    ids = _ids(t, k, e + 2, g)          # experts 8, 9 belong to another rank
    ids[0, 0] = 9
    ids = ids.sort(1).values
    a = moe_align(ids.int(), e, 0, bm)
    cfg = GemmConfig(bm, 64, 4, 2, kind=kind, split_k=split, unroll=unroll)
    out = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
    local = ids.flatten() < e
    rows = a.route_rows.long()[local]
    exp = torch.cat([ref.fp4_gemm(q[r // k:r // k + 1], sa[r // k:r // k + 1], w[ei], s[ei])
                     for r, ei in zip(torch.nonzero(local).flatten().tolist(), ids.flatten()[local].tolist())])
    _assert_close(out[rows], exp, f"{kind} gate_up")
    _assert_far(out[rows], torch.cat([ref.fp4_gemm(q[r // k:r // k + 1], sa[r // k:r // k + 1], w[ei],
                                                   torch.roll(s[ei].view(torch.uint8), 1, 1).view(s.dtype))
                                      for r, ei in zip(torch.nonzero(local).flatten().tolist(),
                                                       ids.flatten()[local].tolist())]), "shifted scales")
    # down: rows in permuted order, scattered to route slots
    hq, hs = ref.act_quant(torch.randn(a.max_rows, h, generator=g).bfloat16())
    sentinel = torch.full((t * k, n), 7.0, dtype=torch.bfloat16)
    y = mxfp4_grouped_gemm(hq, hs, w, s, a, gather_a=False, scatter_out=True, out=sentinel.clone(), config=cfg)
    exp = torch.cat([ref.fp4_gemm(hq[i:i + 1], hs[i:i + 1], w[ei], s[ei])
                     for i, ei in zip(rows.tolist(), ids.flatten()[local].tolist())])
    _assert_close(y[local], exp, f"{kind} down")
    assert torch.equal(y[~local], sentinel[~local]), "non-local slots must not be written"
    if split > 1:  # the ordered reduction is bitwise the single pass
        one = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False,
                                 config=GemmConfig(bm, 64, 4, 2, kind=kind, split_k=1, unroll=unroll))
        assert torch.equal(out[rows].view(torch.int16), one[rows].view(torch.int16))
