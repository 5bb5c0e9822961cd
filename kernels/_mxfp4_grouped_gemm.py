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
bytes in [0, 128] (the fp32 factor 2^(s-1) must be a normal fp32; real checkpoints sit
near 120), so one 128-deep bf16 MMA per activation block does the
whole block, and the only freedom left versus SPEC §4.3 is fp32 summation order inside
one 128-wide activation block, as the contract allows. The dispatch predicate rejects
layers whose scale bytes leave [0, 128] (checked once at load).

e2m1 magnitude code c = e1 e0 m: value 2^(e-1) (1 + m/2) for e = c >> 1 >= 1, 0.5 for
c = 1, 0 for c = 0; see `_nibbles_to_bf16` for the exact bit construction.
"""

import triton
import triton.language as tl

from ._triton_utils import round_to_bf16


@triton.jit
def _nibbles_to_bf16(bits_lo, bits_hi, scale, SELECT: tl.constexpr):
    """Packed bytes (int32) -> bf16 weights of the low (even k) and high (odd k) nibbles,
    times `scale` = 2^(s-127) * 2^126 (fp32).

    The fp32 with sign bit 31 and magnitude code c at bits 22..24 is exactly
    e2m1(c) * 2^-126 (c = 1, e2m1's subnormal 0.5, lands on fp32's subnormal 2^-127), so
    one exact fp32 multiply by 2^(s-1) gives e2m1(c) * 2^(s-127); the bf16 cast is exact.
    SELECT=True builds the subnormal case with a select instead (for targets that flush
    fp32 subnormals).
    """
    lo = ((bits_lo & 0x8) << 28) | ((bits_lo & 0x7) << 22)
    hi = ((bits_hi & 0x80) << 24) | ((bits_hi & 0x70) << 18)
    flo = lo.to(tl.float32, bitcast=True)
    fhi = hi.to(tl.float32, bitcast=True)
    if SELECT:
        flo = tl.where((bits_lo & 0x7) == 1, tl.where((bits_lo & 0x8) != 0, -1.0, 1.0) * 5.877471754111438e-39, flo)
        fhi = tl.where((bits_hi & 0x70) == 0x10, tl.where((bits_hi & 0x80) != 0, -1.0, 1.0) * 5.877471754111438e-39,
                       fhi)
    return (flo * scale).to(tl.bfloat16), (fhi * scale).to(tl.bfloat16)


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
    SELECT_SUBNORMAL: tl.constexpr = False,
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

    # NOTE: the K loop works on 64 packed bytes = 128 k per step, de-interleaved: the low
    # nibbles (even k) and the high nibbles (odd k) are two [BLOCK_N, 64] weight tiles
    # multiplied with the even and odd activation columns. This avoids joining the
    # nibbles into k order (a register shuffle that dominated the first version: 0.4-0.5
    # TB/s measured on the H200); the sum over the block is the same set of exact products.
    kh = tl.arange(0, 64)
    a_ptrs = a_ptr + arow[:, None] * stride_am + 2 * kh[None, :]
    w_ptrs = w_ptr + e * stride_we + n_safe[:, None] * stride_wn + kh[None, :]
    sa_ptrs = sa_ptr + arow * stride_sam
    sw_ptrs = sw_ptr + e * stride_swe + n_safe[:, None] * stride_swn + (kh // 16)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in tl.range(0, (K + 127) // 128, num_stages=NUM_STAGES):
        k0 = kb * 128
        kmask = (k0 // 2 + kh)[None, :] < K // 2
        a_even = tl.load(a_ptrs + k0, mask=kmask, other=0.0)
        a_odd = tl.load(a_ptrs + k0 + 1, mask=kmask, other=0.0)
        packed = tl.load(w_ptrs + k0 // 2, mask=kmask, other=0).to(tl.int32)
        sbyte = tl.load(sw_ptrs + k0 // 32, mask=kmask, other=127).to(tl.int32)
        scale = ((sbyte + 126) << 23).to(tl.float32, bitcast=True)  # 2^(s-1); exact for s <= 128
        w_lo, w_hi = _nibbles_to_bf16(packed, packed, scale, SELECT_SUBNORMAL)
        if SOFTWARE_BF16:
            # NOTE: the Triton 3.6 interpreter multiplies bf16 dot operands as raw integers
            # (measured: errors ~1e10); fp32 operands hold the same exact values there.
            part = tl.dot(a_even.to(tl.float32), tl.trans(w_lo.to(tl.float32)), input_precision="ieee")
            part = tl.dot(a_odd.to(tl.float32), tl.trans(w_hi.to(tl.float32)), part, input_precision="ieee")
        else:
            part = tl.dot(a_even.to(tl.bfloat16), tl.trans(w_lo))
            part = tl.dot(a_odd.to(tl.bfloat16), tl.trans(w_hi), part)
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
