"""fp8_block_gemm_nt (Triton) vs dsv4_moe.reference.fp8_gemm.

The interpreter runs tl.dot on fp8 operands exactly (fp16 products, fp32 numpy
matmul) and the kernel's bf16 output rounding is done in software there, so on CPU the
only freedom is the in-block fp32 sum order (SPEC §4.3): the bound below is <= 1% of
bf16 outputs differing, by at most 1 bf16 ulp (or, for an output that cancels to far below its
terms, by at most TOLERANCES["fp8_gemm"].max_rel_magnitude of their magnitude). A wrong scale, a swapped block index or
a missing K tail changes most outputs by many ulps. Natively on the GPU the wgmma tiles
(M > 16) have a bound of their own (TOLERANCES["fp8_gemm_wgmma"], measured on the H200).
"""

import _triton_interp
import pytest
import torch

from dsv4_moe import MoEConfig, reference as ref
from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.fp8_block_gemm import (NUM_SMS_H200, SPLIT_K_MAX_WS_FRACTION, SPLIT_K_MIN_KB, choose_config,
                                             choose_split_k, fp8_block_gemm_nt)
from dsv4_moe.kernels.scaled_mm_fp8 import scaled_mm_supported
from dsv4_moe.kernels.deep_gemm_fp8 import deep_gemm_supported
from dsv4_moe.testing import TOLERANCES, local_mismatch_frac

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MAX_DIFF_FRACTION = TOLERANCES["fp8_gemm"].max_mismatch_frac
MAX_ULP = TOLERANCES["fp8_gemm"].max_ulp
# On the GPU the wgmma tiles (BLOCK_M = 64: M > 16 under choose_config, but for the mid-M rule's
# mma.sync blocks on narrow GEMMs, MID_M_MAX_N) sum each 32-wide
# K chunk inside the FP8 tensor core (tl.dot max_num_imprecise_acc = 32) before the fp32
# promotion: their bound is TOLERANCES["fp8_gemm_wgmma"] (a share of differing outputs and the
# error against the magnitude of the terms summed, `_magnitude`; measured on the H200 in sessions
# 35 and 38, see the table). The CUDA-core GEMV (M = 1) and the 16-row mma.sync tiles matched the
# reference bitwise at every shape measured, so they keep the bound above on the GPU too; past
# MAX_ULP (an output cancelling far below its terms) TOLERANCES["fp8_gemm"].max_rel_magnitude.
WGMMA = TOLERANCES["fp8_gemm_wgmma"]
ORDER_REL_MAG = TOLERANCES["fp8_gemm"].max_rel_magnitude


def _wgmma_on_gpu(cfg: dict) -> bool:
    return DEV == "cuda" and not _triton_interp.INTERPRETING and not cfg.get("GEMV") and cfg["BLOCK_M"] >= 64


def _magnitude(q, sa, w, sw):
    """The reference GEMM on |q| and |w|: the scale of the terms each output sums."""
    def absolute(t):
        return (t.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    return ref.fp8_gemm(absolute(q), sa, absolute(w), sw).float()


def assert_near_reference(got, want, case, cfg, what):
    """The kernel's output against the reference's, with the bound of its path (see above)."""
    ulp = bf16_ulp_diff(got, want)
    frac = (ulp > 0).float().mean().item()
    first = tuple((ulp > 0).nonzero()[0].tolist()) if frac else None
    if _wgmma_on_gpu(cfg):
        rel = ((got.float() - want.float()).abs() / _magnitude(*case).clamp_min(1e-30)).max().item()
        local = local_mismatch_frac(got, want)
        assert (frac <= WGMMA.max_mismatch_frac and rel <= WGMMA.max_rel_magnitude
                and local <= WGMMA.max_local_mismatch_frac), (
            f"{what} (wgmma on the GPU): {frac:.4f} of outputs differ ({local:.4f} in the worst row or 128-column "
            f"block), max |d| / mag {rel:.3e}; first at {first}")
    else:
        # an output that cancels to a tiny value can differ by more than MAX_ULP of its own from a
        # last-bit change of its partials: there the bound is the order freedom's, on the magnitude
        far = ulp > MAX_ULP
        if far.any():
            rel = ((got.float() - want.float()).abs() / _magnitude(*case).clamp_min(1e-30))[far].max().item()
            far_ok = rel <= ORDER_REL_MAG
        else:
            rel, far_ok = 0.0, True
        assert frac <= MAX_DIFF_FRACTION and far_ok, (
            f"{what}: {frac:.4f} of outputs differ, max {ulp.max().item()} ulp (past {MAX_ULP} ulp: max |d| / mag "
            f"{rel:.3e}); first at {first}")


def bf16_ulp_diff(a, b):
    """Distance in bf16 ulps (monotone integer mapping of the bit patterns)."""
    def key(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return (key(a) - key(b)).abs()


def make_case(m, n, k, seed, sw_dtype=torch.float8_e8m0fnu):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    q, sa = ref.act_quant(x)
    w = (torch.randn(n, k, generator=g) * 0.7).to(torch.float8_e4m3fn)
    sw = torch.randint(118, 126, (-(-n // 128), -(-k // 128)), generator=g, dtype=torch.uint8)
    sw = sw.view(torch.float8_e8m0fnu) if sw_dtype != torch.float32 else \
        ref.gemm._scales_f32(sw.view(torch.float8_e8m0fnu))
    return q, sa, w, sw


def check(m, n, k, seed=0, config=None, sw_dtype=torch.float8_e8m0fnu):
    q, sa, w, sw = make_case(m, n, k, seed, sw_dtype)
    want = ref.fp8_gemm(q, sa, w, sw)
    got = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV), config=config).cpu()
    assert_near_reference(got, want, (q, sa, w, sw), config or choose_config(m, n, k), f"M={m} N={n} K={k}")
    return got, want


@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (3, 256, 384), (17, 384, 256), (5, 200, 300), (33, 768, 384)])
def test_matches_reference(m, n, k):
    check(m, n, k, seed=m + n + k)


# The shared expert's down GEMM reads SwiGLU-quant codes, not random ones: many small values,
# and every element saturated by the clamp (|silu(g) * u| near silu(L) * L) the same value, so the
# same code in many columns. Session 37 measured the down on the layer's own h at 4.5 % differing
# and 3.4e-3 of the magnitude (Pro-TP8 T = 4096, scripts/gpu_check_layer_stages.py), against the
# random inputs' 2.6 % and 1.84e-3: these cases hold the GPU bound on that distribution too.
SWIGLU_LIMIT = MoEConfig.flash().swiglu_limit


@pytest.mark.parametrize("m,n,k", [(33, 512, 384), (20, 256, 2048)]
                         + ([(1024, 7168, 384), (4096, 4096, 2048), (4096, 7168, 384)] if DEV == "cuda" else []))
def test_down_on_swiglu_quant_codes(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 8).bfloat16()   # ~2 % of h saturated: g, |u| >= L
    q, sa = ref.swiglu_quant(gate_up, SWIGLU_LIMIT)
    _, _, w, sw = make_case(1, n, k, seed=m + n + k)
    want = ref.fp8_gemm(q, sa, w, sw)
    got = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV)).cpu()
    assert_near_reference(got, want, (q, sa, w, sw), choose_config(m, n, k), f"down M={m} N={n} K={k}")


def test_float32_weight_scales_and_forced_config():
    check(20, 256, 256, sw_dtype=torch.float32,
          config=dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2, num_warps=4, num_stages=2))
    check(20, 256, 1024, config=dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2, num_warps=4, num_stages=2, SPLIT_K=3))


def test_column_major_padded_activation_scales():
    q, sa, w, sw = make_case(5, 128, 256, seed=4)
    _, sa_cm = act_quant(torch.zeros(5, 256, dtype=torch.bfloat16, device=DEV), scale_fmt="fp32_cm")
    sa_cm[:5] = sa.to(DEV)
    want = ref.fp8_gemm(q, sa, w, sw)
    got = fp8_block_gemm_nt(q.to(DEV), sa_cm, w.to(DEV), sw.to(DEV)).cpu()
    assert bf16_ulp_diff(got, want).max().item() <= MAX_ULP


@pytest.mark.parametrize("m,k", [(4, 256), (33, 384), (64, 7168)])
def test_wrong_scale_is_caught(m, k):
    # The bounds above must not hide a scale error: a 2x weight scale moves every output (also
    # through the wgmma bound on the GPU, M > 16: K = 7168 is the longest V4 K).
    q, sa, w, sw = make_case(m, 128, k, seed=9)
    want = ref.fp8_gemm(q, sa, w, sw)
    sw2 = (sw.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    got = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw2.to(DEV)).cpu()
    assert (bf16_ulp_diff(got, want) > 0).float().mean().item() > 0.9
    with pytest.raises(AssertionError):
        assert_near_reference(got, want, (q, sa, w, sw), choose_config(m, 128, k), "2x weight scale")


def test_wgmma_bound_sees_one_wrong_block_scale():
    """The wgmma recipe's whole-output bounds (8 % differing, 2^-6 of the magnitude) let one
    128 x 128 weight block with a 2x scale through at N = 4096, K = 7168 (the reference itself
    here, CPU): ~2 % of outputs move, each by ~2e-3 of its magnitude. Its per-128-column-block
    share sees it (~70 % of that block's outputs move)."""
    m, n, k = 64, 4096, 7168
    q, sa, w, sw = make_case(m, n, k, seed=21)
    want = ref.fp8_gemm(q, sa, w, sw)
    sw2 = sw.view(torch.uint8).clone()
    sw2[5, 17] += 1
    got = ref.fp8_gemm(q, sa, w, sw2.view(torch.float8_e8m0fnu))
    frac = (bf16_ulp_diff(got, want) > 0).float().mean().item()
    rel = ((got - want).abs() / _magnitude(q, sa, w, sw).clamp_min(1e-30)).max().item()
    assert frac <= WGMMA.max_mismatch_frac and rel <= WGMMA.max_rel_magnitude, (frac, rel)  # missed by those
    assert local_mismatch_frac(got, want) > 2 * WGMMA.max_local_mismatch_frac


def test_m0_no_launch(monkeypatch):
    import dsv4_moe.kernels._fp8_block_gemm as body

    monkeypatch.setattr(body, "launch_fp8_block_gemm", lambda *a, **k: pytest.fail("launched for M=0"))
    q, sa, w, sw = make_case(1, 128, 128, seed=1)
    out = fp8_block_gemm_nt(q[:0].to(DEV), sa[:0].to(DEV), w.to(DEV), sw.to(DEV))
    assert out.shape == (0, 128) and out.dtype == torch.bfloat16


def test_choose_config_shapes():
    c = choose_config(1, 4096, 4096)                        # V4-Flash gate_up, one token: GEMV body
    assert c.get("GEMV") and c["BLOCK_N"] == 64 and c["SPLIT_K"] >= 16   # ~8 programs per SM
    c = choose_config(2, 4096, 4096)                        # decode batch: 16-row MMA tiles
    assert (c["BLOCK_M"], c["BLOCK_N"]) == (16, 64) and c["SPLIT_K"] > 1 and not c.get("GEMV")
    assert 4096 // 64 * c["SPLIT_K"] >= 2 * NUM_SMS_H200    # split-K fills the GPU
    assert choose_config(4, 768, 7168)["SPLIT_K"] > 1       # V4-Pro TP8 gate_up: 12 tiles
    assert choose_config(1, 7168, 384)["SPLIT_K"] == 1      # K = 3 blocks: single pass
    c = choose_config(8192, 4096, 4096)
    assert c["SPLIT_K"] == 1 and c["IMPRECISE"] == 32 and c["BLOCK_M"] >= 64
    assert choose_config(8192, 4096, 4096, fast_accum=True)["IMPRECISE"] == 128


def test_wide_split_switch(monkeypatch):
    """fp8_block_gemm.SPLIT_K_WIDE_PROGRAMS_PER_SM (an A/B switch, off by default): the 64-row tiles
    (M > 16) stay single pass by default; on, they split over K where their tiles leave SMs idle (the
    same bits: test_split_k_bitwise_equals_single_pass's M = 17 case runs that tile config split)."""
    from dsv4_moe.kernels import fp8_block_gemm as F

    for m in (17, 64, 128, 256, 4096):
        assert choose_config(m, 768, 7168)["SPLIT_K"] == 1
    monkeypatch.setattr(F, "MID_M_BLOCK_M", 64)  # session 39 measured it on the 64-row tiles
    monkeypatch.setattr(F, "SPLIT_K_WIDE_PROGRAMS_PER_SM", 4)
    assert [choose_config(m, 768, 7168)["SPLIT_K"] for m in (64, 128, 256)] == [44, 22, 22]  # 12, 24, 24 tiles
    assert choose_config(64, 7168, 384)["SPLIT_K"] == 1        # K = 3 blocks: below SPLIT_K_MIN_KB
    assert choose_config(4096, 768, 7168)["SPLIT_K"] == 1      # 384 tiles fill the GPU
    assert choose_config(64, 768, 7168)["BLOCK_N"] == 64       # the tile config itself is unchanged


def test_mid_m_rule(monkeypatch):
    """16 < M <= 1024 on narrow GEMMs (N <= MID_M_MAX_N) with a long K (>= MID_M_MIN_KB blocks):
    mma.sync row blocks, 16 rows to M = 256 and 32 above, 64 wide, one pass (session 40: V4-Pro TP8's
    shared gate_up); elsewhere 64-row wgmma tiles; 64 turns it off; a bad value is named."""
    from dsv4_moe.kernels import fp8_block_gemm as F

    def tile(m, n, k):
        c = choose_config(m, n, k)
        return c["BLOCK_M"], c["BLOCK_N"], c["SPLIT_K"]

    for m in (17, 32, 64, 128, 192, 256):               # Pro-TP8 gate_up
        assert tile(m, 768, 7168) == (16, 64, 1)
    for m in (257, 512, 1024):
        assert tile(m, 768, 7168) == (32, 64, 1)
    assert tile(1025, 768, 7168)[0] == 64                # past MID_M_MAX
    assert tile(512, 512, 4096) == (32, 64, 1)           # a narrower per-rank width (Flash at TP8)
    assert tile(64, 7168, 384)[0] == 64                  # Pro-TP8 down: K = 3 blocks
    assert tile(64, 4096, 4096)[0] == 64                 # Flash gate_up: N = 4096
    assert tile(64, 4096, 2048)[0] == 64                 # Flash down
    assert tile(64, 1536, 7168)[0] == 64                 # wider than measured (Pro at TP4)
    assert tile(4096, 768, 7168)[0] == 64                # prefill
    assert tile(16, 768, 7168) == (16, 64, 1)            # decode (M <= 16) as before
    monkeypatch.setattr(F, "MID_M_BLOCK_M", 64)
    assert tile(64, 768, 7168) == (64, 64, 1)
    assert tile(512, 768, 7168)[0] == 32
    monkeypatch.setattr(F, "MID_M_BLOCK_M_LARGE", 64)
    assert tile(512, 768, 7168)[0] == 64
    monkeypatch.setattr(F, "MID_M_BLOCK_M_LARGE", 48)
    with pytest.raises(ValueError, match="MID_M_BLOCK_M_LARGE=48: expected 16, 32 or 64"):
        choose_config(64, 768, 7168)


@pytest.mark.parametrize("bm", [16, 32, 64])
def test_mid_m_row_blocks_vs_reference(monkeypatch, bm):
    """Each mid-M row block (split over K too) against the reference, with its path's bound."""
    from dsv4_moe.kernels import fp8_block_gemm as F

    monkeypatch.setattr(F, "MID_M_BLOCK_M", bm)
    m, n, k = 40, 128, 1024
    assert choose_config(m, n, k)["BLOCK_M"] == bm
    got, _ = check(m, n, k, seed=bm)
    q, sa, w, sw = make_case(m, n, k, seed=bm)
    split = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV), split_k=3).cpu()
    assert torch.equal(split.view(torch.int16), got.view(torch.int16))


def test_decode_num_stages_same_bits(monkeypatch):
    """fp8_block_gemm.DECODE_NUM_STAGES (session 42, an A/B switch, 4): it reaches the decode tile only
    (M = 2-16), its stages give the same bits (pipelining only), and a value off 2-4 is named."""
    from dsv4_moe.kernels import fp8_block_gemm as F

    m, n, k = 9, 128, 1024
    q, sa, w, sw = make_case(m, n, k, seed=42)
    args = (q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV))
    assert choose_config(m, n, k)["num_stages"] == 4
    base = fp8_block_gemm_nt(*args).cpu()
    monkeypatch.setattr(F, "DECODE_NUM_STAGES", 3)
    assert choose_config(m, n, k)["num_stages"] == 3
    assert choose_config(1, n, k)["num_stages"] == 4 and choose_config(64, n, k)["num_stages"] == 4
    got = fp8_block_gemm_nt(*args).cpu()
    assert torch.equal(got.view(torch.int16), base.view(torch.int16))
    assert_near_reference(got, ref.fp8_gemm(q, sa, w, sw), (q, sa, w, sw), choose_config(m, n, k), "3 stages")
    monkeypatch.setattr(F, "DECODE_NUM_STAGES", 5)
    with pytest.raises(ValueError, match="DECODE_NUM_STAGES=5: expected 2, 3 or 4"):
        choose_config(m, n, k)


@pytest.mark.parametrize("m,n,k,config,split_k,sw_dtype", [
    (20, 256, 1024, None, None, torch.float8_e8m0fnu), (20, 256, 1024, None, 3, torch.float8_e8m0fnu),
    (40, 200, 300, None, 2, torch.float8_e8m0fnu), (70, 640, 384, None, None, torch.float32),
    (33, 384, 512, dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=2), None, torch.float8_e8m0fnu),
    (33, 384, 512, dict(BLOCK_M=16, BLOCK_N=256, GROUP_M=1, num_warps=4, num_stages=2), 2, torch.float32)])
def test_scale_prefetch_same_bits(monkeypatch, m, n, k, config, split_k, sw_dtype):
    """fp8_block_gemm.SCALE_PREFETCH (on by default since session 41): the scales loaded one K step
    ahead (one scalar weight scale per block for tiles of <= 128 columns) give the same bits as the
    default loop, single pass and split, whole and partial K blocks, e8m0 and fp32 weight scales,
    tiles wider than one 128-block; and stay within the reference's bound."""
    from dsv4_moe.kernels import fp8_block_gemm as F

    q, sa, w, sw = make_case(m, n, k, seed=m + n + k, sw_dtype=sw_dtype)
    args = (q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV))
    monkeypatch.setattr(F, "SCALE_PREFETCH", False)
    base = fp8_block_gemm_nt(*args, config=dict(config) if config else None, split_k=split_k).cpu()
    monkeypatch.setattr(F, "SCALE_PREFETCH", True)
    got = fp8_block_gemm_nt(*args, config=dict(config) if config else None, split_k=split_k).cpu()
    assert torch.equal(got.view(torch.int16), base.view(torch.int16))
    cfg = dict(config) if config else choose_config(m, n, k)
    assert_near_reference(got, ref.fp8_gemm(q, sa, w, sw), (q, sa, w, sw), cfg, f"prefetch M={m} N={n} K={k}")


def test_choose_split_k_workspace_crossover():
    # Workspace 4*KB*M*N bytes vs weights N*K: (M / 32) x; allowed up to 1/8 -> M <= 4.
    n, k = 4096, 4096
    assert choose_split_k(4, n, k, tiles=64) > 1
    assert choose_split_k(5, n, k, tiles=64) == 1
    assert 4 * (k // 128) * 4 * n <= SPLIT_K_MAX_WS_FRACTION * n * k < 4 * (k // 128) * 5 * n
    assert choose_split_k(1, n, k, tiles=NUM_SMS_H200) == 1          # tiles already fill the GPU
    assert choose_split_k(1, n, 128 * (SPLIT_K_MIN_KB - 1), tiles=8) == 1
    assert choose_split_k(1, n, 128 * SPLIT_K_MIN_KB, tiles=8) == SPLIT_K_MIN_KB  # capped at KB
    assert choose_split_k(1, 768, 7168, tiles=12) == 44               # ~4 programs per SM


@pytest.mark.parametrize("m,n,k,split_k", [(1, 128, 1024, 8), (3, 256, 1024, 3), (5, 200, 300, 2),
                                           (17, 384, 640, 100), (2, 768, 384, 3)])
def test_split_k_bitwise_equals_single_pass(m, n, k, split_k):
    q, sa, w, sw = make_case(m, n, k, seed=m * 7 + k)
    args = (q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV))
    cfg = choose_config(m, n, k)
    one = fp8_block_gemm_nt(*args, config=cfg, split_k=1).cpu()
    many = fp8_block_gemm_nt(*args, config=cfg, split_k=split_k).cpu()
    assert torch.equal(one.view(torch.int16), many.view(torch.int16))
    # the GEMV's in-kernel last-program sum (default at M = 1) == the two-launch phase 2,
    # counters left at 0 (the tile body always takes the second launch)
    two = fp8_block_gemm_nt(*args, config={**cfg, "SPLIT_FIXUP": False}, split_k=split_k).cpu()
    assert torch.equal(two.view(torch.int16), many.view(torch.int16))
    from dsv4_moe.kernels.split_k import tile_counters
    assert int(tile_counters(args[0].device, 0).abs().sum()) == 0
    want = ref.fp8_gemm(q, sa, w, sw)
    assert_near_reference(many, want, (q, sa, w, sw), cfg, f"M={m} N={n} K={k} split {split_k}")


def test_split_k_keeps_cross_block_order():
    # Block partials v0 = 1 + 2^-8, v1..v7 = 2^-24 (half an fp32 ulp of v0, all exact).
    # In order, each add is a tie that rounds back to v0 (even), and bf16(1 + 2^-8) is a
    # tie -> 1.0. Summing v4..v7 first (a plain split-K) gives 2^-22, which survives:
    # 1 + 2^-8 + 2^-22 -> bf16 1 + 2^-7. So only the exact ordered sum yields 1.0.
    m, n, k = 1, 128, 1024
    q = torch.zeros(m, k)
    w = torch.zeros(n, k)
    q[0, 0], w[:, 0] = 1.0, 1.0
    q[0, 1], w[:, 1] = 2.0 ** -4, 2.0 ** -4
    q[0, 128::128], w[:, 128::128] = 2.0 ** -6, 2.0 ** -6
    q, w = q.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa = torch.full((m, 8), 2.0 ** -12)
    sa[:, 0] = 1.0
    sw = torch.full((1, 8), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    want = ref.fp8_gemm(q, sa, w, sw)
    assert bool((want == 1.0).all())
    v = torch.tensor([1 + 2.0 ** -8] + [2.0 ** -24] * 7)

    def seq(xs):
        acc = torch.zeros((), dtype=torch.float32)
        for x in xs:
            acc = acc + x
        return acc
    assert seq(v).bfloat16().item() == 1.0
    assert (seq(v[:4]) + seq(v[4:])).bfloat16().item() == 1 + 2.0 ** -7  # plain split-K differs
    for split_k in (1, 2, 4, 8):
        got = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV), split_k=split_k).cpu()
        assert bool((got == 1.0).all()), f"split_k={split_k}: {got[0, :4]}"


def test_split_k_strided_out_and_float32_scales():
    q, sa, w, sw = make_case(4, 200, 1024, seed=11, sw_dtype=torch.float32)
    big = torch.full((4, 264), 7.0, dtype=torch.bfloat16, device=DEV)
    out = big[:, 32:232]
    fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV), out=out, split_k=4)
    one = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV), split_k=1)
    assert torch.equal(out.cpu().view(torch.int16), one.cpu().view(torch.int16))
    assert bool((big[:, :32] == 7.0).all()) and bool((big[:, 232:] == 7.0).all())


def test_wrapper_errors_name_the_argument():
    q, sa, w, sw = make_case(2, 128, 256, seed=2)
    with pytest.raises(ValueError, match="q.dtype"):
        fp8_block_gemm_nt(q.float(), sa, w, sw)
    with pytest.raises(ValueError, match="same K"):
        fp8_block_gemm_nt(q, sa, w[:, :128], sw)
    with pytest.raises(ValueError, match="sa must be float32"):
        fp8_block_gemm_nt(q, sa[:, :1], w, sw)
    with pytest.raises(ValueError, match="sw.shape"):
        fp8_block_gemm_nt(q, sa, w, sw[:, :1])
    with pytest.raises(ValueError, match="sw.dtype"):
        fp8_block_gemm_nt(q, sa, w, sw.view(torch.int8))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="split_k"):
            fp8_block_gemm_nt(q, sa, w, sw, split_k=bad)
    with pytest.raises(ValueError, match="SPLIT_K"):
        fp8_block_gemm_nt(q, sa, w, sw, config=dict(choose_config(2, 128, 256), SPLIT_K=0))


def test_optional_paths_say_why_on_cpu():
    ok, why = scaled_mm_supported(4, 4096, 4096, "cpu")
    assert not ok and "CUDA" in why
    ok, why = deep_gemm_supported(4, 4096, 4096, "cpu")
    assert not ok and why


@pytest.mark.parametrize("m,n,k,split_k", [(1, 256, 1024, 1), (3, 200, 300, 1), (2, 384, 1024, 4)])
def test_gemv_body_vs_reference(m, n, k, split_k):
    """The CUDA-core decode body (GEMV=True): same bound as the MMA body, its exact
    split-K bitwise equal to its single pass."""
    cfg = dict(BLOCK_M=1, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4, GEMV=True, SPLIT_K=1)
    got, _ = check(m, n, k, seed=m + k, config=cfg)
    if split_k > 1:
        q, sa, w, sw = make_case(m, n, k, seed=m + k)
        many = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV), config=cfg, split_k=split_k).cpu()
        assert torch.equal(got.view(torch.int16), many.view(torch.int16))
    q, sa, w, sw = make_case(m, n, k, seed=m + k)
    sw2 = (sw.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    bad = fp8_block_gemm_nt(q.to(DEV), sa.to(DEV), w.to(DEV), sw2.to(DEV), config=cfg).cpu()
    assert (bf16_ulp_diff(bad, got) > 0).float().mean().item() > 0.9


def test_tile_counters_buffer():
    """kernels/split_k.tile_counters: zeroed int32, grown on demand (never shrunk), one
    buffer per (device, stream); a negative count is refused with the value named."""
    from dsv4_moe.kernels.split_k import tile_counters
    a = tile_counters(torch.device("cpu"), 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and int(a.abs().sum()) == 0
    assert tile_counters("cpu", 5) is a                    # the same buffer while it is big enough
    b = tile_counters("cpu", a.numel() + 1)
    assert b.numel() > a.numel() and int(b.abs().sum()) == 0
    assert tile_counters("cpu", 1) is b
    with pytest.raises(ValueError, match="n=-1"):
        tile_counters("cpu", -1)


@pytest.mark.parametrize("m,n,k,split_k", [(1, 128, 1024, 4), (1, 200, 1300, 3), (2, 256, 2048, 5)])
def test_gemv_kb_vec_equals_the_block_loop(m, n, k, split_k):
    """KB_VEC (a program's K blocks loaded as one tile): the same partials and the same
    ordered sum as the per-block loop, including a ragged last split (k=1300: 11 blocks,
    the last one partial) and float32 weight scales; the fixup and two-launch sums agree."""
    q, sa, w, sw = make_case(m, n, k, seed=3 * m + k)
    args = (q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV))
    cfg = dict(BLOCK_M=1, BLOCK_N=64, GROUP_M=1, num_warps=2, num_stages=4, GEMV=True)
    loop = fp8_block_gemm_nt(*args, config=cfg, split_k=split_k).cpu()
    vec = fp8_block_gemm_nt(*args, config={**cfg, "KB_VEC": True}, split_k=split_k).cpu()
    two = fp8_block_gemm_nt(*args, config={**cfg, "KB_VEC": True, "SPLIT_FIXUP": False}, split_k=split_k).cpu()
    assert torch.equal(loop.view(torch.int16), vec.view(torch.int16))
    assert torch.equal(two.view(torch.int16), vec.view(torch.int16))
    sw32 = args[3].view(torch.uint8).to(torch.int32).add(-127).float().exp2()
    vec32 = fp8_block_gemm_nt(*args[:3], sw32, config={**cfg, "KB_VEC": True}, split_k=split_k).cpu()
    assert torch.equal(vec32.view(torch.int16), vec.view(torch.int16))
    one = fp8_block_gemm_nt(*args, config={**cfg, "KB_VEC": True}, split_k=1).cpu()  # unsplit: the loop
    assert torch.equal(one.view(torch.int16), vec.view(torch.int16))


def test_scaled_mm_opt_in_knob(monkeypatch):
    """DSV4_MOE_SCALED_MM: off by default (the accuracy reason), 'prefill' opens the path
    only from SCALED_MM_MIN_TOKENS tokens, anything else is an error naming the value."""
    from dsv4_moe import stages
    from dsv4_moe.dispatch import DispatchContext
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    monkeypatch.delenv("DSV4_MOE_SCALED_MM", raising=False)
    ok, why = stages.fp8_gemm_scaled_mm_supported(DispatchContext(device=dev, num_tokens=4096))
    assert not ok and "closed by choice" in why and "DSV4_MOE_SCALED_MM=prefill" in why
    monkeypatch.setenv("DSV4_MOE_SCALED_MM", "prefill")
    small = stages.SCALED_MM_MIN_TOKENS - 1
    ok, why = stages.fp8_gemm_scaled_mm_supported(DispatchContext(device=dev, num_tokens=small))
    assert not ok and f"T={small}" in why
    ok, why = stages.fp8_gemm_scaled_mm_supported(DispatchContext(device=torch.device("cpu"), num_tokens=4096))
    assert not ok and "CUDA" in why   # opted in, but the device cannot run it: still closed, with the reason
    monkeypatch.setenv("DSV4_MOE_SCALED_MM", "always")
    with pytest.raises(ValueError, match="DSV4_MOE_SCALED_MM='always'"):
        stages.scaled_mm_mode()


@pytest.mark.parametrize("m,n,k", [(1, 256, 2048), (4, 2048, 2048), (2, 2048, 1024)])
def test_overlapped_grids_same_bits(monkeypatch, m, n, k):
    """fp8_block_gemm_nt(overlapped=True, split_k_programs_per_sm=...) (the shared expert beside
    the routed experts): by default the in-line grids; an unsplit GEMV (OVERLAPPED_GEMV_SPLIT
    False) or a smaller split-K target (0: no split) changes the grid, never the bits; a bad
    target is a ValueError naming it."""
    import dsv4_moe.kernels.fp8_block_gemm as fbg

    assert choose_config(m, n, k, overlapped=True) == choose_config(m, n, k)
    q, sa, w, sw = make_case(m, n, k, seed=m + k)
    args = (q.to(DEV), sa.to(DEV), w.to(DEV), sw.to(DEV))
    want = fp8_block_gemm_nt(*args).cpu()
    assert choose_config(m, n, k)["SPLIT_K"] > 1  # the in-line grid splits K here
    monkeypatch.setattr(fbg, "OVERLAPPED_GEMV_SPLIT", False)
    cfg = choose_config(m, n, k, overlapped=True, split_k_programs_per_sm=0)
    assert cfg["SPLIT_K"] == 1 and choose_config(m, n, k)["SPLIT_K"] > 1
    got = fp8_block_gemm_nt(*args, overlapped=True, split_k_programs_per_sm=0).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if m > 1:
        assert 1 < choose_config(m, n, k, split_k_programs_per_sm=1)["SPLIT_K"] < choose_config(m, n, k)["SPLIT_K"]
        got = fp8_block_gemm_nt(*args, split_k_programs_per_sm=1).cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="split_k_programs_per_sm=-1: expected None or an int >= 0"):
        choose_config(m, n, k, split_k_programs_per_sm=-1)


def test_side_stream_scope_reaches_the_shared_gemm(monkeypatch):
    """The layer's side-stream scope (dispatch.side_stream_scope) is what the fp8_gemm stage
    passes on as `overlapped`."""
    from dsv4_moe import dispatch, stages
    import dsv4_moe.kernels.fp8_block_gemm as fbg

    seen = []
    monkeypatch.setattr(fbg, "fp8_block_gemm_nt", lambda *a, **kw: seen.append(kw["overlapped"]))
    stages.fp8_gemm_triton(None, None, None, None)
    with dispatch.side_stream_scope():
        assert dispatch.on_side_stream()
        stages.fp8_gemm_triton(None, None, None, None)
    assert not dispatch.on_side_stream() and seen == [False, True]
