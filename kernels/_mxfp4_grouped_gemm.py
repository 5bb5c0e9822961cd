"""Triton body of `mxfp4_grouped_gemm`: W4A8 grouped GEMM over `moe_align` blocks.

Grid (max_blocks, cdiv(N, BLOCK_N)); a program whose M-block index is past the device
scalar num_valid_blocks returns at once, so the grid is sized from shapes only.

Per program: the BLOCK_M rows of one expert (route ids from the permutation; the
sentinel R marks rows without a route, which read row 0 and are never stored), a
BLOCK_N slice of that expert's output features, and a loop over K in 32-wide
sub-blocks j (SPEC §4.3):

    w   = e4m3(e2m1 codes of w4[e, n, 32j : 32j+32])      exact, bit ops in registers
    p   = dot(q[rows, 32j : 32j+32], w^T)                  fp32 (FP8 MMA, k = 32)
    acc = acc + p * sa[row, j // 4] * 2^(sw[e, n, j] - 127)

sa and the e8m0 weight scale are powers of two, so both products are exact (barring
fp32 underflow) and the only freedom left is the summation order inside the 32-wide
dot, as the contract allows.

e2m1 -> e4m3 bits (sign kept in bit 7): magnitude code c = e1 e0 m with value
2^(e-1) (1 + m/2) for e >= 1 is e4m3 exponent field e + 6 (bias 7), mantissa m << 2,
i.e. byte (c << 2) + 0x30; c = 1 (0.5, subnormal in e2m1) is 2^-1 = 0x30; c = 0 is 0.
"""

import triton
import triton.language as tl

from ._triton_utils import round_to_bf16


@triton.jit
def _e2m1_to_e4m3_bits(c):
    """uint8 codes 0..15 -> uint8 e4m3 bytes of the same value (exact)."""
    mag = c & 7
    bits = tl.where(mag >= 2, (mag << 2) + 0x30, tl.where(mag == 1, 0x30, 0))
    return (bits | ((c & 8) << 4)).to(tl.uint8)


@triton.jit
def _e8m0_to_f32(b):
    """uint8 e8m0 bytes -> fp32 2^(b - 127): bits b << 23; b = 0 -> 2^-127, b = 255 -> NaN."""
    bi = b.to(tl.int32)
    f = (bi << 23).to(tl.float32, bitcast=True)
    f = tl.where(bi == 0, 5.877471754111438e-39, f)
    return tl.where(bi == 255, float("nan"), f)


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
    K32: tl.constexpr,          # K / 32 sub-blocks. NOTE: constexpr because the interpreter
                                # (numpy 2) cannot run a loop to a runtime bound; K is H or I,
                                # a model constant, so this costs no extra compiles in practice
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

    kk = tl.arange(0, 32)
    kh = tl.arange(0, 16)
    a_ptrs = a_ptr + arow[:, None] * stride_am + kk[None, :]
    w_ptrs = w_ptr + e * stride_we + n_safe[:, None] * stride_wn + kh[None, :]
    sa_ptrs = sa_ptr + arow * stride_sam
    sw_ptrs = sw_ptr + e * stride_swe + n_safe * stride_swn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in tl.range(0, K32, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs + j * 32)
        packed = tl.load(w_ptrs + j * 16)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, 32))  # low nibble = even k
        w = _e2m1_to_e4m3_bits(codes).to(tl.float8e4nv, bitcast=True)
        part = tl.dot(a, tl.trans(w))
        s_a = tl.load(sa_ptrs + j // 4)
        s_w = _e8m0_to_f32(tl.load(sw_ptrs + j))
        acc += part * s_a[:, None] * s_w[None, :]

    if OUT_SCATTER:
        orow = tl.where(row_ok, route, 0).to(tl.int64)
    else:
        orow = rows.to(tl.int64)
    o_ptrs = out_ptr + orow[:, None] * stride_om + n[None, :]
    if SOFTWARE_BF16:
        acc = round_to_bf16(acc, True)  # RNE on the bits; the cast below is then exact
    tl.store(o_ptrs, acc.to(tl.bfloat16), mask=row_ok[:, None] & n_ok[None, :])
