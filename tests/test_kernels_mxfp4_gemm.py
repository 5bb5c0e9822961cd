"""mxfp4_grouped_gemm and routed_experts_forward vs the reference: under TRITON_INTERPRET=1 on
the CPU, natively on a GPU host (DEV: inputs are made on the CPU, every kernel-launching call
runs on DEV through `_native`, results come back to the CPU for the checks).

The kernel folds the per-32 weight scale into bf16 weights and sums each 128-wide
activation block in one MMA (fp32 operands under the interpreter, whose bf16 dot is
broken), then rounds to bf16 with RNE on the bits (the interpreter's cast truncates);
the bound below (<= 0.1 % of elements, each <= 1 bf16 ulp) leaves room only for an
in-block summation-order flip. Negative controls show the
same bound catches swapped nibbles and a scale off by one 32-group.

On CUDA the folded swap body (fold_sa) exists only on "mma64"/"mma64e" weights with the PTX
dequantisation (the body whose SASS is hazard-checked; other folded swap launches are refused),
so `_native` runs a folded swap launch given "nk" weights on `to_mma64(w)` with asm=True: the
"mma64" bodies compute the "nk" bodies' bits (test_mma64_bodies_bitwise_nk, native too).
"""
import _triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 where there is no GPU; must precede triton)

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_moe import reference as ref  # noqa: E402
from dsv4_moe.testing import TOLERANCES, assert_bf16_close  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig, mxfp4_grouped_gemm, select_config  # noqa: E402
from dsv4_moe.kernels.routed_experts import routed_experts_forward  # noqa: E402
from dsv4_moe.weights.tensors import RoutedExpertWeights  # noqa: E402
from dsv4_moe.kernels.act_quant import act_quant as _act_quant  # noqa: E402
from dsv4_moe.kernels.finalize import finalize_shared_add as _fsa, finalize_split_shared_add as _fssa  # noqa: E402
from dsv4_moe.kernels.swiglu_quant import swiglu_quant as _sq, swiglu_quant_unfused as _squ  # noqa: E402

# the kernels' device: the GPU when Triton runs natively, else the CPU (interpreter)
DEV = torch.device("cpu" if _triton_interp.INTERPRETING else "cuda")


def _to(obj, dev):
    """obj with every tensor (in tuples, lists, dicts and dataclass fields) on dev."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, dev) for o in obj)
    if isinstance(obj, dict):
        return {key: _to(v, dev) for key, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        moved = {f.name: _to(getattr(obj, f.name), dev) for f in dataclasses.fields(obj)
                 if isinstance(getattr(obj, f.name), torch.Tensor)}
        return dataclasses.replace(obj, **moved) if moved else obj
    return obj


def _folded_swap_on_cuda(cfg):
    return DEV.type == "cuda" and cfg is not None and cfg.kind == "swap" and cfg.fold_sa


def _cuda_fold_args(args, kwargs):
    """mxfp4_grouped_gemm's arguments with a folded swap launch moved to the one body CUDA runs
    (see the module docstring): asm=True, and "nk" weights as to_mma64(w4), layout "mma64"."""
    from dsv4_moe.weights.mma_layout import to_mma64

    cfg = kwargs.get("config")
    if not _folded_swap_on_cuda(cfg):
        return args, kwargs
    kwargs = dict(kwargs, config=dataclasses.replace(cfg, asm=True))
    if kwargs.get("layout", "nk") == "nk":
        args = (*args[:2], to_mma64(args[2]), *args[3:])
        kwargs["layout"] = "mma64"
    return args, kwargs


def _cuda_fold_forward(args, kwargs):
    """routed_experts_forward's arguments, likewise: "nk" experts as "mma64" when a given config
    is a folded swap one, every swap config then with asm=True."""
    configs = kwargs.get("configs")
    if configs is None or not any(_folded_swap_on_cuda(c) for c in configs) or args[4].layout != "nk":
        return args, kwargs
    args = list(args)
    args[4] = args[4].with_layout("mma64")
    configs = tuple(dataclasses.replace(c, asm=True) if c.kind == "swap" else c for c in configs)
    return tuple(args), dict(kwargs, configs=configs)


def _native(fn, adapt=None):
    """fn run on DEV: tensor arguments moved there, tensor results moved back to the CPU."""
    if DEV.type == "cpu":
        return fn

    def run(*args, **kwargs):
        if adapt is not None:
            args, kwargs = adapt(args, kwargs)
        return _to(fn(*_to(args, DEV), **_to(kwargs, DEV)), torch.device("cpu"))
    run.__name__ = run.__qualname__ = fn.__name__
    return run


moe_align = _native(moe_align)
_mxfp4_grouped_gemm = mxfp4_grouped_gemm          # unwrapped: for the CUDA guard's own test
mxfp4_grouped_gemm = _native(mxfp4_grouped_gemm, _cuda_fold_args)
routed_experts_forward = _native(routed_experts_forward, _cuda_fold_forward)
act_quant = _native(_act_quant)
swiglu_quant = _native(_sq)
swiglu_quant_unfused = _native(_squ)
finalize_shared_add = _native(_fsa)
finalize_split_shared_add = _native(_fssa)

# the recipe's share and ulps (the largest share measured on the H200 is 0.073 %: TOLERANCES' note)
MAX_FRAC, MAX_ULP = TOLERANCES["fp4_gemm"].max_mismatch_frac, TOLERANCES["fp4_gemm"].max_ulp


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


@pytest.mark.parametrize("swiglu", ["fused", "unfused"])
def test_swiglu_on_route_list_bitwise(monkeypatch, swiglu):
    """The SwiGLU-quant between the GEMMs on the route list (from SWIGLU_ROUTE_LIST_MIN_ROUTES
    routes) and on all max_rows rows filtered by row_expert (below it) give the same y, bit
    for bit, with an EP rank that owns some of the experts routed to."""
    import dsv4_moe.kernels.routed_experts as re_mod

    g = torch.Generator().manual_seed(5)
    e, h, i, k, t = 8, 256, 128, 3, 6
    gu, gus = _weights(e, 2 * i, h, g)
    dn, dns = _weights(e, h, i, g)
    routed = RoutedExpertWeights(gu, gus, dn, dns, first_expert=2, num_experts=12)
    q, sa = ref.act_quant(torch.randn(t, h, generator=g).bfloat16() * 4)
    ids = _ids(t, k, 12, g)
    tw = torch.rand(t, k, generator=g)
    ys = {}
    for v in (0, 1):
        monkeypatch.setattr(re_mod, "SWIGLU_ROUTE_LIST_MIN_ROUTES", 1 if v else 1 << 30)
        ys[v] = routed_experts_forward(q, sa, tw, ids, routed, 10.0, swiglu)
    local = ref.local_mask(ids, 2, e)
    assert 0 < int(local.sum()) < t * k
    assert torch.equal(ys[0][local].view(torch.int16), ys[1][local].view(torch.int16))


def _rank_case(seed, h, i, e=6, k=3, t=2):
    """A small routed layer owning experts 1..e of e + 2, an input x, sorted ids with one route
    to another rank's expert (token 1, slot 0), and route weights."""
    g = torch.Generator().manual_seed(seed)
    gu, gus = _weights(e, 2 * i, h, g)
    dn, dns = _weights(e, h, i, g)
    routed = RoutedExpertWeights(gu, gus, dn, dns, first_expert=1, num_experts=e + 2)
    x = torch.randn(t, h, generator=g).bfloat16() * 4
    ids = _ids(t, k, e + 2, g)
    ids[1, 0] = 0                                                        # not on this rank
    return routed, x, ids.sort(1).values, torch.rand(t, k, generator=g), g


@pytest.mark.parametrize("fold", [False, True], ids=["per-block-partials", "folded-per-split"])
def test_split_gate_up_partials_summed_in_swiglu_bitwise(monkeypatch, fold):
    """routed_experts.SWIGLU_SUMS_SPLIT: a split-K gate_up returns its fp32 partials
    (reduce=False) and swiglu_quant_partials sums them; y is bit for bit the reduce launch +
    swiglu_quant path and the unfused twin's, with a route to another rank's expert. Both
    partial forms: one per 128-block (4 here) and, with fold_sa, one per split (2)."""
    import dsv4_moe.kernels.routed_experts as re_mod
    from dsv4_moe.kernels.mxfp4_grouped_gemm import split_parts

    e, h, i, k, t = 6, 512, 128, 3, 2
    routed, x, ids, tw, _ = _rank_case(17, h, i, e, k, t)
    up = GemmConfig(16, 64, 4, 2, kind="swap", split_k=2, a_bf16=fold, fold_sa=fold)
    down = GemmConfig(16, 64, 4, 2, kind="swap")
    assert split_parts(up, h) == (2 if fold else 4) and split_parts(down, i) == 1
    q, sa, *pairs = act_quant(x, pairs="scaled" if fold else False)
    ys = {}
    for name, on, swiglu in (("partials", True, "fused"), ("reduce", False, "fused"), ("unfused", True, "unfused")):
        monkeypatch.setattr(re_mod, "SWIGLU_SUMS_SPLIT", on)
        ys[name] = routed_experts_forward(q, sa, tw, ids, routed, 10.0, swiglu, configs=(up, down),
                                          q_pairs=pairs[0] if fold else None)
    local = ref.local_mask(ids, 1, e)
    assert 0 < int(local.sum()) < t * k
    for name in ("reduce", "unfused"):
        assert torch.equal(ys["partials"][local].view(torch.int16), ys[name][local].view(torch.int16)), name


@pytest.mark.parametrize("fold", [False, True], ids=["per-block-partials", "folded-per-split"])
def test_split_down_partials_summed_in_finalize_bitwise(fold):
    """routed_experts_forward(down_reduce=False) (FINALIZE_SUMS_SPLIT): a split-K down hands its
    fp32 partials [P, T, k, H] to finalize_split_shared_add, which gives bit for bit the reduce
    launch + finalize_shared_add result, with a route to another rank's expert; the partials'
    in-order sum rounds to exactly the y the reduce launch writes. An unsplit down refuses."""
    from dsv4_moe.kernels.mxfp4_grouped_gemm import split_parts

    e, h, i, k, t = 6, 256, 512, 3, 2
    routed, x, ids, tw, g = _rank_case(23, h, i, e, k, t)
    up = GemmConfig(16, 64, 4, 2, kind="swap")
    down = GemmConfig(16, 64, 4, 2, kind="swap", split_k=2, fold_sa=fold, a_bf16=fold)
    assert split_parts(down, i) == (2 if fold else 4)
    q, sa = act_quant(x)
    shared = torch.randn(t, h, generator=g).bfloat16()
    y = routed_experts_forward(q, sa, tw, ids, routed, 10.0, configs=(up, down))
    parts = routed_experts_forward(q, sa, tw, ids, routed, 10.0, configs=(up, down), down_reduce=False)
    assert parts.shape == (split_parts(down, i), t, k, h) and parts.dtype == torch.float32
    local = ref.local_mask(ids, 1, e)
    assert 0 < int(local.sum()) < t * k
    summed = torch.zeros(t, k, h)
    for p in parts:
        summed = summed + p
    assert torch.equal(summed.bfloat16()[local].view(torch.int16), y[local].view(torch.int16))
    got = finalize_split_shared_add(parts, ids, 1, e, shared)
    assert torch.equal(got.view(torch.int16), finalize_shared_add(y, ids, 1, e, shared).view(torch.int16))
    with pytest.raises(ValueError, match="down_reduce=False: the down config .* does not split K=512"):
        routed_experts_forward(q, sa, tw, ids, routed, 10.0, configs=(up, dataclasses.replace(down, split_k=1)),
                               down_reduce=False)


def test_reduce_false_guards():
    """reduce=False hands over partials only where the config splits K; with no local route
    the partials are an (unspecified) [P, R, N] buffer and nothing is launched."""
    g = torch.Generator().manual_seed(1)
    w, s = _weights(4, 64, 512, g)
    q, sa = ref.act_quant(torch.randn(2, 512, generator=g).bfloat16())
    a = moe_align(torch.tensor([[0, 1], [1, 3]], dtype=torch.int32), 4, 0, 16)
    with pytest.raises(ValueError, match="reduce=False: config=.* does not split K=512"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False,
                           config=GemmConfig(16, 64, 4, 2, kind="swap"), reduce=False)
    cfg = GemmConfig(16, 64, 4, 2, kind="swap", split_k=4)
    ws = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg, reduce=False)
    assert ws.dtype == torch.float32 and ws.shape == (4, 4, 64)
    out = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
    rows = a.route_rows.long()
    acc = torch.zeros(4, 64)
    for p in range(4):
        acc = acc + ws[p]
    assert torch.equal(out[rows].view(torch.int16), acc.bfloat16().view(torch.int16))
    far = moe_align(torch.tensor([[5, 6]], dtype=torch.int32), 4, 0, 16)  # every route elsewhere
    ws = mxfp4_grouped_gemm(q[:1], sa[:1], w, s, far, gather_a=True, scatter_out=False, config=cfg, reduce=False)
    assert ws.shape == (4, 2, 64)


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


@pytest.mark.parametrize("kind,bm,split,unroll", [("swap", 16, 1, 1), ("swap", 16, 3, 1), ("swap", 16, 1, 2),
                                                 ("gemv", 1, 1, 1), ("gemv", 1, 2, 1), ("gemv", 1, 1, 2),
                                                 ("gemv", 1, 2, 2)],
                         ids=["swap", "swap-splitk", "swap-unroll2", "gemv", "gemv-splitk", "gemv-unroll2",
                              "gemv-splitk-unroll2"])
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


# ---------------------------------------------------------------- "mma64" weight layout
def _run_ptx(src: str, regs: dict) -> dict:
    """A tiny interpreter for the straight-line b32 PTX of the dequantisation asm blocks
    (prmt, shl, shr, and, or, mul.rn.bf16x2). mul.rn.bf16x2 is IEEE per half (bf16 inputs,
    subnormals kept, RNE); every product here is exact, so float64 then bf16 is exact."""
    import re
    import struct

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 16) if tok.lower().startswith("0x") else int(tok)

    def bf16(h):
        return struct.unpack("<f", struct.pack("<I", (h & 0xFFFF) << 16))[0]

    def to_bf16(x):
        return int(torch.tensor([x], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF

    m32 = 0xFFFFFFFF
    for line in src.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        if op == "prmt.b32":
            a, b, sel = srcs
            by = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            assert all(((sel >> 4 * i) & 0x8) == 0 for i in range(4)), "sign-replicate mode not modelled"
            r = sum(by[(sel >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "shl.b32":
            r = (srcs[0] << srcs[1]) & m32
        elif op == "shr.b32":
            r = srcs[0] >> srcs[1]
        elif op == "shf.r.wrap.b32":  # funnel shift right of (b:a), shift mod 32 (a == b: rotate)
            a, b, sh = srcs
            r = (((b << 32) | a) >> (sh & 31)) & m32
        elif op == "xor.b32":
            r = srcs[0] ^ srcs[1]
        elif op == "and.b32":
            r = srcs[0] & srcs[1]
        elif op == "or.b32":
            r = srcs[0] | srcs[1]
        elif op == "mul.rn.bf16x2":
            a, b = srcs
            r = to_bf16(bf16(a) * bf16(b)) | (to_bf16(bf16(a >> 16) * bf16(b >> 16)) << 16)
        else:
            raise AssertionError(f"op {op} not modelled")
        assert re.fullmatch(r"\$\d+|\w+", d), d
        regs[d] = r & m32
    return regs


@pytest.mark.parametrize("which", ["_E2M1X4_TO_BF16_ASM", "_E2M1X4_TO_BF16_SWZ_ASM"])
def test_swz_dequant_ptx_emulated_bitwise(which):
    """Both dequantisation PTX blocks, run by the interpreter above for every byte value
    (both nibbles) and scale bytes 0, 1, 100, 127, 128 - four different scales per pack,
    handed over as bf16 2^(s-1) two per register as inline_asm_elementwise packs them -
    against e2m1 * 2^(s - 127) rounded to bf16 (exact): the same bits, -0.0 included."""
    from dsv4_moe.kernels import _mxfp4_dequant as body
    from dsv4_moe.weights.formats import e2m1_codes_to_float

    src = getattr(body, which).value
    scale_sets = [(0, 1, 100, 127), (128, 127, 1, 0), (100, 100, 128, 128)]
    for sc in scale_sets:
        b16 = [((s + 126) << 7) & 0xFFFF for s in sc]  # bf16 2^(s-1), two per register ($5, $6)
        for b0 in range(256):
            pack = [b0, (b0 * 37 + 11) & 255, (b0 * 91 + 3) & 255, 255 - b0]
            regs = {"$4": pack[0] | pack[1] << 8 | pack[2] << 16 | pack[3] << 24,
                    "$5": b16[0] | b16[1] << 16, "$6": b16[2] | b16[3] << 16}
            out = _run_ptx(src, regs)
            for i, byte in enumerate(pack):
                for nib, reg in ((byte & 0xF, 0), (byte >> 4, 2)):
                    want = (e2m1_codes_to_float(torch.tensor([nib], dtype=torch.uint8)).double()
                            * 2.0 ** (sc[i] - 127)).float().bfloat16().view(torch.int16).item() & 0xFFFF
                    word = out[f"${reg + i // 2}"]
                    got = (word >> (16 * (i % 2))) & 0xFFFF
                    assert got == want, (which, sc, hex(byte), nib, i, hex(got), hex(want))


def test_enc_dequant_ptx_emulated_bitwise():
    """The "mma64e" PTX (session 19, experimental): a stored word made by
    weights.mma_layout.encode_words from four bytes' nibbles converts, in the interpreter
    above, to exactly the bf16 values the "mma64" PTX gives for those bytes (every byte value,
    several scales), and its two halves are the whole block's halves."""
    from dsv4_moe.kernels import _mxfp4_dequant as body
    from dsv4_moe.weights import mma_layout as ml

    def pattern(c):
        return ((c & 7) << 6) | ((c >> 3) << 15)
    for sc in [(0, 1, 100, 127), (128, 127, 1, 0), (254, 126, 2, 128)]:
        b16 = [((v + 126) << 7) & 0xFFFF for v in sc]
        s5, s6 = b16[0] | b16[1] << 16, b16[2] | b16[3] << 16
        for b0 in range(256):
            pack = [b0, (b0 * 37 + 11) & 255, (b0 * 91 + 3) & 255, 255 - b0]
            # outputs 0 / 1: low nibbles of bytes (0, 1) / (2, 3); 2 / 3: their high nibbles
            nib = [[b & 15 for b in pack], [b >> 4 for b in pack]]
            outs = tuple(torch.tensor([pattern(nib[r // 2][2 * (r % 2)]) | pattern(nib[r // 2][2 * (r % 2) + 1]) << 16])
                         for r in range(4))
            word = int(ml.encode_words(outs).item())
            assert [int(o.item()) for o in ml.decode_words(torch.tensor([word]))] == [int(o.item()) for o in outs]
            plain = sum(v << (8 * i) for i, v in enumerate(pack))
            want = _run_ptx(body._E2M1X4_TO_BF16_SWZ_ASM.value, {"$4": plain, "$5": s5, "$6": s6})
            got = _run_ptx(body._E2M1X4_TO_BF16_ENC_ASM.value, {"$4": word, "$5": s5, "$6": s6})
            assert [got[f"${i}"] for i in range(4)] == [want[f"${i}"] for i in range(4)], (sc, pack)
            lo = _run_ptx(body._E2M1X4_LO_ENC_ASM.value, {"$2": word, "$3": s5, "$4": s6})
            hi = _run_ptx(body._E2M1X4_HI_ENC_ASM.value, {"$2": word, "$3": s5, "$4": s6})
            assert (lo["$0"], lo["$1"], hi["$0"], hi["$1"]) == tuple(got[f"${i}"] for i in range(4))


def test_mma64e_layout_roundtrip_and_guards():
    """"mma64e": an invertible re-encoding of every stored "mma64" word (to/from and every
    convert_layout pair round-trip; zero bytes stay zero, so masked tail loads read zeros);
    the same shape checks as "mma64"."""
    from dsv4_moe.weights import mma_layout as ml

    g = torch.Generator().manual_seed(11)
    w = torch.randint(0, 256, (2, 128, 384), dtype=torch.uint8, generator=g)
    e = ml.to_mma64e(w)
    assert e.shape == w.shape and e.dtype == torch.uint8 and not torch.equal(e, ml.to_mma64(w))
    assert torch.equal(ml.from_mma64e(e), w)
    for a in ml.LAYOUTS:
        for b in ml.LAYOUTS:
            assert torch.equal(ml.convert_layout(ml.convert_layout(w, "nk", a), a, b), ml.convert_layout(w, "nk", b))
    assert torch.equal(ml.to_mma64e(torch.zeros(64, 64, dtype=torch.uint8)), torch.zeros(64, 64, dtype=torch.uint8))
    # converted in chunks of whole 64-row tile rows (bounded transient memory): any chunk size
    # gives the one-piece bytes, both ways
    w3 = torch.randint(0, 256, (3, 320, 192), dtype=torch.uint8, generator=g)
    saved = ml._ENC_CHUNK_BYTES
    try:
        ml._ENC_CHUNK_BYTES = 1 << 30
        whole = ml.to_mma64e(w3)
        for chunk in (1, 64 * 192, 3 * 64 * 192):
            ml._ENC_CHUNK_BYTES = chunk
            assert torch.equal(ml.to_mma64e(w3), whole), chunk
            assert torch.equal(ml.from_mma64e(whole), w3), chunk
    finally:
        ml._ENC_CHUNK_BYTES = saved
    # the GEMM configs are the "mma64" ones at every size (Flash), or differ only in what
    # leaves the bits alone (Pro-TP8: a register cap, the folded swap body's ordering)
    from dsv4_moe.kernels.routed_experts import routed_configs
    from dsv4_moe.weights.tensors import RoutedExpertWeights
    u8, e8 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.float8_e8m0fnu)
    for e, h, i in ((256, 4096, 2048), (384, 7168, 384)):
        shapes = (u8.expand(e, 2 * i, h // 2), e8.expand(e, 2 * i, h // 32), u8.expand(e, h, i // 2),
                  e8.expand(e, h, i // 32))
        r64, r64e = (RoutedExpertWeights(*shapes, 0, e, lay) for lay in ("mma64", "mma64e"))
        changed = 0
        for t in (1, 4, 16, 64, 256, 1024, 2048, 8192):
            c64, c64e = routed_configs(t * 6, r64), routed_configs(t * 6, r64e)
            if i >= 2048:  # one MMA chain per block (session 33): the same adds in the same order
                assert [dataclasses.replace(c, one_chain=False) for c in c64e] == list(c64), t
            else:
                def bits(c):  # a cap, the ordering, the N split, one chain: none changes a sum's order
                    # (preload: the same MMAs, loads issued earlier; mma64e only, K = 384)
                    return dataclasses.replace(c, maxnreg=None, fold_order="wait", block_n=128, one_chain=False,
                                               preload=False)
                assert [bits(c) for c in c64e] == [bits(c) for c in c64], t
                changed += c64e != c64
        assert i >= 2048 or changed >= 4   # Pro-TP8 T = 1..256 (16-row blocks): "split" -> "wait", gate_up capped
    with pytest.raises(ValueError, match="cannot take the 'mma64' layout"):
        ml.to_mma64e(torch.zeros(96, 64, dtype=torch.uint8))


@pytest.mark.parametrize("kind,bm,bn,split,fold", [("swap", 16, 128, 1, False), ("swap", 16, 64, 2, False),
                                                  ("swap", 32, 128, 1, True), ("tile", 16, 128, 1, False)],
                         ids=["swap16x128", "swap16x64-splitk", "swap32x128-folded", "tile16x128"])
def test_mma64e_bodies_bitwise_mma64(kind, bm, bn, split, fold):
    """The bodies on "mma64e" weights (decoded in the kernel before the unswizzle on this
    path; by the PTX on the GPU) give the "mma64" bodies' bits, gate_up (gathered) and the
    short-K down (scattered, K = 384)."""
    from dsv4_moe.weights.mma_layout import to_mma64, to_mma64e

    w, s, q, sa, ids = _mma64_case(5)
    e, (t, k) = w.shape[0], ids.shape
    a = moe_align(ids.int(), e, 0, bm)
    cfg = GemmConfig(bm, bn, 4, 2, kind=kind, split_k=split, a_bf16=fold, fold_sa=fold)
    extra = {}
    if fold:
        x = torch.randn(t, w.shape[2] * 2, generator=torch.Generator().manual_seed(2)).bfloat16()
        q, sa, pairs = act_quant(x, pairs="scaled")
        extra = {"a_pairs": pairs, "a_pairs_scaled": True}
    outs = [mxfp4_grouped_gemm(q, sa, conv(w), s, a, gather_a=True, scatter_out=False, config=cfg, layout=lay,
                               **extra) for conv, lay in ((to_mma64, "mma64"), (to_mma64e, "mma64e"))]
    rows = a.route_rows.long()[ids.flatten() < e]
    assert torch.equal(outs[1][rows].view(torch.int16), outs[0][rows].view(torch.int16))
    if not fold:
        g = torch.Generator().manual_seed(9)
        wd, sd = _weights(e, 128, 384, g)
        hq, hs = ref.act_quant(torch.randn(a.max_rows, 384, generator=g).bfloat16())
        sentinel = torch.full((t * k, 128), 7.0, dtype=torch.bfloat16)   # non-local slots stay unwritten
        ys = [mxfp4_grouped_gemm(hq, hs, conv(wd), sd, a, gather_a=False, scatter_out=True, config=cfg, layout=lay,
                                 out=sentinel.clone()) for conv, lay in ((to_mma64, "mma64"), (to_mma64e, "mma64e"))]
        assert torch.equal(ys[1].view(torch.int16), ys[0].view(torch.int16))


@pytest.mark.parametrize("t", [16, 1])
def test_pro_down_block_n_same_bits(monkeypatch, t):
    """routed_experts.PRO_DOWN16_BLOCK_N (session 28: 16 x 64 tiles for the capped Pro-shaped
    16-row down, T = 4-511) and PRO_DOWN16_SMALL_BLOCK_N (the uncapped one at T = 1-3; 64 since
    session 29): those configs on "mma64e" weights give the 16 x 128 config's bits (only the N split
    changes), scattered, K = 384, non-local slots unwritten; the switches reach the configs and
    leave the Flash-shaped down alone."""
    from dsv4_moe.kernels import routed_experts as rx

    def configs(t, e=384, i=384, h=7168):
        rx._routed_configs.cache_clear()
        return rx._routed_configs(t * 6, e, i, h, "mma64e", True, True, True)

    assert configs(1)[1].block_n == 64 and configs(512)[1].block_n == 128
    monkeypatch.setattr(rx, "PRO_DOWN16_SMALL_BLOCK_N", 128)
    assert configs(1)[1].block_n == 128
    monkeypatch.setattr(rx, "PRO_DOWN16_SMALL_BLOCK_N", 64)
    down = configs(t)[1]
    assert (down.kind, down.block_m, down.block_n, down.fold_sa, down.a_bf16) == ("swap", 16, 64, True, t > 1)
    assert all(configs(u, 256, 2048, 4096)[1].block_n == 128 for u in (1, 2, 16))
    rx._routed_configs.cache_clear()
    _short_k_down_twins(down, [dict(block_n=64), dict(block_n=128)], seed=5, data_seed=9)


@pytest.mark.parametrize("t", [1, 8])
def test_pro_down_preload_same_bits(t):
    """GemmConfig.preload (routed_experts.PRO_DOWN_PRELOAD_MIN_ROWS): the short-K Pro-TP8 down with
    all three K blocks' weight and scale loads issued first gives the loop's bits, on fp8 activations
    (T = 1) and on scaled bf16 pairs (T = 8), capped or not (the threshold lowered to reach T = 1 / 8)."""
    from dsv4_moe.kernels import routed_experts as rx

    def down(min_rows, t=t, i=384, e=384, h=7168):
        rx._routed_configs.cache_clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rx, "PRO_DOWN_PRELOAD_MIN_ROWS", min_rows)
            return rx._routed_configs(t * 6, e, i, h, "mma64e", True, True, True)[1]

    base, on = down(math.inf), down(0.0)
    assert (base.kind, base.block_m, base.block_n, base.fold_sa, base.fold_order, base.split_k, base.preload) == \
        ("swap", 16, 64, True, "wait", 1, False)
    assert on == dataclasses.replace(base, preload=True)
    assert not down(0.0, i=2048, e=256, h=4096).preload and not down(0.0, i=768).preload  # K = 384 only
    rx._routed_configs.cache_clear()
    _short_k_down_twins(base, [dict(), dict(preload=True), dict(preload=True, maxnreg=None)], seed=6 + t,
                        data_seed=10 + t)


def test_pro_down_preload_rule():
    """The shipped rule: preload from 0.5 rows per local expert (Pro-TP8 T >= 32) on the 16 x 64
    down blocks only (T <= 256); never on the 16 x 128 / 32- / 64-row blocks of T >= 512, where it
    measured 5-10 % slower; rows counted per local expert (EP: 48 local experts preload at T = 4)."""
    from dsv4_moe.kernels import routed_experts as rx

    def down(t, e=384):
        return rx._routed_configs(t * 6, e, 384, 7168, "mma64e", True, True, True)[1]

    rx._routed_configs.cache_clear()
    assert rx.PRO_DOWN_PRELOAD_MIN_ROWS == 0.5
    got = {t: down(t).preload for t in (1, 4, 8, 16, 32, 64, 256, 512, 1024, 4096, 8192)}
    assert got == {1: False, 4: False, 8: False, 16: False, 32: True, 64: True, 256: True,
                   512: False, 1024: False, 4096: False, 8192: False}
    assert down(4, e=48).preload and not down(4, e=96).preload
    assert all(down(t).maxnreg == 64 for t in (32, 256))  # the cap kept


def test_preload_guards():
    """preload is refused off the folded "wait" unsplit swap body, and off K = 384 at launch."""
    with pytest.raises(ValueError, match="preload=True needs kind 'swap'"):
        GemmConfig(16, 64, kind="tile", preload=True)
    with pytest.raises(ValueError, match="preload=True needs kind 'swap'"):
        GemmConfig(16, 64, kind="swap", fold_sa=True, split_k=2, preload=True)
    cfg = GemmConfig(16, 64, kind="swap", asm=True, fold_sa=True, preload=True)
    from dsv4_moe.weights.mma_layout import to_mma64e
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[0, 1]])
    a = moe_align(ids.int(), 2, 0, 16)
    w, sw = _weights(2, 64, 256, g)
    q, s = ref.act_quant(torch.randn(a.max_rows, 256, generator=g).bfloat16())
    with pytest.raises(ValueError, match="config.preload=True: needs K = 384"):
        mxfp4_grouped_gemm(q, s, to_mma64e(w), sw, a, gather_a=False, scatter_out=True, layout="mma64e", config=cfg)


def _short_k_down_twins(down, changes, seed, data_seed, t=5):
    """The 16-row short-K (K = 384) down of `down` on "mma64e" weights, once per dict of config
    changes: bitwise the same outputs, scattered, the route to another rank's expert unwritten."""
    from dsv4_moe.kernels.mxfp4_grouped_gemm import bf16_pairs
    from dsv4_moe.weights.mma_layout import to_mma64e

    _, _, _, _, ids = _mma64_case(seed, t=t)
    e, (n_tok, k) = 6, ids.shape
    a = moe_align(ids.int(), e, 0, 16)
    g = torch.Generator().manual_seed(data_seed)
    wd, sd = _weights(e, 256, 384, g)
    hq, hs = ref.act_quant(torch.randn(a.max_rows, 384, generator=g).bfloat16() * 3)
    sentinel = torch.full((n_tok * k, 256), 7.0, dtype=torch.bfloat16)
    pairs = dict(a_pairs=bf16_pairs(hq, hs), a_pairs_scaled=True) if down.a_bf16 else {}
    ys = [mxfp4_grouped_gemm(hq, hs, to_mma64e(wd), sd, a, gather_a=False, scatter_out=True, layout="mma64e",
                             config=dataclasses.replace(down, **ch), out=sentinel.clone(), **pairs) for ch in changes]
    other = ids.flatten() >= e                      # the route to another rank's expert: unwritten
    for y in ys:
        assert torch.equal(y.view(torch.int16), ys[0].view(torch.int16))
        assert other.any() and (y[other] == 7.0).all() and not (y[~other] == 7.0).all(dim=1).any()


def test_swz_dequant_ptx_halves_bitwise():
    """The folded swap body converts a tile's even-k and odd-k halves in two pieces of PTX
    (_E2M1X4_LO/HI_SWZ_ASM: the odd half only after the even half's MMA, session 16); each is
    bit for bit its half of _E2M1X4_TO_BF16_SWZ_ASM, for every byte value and several scales."""
    from dsv4_moe.kernels import _mxfp4_dequant as body

    for sc in [(0, 1, 100, 127), (128, 127, 1, 0), (254, 126, 2, 128)]:
        b16 = [((s + 126) << 7) & 0xFFFF for s in sc]
        for b0 in range(256):
            word = b0 | ((b0 * 37 + 11) & 255) << 8 | ((b0 * 91 + 3) & 255) << 16 | (255 - b0) << 24
            s5, s6 = b16[0] | b16[1] << 16, b16[2] | b16[3] << 16
            whole = _run_ptx(body._E2M1X4_TO_BF16_SWZ_ASM.value, {"$4": word, "$5": s5, "$6": s6})
            lo = _run_ptx(body._E2M1X4_LO_SWZ_ASM.value, {"$2": word, "$3": s5, "$4": s6})
            hi = _run_ptx(body._E2M1X4_HI_SWZ_ASM.value, {"$2": word, "$3": s5, "$4": s6})
            got = (lo["$0"], lo["$1"], hi["$0"], hi["$1"])
            want = (whole["$0"], whole["$1"], whole["$2"], whole["$3"])
            assert got == want, (sc, hex(word), [hex(v) for v in got], [hex(v) for v in want])


def _mma64_case(seed, n=192, h=256, e=6, t=5, k=3):
    g = torch.Generator().manual_seed(seed)
    w, s = _weights(e, n, h, g)
    q, sa = ref.act_quant(torch.randn(t, h, generator=g).bfloat16() * 3)
    ids = _ids(t, k, e + 2, g)
    ids[0, 0] = e + 1                    # a route to another rank's expert: never written
    return w, s, q, sa, ids.sort(1).values


@pytest.mark.parametrize("kind,bm,bn,split", [("swap", 16, 128, 1), ("swap", 16, 64, 2), ("swap", 32, 128, 1),
                                             ("tile", 16, 128, 1), ("tile", 32, 64, 1)],
                         ids=["swap16x128", "swap16x64-splitk", "swap32x128", "tile16x128", "tile32x64"])
def test_mma64_bodies_bitwise_nk(kind, bm, bn, split):
    """The "mma64" bodies read the permuted bytes into the same tiles: bitwise the "nk"
    body with the same config, gate_up (gathered) and down (K = 384, scattered); N = 192
    leaves a half tile for BLOCK_N = 128. Also within the reference bound."""
    from dsv4_moe.weights.mma_layout import to_mma64

    w, s, q, sa, ids = _mma64_case(3)
    e, (t, k) = w.shape[0], ids.shape
    a = moe_align(ids.int(), e, 0, bm)
    cfg = GemmConfig(bm, bn, 4, 2, kind=kind, split_k=split)
    out_nk = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
    out_z = mxfp4_grouped_gemm(q, sa, to_mma64(w), s, a, gather_a=True, scatter_out=False, config=cfg,
                               layout="mma64")
    local = ids.flatten() < e
    rows = a.route_rows.long()[local]
    assert torch.equal(out_z[rows].view(torch.int16), out_nk[rows].view(torch.int16))
    exp = torch.cat([ref.fp4_gemm(q[r // k:r // k + 1], sa[r // k:r // k + 1], w[ei], s[ei])
                     for r, ei in zip(torch.nonzero(local).flatten().tolist(), ids.flatten()[local].tolist())])
    _assert_close(out_z[rows], exp, f"mma64 {kind} gate_up")
    g = torch.Generator().manual_seed(9)
    wd, sd = _weights(e, 128, 384, g)
    hq, hs = ref.act_quant(torch.randn(a.max_rows, 384, generator=g).bfloat16())
    sentinel = torch.full((t * k, 128), 7.0, dtype=torch.bfloat16)
    y_nk = mxfp4_grouped_gemm(hq, hs, wd, sd, a, gather_a=False, scatter_out=True, out=sentinel.clone(), config=cfg)
    y_z = mxfp4_grouped_gemm(hq, hs, to_mma64(wd), sd, a, gather_a=False, scatter_out=True, out=sentinel.clone(),
                             config=cfg, layout="mma64")
    assert torch.equal(y_z.view(torch.int16), y_nk.view(torch.int16))
    assert torch.equal(y_z[~local], sentinel[~local]), "non-local slots must not be written"


def test_mma64_guards_and_select_config():
    from dsv4_moe.kernels.routed_experts import routed_configs
    from dsv4_moe.weights.mma_layout import to_mma64

    w, s, q, sa, ids = _mma64_case(4, n=128)
    a1 = moe_align(ids.int(), w.shape[0], 0, 1)
    with pytest.raises(ValueError, match="layout 'mma64' needs kind"):
        mxfp4_grouped_gemm(q, sa, to_mma64(w), s, a1, gather_a=True, scatter_out=False,
                           config=GemmConfig(1, 64, kind="gemv"), layout="mma64")
    a = moe_align(ids.int(), w.shape[0], 0, 16)
    with pytest.raises(ValueError, match="layout='tiles'"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=GemmConfig(16, 64), layout="tiles")
    w96, s96 = _weights(2, 96, 256, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="N=96"):
        mxfp4_grouped_gemm(q, sa, w96, s96, moe_align(torch.zeros(5, 3, dtype=torch.int32), 2, 0, 16),
                           gather_a=True, scatter_out=False, config=GemmConfig(16, 64), layout="mma64")
    # decode: the swap body (the GEMV reads only "nk"); long K at tiny T splits 8 ways
    c = select_config(6, 256, 4096, 4096, "mma64")
    assert (c.kind, c.block_m, c.split_k) == ("swap", 16, 2)      # Flash gate_up T=1: 2-way split (session 29; 4 before)
    assert select_config(12, 256, 4096, 4096, "mma64").split_k == 1  # ... not at T=2 (session 24)
    assert select_config(6, 256, 4096, 2048, "mma64").split_k == 2   # Flash down T=1: 2-way split
    assert select_config(12, 256, 4096, 2048, "mma64").split_k == 1  # ... not at T=2
    assert select_config(6, 384, 7168, 384, "mma64").split_k == 1    # Pro-TP8 down: K = 384
    assert select_config(24, 256, 4096, 4096, "mma64").split_k == 1  # T=4: unsplit
    assert select_config(6, 384, 768, 7168, "mma64").split_k == 8
    # ... 4 ways from 0.1 to 0.22 rows per expert at N <= 1024 (Pro-TP8 T = 7-14; session 43), 0.2 above; only for
    # N <= 2048 (Pro-TP8, not Pro-TP1's N = 6144)
    assert select_config(8 * 6, 384, 768, 7168, "mma64").split_k == 4
    assert [select_config(t * 6, 384, 768, 7168, "mma64").split_k for t in (12, 13, 14, 15, 16)] == [4, 4, 4, 1, 1]
    # ... Pro-TP4's gate_up (N = 1536) keeps the band to 0.2 rows (session 43: to 0.22 was slower there)
    assert [select_config(t * 6, 384, 1536, 7168, "mma64").split_k for t in (12, 13, 14)] == [4, 1, 1]
    assert select_config(8 * 6, 384, 6144, 7168, "mma64").split_k == 1
    assert select_config(1024 * 6, 256, 4096, 4096, "mma64").block_m == 32
    assert select_config(4096 * 6, 256, 4096, 4096, "mma64").kind == "tile"

    def shape(*sz):
        return torch.zeros(1, 1, 1, dtype=torch.uint8).expand(*sz)
    pro_tp8 = RoutedExpertWeights(shape(384, 768, 3584), shape(384, 768, 224), shape(384, 7168, 192),
                                  shape(384, 7168, 12), first_expert=0, num_experts=384, layout="mma64")
    for t in (1, 2, 4, 16, 256):
        up, down = routed_configs(t * 6, pro_tp8)
        assert up.block_m == down.block_m and up.kind != "gemv" and down.kind != "gemv", (t, up, down)
        # bf16 activation pairs (written by act_quant / swiglu_quant): gate_up's swap body,
        # split or not (session 24: split on pairs 1.04-1.10x in the H200 layer at T = 1-4);
        # the short-K down from 0.05 rows per expert (session 24: 1.02x at T = 8-256, level
        # at T = 4, slower at T = 1)
        assert up.a_bf16, (t, up)
        assert down.a_bf16 == (t * 6 / 384 >= 0.05), (t, down)
    # the long-K decode gate_up splits 8 ways below 0.1 rows per expert, 4 ways below 0.22
    assert [routed_configs(t * 6, pro_tp8)[0].split_k for t in (1, 6, 7, 14, 15, 16)] == [8, 8, 4, 4, 1, 1]
    # the short-K down swap body: K loop unrolled twice; a register cap on 16-row blocks
    # from 0.05 routes per expert (probes of sessions 6 and 10)
    for t in (1, 4, 16, 256):
        up, down = routed_configs(t * 6, pro_tp8)
        assert down.maxnreg == (128 if t * 6 / 384 >= 0.05 else None), (t, down)
        assert down.unroll == 2 and up.unroll == 1 and up.maxnreg is None, (t, up, down)
    assert routed_configs(4 * 6, pro_tp8)[1].maxnreg == 128 and routed_configs(6, pro_tp8)[1].maxnreg is None
    # the 32-row band: both GEMMs on bf16 pairs, down unrolled twice, no cap; 16-row
    # blocks below 16 rows per expert (T = 512, 1000), 32-row ones from there (T = 1024, 2048;
    # session 11: from 24 rows; session 20: from 16)
    for t, bm in ((512, 16), (1000, 16), (1024, 32), (2048, 32)):
        up, down = routed_configs(t * 6, pro_tp8)
        assert (up.kind, up.block_m, up.a_bf16, up.unroll, up.maxnreg) == ("swap", bm, True, 1, None), (t, up)
        assert down == dataclasses.replace(up, unroll=2, fold_order=down.fold_order), (t, down)
    # session 18: from 64 rows per expert (session 19: 40) 64-row folded swap blocks on one
    # warpgroup, 3 stages, both GEMMs on scaled pairs; the short-K down unrolled twice and
    # (session 19) capped at 168 registers
    for t in (2560, 4096, 8192, 16384):  # session 19: from 40 rows (T >= 2560; was 64)
        up, down = routed_configs(t * 6, pro_tp8)
        assert (up.kind, up.block_m, up.num_warps, up.num_stages, up.a_bf16, up.fold_sa, up.fold_order,
                up.maxnreg, up.unroll) == ("swap", 64, 4, 3, True, True, "wait", None, 1), (t, up)
        assert down == dataclasses.replace(up, unroll=2, maxnreg=168), (t, down)
    assert routed_configs(2559 * 6, pro_tp8)[0].block_m == 32
    flash = RoutedExpertWeights(shape(256, 4096, 2048), shape(256, 4096, 128), shape(256, 4096, 1024),
                                shape(256, 4096, 64), first_expert=0, num_experts=256, layout="mma64")
    for t, cap in ((1, None), (2, None), (16, 128), (256, 128)):
        # long-K down (K = 2048) on 16-row blocks: no unroll; a 128-register cap from 0.2 rows
        # per expert (session 23), not on the split-K down of T = 1
        down = routed_configs(t * 6, flash)[1]
        assert down.unroll == 1 and down.maxnreg == cap, (t, down)
    # long-K down on bf16 pairs (written by swiglu_quant) at every T (from 0.2 rows per expert
    # before session 23) but the split-K down of T = 1; gate_up at every T, its split-K of T = 1
    # included (session 24; from 0.05 rows, T = 3, before), capped at 128 registers unsplit
    assert [routed_configs(t * 6, flash)[1].a_bf16 for t in (1, 2, 3, 4, 16, 256, 1024)] == \
        [False, True, True, True, True, True, True]
    assert [routed_configs(t * 6, flash)[0].a_bf16 for t in (1, 2, 4, 16, 1024)] == [True] * 5
    assert [(c.split_k, c.maxnreg) for c in (routed_configs(t * 6, flash)[0] for t in (1, 2, 3))] == \
        [(2, None), (1, 128), (1, 128)]   # T = 1 split 2 ways (session 29; 4 before)
    # the Flash 32-row down: unrolled twice per-block, rolled when folded (the default since session 17)
    assert routed_configs(1024 * 6, flash)[1].unroll == 1 and routed_configs(1024 * 6, flash)[1].block_m == 32
    # session 18: from 40 rows per expert (session 19: 36; session 20: 40 again, T >= 1707) both
    # GEMMs run 64-row folded swap blocks on one warpgroup, 3 stages, capped at 168 registers
    # (was: the 64-row tile body); the 32-row swap band below
    for t in (1707, 2048, 4096, 8192):
        up, down = routed_configs(t * 6, flash)
        assert (up.kind, up.block_m, up.num_warps, up.num_stages, up.a_bf16, up.fold_sa, up.fold_order,
                up.maxnreg, up.unroll) == ("swap", 64, 4, 3, True, True, "wait", 168, 1), (t, up)
        assert down == up, (t, down)
    assert routed_configs(1706 * 6, flash)[0].kind == "swap" and routed_configs(1706 * 6, flash)[0].block_m == 32
    # per-block swap bodies (DSV4_MOE_FOLD_SWAP=0 / DSV4_MOE_FOLD_ACT_SCALE=0) would spill at 64
    # rows: there the 64-row tile body stays (session 12's configs)
    from dsv4_moe.kernels.routed_experts import _routed_configs
    for fold, fold_swap in ((True, False), (False, True)):
        up, down = _routed_configs(8192 * 6, 256, 2048, 4096, "mma64", fold, fold_swap)
        assert (up.kind, up.num_stages, up.maxnreg, down.kind, down.num_stages) == ("tile", 2, 168, "tile", 3), (up, down)
        up, down = _routed_configs(8192 * 6, 384, 384, 7168, "mma64", fold, fold_swap)
        assert (up.kind, down.kind, down.a_bf16) == ("tile", "tile", False), (up, down)
    # a 128-register cap on Flash's unsplit gate_up on pairs, 16-row blocks (from 0.2 rows per
    # expert before session 23, 0.05 in session 23); not on the split-K gate_up of T = 1
    assert [routed_configs(t * 6, flash)[0].maxnreg for t in (1, 2, 3, 4, 16, 256, 1024)] == \
        [None, 128, 128, 128, 128, 128, None]
    assert routed_configs(16 * 6, pro_tp8)[0].maxnreg is None
    nk = dataclasses.replace(pro_tp8, layout="nk")  # "nk" decodes on the tile/GEMV bodies: no pairs
    assert not any(routed_configs(t * 6, nk)[0].a_bf16 for t in (16, 256, 1024))


def test_gemm_config_maxnreg_guard_and_interpreted_equality():
    """GemmConfig.maxnreg: validated; a launch option only (the interpreter ignores it), so
    the capped config computes the same bits as the uncapped one."""
    with pytest.raises(ValueError, match="maxnreg=7"):
        GemmConfig(16, 64, kind="swap", maxnreg=7)
    with pytest.raises(ValueError, match="maxnreg='128'"):
        GemmConfig(16, 64, kind="swap", maxnreg="128")
    with pytest.raises(ValueError, match="unroll=2"):
        GemmConfig(16, 64, kind="tile", unroll=2)
    with pytest.raises(ValueError, match="unroll=0"):
        GemmConfig(16, 64, kind="swap", unroll=0)
    g = torch.Generator().manual_seed(3)
    w, s = _weights(4, 64, 128, g)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]], dtype=torch.int32)
    a = moe_align(ids, 4, 0, 16)
    q, sa = ref.act_quant(torch.randn(3, 128, generator=g).bfloat16())
    outs = [mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False,
                               config=GemmConfig(16, 64, 4, 2, kind="swap", maxnreg=r))[a.route_rows.long()]
            for r in (None, 128)]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_bf16_pairs_layout():
    """bf16_pairs: each 128-block of a row as its 64 even-k values then its 64 odd-k values,
    exact e4m3 -> bf16 (one strided copy)."""
    from dsv4_moe.kernels.mxfp4_grouped_gemm import bf16_pairs

    q = (torch.randn(5, 384, generator=torch.Generator().manual_seed(1)) * 40).to(torch.float8_e4m3fn)
    p = bf16_pairs(q)
    assert p.dtype == torch.bfloat16 and p.shape == q.shape and p.is_contiguous()
    f = q.float()
    for b in range(3):
        assert torch.equal(p[:, 128 * b:128 * b + 64].float(), f[:, 128 * b:128 * (b + 1):2])
        assert torch.equal(p[:, 128 * b + 64:128 * (b + 1)].float(), f[:, 128 * b + 1:128 * (b + 1):2])


@pytest.mark.parametrize("kind", ["swap", "tile"])
@pytest.mark.parametrize("layout", ["nk", "mma64"])
def test_bf16_activations_bitwise(layout, kind):
    """GemmConfig.a_bf16: the swap and tile bodies read the activations as bf16 [64 even |
    64 odd] per 128-block: the same values and MMA, so the same bits, gathered (gate_up) and
    permuted (down, K = 384) rows, split-K included (swap)."""
    from dsv4_moe.weights.mma_layout import to_mma64

    w, s, q, sa, ids = _mma64_case(6, n=128)
    e, (t, k) = w.shape[0], ids.shape
    a = moe_align(ids.int(), e, 0, 16)
    wl = to_mma64(w) if layout == "mma64" else w
    rows = a.route_rows.long()[ids.flatten() < e]
    for split in ((1, 2) if kind == "swap" else (1,)):
        base = mxfp4_grouped_gemm(q, sa, wl, s, a, gather_a=True, scatter_out=False, layout=layout,
                                  config=GemmConfig(16, 128, 4, 2, kind=kind, split_k=split))
        pre = mxfp4_grouped_gemm(q, sa, wl, s, a, gather_a=True, scatter_out=False, layout=layout,
                                 config=GemmConfig(16, 128, 4, 2, kind=kind, split_k=split, a_bf16=True))
        assert torch.equal(pre[rows].view(torch.int16), base[rows].view(torch.int16))
    wd, sd = _weights(e, 128, 384, torch.Generator().manual_seed(2))
    wdl = to_mma64(wd) if layout == "mma64" else wd
    hq, hs = ref.act_quant(torch.randn(a.max_rows, 384, generator=torch.Generator().manual_seed(3)).bfloat16())
    y0 = mxfp4_grouped_gemm(hq, hs, wdl, sd, a, gather_a=False, scatter_out=True, layout=layout,
                            config=GemmConfig(16, 128, 4, 2, kind=kind))
    y1 = mxfp4_grouped_gemm(hq, hs, wdl, sd, a, gather_a=False, scatter_out=True, layout=layout,
                            config=GemmConfig(16, 128, 4, 2, kind=kind, a_bf16=True))
    local = ids.flatten() < e
    assert torch.equal(y1[local].view(torch.int16), y0[local].view(torch.int16))
    with pytest.raises(ValueError, match="a_bf16=True needs kind 'swap' or 'tile'"):
        GemmConfig(1, 64, kind="gemv", a_bf16=True)
    wk, sk = _weights(e, 128, 96, torch.Generator().manual_seed(4))
    qk, sak = ref.act_quant(torch.randn(t, 96).bfloat16())
    with pytest.raises(ValueError, match="K=96 must be a multiple of 128"):
        mxfp4_grouped_gemm(qk, sak, wk, sk, a, gather_a=True, scatter_out=False,
                           config=GemmConfig(16, 128, kind="swap", a_bf16=True))


def test_a_pairs_from_act_quant_bitwise():
    """`a_pairs`: the bf16 pairs written by act_quant (pairs=True) and swiglu_quant give the
    GEMM the same operand as its own conversion (bitwise); misuse is named."""
    from dsv4_moe.kernels.mxfp4_grouped_gemm import bf16_pairs

    w, s, _, _, ids = _mma64_case(7, n=128)
    e, (t, k) = w.shape[0], ids.shape
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(8)).bfloat16() * 3
    q, sa, p = act_quant(x, pairs=True)
    assert torch.equal(p.view(torch.int16), bf16_pairs(q).view(torch.int16))
    a = moe_align(ids.int(), e, 0, 16)
    cfg = GemmConfig(16, 128, 4, 2, kind="swap", a_bf16=True)
    rows = a.route_rows.long()[ids.flatten() < e]
    own = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
    given = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg, a_pairs=p)
    assert torch.equal(given[rows].view(torch.int16), own[rows].view(torch.int16))
    # down: swiglu_quant's pairs of its own fp8 output (padding rows skipped, never read)
    gu = torch.randn(a.max_rows, 256, generator=torch.Generator().manual_seed(9)).bfloat16() * 4
    hq, hs, hp = swiglu_quant(gu, limit=7.0, route_weight=a.row_weight, expert_ids=a.row_expert,
                              strategy="group", pairs=True)
    wd, sd = _weights(e, 128, 128, torch.Generator().manual_seed(2))
    y0 = mxfp4_grouped_gemm(hq, hs, wd, sd, a, gather_a=False, scatter_out=True, config=cfg)
    y1 = mxfp4_grouped_gemm(hq, hs, wd, sd, a, gather_a=False, scatter_out=True, config=cfg, a_pairs=hp)
    local = ids.flatten() < e
    assert torch.equal(y1[local].view(torch.int16), y0[local].view(torch.int16))
    with pytest.raises(ValueError, match="a_pairs: given, but config.a_bf16 is False"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False,
                           config=GemmConfig(16, 128, 4, 2, kind="swap"), a_pairs=p)
    with pytest.raises(ValueError, match="a_pairs: expected a contiguous"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg, a_pairs=p[:, :128])
    with pytest.raises(ValueError, match="a_pairs: expected a contiguous"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg, a_pairs=p.float())


# ---------------------------------------------------------------- fold_sa (session 15)
def test_scaled_pairs_from_quantisers_bitwise():
    """pairs="scaled": act_quant, swiglu_quant (fused and unfused) and route_front's
    reference twin write bf16(q * s) in the pairs layout, exactly `bf16_pairs(q, s)`; the
    argument is validated."""
    from dsv4_moe import stages
    from dsv4_moe.kernels.mxfp4_grouped_gemm import bf16_pairs

    g = torch.Generator().manual_seed(31)
    x = torch.randn(5, 384, generator=g).bfloat16() * torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(128)
    x = x.bfloat16()
    q, s, p = act_quant(x, pairs="scaled")
    want = bf16_pairs(q, s)
    assert torch.equal(p.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(p.view(torch.int16), bf16_pairs(q).view(torch.int16))
    f = q.float().view(5, 3, 128) * s[:, :, None]
    assert torch.equal(p[:, 64:128].float(), f[:, 0, 1::2])  # odd k of block 0, scaled, exact
    rq, rs, rp = stages.act_quant_reference(x, pairs="scaled")
    assert torch.equal(rp.view(torch.int16), want.view(torch.int16))
    gu = torch.randn(6, 512, generator=g).bfloat16() * 3
    rw = torch.rand(6, generator=g)
    hq, hs, hp = swiglu_quant(gu, limit=7.0, route_weight=rw, strategy="group", pairs="scaled")
    assert torch.equal(hp.view(torch.int16), bf16_pairs(hq, hs).view(torch.int16))
    uq, us, up = swiglu_quant_unfused(gu, limit=7.0, route_weight=rw, pairs="scaled")
    assert torch.equal(up.view(torch.int16), hp.view(torch.int16))
    for fn in (lambda: act_quant(x, pairs="yes"), lambda: swiglu_quant(gu, pairs=1.5)):
        with pytest.raises(ValueError, match="expected False, True or 'scaled'"):
            fn()
    with pytest.raises(ValueError, match="pairs='scaled' needs scale_fmt='fp32'"):
        act_quant(x, pairs="scaled", scale_fmt="e8m0")


@pytest.mark.parametrize("kind,a_bf16,split,bm,warps",
                         [("swap", True, 1, 16, 4), ("swap", False, 1, 16, 4), ("swap", False, 2, 16, 4),
                          ("swap", True, 3, 16, 4), ("tile", True, 1, 16, 4), ("tile", False, 1, 16, 4),
                          ("swap", True, 1, 64, 8), ("swap", True, 1, 64, 4)],
                         ids=["scaled-pairs", "fp8", "fp8-splitk", "scaled-pairs-splitk", "tile-scaled-pairs",
                              "tile-fp8", "swap64-8warps", "swap64-4warps"])
def test_fold_sa_vs_reference(kind, a_bf16, split, bm, warps):
    """GemmConfig.fold_sa: the activation scale folded into the bf16 operand (one MMA chain
    over K) against the reference, gathered gate_up and scattered down (K = 384, a non-local
    route never written), in the same bound as every body; the wrapper's own scaled pairs
    equal act_quant's (bitwise); the bound still rejects a scale off by one 32-group. Also the
    64-row swap blocks: 8 warps (probed), 4 warps (the layer's prefill config since session 18)."""

    g = torch.Generator().manual_seed(41)
    e, t, k, h, n = 8, 5, 3, 384, 128
    w, s = _weights(e, n, h, g)
    x = (torch.randn(t, h, generator=g) * torch.tensor([3.0, 1e-2, 40.0]).repeat_interleave(128)).bfloat16()
    q, sa, qp = act_quant(x, pairs="scaled")
    ids = _ids(t, k, e + 2, g)
    ids[0, 0] = 9
    ids = ids.sort(1).values
    a = moe_align(ids.int(), e, 0, bm)
    cfg = GemmConfig(bm, 64, warps, 2, kind=kind, split_k=split, a_bf16=a_bf16, fold_sa=True)
    given = dict(a_pairs=qp, a_pairs_scaled=True) if a_bf16 else {}
    out = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg, **given)
    local = ids.flatten() < e
    rows = a.route_rows.long()[local]
    routes = list(zip(torch.nonzero(local).flatten().tolist(), ids.flatten()[local].tolist()))
    exp = torch.cat([ref.fp4_gemm(q[r // k:r // k + 1], sa[r // k:r // k + 1], w[ei], s[ei]) for r, ei in routes])
    _assert_close(out[rows], exp, "fold gate_up")
    _assert_far(out[rows], torch.cat([ref.fp4_gemm(q[r // k:r // k + 1], sa[r // k:r // k + 1], w[ei],
                                                   torch.roll(s[ei].view(torch.uint8), 1, 1).view(s.dtype))
                                      for r, ei in routes]), "shifted scales")
    if a_bf16:  # the wrapper's fallback conversion makes the same operand
        own = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
        assert torch.equal(own[rows].view(torch.int16), out[rows].view(torch.int16))
    hq, hs = ref.act_quant(torch.randn(a.max_rows, h, generator=g).bfloat16())
    sentinel = torch.full((t * k, n), 7.0, dtype=torch.bfloat16)
    y = mxfp4_grouped_gemm(hq, hs, w, s, a, gather_a=False, scatter_out=True, out=sentinel.clone(), config=cfg)
    exp = torch.cat([ref.fp4_gemm(hq[i:i + 1], hs[i:i + 1], w[ei], s[ei])
                     for i, (_, ei) in zip(rows.tolist(), routes)])
    _assert_close(y[local], exp, "fold down")
    assert torch.equal(y[~local], sentinel[~local]), "non-local slots must not be written"


def test_fold_sa_guards_and_routed_configs(monkeypatch):
    """fold_sa needs the swap body and the right pairs; routed_configs folds every swap and
    tile GEMM of the mma64 layout (the swap ones in the "split" order on 16-row blocks over
    at most SPLIT_ORDER_MAX_BLOCKS K blocks, else "wait"); DSV4_MOE_FOLD_SWAP=0 keeps the
    swap GEMMs per-block."""
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.weights.tensors import RoutedExpertWeights

    with pytest.raises(ValueError, match="fold_sa=True needs kind 'swap' or 'tile'"):
        GemmConfig(1, 64, kind="gemv", fold_sa=True)
    with pytest.raises(ValueError, match="GemmConfig.fold_order='late': expected 'wait' or 'split'"):
        GemmConfig(16, 128, kind="swap", fold_sa=True, fold_order="late")
    # both orderings are exact at 2-4 stages on the H200 (session 17), so all accepted
    GemmConfig(32, 128, 4, 3, kind="swap", a_bf16=True, fold_sa=True, fold_order="split")
    GemmConfig(16, 128, 4, 4, kind="swap", a_bf16=True, fold_sa=True)
    assert rx.fold_config(GemmConfig(32, 128, 4, 3, kind="swap", a_bf16=True), 384) == \
        GemmConfig(32, 128, 4, 3, kind="swap", a_bf16=True, fold_sa=True, fold_order="wait")
    assert rx.fold_config(GemmConfig(16, 128, 4, 4, kind="swap"), 512).fold_order == "split"   # 4 blocks
    assert rx.fold_config(GemmConfig(16, 128, 4, 4, kind="swap"), 640).fold_order == "wait"    # 5 blocks
    assert rx.fold_config(GemmConfig(16, 128, 4, 4, kind="swap", split_k=8), 7168).fold_order == "wait"
    assert rx.fold_config(GemmConfig(64, 128, 4, 3, a_bf16=True), 384) == GemmConfig(64, 128, 4, 3, a_bf16=True, fold_sa=True)
    g = torch.Generator().manual_seed(5)
    w, s = _weights(4, 128, 256, g)
    q, sa, p = act_quant(torch.randn(2, 256, generator=g).bfloat16(), pairs=True)
    a = moe_align(torch.tensor([[0, 1], [1, 3]], dtype=torch.int32), 4, 0, 16)
    fold = GemmConfig(16, 128, kind="swap", a_bf16=True, fold_sa=True)
    with pytest.raises(ValueError, match="a_pairs_scaled=False: config.fold_sa=True takes scaled pairs"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=fold, a_pairs=p)
    with pytest.raises(ValueError, match="a_pairs_scaled=True: config.fold_sa=False takes plain pairs"):
        mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False,
                           config=dataclasses.replace(fold, fold_sa=False), a_pairs=p, a_pairs_scaled=True)

    def shaped(*shape, dtype=torch.uint8):  # shapes only: routed_configs reads no values
        return torch.empty(1, dtype=dtype).expand(*shape)

    def routed(e, h, i):
        return RoutedExpertWeights(shaped(e, 2 * i, h // 2), shaped(e, 2 * i, h // 32, dtype=torch.float8_e8m0fnu),
                                   shaped(e, h, i // 2), shaped(e, h, i // 32, dtype=torch.float8_e8m0fnu),
                                   0, e, "mma64")
    flash, pro = routed(256, 4096, 2048), routed(384, 7168, 384)
    assert rx.FOLD_SWAP is True
    # default: (T, gate_up kind, gate_up order, down order)
    for r, t, kind, up_order, down_order in (
            (flash, 1, "swap", "wait", "wait"), (flash, 4, "swap", "wait", "wait"),
            (flash, 16, "swap", "wait", "wait"), (flash, 1024, "swap", "wait", "wait"),
            (flash, 4096, "swap", "wait", "wait"), (flash, 8192, "swap", "wait", "wait"),  # 64-row blocks
            (pro, 1, "swap", "wait", "split"),       # down: 16 rows, K = 384 (3 blocks)
            (pro, 4, "swap", "wait", "split"), (pro, 16, "swap", "wait", "split"),
            (pro, 1000, "swap", "wait", "split"),
            (pro, 2048, "swap", "wait", "wait"),     # 32-row blocks
            (pro, 4096, "swap", "wait", "wait"), (pro, 8192, "swap", "wait", "wait")):  # 64-row blocks
        up, down = rx.routed_configs(t * 6, r)
        assert (up.kind, up.fold_sa, down.fold_sa, up.fold_order, down.fold_order) == \
            (kind, True, True, up_order, down_order), (r.hidden, t, up, down)
        assert rx.pairs_mode(up) == ("scaled" if up.a_bf16 else False)
    monkeypatch.setattr(rx, "FOLD_SWAP", False)
    for r, t in ((flash, 1), (flash, 16), (flash, 1024), (pro, 4), (pro, 1024), (pro, 4096)):  # swap bodies
        assert not any(c.fold_sa for c in rx.routed_configs(t * 6, r)), (r.hidden, t)
        assert rx.pairs_mode(rx.routed_configs(t * 6, r)[0]) in (True, False)
    # prefill falls back to the tile body (folded still), not to a per-block 64-row swap
    for r, t in ((flash, 4096), (flash, 8192), (pro, 8192)):
        assert all(c.kind == "tile" and c.fold_sa for c in rx.routed_configs(t * 6, r)), (r.hidden, t)
    nk = dataclasses.replace(flash, layout="nk")
    assert not any(c.fold_sa for c in rx.routed_configs(16 * 6, nk))


def test_fold_switch_reaches_memoised_configs(monkeypatch):
    """routed_configs is memoised on the shapes; the module switches are part of the key, so
    an A/B that flips FOLD_ACT_SCALE (scripts/gpu_profile_layer.py --ab) takes effect."""
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.weights.tensors import RoutedExpertWeights

    u8, e8 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.float8_e8m0fnu)
    r = RoutedExpertWeights(u8.expand(256, 4096, 2048), e8.expand(256, 4096, 128), u8.expand(256, 4096, 1024),
                            e8.expand(256, 4096, 64), 0, 256, "mma64")
    assert all(c.fold_sa for c in rx.routed_configs(8192 * 6, r))
    monkeypatch.setattr(rx, "FOLD_ACT_SCALE", False)
    assert not any(c.fold_sa for c in rx.routed_configs(8192 * 6, r))


def test_folded_swap_refused_off_the_checked_body(monkeypatch):
    """On CUDA (here: the interpreter switched off by hand) a folded swap launch must use the
    "mma64" layout and the PTX dequant, the body whose SASS is hazard-checked; the check
    fires before anything compiles."""
    from dsv4_moe.kernels import _triton_utils

    monkeypatch.setattr(_triton_utils, "interpreting", lambda: False)
    g = torch.Generator().manual_seed(3)
    w, s = _weights(4, 128, 256, g)
    q, sa = ref.act_quant(torch.randn(2, 256, generator=g).bfloat16())
    a = moe_align(torch.tensor([[0, 1], [1, 3]], dtype=torch.int32), 4, 0, 16)
    with pytest.raises(ValueError, match=r"fold_sa=True on the swap body needs layout 'mma64' or 'mma64e' and asm=True on "
                                         r"CUDA \(got layout='nk', asm=True\)"):
        _mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False,
                           config=GemmConfig(16, 128, kind="swap", asm=True, fold_sa=True))


def test_fold_swap_switch(monkeypatch):
    """FOLD_SWAP (DSV4_MOE_FOLD_SWAP, on by default) reaches the memoised configs: the Flash
    T = 1024 32-row GEMMs fold ("wait" order, 3 stages) unless it is off."""
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.weights.tensors import RoutedExpertWeights

    u8, e8 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.float8_e8m0fnu)
    r = RoutedExpertWeights(u8.expand(256, 4096, 2048), e8.expand(256, 4096, 128), u8.expand(256, 4096, 1024),
                            e8.expand(256, 4096, 64), 0, 256, "mma64")
    up, down = rx.routed_configs(1024 * 6, r)
    assert (up.kind, up.block_m, up.fold_sa, down.fold_sa, up.num_stages, up.fold_order, down.unroll) == \
        ("swap", 32, True, True, 3, "wait", 1)
    assert rx.pairs_mode(up) == "scaled"
    monkeypatch.setattr(rx, "FOLD_SWAP", False)
    up, down = rx.routed_configs(1024 * 6, r)
    assert (up.fold_sa, down.fold_sa, down.unroll) == (False, False, 2)
    assert rx.pairs_mode(up) is True


def test_n_fastest_launch_order_same_bits():
    """GemmConfig.n_fastest (weight blocks fastest in the grid, a probe of session 18): the same
    programs in another order, so the same bits, folded or not, split or not; swap only."""
    with pytest.raises(ValueError, match="n_fastest=True needs kind 'swap'"):
        GemmConfig(64, 128, n_fastest=True)
    g = torch.Generator().manual_seed(3)
    e, t, k, h, n = 4, 6, 2, 256, 128
    w, s = _weights(e, n, h, g)
    q, sa = ref.act_quant(torch.randn(t, h, generator=g).bfloat16())
    ids = _ids(t, k, e, g).sort(1).values
    for cfg in (GemmConfig(16, 64, 4, 2, kind="swap"), GemmConfig(16, 64, 4, 2, kind="swap", fold_sa=True),
                GemmConfig(16, 64, 4, 2, kind="swap", split_k=2)):
        a = moe_align(ids.int(), e, 0, cfg.block_m)
        base = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
        nf = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False,
                                config=dataclasses.replace(cfg, n_fastest=True))
        rows = a.route_rows.long()
        assert torch.equal(nf[rows].view(torch.int16), base[rows].view(torch.int16)), cfg


def test_n_fastest_rule_and_switch(monkeypatch):
    """routed_configs launches the unsplit 32- and 64-row swap GEMMs with the weight blocks
    fastest (session 19's layer A/B); never the 16-row decode blocks, split-K, tile bodies or
    a grid whose worst-case M-block count passes CUDA's y limit; DSV4_MOE_N_FASTEST=0
    (rx.N_FASTEST False) turns it off and reaches the memoised configs."""
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.weights.tensors import RoutedExpertWeights

    def routed(e, h, i):
        u8, e8 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.float8_e8m0fnu)
        return RoutedExpertWeights(u8.expand(e, 2 * i, h // 2), e8.expand(e, 2 * i, h // 32), u8.expand(e, h, i // 2),
                                   e8.expand(e, h, i // 32), 0, e, "mma64")
    flash, pro = routed(256, 4096, 2048), routed(384, 7168, 384)
    assert rx.N_FASTEST is True
    for r, t, nf in ((flash, 1, False), (flash, 16, False), (flash, 256, False),  # 16-row blocks
                     (flash, 512, True), (flash, 1024, True), (flash, 8192, True),  # 32 / 64 rows
                     (pro, 1, False), (pro, 1000, False), (pro, 1024, True), (pro, 2048, True), (pro, 8192, True)):
        for c in rx.routed_configs(t * 6, r):
            assert c.n_fastest == nf and (not nf or (c.kind == "swap" and c.block_m >= 32 and c.split_k == 1)), \
                (r.hidden, t, c)
    # the tile bodies (swap fold off) never
    assert not any(c.n_fastest for c in rx._routed_configs(8192 * 6, 256, 2048, 4096, "mma64", True, False, True))
    # a grid past 65535 M-blocks keeps the m-blocks fastest (rather than a launch error)
    up, _ = rx._routed_configs(65536 * 64, 256, 2048, 4096, "mma64", True, True, True)
    assert up.kind == "swap" and not up.n_fastest
    assert rx._n_fastest(GemmConfig(64, 128, 4, 3, kind="swap"), 65535 * 64 - 256 * 64, 256).n_fastest
    assert not rx._n_fastest(GemmConfig(64, 128, 4, 3, kind="swap"), 65535 * 64, 256).n_fastest
    monkeypatch.setattr(rx, "N_FASTEST", False)
    assert not any(c.n_fastest for t in (1024, 8192) for c in rx.routed_configs(t * 6, flash))


@pytest.mark.parametrize("kind", ["swap", "tile"])
def test_a_pad_rows_same_bits(monkeypatch, kind):
    """mxfp4_grouped_gemm.A_PAD_ROWS (session 22): the padding rows of a block load row 0 of A
    (0, before), the block's first routed row (1) or nothing (2, masked loads; the default). Padding
    products are never stored, so the routed rows' bits are the same every way: gathered
    (gate_up) and permuted (down, K = 384) rows, plain / K-split / folded swap bodies, with
    blocks of 1-3 routes in 16 rows and no routed row reading token 0."""
    from dsv4_moe.kernels import mxfp4_grouped_gemm as mg

    g = torch.Generator().manual_seed(11)
    e, t, k, h, n = 5, 4, 2, 256, 128
    w, s = _weights(e, n, h, g)
    q, sa = ref.act_quant(torch.randn(t, h, generator=g).bfloat16())
    ids = torch.tensor([[1, 3], [0, 4], [1, 2], [3, 4]])
    a = moe_align(ids.int(), e, 0, 16)
    rows = a.route_rows.long()
    wd, sd = _weights(e, n, 384, g)
    hq, hs = ref.act_quant(torch.randn(a.max_rows, 384, generator=g).bfloat16())
    cfgs = [GemmConfig(16, 128, 4, 2, kind=kind, a_bf16=True)]
    if kind == "swap":
        cfgs += [GemmConfig(16, 128, 4, 2, kind="swap", a_bf16=True, split_k=2),
                 GemmConfig(16, 128, 4, 2, kind="swap", a_bf16=True, fold_sa=True)]
    for cfg in cfgs:
        outs = {}
        for pad in (0, 1, 2):
            monkeypatch.setattr(mg, "A_PAD_ROWS", pad)
            up = mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
            down = mxfp4_grouped_gemm(hq, hs, wd, sd, a, gather_a=False, scatter_out=True, config=cfg)
            outs[pad] = (up[rows], down)
        want = _per_route_reference(q, sa, w, s, ids, gather=True)
        _assert_close(outs[1][0], want, f"{cfg} gate_up vs reference")
        for pad in (0, 2):
            assert torch.equal(outs[pad][0].view(torch.int16), outs[1][0].view(torch.int16)), (cfg, pad)
            assert torch.equal(outs[pad][1].view(torch.int16), outs[1][1].view(torch.int16)), (cfg, pad)


@pytest.mark.parametrize("name, value, check", [
    # session 23's A/B switches (bench --set): each moves only the configs it names
    ("FLASH_DOWN_PAIRS_MIN_ROWS", float("inf"), lambda fl, pro: not fl(4)[1].a_bf16 and not fl(16)[1].a_bf16),
    ("FLASH_DOWN16_CAP_MIN_ROWS", float("inf"), lambda fl, pro: fl(16)[1].maxnreg is None),
    ("FLASH_UP16_CAP_MIN_ROWS", 0.2, lambda fl, pro: fl(4)[0].maxnreg is None and fl(16)[0].maxnreg == 128),
    # session 24's
    ("UP_SPLIT_PAIRS", False, lambda fl, pro: not fl(1)[0].a_bf16 and not pro(4)[0].a_bf16 and fl(2)[0].a_bf16),
    ("UP_PAIRS_MIN_ROWS", 0.05, lambda fl, pro: not fl(2)[0].a_bf16 and fl(3)[0].a_bf16),
    ("PRO_DOWN_PAIRS_MIN_ROWS", 0.0, lambda fl, pro: pro(1)[1].a_bf16 and pro(16)[1].a_bf16
                                                     and pro(16)[1].maxnreg == 64 and pro(16)[1].unroll == 2),
    ("PRO_DOWN_PAIRS_MIN_ROWS", float("inf"), lambda fl, pro: not pro(4)[1].a_bf16 and not pro(16)[1].a_bf16
                                                              and pro(16)[1].maxnreg == 64),
])
def test_session23_config_switches(monkeypatch, name, value, check):
    import dsv4_moe.kernels.routed_experts as rx

    def cfgs(e, i, h):
        return lambda t: rx._routed_configs(t * 6, e, i, h, "mma64e", True, True, True)
    fl, pro = cfgs(256, 2048, 4096), cfgs(384, 384, 7168)
    # the defaults: Flash down on pairs from T = 2, both Flash 16-row caps, Pro-TP8 down on pairs
    # from T = 4 (session 24; fp8 below), its 16-row cap 64 (session 29; 96 in session 25)
    rx._routed_configs.cache_clear()
    assert fl(4)[1].a_bf16 and fl(16)[1].maxnreg == 128 and fl(4)[0].maxnreg == 128
    assert not pro(1)[1].a_bf16 and not pro(3)[1].a_bf16
    assert pro(4)[1].a_bf16 and pro(16)[1].a_bf16 and pro(16)[1].maxnreg == 64 and pro(16)[1].unroll == 2
    monkeypatch.setattr(rx, name, value)
    rx._routed_configs.cache_clear()
    try:
        assert check(fl, pro), name
    finally:
        monkeypatch.undo()
        rx._routed_configs.cache_clear()


def test_one_chain_rule_and_guard():
    """GemmConfig.one_chain (one MMA chain per 128-block): only on folded "wait" swap configs, set by
    routed_configs on the unsplit, uncapped-or->=112 16-row decode GEMMs from ONE_CHAIN_MIN_ROWS."""
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig
    from dsv4_moe.weights.tensors import RoutedExpertWeights
    with pytest.raises(ValueError, match="one_chain=True needs kind 'swap' with fold_sa=True"):
        GemmConfig(16, 128, kind="swap", one_chain=True)
    with pytest.raises(ValueError, match="one_chain=True needs kind 'swap'"):
        GemmConfig(64, 128, kind="tile", fold_sa=True, one_chain=True)
    u8, e8 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.float8_e8m0fnu)
    flash = RoutedExpertWeights(u8.expand(256, 4096, 2048), e8.expand(256, 4096, 128), u8.expand(256, 4096, 1024),
                                e8.expand(256, 4096, 64), 0, 256, "mma64e")
    pro = RoutedExpertWeights(u8.expand(384, 768, 3584), e8.expand(384, 768, 224), u8.expand(384, 7168, 192),
                              e8.expand(384, 7168, 12), 0, 384, "mma64e")
    chains = {(n, t): [c.one_chain for c in rx.routed_configs(6 * t, r)]
              for n, r in (("flash", flash), ("pro", pro)) for t in (1, 2, 4, 16, 2048)}
    assert chains[("flash", 1)] == [False, False]    # split-K: measured slower
    assert chains[("flash", 2)] == [False, False]    # 0.047 rows: below the threshold
    assert chains[("flash", 4)] == [True, True] and chains[("flash", 16)] == [True, True]
    assert chains[("pro", 4)] == [False, False]      # split-K gate_up, 64-register down
    assert chains[("pro", 16)] == [True, False]      # the down's 64-register cap would spill
    assert chains[("flash", 2048)] == [False, False] and chains[("pro", 2048)] == [False, False]  # 64/32-row blocks
    try:
        rx.ONE_CHAIN_MIN_ROWS = float("inf")
        rx._routed_configs.cache_clear()
        assert not any(c.one_chain for c in rx.routed_configs(6 * 16, flash))
    finally:
        rx.ONE_CHAIN_MIN_ROWS = 0.08
        rx._routed_configs.cache_clear()
    # the split-K A/B switch (session 34): the T = 1 GEMMs by name; an unknown value is an error
    try:
        for value, want in (("gate_up", [True, False]), ("down", [False, True]), ("both", [True, True])):
            rx.ONE_CHAIN_SPLIT_K = value
            rx._routed_configs.cache_clear()
            up, down = rx.routed_configs(6, flash)
            assert up.split_k > 1 and down.split_k > 1 and [up.one_chain, down.one_chain] == want, value
        assert [c.one_chain for c in rx.routed_configs(6 * 16, flash)] == [True, True]  # unsplit: unchanged
        rx.ONE_CHAIN_SPLIT_K = "gateup"
        rx._routed_configs.cache_clear()
        with pytest.raises(ValueError, match="ONE_CHAIN_SPLIT_K='gateup': expected one of 'off', 'gate_up'"):
            rx.routed_configs(6, flash)
    finally:
        rx.ONE_CHAIN_SPLIT_K = "off"
        rx._routed_configs.cache_clear()


def test_config_override_switch():
    """routed_experts.CONFIG_OVERRIDE (an A/B probe switch): named fields of the chosen gate_up / down
    configs replaced, typed as the field; malformed text, unknown fields and block_m / kind are errors."""
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.weights.tensors import RoutedExpertWeights
    u8, e8 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.float8_e8m0fnu)
    flash = RoutedExpertWeights(u8.expand(256, 4096, 2048), e8.expand(256, 4096, 128), u8.expand(256, 4096, 1024),
                                e8.expand(256, 4096, 64), 0, 256, "mma64e")
    base_up, base_down = rx.routed_configs(6, flash)
    try:
        rx.CONFIG_OVERRIDE = "gate_up: one_chain=1, num_stages=6 ; down:maxnreg=96"
        rx._routed_configs.cache_clear()
        up, down = rx.routed_configs(6, flash)
        assert up == dataclasses.replace(base_up, one_chain=True, num_stages=6)
        assert down == dataclasses.replace(base_down, maxnreg=96)
        rx.CONFIG_OVERRIDE = "down:maxnreg=none"
        rx._routed_configs.cache_clear()
        assert rx.routed_configs(6, flash)[1].maxnreg is None
        for bad, match in (("upgate:num_stages=3", "should read 'gate_up:FIELD=VALUE"),
                           ("gate_up:stages=3", "FIELD a GemmConfig field other than block_m / kind"),
                           ("gate_up:block_m=32", "other than block_m / kind"),
                           ("gate_up:num_stages=three", "num_stages='three': expected an int"),
                           ("gate_up:one_chain=yes", "one_chain='yes': expected 0/1/true/false"),
                           ("down:one_chain=1,fold_sa=0", "one_chain=True needs kind 'swap' with fold_sa=True")):
            rx.CONFIG_OVERRIDE = bad
            rx._routed_configs.cache_clear()
            with pytest.raises(ValueError, match=match):
                rx.routed_configs(6, flash)
    finally:
        rx.CONFIG_OVERRIDE = ""
        rx._routed_configs.cache_clear()
    assert rx.routed_configs(6, flash) == (base_up, base_down)
