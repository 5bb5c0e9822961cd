"""Triton body of `mxfp4_grouped_gemm`: W4A8 grouped GEMM over `moe_align` blocks.

Grid (max_blocks, cdiv(N, BLOCK_N)); a program whose M-block index is past the device
scalar num_valid_blocks returns at once, so the grid is sized from shapes only.

Per program: the BLOCK_M rows of one expert (route ids from the permutation; the
sentinel R marks rows without a route, which read row 0 and are never stored), a
BLOCK_N slice of that expert's output features, and a loop over K in 128-wide blocks kb
(one activation scale each):

    w   = bf16(e2m1(w4[e, n, k]) * 2^(sw[e, n, k // 32] - 127))   exact, built on the bits
    a   = bf16(q[rows, k])                                          exact (e4m3 -> bf16)
    p   = dot(a, w^T)                       bf16 MMA, fp32 accumulation over the 128 k
    acc = acc + p * sa[row, kb]             exact product (power of two)

Why bf16 MMA and not FP8 MMA: every product q * e2m1 * 2^s is exact in fp32 either way,
but Hopper's FP8 wgmma keeps only ~14 bits while accumulating inside the instruction
(measured on the H200: 1.5-2.6% of bf16 outputs off the reference at M >= 64 tiles),
and applying the per-32 weight scale after an FP8 MMA needs a K=32 MMA per scale group
(measured 0.4-0.5 TB/s). Folding the e8m0 scale into a bf16 weight is exact for scale
bytes in [2, 252] (the bf16 exponent field is s - 1 + e for e2m1 exponent e in 0..3;
real checkpoints sit near 120), so one 128-deep bf16 MMA per activation block does the
whole block, and the only freedom left versus SPEC §4.3 is fp32 summation order inside
one 128-wide activation block, as the contract allows. The dispatch predicate rejects
layers whose scale bytes leave [2, 252] (checked once at load).

e2m1 magnitude code c = e1 e0 m: value 2^(e-1) (1 + m/2) for e = c >> 1 >= 1, 0.5 for
c = 1, 0 for c = 0. bf16 of value * 2^(s-127): exponent field s - 1 + e (e = 0 for
c = 1, with mantissa 0), mantissa bit 6 = m.
"""

import triton
import triton.language as tl

from ._triton_utils import round_to_bf16


@triton.jit
def _mxfp4_to_bf16(codes, s):
    """uint8 e2m1 codes [.., 128] and int32 e8m0 bytes (broadcast) -> bf16 of code * 2^(s-127)."""
    c = codes.to(tl.int32)
    mag = c & 7
    e = mag >> 1
    m = tl.where(mag >= 2, mag & 1, 0)
    bits = ((c & 8) << 12) | ((s - 1 + e) << 7) | (m << 6)
    bits = tl.where(mag == 0, (c & 8) << 12, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mxfp4_grouped_gemm_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_blocks_ptr,
    N, R, top_k,
    stride_am, stride_sam,
    stride_we, stride_wn,
    stride_swe, stride_swn,
    stride_om,
    A_GATHER: tl.constexpr,     # True: A row = route // top_k (tokens); False: A row = GEMM row
    OUT_SCATTER: tl.constexpr,  # True: out row = route id; False: out row = GEMM row
    K: tl.constexpr,            # NOTE: constexpr because the interpreter (numpy 2) cannot run a
                                # loop to a runtime bound; K is H or I/tp, a model constant
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    SOFTWARE_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast truncates
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ids_ptr + rows)
    row_ok = route < R
    if A_GATHER:
        arow = route // top_k
    else:
        arow = rows
    arow = tl.where(row_ok, arow, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)

    kk = tl.arange(0, 128)
    kh = tl.arange(0, 64)
    k4 = tl.arange(0, 4)
    a_ptrs = a_ptr + arow[:, None] * stride_am + kk[None, :]
    w_ptrs = w_ptr + e * stride_we + n_safe[:, None] * stride_wn + kh[None, :]
    sa_ptrs = sa_ptr + arow * stride_sam
    sw_ptrs = sw_ptr + e * stride_swe + n_safe[:, None] * stride_swn + k4[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in tl.range(0, (K + 127) // 128, num_stages=NUM_STAGES):
        k0 = kb * 128
        a = tl.load(a_ptrs + k0, mask=(k0 + kk)[None, :] < K, other=0.0)
        packed = tl.load(w_ptrs + k0 // 2, mask=(k0 // 2 + kh)[None, :] < K // 2, other=0)
        sw = tl.load(sw_ptrs + k0 // 32, mask=(k0 // 32 + k4)[None, :] < K // 32, other=127).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, 128))  # low nibble = even k
        s_full = tl.reshape(tl.broadcast_to(sw[:, :, None], (BLOCK_N, 4, 32)), (BLOCK_N, 128))
        w = _mxfp4_to_bf16(codes, s_full)
        if SOFTWARE_BF16:
            # NOTE: the Triton 3.6 interpreter multiplies bf16 dot operands as raw integers
            # (measured: errors ~1e10); fp32 operands hold the same exact values there.
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a.to(tl.bfloat16), tl.trans(w))
        s_a = tl.load(sa_ptrs + kb)
        acc += part * s_a[:, None]

    if OUT_SCATTER:
        orow = tl.where(row_ok, route, 0).to(tl.int64)
    else:
        orow = rows.to(tl.int64)
    o_ptrs = out_ptr + orow[:, None] * stride_om + n[None, :]
    if SOFTWARE_BF16:
        acc = round_to_bf16(acc, True)  # RNE on the bits; the cast below is then exact
    tl.store(o_ptrs, acc.to(tl.bfloat16), mask=row_ok[:, None] & n_ok[None, :])
