"""fp8_block_gemm_nt — FP8 GEMM with 1x128 activation and 128x128 weight block scales (Triton).

    out[m, n] = bf16( sum_kb  dot(q[m, kb], w[n, kb]) * sa[m, kb] * sw[n // 128, kb] )

The shared expert's two GEMMs (SPEC §4.3), "NT": both operands K-contiguous, as stored
in the checkpoint. Any M >= 1, N, K (K need not be a multiple of 128; the last block is
partial) -- I = 384 (N = 768 for gate_up, K = 384 for down) is served unpadded.

`choose_config(M, N, K)` picks tiles and, for decode, the exact split-K (see its
comments); any config can be forced with `config=`, the split with `split_k=` (the GPU
sweep in scripts/gpu_check_shared.py does). Triton is imported lazily.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_moe._types import is_int

__all__ = ["fp8_block_gemm_nt", "choose_config", "choose_split_k", "NUM_SMS_H200",
           "SPLIT_K_MAX_WS_FRACTION", "SPLIT_K_MIN_KB", "FAST_PREFILL_IMPRECISE",
           "OVERLAPPED_GEMV_SPLIT"]

_BLOCK = 128
NUM_SMS_H200 = 132
# Exact split-K (decode) writes an fp32 workspace [KB, M, N] in phase 1 and reads it back
# in phase 2: 4*KB*M*N bytes each way, i.e. (M / 32) x the weight bytes N*K. It is used
# only while that is at most this fraction of the weight bytes (M <= 4 when 128 | K).
# NOTE: measured on the H200 (docs/bench/2026-11-29/gpu_check_shared.txt, split-K table):
# split-K wins at M = 1..4 on the gate_up shapes (Flash 19.8 -> 14.8 us, Pro-TP8
# 28.5 -> 13.7 us, Pro-TP1 30.9 -> 22.5 us) but loses at M = 16 on Pro-TP1 gate_up
# (25.9 -> 28.9 us) and Flash down (12.4 -> 13.6 us), so the limit was cut from 0.5
# (M <= 16) to 0.125.
SPLIT_K_MAX_WS_FRACTION = 0.125
# ... and only for K >= 8 blocks (1024): with fewer blocks the single pass is short and
# launch-bound already, and phase 2 is a second launch (re-tune from gpu_check_shared).
SPLIT_K_MIN_KB = 8
# Programs to aim for in split-K phase 1: ~4 per SM (each holds <= 40 KB of smem at
# 16 x 64 tiles, 4 stages, so several co-reside and keep loads in flight).
_SPLIT_K_PROGRAMS_PER_SM = 4
# Pipeline stages of the decode tile (M = 2-16, 16 x 64 mma.sync). A/B switch (session 42): fewer stages
# take less shared memory from the SMs the routed gate_up shares with the overlapped shared gate_up (its
# 12 unsplit programs at Pro-TP8 T = 5-16 span the routed gate_up). NOTE (session 42, H200, the layer
# bench --graph-chain, Pro-TP8, alternating runs in two calls, us, docs/bench/2026-12-01/session42/
# all_call{8,9}_6f07add.log; 4 / 3 / 2 stages): T=8 92.5, 91.9 / 92.0 / 95.0, 95.3; T=9 97.5, 97.4, 96.8,
# 97.0 / 96.4, 96.1, 96.0 / 101.5, 101.1; T=10 103.0, 103.4 / 103.8, 103.2; T=12 117.1 / 117.7 / 119.0,
# 118.4; T=16 136.9, 137.3, 137.8 / 169.4, 168.6, 168.3 / 150.4, 150.0. Three stages are ~1 us faster at
# T = 9 only and 31 us slower at T = 16, so 4 stays. Session 43's timeline of T = 16 (docs/bench/2026-12-01/
# session43/timeline_layer_t16s{4,3}_27f208e.txt, us, 4 / 3 stages): the shared gate_up 53.7 / 41.6, the
# routed gate_up beside it 78.8 / 109.8 - the loss is the routed kernel's (its unsplit T = 16 grid fills one
# wave only just; DESIGN.md session 43 item 3). At T = 13-14 (now split-K) 3 stages were level.
DECODE_NUM_STAGES = 4
# tl.dot max_num_imprecise_acc of the faster, less accurate prefill mode (see
# _fp8_block_gemm's NOTE): the whole 128-wide block accumulates inside the tensor core.
FAST_PREFILL_IMPRECISE = 128


# M = 1 runs the CUDA-core GEMV body (GEMV=True) with BLOCK_N 64; when split (the rule
# below at ~8 programs per SM says so) two K blocks per program (see choose_config).
# NOTE: measured on the H200 (scripts/gpu_probe_fp8_gemv.py,
# docs/bench/2026-11-29/session2/probe_fp8_gemv.json, CUDA graphs): at M = 1 it beats the
# 16-row mma.sync body on all six V4 shapes (Flash gate_up 9.6 -> 7.7 us, down 7.5 ->
# 5.8, Pro-TP8 down 4.5 -> 4.0, Pro-TP1 gate_up 17.3 -> 15.5, down 12.5 -> 8.9; Pro-TP8
# gate_up 7.3 -> 7.5 at 16 splits) and loses from M = 2 on (each row re-reads the
# weights from L1/L2: Flash gate_up M = 2 9.9 vs 11.1 us), so only M = 1 uses it.
# 0 % of outputs off the float64-summed reference at every shape.
_GEMV_PROGRAMS_PER_SM = 8
# A GEMM that runs beside the routed experts (the layer's shared expert on its side stream:
# `overlapped=True`, set from dispatch.side_stream_scope) may take smaller grids, so that the
# routed front's one-program kernels get SMs (session 27's timelines: at Flash T = 4 the
# alignment's 2.8 us stretched to 10.8 beside the shared expert's split-K grid). The split-K
# target of such a GEMM comes from the caller (`split_k_programs_per_sm`; the layer takes it
# from dispatch.shared_split_policy). Every choice gives the same bits (the split-K is exact).
#   OVERLAPPED_GEMV_SPLIT  M = 1: split the GEMV over K (False: N / 64 programs)
# NOTE (session 28, H200, gpu_profile_layer.py --ab, 12 forwards per graph, 3 captures, us,
# True / False): Pro-TP8 T=1 33.0 / 79.5, Flash T=1 55.7 / 83.8 - the unsplit GEMV is far too
# slow beside the routed experts, so True stays.
OVERLAPPED_GEMV_SPLIT = True
# On by default since session 41 (built session 40): the MMA tiles (M >= 2) load each K block's two
# scales one K step ahead. Why: the sm_90a SASS of the K loop (compiled offline, the 64 x 64 wgmma
# and 16 x 64 mma.sync tiles, session 40) issues the scale loads (LDG: sa per row, sw per column as
# 16 byte loads per thread) inside the iteration that consumes them - in the mma.sync loop after most
# of its HMMAs - while the operand tiles arrive by cp.async 4 stages ahead; the GEMMs took ~0.5 us per
# K block per program at every tile (scripts/gpu_probe_mid_m.py), about one L2/DRAM round trip. With
# it a tile of <= 128 columns loads one scalar sw per block (its columns share it). The same products
# in the same order: the same bits (tests/test_kernels_fp8_gemm.py, natively on the H200 too).
# NOTE (session 41, H200; docs/bench/2026-12-01/session41/): alone (gpu_probe_mid_m.py, L2-warm, us,
# False / True) Pro-TP8 gate_up M=8 19.1 / 17.0, M=64 (16-row) 19.2 / 17.1, M=512 34.5 / 31.8,
# M=4096 137.7 / 126.7; Flash gate_up M=64 15.7 / 13.5, M=4096 322.4 / 281.5 (the 64 x 128 tile at
# 255 registers does not spill); down M=8 2.8 / 2.6. In the layer (gpu_profile_layer.py --ab, 4
# weight sets, median of 3 interleaved captures, output bitwise the same): Pro-TP8 T=8 92.0 / 91.8,
# T=512 685.6 / 680.9, T=1024 844.1 / 840.4, T=32-256 level; Flash T=64 876.9 / 870.6, T=256
# 1238.3 / 1231.5, T=1024 1690.0 / 1669.9; the layer bench at T=8192: Pro-TP8 3192.5 / 3146.4,
# Flash 7482.8 / 7352.9. The shared expert is a small part of the layer, so ~1 %.
SCALE_PREFETCH = True
# A/B switch (session 39, off by default): split the 64-row tiles (M > 16) over K, to about this
# many programs per SM, when their tiles leave SMs idle - ignoring SPLIT_K_MAX_WS_FRACTION (at
# Pro-TP8's shared gate_up, M = 64: 12 tiles of 64 x 64 each streaming K = 7168; the workspace
# [KB, M, N] is 2x the weights). The same bits (the exact split-K of the same tile config).
# NOTE (session 39, H200, docs/bench/2026-12-01/session39/): alone (scripts/gpu_probe_wide_split.py,
# 4 per SM, L2-warm) the Pro-TP8 gate_up at M = 32 / 64 / 128 takes 26.0 -> 9.6 / 11.4 / 16.9 us, at
# M = 256 46.3 -> 47.1; Flash's (64 tiles) loses, M = 64 15.8 -> 27.6, M = 256 27.8 -> 129.0. In the
# Pro-TP8 layer (bench, graph-chain, us, off / 4 per SM): T=24 200.4 / 203.5, T=32 264.0 / 243.3,
# T=48 322.1 / 324.3, T=64 373.3 / 366.8 and 375.3 / 367.0, T=96 465.4 / 454.5, T=128 512.3 / 510.3,
# T=256 589.4 / 646.7; with the fork after the alignment at T = 64-128 it loses (T=64 418.4). No rule
# held across T, so it stays off; the shared expert's cost it attacks is measured in DESIGN session 39.
SPLIT_K_WIDE_PROGRAMS_PER_SM = 0
# Mid M (16 < M <= MID_M_MAX) on narrow GEMMs with a long K (N <= MID_M_MAX_N, K of at least
# MID_M_MIN_KB 128-blocks: V4-Pro TP8's shared gate_up, N = 768, K = 7168, and narrower per-rank
# widths), where the 64-row tiles are few programs each streaming all of K: row blocks of
# MID_M_BLOCK_M (M <= 256) or MID_M_BLOCK_M_LARGE (M > 256) on Triton's mma.sync, 64 columns, one
# pass (each row block re-reads the weights, mostly from the L2). Elsewhere 64-row wgmma tiles.
# MID_M_BLOCK_M = MID_M_BLOCK_M_LARGE = 64 turns the rule off.
# NOTE (session 40, H200, docs/bench/2026-12-01/session40/): alone (scripts/gpu_probe_mid_m.py,
# L2-warm, us, 64-row wgmma / 16-row mma.sync, % of bf16 outputs off the fp64-summed result) the
# Pro-TP8 gate_up at M = 32 / 64 / 128 takes 26.0 / 26.0 / 26.1 -> 19.3 / 19.4 / 19.5 us, 2.6-2.8 % ->
# 0.004 % off; the Pro-TP8 down (K = 3 blocks) 3.3 -> 6.0 (why MID_M_MIN_KB), Flash's gate_up at
# M = 64 15.8 -> 15.7. In the Pro-TP8 layer, beside the routed experts on the side stream (bench,
# graph-chain, us, 64-row / 16-row): T=17 162.7 / 163.0, T=24 199.3 / 198.2, T=32 265.2 / 240.8,
# T=64 361.9 / 355.0, T=96 473.4 / 451.7, T=128 500.3 / 496.7, T=160 558.0 / 541.7, T=192 572.4 /
# 537.6, T=256 603.7 / 590.6 (T=32 in five runs over three calls: 240.6-241.2 against 261.2-265.6;
# the spread between runs of one config is up to ~13 us at T >= 96); above T = 256 (64-row / 16-row /
# 32-row): T=384 619.0 and 638.1 / 624.8 / 618.6, T=512 676.9 and 681.2 / 654.8 / 659.6, T=768 772.7
# and 775.4 / 748.8 / 732.8, T=1024 825.1 and 833.4 / 821.3 / 779.3; 32-row at T <= 128 was 0.8-2.8
# us behind 16-row. The smaller programs (72-80 registers, 10 KB of shared memory per stage against
# ~200 and 16 KB) share the SMs with the routed grid better. Split over K they lost at T >= 64 (T=64
# ~420). In the Flash layer (N = 4096, the shared expert in line at these T; 16-row tiles at every
# M <= 256) it was mixed: T=24 464.3 / 483.0, T=32 584.5 / 566.2, T=64 841.9 / 833.0, T=128 1041.7 /
# 1058.3, T=256 1153.9 / 1185.2 - so the rule keeps N > 768 on the wgmma tiles.
MID_M_BLOCK_M = 16
MID_M_BLOCK_M_LARGE = 32
MID_M_MAX = 1024
MID_M_MAX_N = 768
MID_M_MIN_KB = 8


def choose_split_k(m: int, n: int, k: int, tiles: int, num_sms: int = NUM_SMS_H200,
                   programs_per_sm: int = _SPLIT_K_PROGRAMS_PER_SM) -> int:
    """Number of K-block groups for the exact split-K path (1 = single pass).

    Split only when the output tiles alone cannot occupy the GPU (tiles < num_sms), K has
    at least SPLIT_K_MIN_KB blocks, and the fp32 workspace 4*KB*M*N is at most
    SPLIT_K_MAX_WS_FRACTION of the weight bytes N*K. Then aim for ~4 programs per SM.
    """
    kb = -(-k // _BLOCK)
    if kb < SPLIT_K_MIN_KB or tiles >= num_sms or 4 * kb * m * n > SPLIT_K_MAX_WS_FRACTION * n * k:
        return 1
    return min(kb, -(-programs_per_sm * num_sms // tiles))


def choose_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_H200, fast_accum: bool = False,
                  overlapped: bool = False, split_k_programs_per_sm: Optional[int] = None) -> dict:
    """Tile config for an [M, K] x [N, K]^T FP8 GEMM (keys: BLOCK_M, BLOCK_N, GROUP_M,
    num_warps, num_stages, IMPRECISE, SPLIT_K).

    M = 1: the CUDA-core GEMV body (GEMV=True, see _GEMV_PROGRAMS_PER_SM).
    Decode (M <= 16): weight-bandwidth bound, a GEMV in disguise. BLOCK_M = 16 (Triton
    then uses mma.sync, whose fp8 sums matched the reference bitwise on the H200) and
    BLOCK_N = 64 (the fastest single-pass tile at M = 1 on 4 of the 6 V4 shapes in the
    H200 sweep). N / 64 tiles alone put 12-112 programs on 132 SMs, each streaming all of
    K (measured ~1 TB/s), so the exact split-K (choose_split_k) spreads K over ~4
    programs per SM.
    Mid M (<= 128): 64-row tiles, single pass (the split-K workspace would outweigh the
    weights); on narrow GEMMs with a long K (MID_M_MAX_N, MID_M_MIN_KB: V4-Pro TP8's shared
    gate_up) 16-row mma.sync blocks instead, 32-row from M = 257 to MID_M_MAX.
    Prefill: 64 x 128, 4 warps, 4 stages -- the best of the swept configs at M = 4096 on
    all six shapes (H200: flash gate_up 302 us vs 540 us for 128 x 128 x 8 warps and
    1393 us for 128 x 256, which spills: the fp32 accumulator plus the fp32 block
    partial need 2 x 128 registers per thread). Re-tune from the `sweep` rows of
    scripts/gpu_check_shared.py.
    fast_accum=True: IMPRECISE = FAST_PREFILL_IMPRECISE for the wgmma (M > 16) tiles:
    faster, and ~2.5x as many bf16 outputs off by an ulp or more (see _fp8_block_gemm).
    overlapped=True: M = 1 on a GEMM beside the routed experts (OVERLAPPED_GEMV_SPLIT).
    split_k_programs_per_sm: the split-K target at M = 2-16 (None: ~4 programs per SM; 0: no
    split, N / 64 programs).
    """
    if split_k_programs_per_sm is not None and (not is_int(split_k_programs_per_sm) or split_k_programs_per_sm < 0):
        raise ValueError(f"split_k_programs_per_sm={split_k_programs_per_sm!r}: expected None or an int >= 0")
    imp = FAST_PREFILL_IMPRECISE if fast_accum else 32
    if m == 1:
        tiles = -(-n // 64)
        split = choose_split_k(m, n, k, tiles, num_sms, _GEMV_PROGRAMS_PER_SM)
        if split == 1 or (overlapped and not OVERLAPPED_GEMV_SPLIT):
            return dict(BLOCK_M=1, BLOCK_N=64, GROUP_M=1, num_warps=2, num_stages=4, IMPRECISE=32, GEMV=True,
                        SPLIT_K=1)
        # NOTE (session 7): two K blocks per program, loaded as one tile (KB_VEC), 4 warps.
        # H200, weights rotated over 8 copies, us default (~8 programs per SM, the block
        # loop) -> this (docs/bench/2026-11-29/session7/probe_fp8_gemv_vec_80c262f.txt):
        # Flash gate_up 8.59 -> 7.89, down 5.95 -> 5.46, Pro-TP8 gate_up 5.43 -> 4.76, Pro-TP1
        # gate_up 16.94 -> 16.65, down 10.56 -> 10.19; bitwise the same outputs. Four blocks
        # per program with 2 warps spilled (Pro-TP1 gate_up 29.7 us).
        # NOTE (session 41, measured and removed): the GEMV body's scale loads written before its
        # product sums (the sm_90a SASS issues them after the sum, a second memory round trip per
        # program; moved, with the operands'). Alone (gpu_probe_mid_m.py, us, kept / moved, two runs
        # each): Pro-TP8 gate_up 4.5 / 4.2, Flash gate_up 6.3 / 6.2, Flash down 4.9, 4.5 / 5.3, 5.3,
        # Pro-TP8 down 3.1 / 3.1; the layer at T = 1 (gpu_profile_layer.py --ab, median of 5 captures):
        # Pro-TP8 32.9 / 32.7, Flash 53.6 / 53.5 - level in the layer, mixed alone (docs/bench/
        # 2026-12-01/session41/all_call4_caa4c10.log).
        return dict(BLOCK_M=1, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4, IMPRECISE=32, GEMV=True,
                    SPLIT_K=-(-(-(-k // _BLOCK)) // 2), KB_VEC=True)
    # NOTE (session 40, H200, the Pro-TP8 layer bench, graph-chain, us, T = 4 / 8 / 12 / 16; the shared
    # expert beside the routed experts; docs/bench/2026-12-01/session40/all_call7_9a29c08.log): this
    # config 64.2 / 92.2 / 120.2 / 141.0 (again 64.4 / 92.1 / 120.4 / 141.0); BLOCK_N 32: 63.2 / 92.5 /
    # 121.5 / 144.8; BLOCK_N 128: 66.9 / 100.2 / 128.5 / 161.5; split-K without the workspace cap
    # (SPLIT_K_MAX_WS_FRACTION 1.0, ~4 programs per SM): 64.7 / 94.9 / 121.6 / 143.3, at ~1 per SM:
    # 63.1 / 94.2 / 124.7 / 166.1. Kept.
    if m <= 16:
        tiles = -(-n // 64)
        pps = _SPLIT_K_PROGRAMS_PER_SM if split_k_programs_per_sm is None else split_k_programs_per_sm
        split = choose_split_k(m, n, k, tiles, num_sms, pps) if pps > 0 else 1
        if DECODE_NUM_STAGES not in (2, 3, 4):
            raise ValueError(f"fp8_block_gemm.DECODE_NUM_STAGES={DECODE_NUM_STAGES!r}: expected 2, 3 or 4")
        return dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=DECODE_NUM_STAGES, IMPRECISE=32,
                    SPLIT_K=max(1, split))
    for name, v in (("MID_M_BLOCK_M", MID_M_BLOCK_M), ("MID_M_BLOCK_M_LARGE", MID_M_BLOCK_M_LARGE)):
        if v not in (16, 32, 64):
            raise ValueError(f"fp8_block_gemm.{name}={v!r}: expected 16, 32 or 64")
    mid = m <= MID_M_MAX and n <= MID_M_MAX_N and -(-k // _BLOCK) >= MID_M_MIN_KB
    bm = (MID_M_BLOCK_M if m <= 256 else MID_M_BLOCK_M_LARGE) if mid else 64
    bn = 128 if bm == 64 and (m > 128 or -(-m // 64) * -(-n // 128) >= num_sms) else 64
    tiles = -(-m // bm) * -(-n // bn)
    split = 1
    if SPLIT_K_WIDE_PROGRAMS_PER_SM > 0 and tiles < num_sms and -(-k // _BLOCK) >= SPLIT_K_MIN_KB:
        split = min(-(-k // _BLOCK), -(-SPLIT_K_WIDE_PROGRAMS_PER_SM * num_sms // tiles))
    return dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8 if bm == 64 else 1, num_warps=4, num_stages=4,
                IMPRECISE=imp if bm == 64 else 32, SPLIT_K=split)


def fp8_block_gemm_nt(q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, *,
                      out: Optional[torch.Tensor] = None, config: Optional[dict] = None,
                      split_k: Optional[int] = None, overlapped: bool = False,
                      split_k_programs_per_sm: Optional[int] = None) -> torch.Tensor:
    """Block-scaled FP8 GEMM, bf16 output.

    Args:
        q    [M, K]                      float8_e4m3fn  activations, unit column stride
        sa   [>=M, ceil(K/128)]          float32        activation scales, any strides (the
                                                        row-major and padded column-major
                                                        act_quant layouts both work)
        w    [N, K]                      float8_e4m3fn  weights, unit column stride
        sw   [ceil(N/128), ceil(K/128)]  float8_e8m0fnu | uint8 (e8m0 bytes) | float32
        out  [M, N]                      bfloat16, optional, unit column stride
        config                           optional tile dict (choose_config's keys)
        split_k                          optional override of config's SPLIT_K: 1 = single
                                         pass, > 1 = exact split-K over that many K-block
                                         groups (clipped to ceil(K/128)); same bits as the
                                         single pass for the same tile config
        overlapped                       the call runs beside the routed experts: choose_config's
                                         `overlapped` grids (the same bits)
        split_k_programs_per_sm          choose_config's split-K target at M = 2-16 (None: ~4
                                         programs per SM, 0: no split; the same bits)
    Returns: out [M, N] bfloat16. M = 0 returns an empty tensor without a launch.
    Split-K allocates a float32 workspace [ceil(K/128), M, N] per call.
    """
    fn = "fp8_block_gemm_nt"
    for name, t in (("q", q), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{fn}: {name} must be a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{fn}: {name}.dtype={t.dtype}, expected torch.float8_e4m3fn")
        if t.numel() and t.stride(1) != 1:
            raise ValueError(f"{fn}: {name}.stride()={tuple(t.stride())}, expected unit column stride")
    m, k = q.shape
    n, kw = w.shape
    if kw != k or k == 0:
        raise ValueError(f"{fn}: q.shape={tuple(q.shape)} and w.shape={tuple(w.shape)} need the same K > 0")
    if n == 0:
        raise ValueError(f"{fn}: w.shape={tuple(w.shape)} has N=0")
    kb = -(-k // _BLOCK)
    for name, t, optional in (("sa", sa, False), ("sw", sw, False), ("out", out, True)):
        if not (isinstance(t, torch.Tensor) or (optional and t is None)):
            raise TypeError(f"{fn}: {name}: expected a torch.Tensor{' or None' if optional else ''}, got "
                            f"{type(t).__name__}")
    if config is not None and not (isinstance(config, dict) and {"BLOCK_M", "BLOCK_N"} <= set(config)):
        raise ValueError(f"{fn}: config={config!r}: expected None or a dict with at least BLOCK_M and BLOCK_N "
                         f"(as choose_config returns)")
    if sa.dtype != torch.float32 or sa.dim() != 2 or sa.shape[0] < m or sa.shape[1] != kb:
        raise ValueError(f"{fn}: sa must be float32 [>={m}, {kb}], got {sa.dtype} {tuple(sa.shape)}")
    if sw.dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32):
        raise ValueError(f"{fn}: sw.dtype={sw.dtype}, expected float8_e8m0fnu, uint8 (e8m0 bytes) or float32")
    if tuple(sw.shape) != (-(-n // _BLOCK), kb):
        raise ValueError(f"{fn}: sw.shape={tuple(sw.shape)}, expected {(-(-n // _BLOCK), kb)}")
    for name, t in (("sa", sa), ("w", w), ("sw", sw)):
        if t.device != q.device:
            raise ValueError(f"{fn}: {name}.device={t.device}, expected q's device {q.device}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or (out.numel() and out.stride(1) != 1):
        raise ValueError(f"{fn}: out must be bfloat16 {(m, n)} with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    if split_k is not None and (not is_int(split_k) or split_k < 1):
        raise ValueError(f"{fn}: split_k={split_k!r}, expected None or an int >= 1")
    if m == 0:
        return out
    cfg = dict(config) if config is not None else choose_config(
        m, n, k, overlapped=overlapped, split_k_programs_per_sm=split_k_programs_per_sm)
    if split_k is not None:
        cfg["SPLIT_K"] = split_k
    cfg.setdefault("SCALE_PREFETCH", SCALE_PREFETCH)
    sk = cfg.get("SPLIT_K", 1)
    if not is_int(sk) or sk < 1:
        raise ValueError(f"{fn}: config SPLIT_K={sk!r}, expected an int >= 1")
    if not 0 < cfg.get("IMPRECISE", 32) <= _BLOCK:
        raise ValueError(f"{fn}: config IMPRECISE={cfg['IMPRECISE']}, expected 1..128 (tl.dot max_num_imprecise_acc)")
    from ._fp8_block_gemm import launch_fp8_block_gemm
    from ._triton_utils import interpreting

    sw_k = sw.view(torch.uint8) if sw.dtype == torch.float8_e8m0fnu else sw
    launch_fp8_block_gemm(q.view(torch.uint8), sa, w.view(torch.uint8), sw_k, out, cfg, interpreting())
    return out
