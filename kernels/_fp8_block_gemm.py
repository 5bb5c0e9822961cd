"""Triton body of fp8_block_gemm_nt: out[M, N] = bf16(sum over 128-wide K blocks of
dot(q, w^T) * sa[m, kb] * sw[n // 128, kb]) (SPEC §4.3).

Two paths, one block-partial code (`_block_partial`), so their bits agree by construction:

* single-pass (SPLIT_K = 1): one program per [BLOCK_M, BLOCK_N] output tile, grouped
  (GROUP_M) launch order for L2 reuse of the weight tiles, looping over every K block:

      v   = dot(a[BM, 128], b[128, BN]) * sa[:, None] * sw[None, :]     (fp32)
      acc = acc + v                                                      (kb ascending)

* exact split-K (SPLIT_K > 1, decode): phase 1, grid (tiles, SPLIT_K), each program
  computes v for its run of K blocks and stores it to an fp32 workspace ws[KB, M, N];
  phase 2 (`_splitk_sum_kernel`) adds ws[0..KB-1] in ascending kb starting from 0.0
  with plain fp32 adds and rounds once to bf16. That is the single-pass sequence of
  roundings exactly, so both paths give the same bits (for the same tile config, which
  fixes the MMA instruction and so the in-block sum order of the dot). A plain split-K
  (sum each half, then add the halves) would reassociate the cross-block sum, which
  SPEC §4.3 fixes.

NOTE: both scales are powers of two, so v's two products are exact (barring fp32
under/overflow). Kernels are launched with enable_fp_fusion=False anyway so that
`acc + partial * sa * sw` is never contracted into an FMA: with an FMA the product is
not rounded before the add, which would differ from the stored-then-added split-K value
in the (unrealistic) underflow case; without it, bitwise equality holds unconditionally.
The cost is one FMUL per accumulator element per 128-wide K block.

NOTE: IMPRECISE is tl.dot's max_num_imprecise_acc. On Hopper the fp8 wgmma accumulates
inside one instruction (k = 32) with reduced precision (measured on the H200 at M = 4096
vs the fp64-in-block reference: 2.5% of bf16 outputs differ with IMPRECISE=32, 6.2% with
128 -- the same as torch's scaled_mm; on 16-row tiles (M <= 16, and the mid-M rule of
fp8_block_gemm.choose_config) Triton uses mma.sync and 0% differ). IMPRECISE=128 lets
the tensor core accumulate the whole 128-wide block (as DeepGEMM and Triton's SM90
default do) and avoids a wgmma wait + fp32 add after every k = 32 step; IMPRECISE=32
promotes into fp32 registers after every wgmma, as close to an fp32 in-block sum as the
hardware gets. 32 is the default (accuracy); fp8_block_gemm.FAST_PREFILL_IMPRECISE names
the faster mode, and gpu_check_shared.py times both.

NOTE (registers, from `ptxas -v -arch=sm_90a` on this kernel compiled offline with
triton.compile(ASTSource(..., attrs=divisibility 16), GPUTarget("cuda", 90, 32))):
IMPRECISE=32 costs ~100 registers per thread (the per-wgmma promotion keeps a second
fp32 tile live), so 64x128 with 4 warps hits 255 and spills 52 B, 128x128x8w spills
268 B and 128x256x8w 1.7 KB (why the first H200 run measured it at 1393 us); 64x128
and 128x64 with 8 warps do not spill. IMPRECISE=128: 64x128x4w 190 registers. Decode
(16 x 64, mma.sync) uses 72-80. Without the divisibility hints Triton does not
pipeline the loads (no cp.async): the real launch gets them from Triton's argument
specialization (K, N, strides % 16 == 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import pdl_enter, pdl_options, round_to_bf16, split_k_arrive, split_k_reset


@triton.jit
def _e8m0_to_f32(b):
    """uint8 e8m0 bytes -> fp32 2^(b-127), exactly; 0 -> 2^-127 (subnormal), 255 -> NaN."""
    bi = b.to(tl.int32)
    f = (bi << 23).to(tl.float32, bitcast=True)
    f = tl.where(bi == 0, tl.full(f.shape, 0x400000, tl.int32).to(tl.float32, bitcast=True), f)
    return tl.where(bi == 255, tl.full(f.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), f)


@triton.jit
def _k_range(num_kb, kb_per_split, SPLIT: tl.constexpr):
    """The program's K blocks [kb_lo, kb_hi): its split's run (grid axis 1), or all of them."""
    if SPLIT:
        kb_lo = tl.program_id(1) * kb_per_split
        kb_hi = min(kb_lo + kb_per_split, num_kb)
    else:
        kb_lo = 0
        kb_hi = num_kb
    return kb_lo, kb_hi


@triton.jit
def _block_dot(a_ptrs, b_ptrs, kb, K, EVEN_K: tl.constexpr, IMPRECISE: tl.constexpr):
    """dot(q block kb, w block kb) in fp32; a_ptrs / b_ptrs point at K block 0."""
    offs_k = tl.arange(0, 128)
    if EVEN_K:
        a = tl.load(a_ptrs + kb * 128)
        b = tl.load(b_ptrs + kb * 128)
    else:
        k_left = K - kb * 128
        a = tl.load(a_ptrs + kb * 128, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs + kb * 128, mask=offs_k[:, None] < k_left, other=0.0)
    return tl.dot(a, b, max_num_imprecise_acc=IMPRECISE)


@triton.jit
def _block_scales(sa_ptrs, sb_ptrs, kb, stride_sak, stride_sbk, SB_E8M0: tl.constexpr):
    """(sa[:, kb], sw[:, kb]) as fp32 (sb_ptrs: one pointer per column, or a scalar pointer)."""
    sa = tl.load(sa_ptrs + kb * stride_sak)
    sb = tl.load(sb_ptrs + kb * stride_sbk)
    if SB_E8M0:
        sb = _e8m0_to_f32(sb)
    return sa, sb


@triton.jit
def _block_partial(a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, kb, K, stride_sak, stride_sbk,
                   SB_E8M0: tl.constexpr, EVEN_K: tl.constexpr, IMPRECISE: tl.constexpr):
    """v[BM, BN] = dot(q block kb, w block kb) * sa[:, kb] * sw[:, kb] (fp32).

    a_ptrs / b_ptrs point at K block 0; the block offset is added here.
    """
    partial = _block_dot(a_ptrs, b_ptrs, kb, K, EVEN_K, IMPRECISE)
    sa, sb = _block_scales(sa_ptrs, sb_ptrs, kb, stride_sak, stride_sbk, SB_E8M0)
    return partial * sa[:, None] * sb[None, :]


# NOTE: scalars that only index the (small) scale tensors or count K blocks are not
# specialized (Triton would otherwise compile a variant per "divisible by 16" pattern of
# KB, which differs between the V4 shapes); M, N, K and the operand strides are.
@triton.jit(do_not_specialize=["num_kb", "kb_per_split", "stride_sam", "stride_sak", "stride_sbn", "stride_sbk"])
def _fp8_block_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, ws_ptr,
    M, N, K, num_kb, kb_per_split,
    stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_cm,
    SB_E8M0: tl.constexpr, EVEN_K: tl.constexpr, IMPRECISE: tl.constexpr, SOFTWARE: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
    SCALE_PREFETCH: tl.constexpr = False,  # fp8_block_gemm.SCALE_PREFETCH (see there)
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_size_m)
    pid_n = (pid % num_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped (modulo) row/col indices: loads need no M/N mask; the stores are masked.
    am = (offs_m % M).to(tl.int64)
    bn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, 128)
    a_ptrs = a_ptr + am[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + bn[None, :] * stride_bn + offs_k[:, None]
    sa_ptrs = sa_ptr + am * stride_sam
    sb_ptrs = sb_ptr + (bn // 128) * stride_sbn
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]

    if SCALE_PREFETCH:
        # Each block's scales are loaded one K step ahead, so their latency hides behind the
        # previous block's MMAs instead of following them (the same values, the same products);
        # a tile of <= 128 columns lies inside one 128-row weight block: one scalar sw per block.
        if BLOCK_N <= 128:
            sb_ptrs = sb_ptr + ((pid_n * BLOCK_N) % N // 128).to(tl.int64) * stride_sbn
        kb_lo, kb_hi = _k_range(num_kb, kb_per_split, SPLIT)
        sa_n, sb_n = _block_scales(sa_ptrs, sb_ptrs, kb_lo, stride_sak, stride_sbk, SB_E8M0)
        ws_ptrs = (ws_ptr + (kb_lo.to(tl.int64) * M) * N
                   + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :])
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):
            sa_c, sb_c = sa_n, sb_n
            sa_n, sb_n = _block_scales(sa_ptrs, sb_ptrs, min(kb + 1, kb_hi - 1), stride_sak, stride_sbk, SB_E8M0)
            partial = _block_dot(a_ptrs, b_ptrs, kb, K, EVEN_K, IMPRECISE)
            if BLOCK_N <= 128:
                v = partial * sa_c[:, None] * sb_c
            else:
                v = partial * sa_c[:, None] * sb_c[None, :]
            if SPLIT:
                tl.store(ws_ptrs, v, mask=out_mask)
                ws_ptrs += M * N
            else:
                acc = acc + v
        if not SPLIT:
            c = round_to_bf16(acc, SOFTWARE).to(tl.bfloat16)
            c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
            tl.store(c_ptrs, c, mask=out_mask)
    elif SPLIT:
        # Phase 1: the scaled partials of K blocks [kb_lo, kb_hi) -> ws[kb, m, n].
        kb_lo = tl.program_id(1) * kb_per_split
        kb_hi = min(kb_lo + kb_per_split, num_kb)
        ws_ptrs = (ws_ptr + (kb_lo.to(tl.int64) * M) * N
                   + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :])
        for kb in range(kb_lo, kb_hi):
            v = _block_partial(a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, kb, K, stride_sak, stride_sbk,
                               SB_E8M0, EVEN_K, IMPRECISE)
            tl.store(ws_ptrs, v, mask=out_mask)
            ws_ptrs += M * N
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, num_kb):
            v = _block_partial(a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, kb, K, stride_sak, stride_sbk,
                               SB_E8M0, EVEN_K, IMPRECISE)
            acc = acc + v
        # SOFTWARE (interpreter): RNE on the bits, then an exact narrowing (see round_to_bf16).
        c = round_to_bf16(acc, SOFTWARE).to(tl.bfloat16)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, c, mask=out_mask)


@triton.jit(do_not_specialize=["num_kb", "kb_per_split", "stride_sam", "stride_sak", "stride_sbn", "stride_sbk"])
def _fp8_gemv_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, ws_ptr, cnt_ptr,
    M, N, K, num_kb, kb_per_split,
    stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_cm,
    SB_E8M0: tl.constexpr, EVEN_K: tl.constexpr, SOFTWARE: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    FIXUP: tl.constexpr = False,   # SPLIT: the tile's last program sums ws (kernels/split_k.py)
    NUM_KB: tl.constexpr = 0,      # FIXUP: K blocks to sum (unrolled, as in _splitk_sum_kernel)
    KB_VEC: tl.constexpr = 0,      # SPLIT: the program's K blocks as one [BLOCK_N, KB_VEC, 128] load
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    """Decode body (GEMV config): one activation row x BLOCK_N weight rows per program on
    the CUDA cores. Per K block the 128 exact fp32 products are summed in any order (the
    in-block freedom of SPEC §4.3), then scaled and accumulated in block order exactly
    like the MMA body (same ws layout, same phase 2)."""
    pdl_enter(PDL)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    m = pid // num_pid_n
    offs_n = (pid % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    bn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, 128)
    a_ptrs = a_ptr + m.to(tl.int64) * stride_am + offs_k
    b_ptrs = b_ptr + bn[:, None] * stride_bn + offs_k[None, :]
    sb_ptrs = sb_ptr + (bn // 128) * stride_sbn
    sa_ptr_m = sa_ptr + m.to(tl.int64) * stride_sam
    n_ok = offs_n < N
    kb_lo, kb_hi = _k_range(num_kb, kb_per_split, SPLIT)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if KB_VEC > 0:
        # NOTE (session 7): the runtime-bound loop below is not software-pipelined by Triton
        # (no cp.async in its PTX): each K block's loads wait for the previous block's sum.
        # Here all of the program's blocks are loaded at once, then summed per block.
        kbs = kb_lo + tl.arange(0, KB_VEC)
        kb_ok = kbs < kb_hi
        ka = kbs[:, None] * 128 + offs_k[None, :]
        if EVEN_K:
            kmask = kb_ok[:, None] & (offs_k < 128)[None, :]
        else:
            kmask = kb_ok[:, None] & (ka < K)
        a2 = tl.load(a_ptr + m.to(tl.int64) * stride_am + ka, mask=kmask, other=0.0)
        b3 = tl.load(b_ptr + bn[:, None, None] * stride_bn + ka[None, :, :], mask=kmask[None, :, :], other=0.0)
        p2 = tl.sum(b3.to(tl.float32) * a2.to(tl.float32)[None, :, :], axis=2)
        sb2 = tl.load(sb_ptr + (bn // 128)[:, None] * stride_sbn + kbs[None, :] * stride_sbk,
                      mask=kb_ok[None, :], other=0)
        if SB_E8M0:
            sb2 = _e8m0_to_f32(sb2)
        v2 = p2 * tl.load(sa_ptr_m + kbs * stride_sak, mask=kb_ok, other=0.0)[None, :] * sb2
        tl.store(ws_ptr + (m.to(tl.int64) + kbs.to(tl.int64)[None, :] * M) * N + offs_n[:, None], v2,
                 mask=n_ok[:, None] & kb_ok[None, :])
    else:
        for kb in range(kb_lo, kb_hi):
            if EVEN_K:
                a = tl.load(a_ptrs + kb * 128)
                b = tl.load(b_ptrs + kb * 128)
            else:
                k_left = K - kb * 128
                a = tl.load(a_ptrs + kb * 128, mask=offs_k < k_left, other=0.0)
                b = tl.load(b_ptrs + kb * 128, mask=offs_k[None, :] < k_left, other=0.0)
            p = tl.sum(b.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
            sb = tl.load(sb_ptrs + kb * stride_sbk)
            if SB_E8M0:
                sb = _e8m0_to_f32(sb)
            v = p * tl.load(sa_ptr_m + kb * stride_sak) * sb
            if SPLIT:
                tl.store(ws_ptr + (m.to(tl.int64) + kb * M) * N + offs_n, v, mask=n_ok)
            else:
                acc = acc + v
    if not SPLIT:
        c = round_to_bf16(acc, SOFTWARE).to(tl.bfloat16)
        tl.store(c_ptr + m.to(tl.int64) * stride_cm + offs_n, c, mask=n_ok)
    elif FIXUP:
        if split_k_arrive(cnt_ptr + pid, tl.num_programs(1)):
            p = ws_ptr + m.to(tl.int64) * N + offs_n
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for kb2 in tl.static_range(NUM_KB):
                acc = acc + tl.load(p, mask=n_ok, other=0.0, cache_modifier=".cg")
                p += M * N
            c = round_to_bf16(acc, SOFTWARE).to(tl.bfloat16)
            tl.store(c_ptr + m.to(tl.int64) * stride_cm + offs_n, c, mask=n_ok)
            split_k_reset(cnt_ptr + pid)


@triton.jit
def _splitk_sum_kernel(ws_ptr, c_ptr, MN, N, stride_cm,
                       NUM_KB: tl.constexpr, SOFTWARE: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = 0):
    """Phase 2: out[m, n] = bf16(((0 + ws[0,m,n]) + ws[1,m,n]) + ... ), kb ascending.

    The K-block loop is unrolled (NUM_KB constexpr, <= 56 for the V4 shapes) so all of a
    thread's loads are independent and in flight together; the adds stay in order.
    """
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    p = ws_ptr + offs
    for kb in tl.static_range(NUM_KB):
        acc = acc + tl.load(p, mask=mask, other=0.0)
        p += MN  # pointer (64-bit) arithmetic: no int32 overflow of kb * M * N
    c = round_to_bf16(acc, SOFTWARE).to(tl.bfloat16)
    m = offs // N
    n = offs - m * N
    tl.store(c_ptr + m * stride_cm + n, c, mask=mask)


SUM_BLOCK = 128   # phase-2 elements per program: 1 warp x 4 fp32 (16-byte loads)


def launch_fp8_block_gemm(q_u8, sa, w_u8, sw, out, cfg: dict, interpreting: bool) -> None:
    """cfg: choose_config's keys; SPLIT_K > 1 runs the two-phase exact split-K."""
    m, k = q_u8.shape
    n = w_u8.shape[0]
    num_kb = triton.cdiv(k, 128)
    sb_e8m0 = sw.dtype == torch.uint8
    a = q_u8.view(torch.float8_e4m3fn)
    b = w_u8.view(torch.float8_e4m3fn)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    split_k = min(int(cfg.get("SPLIT_K", 1)), num_kb)
    kb_per = triton.cdiv(num_kb, split_k)
    split_k = triton.cdiv(num_kb, kb_per)  # no empty K groups
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    extra = {} if interpreting else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                         enable_fp_fusion=False)
    ws = torch.empty((num_kb, m, n) if split_k > 1 else (1,), dtype=torch.float32, device=out.device)
    # NOTE (session 6): the split-K GEMV (M = 1) sums its workspace in the tile's last
    # program (kernels/split_k.py), bitwise the two-launch phase 2 (SPLIT_FIXUP=False keeps
    # that). H200, CUDA graphs, us fixup / two launches (probe_fixup_67a29ba.txt): Flash
    # shared gate_up 8.8 / 9.4, down 6.4 / 6.8, Pro-TP8 gate_up 5.4 / 6.5, Pro-TP1 gate_up
    # 17.0 / 18.9. The tile body (M = 4) lost with it (Flash gate_up 11.4 / 10.9, Pro-TP8
    # 8.2 / 7.0), and so did the routed MXFP4 swap body (Flash gate_up T=1 47.7 / 39.1,
    # Pro-TP8 25.6 / 19.1: the last program's serial reduction, 160-178 registers), so
    # those keep the second launch.
    fixup = split_k > 1 and bool(cfg.get("GEMV", False)) and cfg.get("SPLIT_FIXUP", True)
    programs = m * triton.cdiv(n, bn) if cfg.get("GEMV", False) else tiles
    if fixup:
        from .split_k import tile_counters
        cnt = tile_counters(out.device, programs)
    else:
        cnt = ws  # never dereferenced
    fix = dict(FIXUP=fixup, NUM_KB=num_kb if fixup else 0)
    if cfg.get("KB_VEC", False) and cfg.get("GEMV", False) and split_k > 1:  # unsplit: the block loop
        fix["KB_VEC"] = triton.next_power_of_2(kb_per)
    pdl = {} if interpreting else pdl_options(out.device)
    if cfg.get("GEMV", False):
        _fp8_gemv_kernel[(programs, split_k)](
            a, sa, b, sw, out, ws, cnt, m, n, k, num_kb, kb_per,
            a.stride(0), b.stride(0), sa.stride(0), sa.stride(1), sw.stride(0), sw.stride(1), out.stride(0),
            SB_E8M0=sb_e8m0, EVEN_K=(k % 128 == 0), SOFTWARE=interpreting, SPLIT=split_k > 1, BLOCK_N=bn,
            **fix, **extra, **pdl)
    else:
        _fp8_block_gemm_kernel[(tiles, split_k)](
            a, sa, b, sw, out, ws, m, n, k, num_kb, kb_per,
            a.stride(0), b.stride(0), sa.stride(0), sa.stride(1), sw.stride(0), sw.stride(1), out.stride(0),
            SB_E8M0=sb_e8m0, EVEN_K=(k % 128 == 0), IMPRECISE=cfg.get("IMPRECISE", 32), SOFTWARE=interpreting,
            SPLIT=split_k > 1, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8),
            SCALE_PREFETCH=bool(cfg.get("SCALE_PREFETCH", False)), **extra, **pdl,
        )
    if split_k > 1 and not fixup:
        extra2 = {} if interpreting else dict(num_warps=SUM_BLOCK // 128, num_stages=1, enable_fp_fusion=False)
        _splitk_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            ws, out, m * n, n, out.stride(0), NUM_KB=num_kb, SOFTWARE=interpreting, BLOCK=SUM_BLOCK, **extra2, **pdl)
