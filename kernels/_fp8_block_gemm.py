"""Triton body of fp8_block_gemm_nt: out[M, N] = bf16(sum over 128-wide K blocks of
dot(q, w^T) * sa[m, kb] * sw[n // 128, kb]) (SPEC §4.3).

One program per [BLOCK_M, BLOCK_N] output tile, grouped (GROUP_M) launch order for L2
reuse of the weight tiles. The K loop steps one 128-wide scale block at a time:

    partial = tl.dot(a[BM, 128], b[128, BN])      fp32 (wgmma on SM90)
    acc    += partial * sa[:, None] * sw[None, :]

NOTE: both scales are powers of two, so the products are exact (barring fp32
under/overflow) and `(partial * sa) * sw`, `partial * (sa * sw)` and the FMA the
compiler may form with `acc +=` all give the same bits; only the in-block sum order of
the dot is free (SPEC §4.3). The block order is fixed (ascending kb) and there is no
split-K, which would reorder the cross-block sum.

NOTE: IMPRECISE is tl.dot's max_num_imprecise_acc. Triton's SM90 default (2^30) lets
the fp8 wgmma accumulate a whole dot in the tensor core's reduced-precision
accumulator; here the dot is one 128-wide block, so IMPRECISE=128 is that default
(accumulate the block in the tensor core, as DeepGEMM does), while 32 promotes into
fp32 registers after every wgmma (k = 32), as close to an fp32 in-block sum as the
hardware gets. Triton requires 0 < IMPRECISE <= 128 here. gpu_check_shared.py
measures both (accuracy and speed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import round_to_bf16


@triton.jit
def _e8m0_to_f32(b):
    """uint8 e8m0 bytes -> fp32 2^(b-127), exactly; 0 -> 2^-127 (subnormal), 255 -> NaN."""
    bi = b.to(tl.int32)
    f = (bi << 23).to(tl.float32, bitcast=True)
    f = tl.where(bi == 0, tl.full(f.shape, 0x400000, tl.int32).to(tl.float32, bitcast=True), f)
    return tl.where(bi == 255, tl.full(f.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), f)


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr,
    M, N, K, num_kb,
    stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_cm,
    SB_E8M0: tl.constexpr, EVEN_K: tl.constexpr, IMPRECISE: tl.constexpr, SOFTWARE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
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
    # Wrapped (modulo) row/col indices: loads need no M/N mask; the store is masked.
    am = (offs_m % M).to(tl.int64)
    bn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, 128)
    a_ptrs = a_ptr + am[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + bn[None, :] * stride_bn + offs_k[:, None]
    sa_ptrs = sa_ptr + am * stride_sam
    sb_ptrs = sb_ptr + (bn // 128) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_kb):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kb * 128
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        partial = tl.dot(a, b, max_num_imprecise_acc=IMPRECISE)
        sa = tl.load(sa_ptrs + kb * stride_sak)
        sb = tl.load(sb_ptrs + kb * stride_sbk)
        if SB_E8M0:
            sb = _e8m0_to_f32(sb)
        acc += partial * sa[:, None] * sb[None, :]
        a_ptrs += 128
        b_ptrs += 128

    # SOFTWARE (interpreter): RNE on the bits, then an exact narrowing (see round_to_bf16).
    c = round_to_bf16(acc, SOFTWARE).to(tl.bfloat16)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, c, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def launch_fp8_block_gemm(q_u8, sa, w_u8, sw, out, cfg: dict, interpreting: bool) -> None:
    m, k = q_u8.shape
    n = w_u8.shape[0]
    num_kb = triton.cdiv(k, 128)
    sb_e8m0 = sw.dtype == torch.uint8
    a = q_u8.view(torch.float8_e4m3fn)
    b = w_u8.view(torch.float8_e4m3fn)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    extra = {} if interpreting else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _fp8_block_gemm_kernel[grid](
        a, sa, b, sw, out, m, n, k, num_kb,
        a.stride(0), b.stride(0), sa.stride(0), sa.stride(1), sw.stride(0), sw.stride(1), out.stride(0),
        SB_E8M0=sb_e8m0, EVEN_K=(k % 128 == 0), IMPRECISE=cfg.get("IMPRECISE", 32),
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8), SOFTWARE=interpreting, **extra,
    )
