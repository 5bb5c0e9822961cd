"""EXPERIMENTAL Triton body of `mxfp4_grouped_gemm` on FP8 tensor cores (GemmConfig.fp8_mma,
off everywhere; session 6). Compiled for sm_90 and tested on the CPU; not yet timed or
accuracy-checked on the H200 (scripts/gpu_probe_swz.py --fp8). docs/DESIGN.md ("The decode
MXFP4 body's budget") has its instruction counts and why it exists.
"""

import triton
import triton.language as tl

from ._triton_utils import round_to_bf16


# e2m1 nibbles -> e4m3 codes of e2m1 * 2^-6 (exact), four packed bytes at a time: $0 gets
# the low nibbles (even k) of bytes 0..3, $1 the high nibbles (odd k). Per byte lane:
# low: magnitude bits 0..2 -> 2..4, sign bit 3 -> 7; high: magnitude 4..6 -> 2..4, sign 7.
_E2M1X4_TO_E4M3_ASM = tl.constexpr("""
{
.reg .b32 t, u;
shl.b32 t, $2, 2;
and.b32 t, t, 0x1C1C1C1C;
shl.b32 u, $2, 4;
and.b32 u, u, 0x80808080;
or.b32 $0, t, u;
shr.b32 t, $2, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $2, 0x80808080;
or.b32 $1, t, u;
}
""")


@triton.jit
def _mxfp4_grouped_gemm_swap8_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_blocks_ptr,
    N, R, top_k,
    stride_am, stride_sam,
    stride_we, stride_wn,
    stride_swe, stride_swn,
    stride_om,
    A_GATHER: tl.constexpr, OUT_SCATTER: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    SOFTWARE_BF16: tl.constexpr,
):
    """EXPERIMENTAL (session 6, GemmConfig.fp8_mma; compiled and CPU-tested, not yet timed
    on the H200): the swap body on FP8 tensor cores, SPEC §4.3's per-32 form literally.

    Per 32-wide K group g: the e2m1 codes become e4m3 codes of e2m1 * 2^-6 on the bits
    (exact: c = e1 e0 m lands on exponent e, mantissa m00, c = 1 on e4m3's subnormal
    2^-7), one k = 32 FP8 MMA from a zero accumulator gives partial_g * 2^-6, and

        acc += (part * 2^(s[n, g] - 121)) * sa[row, g // 4]

    where both products are exact (powers of two), so each step is the reference's
    `acc += partial * sa * sw` with one rounding. The weights' k order is natural (the
    low nibble of byte b is k = 2b, the high one 2b + 1), so the activations need no
    permutation. Against the reference the only difference is the FP8 MMA's own
    accumulation of the 32 exact products (Hopper keeps fewer than fp32's bits there);
    ~0.9 instructions per weight to build the operand instead of ~2.3 (docs/DESIGN.md)."""
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
    kb16 = tl.arange(0, 16)
    k32 = tl.arange(0, 32)
    # MMA k slot j of a group holds k = 2j (j < 16, the low nibbles) or 2(j - 16) + 1 (the
    # high nibbles): the weights' order after the packed conversion. The wrapper hands the
    # activations over in that order (fp8_pairs32: each 32-group as 16 even k | 16 odd k;
    # any order of the 32 products is the same exact set), so they load contiguously.
    w_ptrs = w_ptr + e * stride_we + n_safe[:, None] * stride_wn + kb16[None, :]
    a_ptrs = a_ptr + arow[:, None] * stride_am + k32[None, :]
    sw_ptrs = sw_ptr + e * stride_swe + n_safe * stride_swn
    sa_ptrs = sa_ptr + arow * stride_sam
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    GPI: tl.constexpr = 4 if K % 128 == 0 else 1       # groups per loop iteration (unrolled)
    for it in tl.range(0, K // (32 * GPI), num_stages=NUM_STAGES):
        for u in tl.static_range(GPI):
            g = it * GPI + u
            pk = tl.load(w_ptrs + g * 16)                             # [BLOCK_N, 16] bytes = 32 k
            if SOFTWARE_BF16:
                lo = ((pk & 7) << 2) | ((pk & 8) << 4)                # even k: e4m3 of e2m1 * 2^-6
                hi = ((pk >> 2) & 0x1C) | (pk & 0x80)                 # odd k
            else:  # the same bytes, four at a time on 32-bit words (GPU only)
                lo, hi = tl.inline_asm_elementwise(
                    _E2M1X4_TO_E4M3_ASM, "=r,=r,r", [pk], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
            w8 = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 32)).to(tl.float8e4nv, bitcast=True)
            a8 = tl.load(a_ptrs + g * 32)                             # [BLOCK_M, 32] e4m3, k slots as w8
            if SOFTWARE_BF16:
                part = tl.dot(w8.to(tl.float32), tl.trans(a8.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(w8, tl.trans(a8))
            sg = tl.load(sw_ptrs + g).to(tl.int32)
            c = ((sg + 6) << 23).to(tl.float32, bitcast=True)         # 2^(s - 121), s <= 248
            s_a = tl.load(sa_ptrs + g // 4, mask=row_ok, other=0.0)
            acc += (part * c[:, None]) * s_a[None, :]
    if OUT_SCATTER:
        orow = tl.where(row_ok, route, 0).to(tl.int64)
    else:
        orow = rows.to(tl.int64)
    if SOFTWARE_BF16:
        acc = round_to_bf16(acc, True)
    tl.store(out_ptr + orow[None, :] * stride_om + n[:, None], acc.to(tl.bfloat16),
             mask=n_ok[:, None] & row_ok[None, :])
