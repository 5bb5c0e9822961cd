"""Device helpers of the MXFP4 grouped GEMM bodies (`_mxfp4_grouped_gemm.py`): e2m1 codes +
e8m0 scales -> exact bf16 weights, and the "mma64" weight-tile loads.

    _nibbles_to_f32      packed bytes -> fp32 e2m1(c) * 2^-126 of both nibbles (exact)
    _dequant_w           [BLOCK_N, 64] bytes + [BLOCK_N, 4] scales -> fp32 (even k, odd k)
                         tiles e2m1 * 2^(s-127) (what the interpreter runs)
    _dequant_w_asm       the same values as bf16 by inline PTX (GPU only), any layout
    _dequant_w_swz_asm   the same values, cheaper PTX (used with "mma64" weights)
    _dequant_w_swz_asm_half  one of its two tiles (the folded swap body, one at a time)
    _mma64_tile_ptrs     pointers to a program's 64-row tiles of one 128-block ("mma64")
    _mma64_unswizzle     stored "mma64" bytes -> the [BLOCK_N, 64] packed tile

Both PTX blocks are checked bit for bit on the CPU by an interpreter of their text
(tests/test_kernels_mxfp4_gemm.py::test_swz_dequant_ptx_emulated_bitwise) and on the
H200 against `_dequant_w` (scripts/gpu_probe_swz.py, asm_vs_plain).
"""

import triton
import triton.language as tl


@triton.jit
def _nibbles_to_f32(bits_lo, bits_hi, SELECT: tl.constexpr):
    """Packed bytes (int32) -> fp32 e2m1(c) * 2^-126 of the low (even k) and high (odd k)
    nibbles.

    The fp32 with sign bit 31 and magnitude code c at bits 22..24 is exactly
    e2m1(c) * 2^-126 (c = 1, e2m1's subnormal 0.5, lands on fp32's subnormal 2^-127), so
    one exact fp32 multiply by 2^(s-1) then gives e2m1(c) * 2^(s-127), and the bf16 cast
    of that is exact. SELECT=True builds the subnormal case with a select instead (for
    targets that flush fp32 subnormals).
    """
    lo = ((bits_lo & 0x8) << 28) | ((bits_lo & 0x7) << 22)
    hi = ((bits_hi & 0x80) << 24) | ((bits_hi & 0x70) << 18)
    flo = lo.to(tl.float32, bitcast=True)
    fhi = hi.to(tl.float32, bitcast=True)
    if SELECT:
        flo = tl.where((bits_lo & 0x7) == 1, tl.where((bits_lo & 0x8) != 0, -1.0, 1.0) * 5.877471754111438e-39, flo)
        fhi = tl.where((bits_hi & 0x70) == 0x10, tl.where((bits_hi & 0x80) != 0, -1.0, 1.0) * 5.877471754111438e-39,
                       fhi)
    return flo, fhi


# e2m1 pairs -> bf16x2 on the bits, then one bf16x2 multiply by the group's 2^(s-1) (sm_90's
# mul.rn.bf16x2). Per 4 packed bytes ($4, elements 0..3 in its bytes 0..3) and their
# groups' scales as bf16 2^(s-1), one per element, packed two per register by
# inline_asm_elementwise exactly like the outputs ($5: elements 0 and 1, the pair of
# outputs $0 / $2; $6: elements 2 and 3, of $1 / $3), so the construction is exact for any
# pairing of elements to groups (session 6: the scales used to arrive as one 32-bit word per
# element and cost two prmt per pack): a bf16 with magnitude code c at bits 6..8 is exactly
# |e2m1(c)| * 2^-126 (c = 1 lands on the bf16 subnormal 2^-127), as in _nibbles_to_f32, so
# the product with 2^(s-1) is |e2m1(c)| * 2^(s-127), exact for s <= 128 (rounding never
# happens); the sign bit is then OR-ed in (ptxas folds the and + or into one LOP3).
_E2M1X4_TO_BF16_ASM = tl.constexpr("""
{
.reg .b32 x, y, t, u;
prmt.b32 x, $4, 0, 0x4140;
prmt.b32 y, $4, 0, 0x4342;
shl.b32 t, x, 6;
and.b32 t, t, 0x01C001C0;
mul.rn.bf16x2 t, t, $5;
shl.b32 u, x, 12;
and.b32 u, u, 0x80008000;
or.b32 $0, t, u;
shl.b32 t, y, 6;
and.b32 t, t, 0x01C001C0;
mul.rn.bf16x2 t, t, $6;
shl.b32 u, y, 12;
and.b32 u, u, 0x80008000;
or.b32 $1, t, u;
shl.b32 t, x, 2;
and.b32 t, t, 0x01C001C0;
mul.rn.bf16x2 t, t, $5;
shl.b32 u, x, 8;
and.b32 u, u, 0x80008000;
or.b32 $2, t, u;
shl.b32 t, y, 2;
and.b32 t, t, 0x01C001C0;
mul.rn.bf16x2 t, t, $6;
shl.b32 u, y, 8;
and.b32 u, u, 0x80008000;
or.b32 $3, t, u;
}
""")


@triton.jit
def _scales_bf16(sb4, BLOCK_N: tl.constexpr):
    """[BLOCK_N, 4] e8m0 bytes -> [BLOCK_N, 4, 16] bf16 2^(s-1) (exact for s <= 128), one
    per element of the [BLOCK_N, 64] tile viewed as [BLOCK_N, 4 groups, 16]."""
    s16 = ((sb4.to(tl.int32) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.broadcast_to(s16[:, :, None], (BLOCK_N, 4, 16))


@triton.jit
def _dequant_w_asm(packed, sb4, BLOCK_N: tl.constexpr):
    """Packed [BLOCK_N, 64] uint8 + [BLOCK_N, 4] uint8 e8m0 -> bf16 (even k, odd k) tiles of
    e2m1 * 2^(s-127), exactly, by the inline PTX above (GPU only)."""
    p3 = tl.reshape(packed.to(tl.uint8), (BLOCK_N, 4, 16))
    w_lo, w_hi = tl.inline_asm_elementwise(
        _E2M1X4_TO_BF16_ASM, "=r,=r,=r,=r,r,r,r", [p3, _scales_bf16(sb4, BLOCK_N)],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.reshape(w_lo, (BLOCK_N, 64)), tl.reshape(w_hi, (BLOCK_N, 64))


# e2m1 pairs -> bf16x2 for the "mma64" weight layout (fewer instructions than the asm
# above: 16 + 2 instead of 22 per 4 packed bytes). The scales come in as a bf16 tensor
# (2^(s-1) per element), which inline_asm_elementwise packs two per register exactly like
# the outputs: $5 holds the scales of elements 0 and 1 (the pair of output $0 / $2), $6
# those of elements 2 and 3 ($1 / $3), so no prmt gathers them (session 6: the two prmt
# per 4 bytes of the first version were 28 of the swap body's 531-instruction SASS loop)
# and the construction stays exact for any pairing. Bytes go to the HIGH byte of each
# 16-bit half (x = [e1 0 e0 0]); then per half:
#   low nibble  (bits 8..11): magnitude >> 2 -> bits 6..8, sign << 4 -> bit 15, one LOP3
#                             ((a | b) & 0x81C0: a and b are zero where the other lands)
#   high nibble (bits 12..15): magnitude >> 6 -> bits 6..8 (masked: the low nibble's bit 0
#                             lands at 8 in x itself), sign already at bit 15
# and the signed bf16 (|e2m1| * 2^-126, c = 1 the bf16 subnormal) times the group's
# 2^(s-1) is e2m1 * 2^(s-127) exactly, the same values as _E2M1X4_TO_BF16_ASM
# (bit-checked for every byte and scale bytes 0, 1, 100, 127, 128 by
# tests/test_kernels_mxfp4_gemm.py::test_swz_dequant_ptx_emulated_bitwise).
def _swz_ptx(packed: str, lo: tuple | None, hi: tuple | None) -> str:
    """PTX of the construction above for one packed register: the low-nibble (even k) pair
    into lo = (out0, out1, scale0, scale1), the high-nibble (odd k) pair into hi."""
    text = ["{", ".reg .b32 x, y, t, u;", f"prmt.b32 x, {packed}, 0, 0x1404;", f"prmt.b32 y, {packed}, 0, 0x3424;"]
    if lo:
        for src, out, sc in (("x", lo[0], lo[2]), ("y", lo[1], lo[3])):
            text += [f"shr.b32 t, {src}, 2;", f"shl.b32 u, {src}, 4;", "or.b32 t, t, u;", "and.b32 t, t, 0x81C081C0;",
                     f"mul.rn.bf16x2 {out}, t, {sc};"]
    if hi:
        for src, out, sc in (("x", hi[0], hi[2]), ("y", hi[1], hi[3])):
            text += [f"shr.b32 t, {src}, 6;", "and.b32 t, t, 0x01C001C0;", f"and.b32 u, {src}, 0x80008000;",
                     "or.b32 t, t, u;", f"mul.rn.bf16x2 {out}, t, {sc};"]
    return "\n" + "\n".join(text + ["}"]) + "\n"


_E2M1X4_TO_BF16_SWZ_ASM = tl.constexpr(_swz_ptx("$4", ("$0", "$1", "$5", "$6"), ("$2", "$3", "$5", "$6")))
# One half each (inputs $2 packed, $3 / $4 scales): the folded swap body converts the odd-k
# half only after the MMA on the even-k half (see _dequant_w_swz_asm_half).
_E2M1X4_LO_SWZ_ASM = tl.constexpr(_swz_ptx("$2", ("$0", "$1", "$3", "$4"), None))
_E2M1X4_HI_SWZ_ASM = tl.constexpr(_swz_ptx("$2", None, ("$0", "$1", "$3", "$4")))


# The "mma64e" layout (weights/mma_layout.py; the CUDA default): each stored word re-encoded so
# that output r is (XOR of the word rotated right by s, s in _ENC_OUTPUTS[r]) & 0x81C081C0,
# the signed bf16 pattern before the scale, as above: 4 funnel shifts + 4 LOP3 (ptxas folds
# xor + and) + 4 HMUL2 per 8 weights, against 2 PRMT + 10 shift / LOP3 + 4 HMUL2 for "mma64".
# The rotation amounts here must be weights.mma_layout._ENC_OUTPUTS (tested).
def _enc_ptx(packed: str, lo: tuple | None, hi: tuple | None) -> str:
    """PTX of the "mma64e" construction for one stored register: the even-k pairs into
    lo = (out0, out1, scale0, scale1), the odd-k pairs into hi."""
    text = ["{", ".reg .b32 a, b, c, t;"]
    if lo:
        text += [f"and.b32 t, {packed}, 0x81C081C0;", f"mul.rn.bf16x2 {lo[0]}, t, {lo[2]};",
                 f"shf.r.wrap.b32 t, {packed}, {packed}, 12;", "and.b32 t, t, 0x81C081C0;",
                 f"mul.rn.bf16x2 {lo[1]}, t, {lo[3]};"]
    if hi:
        text += [f"shf.r.wrap.b32 a, {packed}, {packed}, 2;", f"shf.r.wrap.b32 b, {packed}, {packed}, 6;",
                 f"shf.r.wrap.b32 c, {packed}, {packed}, 8;",
                 "xor.b32 t, a, b;", "and.b32 t, t, 0x81C081C0;", f"mul.rn.bf16x2 {hi[0]}, t, {hi[2]};",
                 "xor.b32 t, a, c;", "and.b32 t, t, 0x81C081C0;", f"mul.rn.bf16x2 {hi[1]}, t, {hi[3]};"]
    return "\n" + "\n".join(text + ["}"]) + "\n"


_E2M1X4_TO_BF16_ENC_ASM = tl.constexpr(_enc_ptx("$4", ("$0", "$1", "$5", "$6"), ("$2", "$3", "$5", "$6")))
_E2M1X4_LO_ENC_ASM = tl.constexpr(_enc_ptx("$2", ("$0", "$1", "$3", "$4"), None))
_E2M1X4_HI_ENC_ASM = tl.constexpr(_enc_ptx("$2", None, ("$0", "$1", "$3", "$4")))


@triton.jit
def _dequant_w_swz_asm(packed, sb4, BLOCK_N: tl.constexpr, ENC: tl.constexpr = False):
    """As _dequant_w_asm, by _E2M1X4_TO_BF16_SWZ_ASM (GPU only); the scales are handed
    over as bf16 2^(s-1), one per element (packed two per register by Triton)."""
    p3 = tl.reshape(packed.to(tl.uint8), (BLOCK_N, 4, 16))
    if ENC:
        w_lo, w_hi = tl.inline_asm_elementwise(
            _E2M1X4_TO_BF16_ENC_ASM, "=r,=r,=r,=r,r,r,r", [p3, _scales_bf16(sb4, BLOCK_N)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        w_lo, w_hi = tl.inline_asm_elementwise(
            _E2M1X4_TO_BF16_SWZ_ASM, "=r,=r,=r,=r,r,r,r", [p3, _scales_bf16(sb4, BLOCK_N)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.reshape(w_lo, (BLOCK_N, 64)), tl.reshape(w_hi, (BLOCK_N, 64))


@triton.jit
def _dequant_w_swz_asm_half(packed, sb4, BLOCK_N: tl.constexpr, HI: tl.constexpr, ENC: tl.constexpr = False):
    """One of _dequant_w_swz_asm's two tiles: the even-k one (HI False) or the odd-k one."""
    p3 = tl.reshape(packed.to(tl.uint8), (BLOCK_N, 4, 16))
    if HI:
        w = tl.inline_asm_elementwise(_E2M1X4_HI_ENC_ASM if ENC else _E2M1X4_HI_SWZ_ASM, "=r,=r,r,r,r",
                                      [p3, _scales_bf16(sb4, BLOCK_N)], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        w = tl.inline_asm_elementwise(_E2M1X4_LO_ENC_ASM if ENC else _E2M1X4_LO_SWZ_ASM, "=r,=r,r,r,r",
                                      [p3, _scales_bf16(sb4, BLOCK_N)], dtype=tl.bfloat16, is_pure=True, pack=4)
    return tl.reshape(w, (BLOCK_N, 64))


@triton.jit
def _rotr32(w, S: tl.constexpr):
    """Rotate uint32 values right by S bits (0 < S < 32)."""
    return (w >> S) | (w << (32 - S))


@triton.jit
def _enc_code(o, H: tl.constexpr):
    """The e2m1 code (sign << 3 | magnitude) in 16-bit half H of a decoded "mma64e" output."""
    return ((o >> (6 + 16 * H)) & 7) | (((o >> (15 + 16 * H)) & 1) << 3)


@triton.jit
def _mma64e_decode(s, BLOCK_N: tl.constexpr):
    """Stored "mma64e" bytes [BLOCK_N // 64, 16, 256] -> the same tile in "mma64" bytes (what
    the plain / interpreted bodies unswizzle and convert; the PTX path decodes in registers)."""
    b = tl.reshape(s.to(tl.uint32), (BLOCK_N // 64, 16, 64, 4))
    sh = (tl.arange(0, 4) * 8).to(tl.uint32)
    w = tl.sum(b << sh[None, None, None, :], axis=3)       # disjoint bits: the sum is the OR
    r2 = _rotr32(w, 2)
    o0 = w & 0x81C081C0
    o1 = _rotr32(w, 12) & 0x81C081C0
    o2 = (r2 ^ _rotr32(w, 6)) & 0x81C081C0
    o3 = (r2 ^ _rotr32(w, 8)) & 0x81C081C0
    b0 = _enc_code(o0, 0) | (_enc_code(o2, 0) << 4)
    b1 = _enc_code(o0, 1) | (_enc_code(o2, 1) << 4)
    b2 = _enc_code(o1, 0) | (_enc_code(o3, 0) << 4)
    b3 = _enc_code(o1, 1) | (_enc_code(o3, 1) << 4)
    x = tl.join(tl.join(b0, b2), tl.join(b1, b3))           # [..., 64, 2, 2]: byte 2 i + j
    return tl.reshape(x, (BLOCK_N // 64, 16, 256)).to(tl.uint8)


@triton.jit
def _mma64_tile_ptrs(w_e_ptr, pid_n, N, stride_wn, BLOCK_N: tl.constexpr):
    """[BLOCK_N // 64, 16, 256] pointers to the first 128-block of this program's 64-row
    tiles in the "mma64" layout (tile (t, kb) = 4096 contiguous bytes at
    t * 64 * stride_wn + kb * 4096); tiles past N read tile 0 (their rows are masked)."""
    i0 = pid_n * (BLOCK_N // 64) + tl.arange(0, BLOCK_N // 64)
    i0 = tl.where(i0 < N // 64, i0, 0).to(tl.int64)
    i1 = tl.arange(0, 16)
    i2 = tl.arange(0, 256)
    return w_e_ptr + i0[:, None, None] * (64 * stride_wn) + i1[None, :, None] * 256 + i2[None, None, :]


@triton.jit
def _mma64_unswizzle(s, BLOCK_N: tl.constexpr):
    """[BLOCK_N // 64, 16, 256] bytes as stored -> the [BLOCK_N, 64] packed tile (rows n,
    bytes kb of one 128-block). A reshape/permute of the bit-split indices (the inverse of
    weights.mma_layout.to_mma64): for a 16-byte vector load per thread, the register
    layout Triton derives is the wgmma A-operand layout itself, so no shared-memory
    shuffle is generated (ttgir: no convert_layout in the loop)."""
    x = tl.reshape(s, (BLOCK_N // 64, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2))
    # dims 0 n6 | 1 k5 2 n5 3 n4 4 n2 | 5 n1 6 n0 7 k2 8 k1 9 k4 10 k3 11 n3 12 k0 -> n6..n0, k5..k0
    x = tl.permute(x, (0, 2, 3, 11, 4, 5, 6, 1, 9, 10, 7, 8, 12))
    return tl.reshape(x, (BLOCK_N, 64))


@triton.jit
def _dequant_w(packed, sb4, BLOCK_N: tl.constexpr, SELECT_SUBNORMAL: tl.constexpr):
    """Packed [BLOCK_N, 64] bytes + [BLOCK_N, 4] e8m0 bytes -> fp32 (even k, odd k)
    [BLOCK_N, 64] tiles holding e2m1 * 2^(s-127) exactly (see _nibbles_to_f32)."""
    sc4 = ((sb4.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True)  # 2^(s-1); exact for s <= 128
    p32 = packed.to(tl.int32)
    f_lo, f_hi = _nibbles_to_f32(p32, p32, SELECT_SUBNORMAL)
    w_lo = tl.reshape(tl.reshape(f_lo, (BLOCK_N, 4, 16)) * sc4[:, :, None], (BLOCK_N, 64))
    w_hi = tl.reshape(tl.reshape(f_hi, (BLOCK_N, 4, 16)) * sc4[:, :, None], (BLOCK_N, 64))
    return w_lo, w_hi
