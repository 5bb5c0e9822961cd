"""swiglu_quant (fused Triton) and swiglu_quant_unfused vs dsv4_moe.reference.swiglu_quant.

On CPU (TRITON_INTERPRET=1) the fused kernel computes exp with numpy, not torch's CPU
exp, so inputs here use gate values on which the two agree bit for bit (checked by the
`_agreeing_gates` fixture); everything else (clamps, silu, route weight, bf16 rounding,
scales, codes, filtering) is then compared bitwise. On the GPU both sides use CUDA's
expf (scripts/gpu_check_shared.py checks all shapes bitwise).
"""

import _triton_interp  # noqa: F401
import numpy as np
import pytest
import torch

from dsv4_moe import reference as ref
from dsv4_moe.kernels.swiglu_quant import (PERSISTENT_I_MULTIPLE, PERSISTENT_MIN_ELEMENTS, choose_strategy, swiglu_quant,
                                           swiglu_quant_partials, swiglu_quant_unfused)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STRATEGIES = ["group", "persistent"]


def assert_bytes_equal(a, b, what):
    a8, b8 = a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)
    bad = (a8 != b8).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {a8.numel()} bytes differ; first at "
                              f"{tuple(bad[0].tolist())}: got {a8[tuple(bad[0])].item():#04x} "
                              f"want {b8[tuple(bad[0])].item():#04x}")


def _gate_up(m, i, seed, gate_scale=4.0, up_scale=4.0):
    """bf16 [m, 2i]; gates whose fp32 silu is identical computed as the interpreted kernel does
    (g / (1 + exp(-g)), numpy's exp) and as the reference does (torch's F.silu). Gates past the
    +10 clamp pass the filter (silu(10) agrees), so the clamp is exercised here too."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(m * i * 3, generator=g) * gate_scale).bfloat16().float()
    if not torch.cuda.is_available():
        gc = gate.clamp(max=10.0)
        same = gc / (1 + torch.from_numpy(np.exp(-gc.numpy()))) == torch.nn.functional.silu(gc)
        gate = gate[same]
    gate = gate[: m * i].view(m, i)
    up = torch.randn(m, i, generator=g) * up_scale
    return torch.cat([gate, up], 1).bfloat16()


def run_both(x, **kw):
    out = {}
    for strat in STRATEGIES:
        if strat == "persistent" and (x.shape[1] // 2) % PERSISTENT_I_MULTIPLE:
            with pytest.raises(ValueError, match=f"strategy='persistent' needs I % {PERSISTENT_I_MULTIPLE} == 0"):
                swiglu_quant(x.to(DEV), strategy=strat, **kw)
            continue
        out[strat] = swiglu_quant(x.to(DEV), strategy=strat, **kw)
    out["unfused"] = swiglu_quant_unfused(x.to(DEV), **kw)
    return out


# (40, 136): I % 16 == 8 over several row blocks, where the persistent kernel wrote wrong codes on
# the H200 (it now refuses such widths; the others must be right there); (40, 144): a width off
# the 128-multiples that the persistent kernel takes
@pytest.mark.parametrize("m,i", [(1, 128), (3, 384), (9, 256), (4, 200), (40, 136), (40, 144)])
def test_matches_reference_bitwise(m, i):
    x = _gate_up(m, i, seed=m * 7 + i)
    assert (x[:, :i].float() > 10.0).any() or m * i < 1000, "no gate past the clamp: the inputs cannot see it"
    rq, rs = ref.swiglu_quant(x, 10.0)
    for name, (q, s) in run_both(x).items():
        assert_bytes_equal(s, rs, f"{name} scales m={m} i={i}")
        assert_bytes_equal(q, rq, f"{name} codes m={m} i={i}")
    if (x[:, :i].float() > 10.0).any():  # negative control: without the clamps the codes differ
        assert not torch.equal(ref.swiglu_quant(x, 1e30)[0].view(torch.uint8), rq.view(torch.uint8))


def test_route_weight_applied_before_rounding():
    x = _gate_up(6, 384, seed=3)
    w = torch.rand(6) + 0.25
    rq, rs = ref.swiglu_quant(x, 10.0, w)
    for name, (q, s) in run_both(x, route_weight=w.to(DEV)).items():
        assert_bytes_equal(s, rs, f"{name} scales")
        assert_bytes_equal(q, rq, f"{name} codes")
    _, s_now = ref.swiglu_quant(x, 10.0)
    assert not torch.equal(s_now, rs)  # the weight really changes the result


def test_clamp_active_and_no_lower_gate_clamp():
    i = 128
    x = torch.zeros(3, 2 * i)
    x[0, :i] = 50.0        # gate clamped to 10 from above
    x[0, i:] = torch.linspace(-40, 40, i)   # up clamped to [-10, 10]
    x[1, :i] = -60.0       # very negative gate: NOT clamped to -10 -> silu ~ -5e-25
    x[1, i:] = 1.0
    x[2, :i] = 0.0         # silu(0) = 0 -> all-zero group -> floor scale
    x[2, i:] = 5.0
    x = x.bfloat16()
    rq, rs = ref.swiglu_quant(x, 10.0)
    for name, (q, s) in run_both(x).items():
        assert_bytes_equal(s, rs, f"{name} scales")
        assert_bytes_equal(q, rq, f"{name} codes")
        # gate -60: silu(-60) ~ -5.3e-25, below the 1e-4 amax floor -> scale 2^-22. A
        # lower clamp at -10 would give silu(-10) = -4.54e-4 -> scale 2^-19.
        assert s[1, 0].item() == 2.0 ** -22
        assert s[2, 0].item() == 2.0 ** -22


def test_nan_and_inf_inputs():
    i = 128
    x = torch.full((2, 2 * i), 1.0)
    x[0, 3] = float("nan")          # NaN gate -> NaN h -> NaN code, ignored by amax
    x[1, i + 4] = float("inf")      # inf up -> clamped to 10
    x = x.bfloat16()
    rq, rs = ref.swiglu_quant(x, 10.0)
    for name, (q, s) in run_both(x).items():
        assert_bytes_equal(s, rs, f"{name} scales")
        q8 = q.cpu().view(torch.uint8)
        assert (q8[0, 3].item() & 0x7F) == 0x7F
        rq8 = rq.view(torch.uint8).clone()
        rq8[0, 3] = q8[0, 3]  # sign of a computed NaN is platform-defined
        assert_bytes_equal(q8, rq8, f"{name} codes")


@pytest.mark.parametrize("scale_fmt", ["e8m0", "fp32_cm", "amax"])
def test_scale_formats_fused_equals_unfused(scale_fmt):
    x = _gate_up(5, 384, seed=11)
    res = run_both(x, scale_fmt=scale_fmt)
    q0, s0 = res["unfused"]
    for name in STRATEGIES:
        q, s = res[name]
        assert s.dtype == s0.dtype and s.shape == s0.shape and s.stride() == s0.stride()
        assert_bytes_equal(s, s0, f"{name} {scale_fmt} scales")
        assert_bytes_equal(q, q0, f"{name} {scale_fmt} codes")
    _, rs = ref.swiglu_quant(x, 10.0)
    if scale_fmt == "e8m0":
        assert_bytes_equal(s0, ref.quant.scale_to_e8m0_bits(rs), "e8m0 vs reference")
    elif scale_fmt == "fp32_cm":
        assert s0.shape == (8, 3) and s0.stride() == (1, 8)
        assert_bytes_equal(s0[:5], rs, "fp32_cm vs reference")


@pytest.mark.parametrize("with_map", [False, True])
def test_filtered_rows_left_untouched(with_map):
    m, i = 8, 256
    x = _gate_up(m, i, seed=5)
    w = torch.rand(m)
    ids = torch.tensor([0, -1, 3, 2, -1, 1, 3, 0], dtype=torch.int32)
    emap = torch.tensor([0, -1, 1, -1], dtype=torch.int32) if with_map else None
    keep = ids >= 0
    if with_map:
        keep &= emap[ids.clamp_min(0).long()] >= 0
    rq, rs = ref.swiglu_quant(x, 10.0, w)
    for name in STRATEGIES + ["unfused"]:
        oq = torch.full((m, i), 0x5A, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        os_ = torch.full((m, 2), -3.0, device=DEV)
        kw = dict(route_weight=w.to(DEV), expert_ids=ids.to(DEV),
                  expert_map=emap.to(DEV) if with_map else None, out_q=oq, out_s=os_)
        if name == "unfused":
            swiglu_quant_unfused(x.to(DEV), **kw)
        else:
            swiglu_quant(x.to(DEV), strategy=name, **kw)
        q8, s = oq.cpu().view(torch.uint8), os_.cpu()
        assert (q8[~keep] == 0x5A).all() and (s[~keep] == -3.0).all(), f"{name}: skipped rows were written"
        assert_bytes_equal(q8[keep], rq.view(torch.uint8)[keep], f"{name} kept codes")
        assert_bytes_equal(s[keep], rs[keep], f"{name} kept scales")


@pytest.mark.parametrize("filtered", [False, True])
def test_pairs_output(filtered):
    """pairs=True: bf16(q) in act_quant's "pairs" layout from the same kernel (both
    strategies) and from the unfused twin, bit for bit; skipped rows keep their bytes."""
    m, i = 8, 256
    x = _gate_up(m, i, seed=11)
    w = torch.rand(m)
    ids = torch.tensor([0, -1, 3, 2, -1, 1, 3, 0], dtype=torch.int32) if filtered else None
    keep = ids >= 0 if filtered else torch.ones(m, dtype=torch.bool)
    rq, rs = ref.swiglu_quant(x, 10.0, w)
    want = rq.float().bfloat16().view(m, i // 128, 64, 2).transpose(2, 3).reshape(m, i)
    for name in STRATEGIES + ["unfused"]:
        op = torch.full((m, i), -5.0, dtype=torch.bfloat16, device=DEV)
        kw = dict(route_weight=w.to(DEV), expert_ids=ids.to(DEV) if filtered else None, pairs=True, out_pairs=op)
        if name == "unfused":
            q, s, p = swiglu_quant_unfused(x.to(DEV), **kw)
        else:
            q, s, p = swiglu_quant(x.to(DEV), strategy=name, **kw)
        assert p is op
        assert_bytes_equal(q.view(torch.uint8)[keep.to(q.device)], rq.view(torch.uint8)[keep], f"{name} codes")
        assert_bytes_equal(p[keep.to(p.device)], want[keep], f"{name} pairs")
        assert (p.cpu()[~keep] == -5.0).all(), f"{name}: skipped rows' pairs were written"
    with pytest.raises(ValueError, match="pairs=True needs I % 128 == 0.*I=200"):
        swiglu_quant(_gate_up(2, 200, seed=1).to(DEV), pairs=True)
    with pytest.raises(ValueError, match="out_pairs given with pairs=False"):
        swiglu_quant_unfused(x.to(DEV), out_pairs=torch.empty(m, i, dtype=torch.bfloat16, device=DEV))


def test_m0_no_launch(monkeypatch):
    import dsv4_moe.kernels._swiglu_quant as body

    monkeypatch.setattr(body, "launch_swiglu_quant", lambda *a, **k: pytest.fail("launched for M=0"))
    q, s = swiglu_quant(torch.empty(0, 768, dtype=torch.bfloat16, device=DEV))
    assert q.shape == (0, 384) and s.shape == (0, 3)
    q, s = swiglu_quant_unfused(torch.empty(0, 768, dtype=torch.bfloat16, device=DEV))
    assert q.shape == (0, 384) and s.shape == (0, 3)


def test_strategy_rule():
    assert choose_strategy(1, 2048, filtered=False) == "group"
    assert choose_strategy(96, 2048, filtered=True) == "group"          # routed decode: launch-bound
    assert choose_strategy(8192 * 6, 384, filtered=True) == "persistent"
    assert choose_strategy(8192, 2048, filtered=False) == "persistent"
    # widths off the multiples of 16 (none in DeepSeek-V4) stay on the group kernel at any size
    assert choose_strategy(PERSISTENT_MIN_ELEMENTS, 1000, filtered=False) == "group"
    assert choose_strategy(PERSISTENT_MIN_ELEMENTS, 1008, filtered=False) == "persistent"
    with pytest.raises(ValueError, match="strategy='persistent' needs I % 16 == 0, got I=200"):
        swiglu_quant(_gate_up(2, 200, seed=3).to(DEV), strategy="persistent")


def test_wrapper_errors_name_the_argument():
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="gate_up.dtype"):
        swiglu_quant(x.float())
    with pytest.raises(ValueError, match="2I"):
        swiglu_quant(torch.zeros(2, 255, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="route_weight"):
        swiglu_quant(x, route_weight=torch.ones(3, device=DEV))
    with pytest.raises(ValueError, match="expert_ids"):
        swiglu_quant(x, expert_ids=torch.zeros(2, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="expert_map given without expert_ids"):
        swiglu_quant(x, expert_map=torch.zeros(4, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="strategy"):
        swiglu_quant(x, strategy="fast")
    with pytest.raises(ValueError, match="out_q"):
        swiglu_quant(x, out_q=torch.empty(2, 256, dtype=torch.float8_e4m3fn, device=DEV))


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
def test_rows_strategy_matches_filtered_rows(monkeypatch, pairs, one_row):
    """strategy "rows" (the routed path: align.route_rows lists the GEMM row of each local
    route, -1 for the others) computes exactly the listed rows, bit for bit the reference
    there and the expert_ids-filtered call's bytes everywhere; unlisted rows keep theirs.
    37 listed entries span three 16-row programs, the last one partial; -1 and an
    out-of-range entry are skipped (one_row: the one-row-per-program launch of short lists).
    The unfused twin takes the same rows argument."""
    import dsv4_moe.kernels._swiglu_quant as body

    monkeypatch.setattr(body, "ROWS_SMALL_MAX_R", 1 << 30 if one_row else 0)
    m, i = 40, 256
    x = _gate_up(m, i, seed=13)
    w = torch.rand(m)
    g = torch.Generator().manual_seed(3)
    listed = torch.randperm(m, generator=g)[:35].int()
    rows = torch.cat([listed[:20], torch.tensor([-1], dtype=torch.int32), listed[20:],
                      torch.tensor([m + 5], dtype=torch.int32)])
    keep = torch.zeros(m, dtype=torch.bool)
    keep[listed.long()] = True
    ids = torch.where(keep, 0, -1).int()
    rq, rs = ref.swiglu_quant(x, 10.0, w)
    outs = {}
    for name in ("rows", "filtered", "unfused"):
        oq = torch.full((m, i), 0x5A, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        os_ = torch.full((m, 2), -3.0, device=DEV)
        op = torch.full((m, i), -5.0, dtype=torch.bfloat16, device=DEV) if pairs else None
        kw = dict(route_weight=w.to(DEV), out_q=oq, out_s=os_, pairs=pairs, out_pairs=op)
        if name == "rows":
            swiglu_quant(x.to(DEV), rows=rows.to(DEV), **kw)
        elif name == "filtered":
            swiglu_quant(x.to(DEV), expert_ids=ids.to(DEV), strategy="group", **kw)
        else:
            swiglu_quant_unfused(x.to(DEV), rows=rows.to(DEV), **kw)
        outs[name] = (oq.cpu(), os_.cpu(), op.cpu() if pairs else None)
        q8, s = oq.cpu().view(torch.uint8), os_.cpu()
        assert (q8[~keep] == 0x5A).all() and (s[~keep] == -3.0).all(), f"{name}: unlisted rows were written"
        assert_bytes_equal(q8[keep], rq.view(torch.uint8)[keep], f"{name} listed codes")
        assert_bytes_equal(s[keep], rs[keep], f"{name} listed scales")
    for name in ("filtered", "unfused"):
        for a, b, what in zip(outs["rows"], outs[name], ("q", "s", "pairs")):
            if a is not None:
                assert_bytes_equal(a, b, f"rows vs {name}: {what}")


def test_rows_argument_errors():
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=DEV)
    r = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="rows must be an int32"):
        swiglu_quant(x, rows=r.long())
    with pytest.raises(ValueError, match="strategy='group' with rows=given"):
        swiglu_quant(x, rows=r, strategy="group")
    with pytest.raises(ValueError, match="strategy='rows' with rows=None"):
        swiglu_quant(x, strategy="rows")
    with pytest.raises(ValueError, match="fp32_cm"):
        swiglu_quant_unfused(x, rows=r, scale_fmt="fp32_cm")


def _partials(p, r, i, seed):
    """fp32 [P, R, 2I] split-K partials whose in-order sums reach past the clamp (|.| > 10)
    and whose sum order matters in bf16 (checked by the test's negative control)."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(p, r, 2 * i, generator=g) * 3.0
    # gate column 0: +0.0 + 1e8 + 1 - 1e8 + 0.25 = 0.25 in this order, 0 in the reverse one
    parts[:, :, 0] = torch.tensor([1e8, 1.0, -1e8, 0.25])[:, None]
    parts[:, 0, 5] = -0.0  # an all -0.0 column: +0.0 + (-0.0) ... = +0.0
    return parts


@pytest.mark.parametrize("pairs,scale_fmt", [(False, "fp32"), (True, "fp32"), ("scaled", "fp32"), (False, "e8m0")])
def test_partials_equal_reduce_then_rows(pairs, scale_fmt):
    """swiglu_quant_partials (the split-K gate_up's reduce folded into the SwiGLU-quant) is
    bit for bit the reduce - bf16(+0.0 + parts[0] + ... + parts[P-1]) written to row rows[r]
    - followed by swiglu_quant(rows=...): codes, scales and pairs; a route with row -1, one
    past M and the rows never listed keep their bytes. Negative control: the reversed sum
    order gives other codes, so the comparison sees the order."""
    p_n, r, i, m = 4, 9, 256, 40
    parts = _partials(p_n, r, i, seed=21)
    g = torch.Generator().manual_seed(4)
    rows = torch.randperm(m, generator=g)[:r].int()
    rows[3], rows[7] = -1, m + 2
    w = torch.rand(m, generator=g)
    keep = torch.zeros(m, dtype=torch.bool)
    keep[rows[(rows >= 0) & (rows < m)].long()] = True

    def reduce(order):
        acc = torch.zeros(r, 2 * i)
        for j in order:
            acc = acc + parts[j]
        gu = torch.zeros(m, 2 * i, dtype=torch.bfloat16)
        ok = (rows >= 0) & (rows < m)
        gu[rows[ok].long()] = acc[ok].bfloat16()
        return gu

    def fresh():
        oq = torch.full((m, i), 0x5A, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        os_ = (torch.full((m, 2), 0x7B, dtype=torch.uint8, device=DEV).view(torch.float8_e8m0fnu)
               if scale_fmt == "e8m0" else torch.full((m, 2), -3.0, device=DEV))
        op = torch.full((m, i), -5.0, dtype=torch.bfloat16, device=DEV) if pairs else None
        return dict(route_weight=w.to(DEV), scale_fmt=scale_fmt, out_q=oq, out_s=os_, pairs=pairs, out_pairs=op)

    kw = fresh()
    got = swiglu_quant_partials(parts.to(DEV), rows.to(DEV), m, **kw)
    kw2 = fresh()
    want = swiglu_quant(reduce(range(p_n)).to(DEV), rows=rows.to(DEV), **kw2)
    assert len(got) == (3 if pairs else 2)
    for a, b, what in zip(got, want, ("q", "s", "pairs")):
        assert_bytes_equal(a, b, f"partials vs reduce + rows: {what}")
    q8 = got[0].cpu().view(torch.uint8)
    assert (q8[~keep] == 0x5A).all(), "unlisted rows were written"
    assert int(keep.sum()) == r - 2
    rev = swiglu_quant(reduce(reversed(range(p_n))).to(DEV), rows=rows.to(DEV), **fresh())
    assert not torch.equal(rev[0].cpu().view(torch.uint8), q8), "negative control: sum order not seen"


def test_partials_argument_errors():
    parts = torch.zeros(2, 3, 256, device=DEV)
    rows = torch.zeros(3, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="partials must be a float32"):
        swiglu_quant_partials(parts.bfloat16(), rows, 4)
    with pytest.raises(ValueError, match="rows has 2 entries, partials 3 routes"):
        swiglu_quant_partials(parts, rows[:2], 4)
    with pytest.raises(ValueError, match="num_rows=-1"):
        swiglu_quant_partials(parts, rows, -1)
    with pytest.raises(ValueError, match="partials must be contiguous"):
        swiglu_quant_partials(parts.transpose(0, 1), rows, 4)
    with pytest.raises(ValueError, match="route_weight must be a contiguous float32"):
        swiglu_quant_partials(parts, rows, 4, route_weight=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="fp32_cm"):
        swiglu_quant_partials(parts, rows, 4, scale_fmt="fp32_cm")
    q, s = swiglu_quant_partials(torch.zeros(2, 0, 256, device=DEV), rows[:0], 4)  # no route: no launch
    assert q.shape == (4, 128) and s.shape == (4, 1)
