"""Exact byte-level views of the checkpoint's number formats (SPEC §3).

    e2m1  (MXFP4 element)   4 bits: sign | 2-bit exponent | 1-bit mantissa
                            codes 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign
                            packed two per byte along K: low nibble = even k, high = k+1
    e8m0  (MX / UE8M0 scale) byte b -> 2^(b-127); 0xFF is NaN; fp32 bits are b << 23
    e4m3  (FP8 weights/acts) torch.float8_e4m3fn, max 448, RNE cast

Every function here is exact (no rounding) except the quantisers, whose rounding rule
is stated. Kernels, the reference and the checkpoint writer all use these, so there is
one definition of each format.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES", "E4M3_MAX", "E2M1_MAX",
    "unpack_e2m1", "pack_e2m1", "e2m1_codes_to_float",
    "e8m0_to_float32", "float32_to_e8m0", "as_e8m0", "as_uint8",
    "ue8m0_scale", "dequant_mxfp4", "dequant_fp8_block",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Value of each 4-bit e2m1 code (bit 3 = sign). -0.0 for code 8 keeps the sign bit.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a 1-byte tensor (int8, uint8, e8m0, e4m3, float4_e2m1fn_x2) as uint8."""
    if t.element_size() != 1:
        raise TypeError(f"as_uint8: expected a 1-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def as_e8m0(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a 1-byte tensor as torch.float8_e8m0fnu (no conversion)."""
    return as_uint8(t).view(torch.float8_e8m0fnu)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed bytes -> [..., K] uint8 codes (0..15), low nibble first."""
    b = as_uint8(packed)
    lo = b & 0x0F
    hi = b >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes (0..15, K even) -> [..., K/2] uint8, even k in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32 values (exact)."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def e8m0_to_float32(s: torch.Tensor) -> torch.Tensor:
    """e8m0 (or uint8) bytes -> float32 2^(b-127), exactly; 255 -> NaN.

    The fp32 with bits b << 23 is 2^(b-127) for b >= 1; b = 0 (2^-127) is subnormal in
    fp32 and is produced separately.
    """
    b = as_uint8(s).to(torch.int32)
    out = (b << 23).view(torch.float32)
    out = torch.where(b == 0, torch.full_like(out, 2.0 ** -127), out)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def float32_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Exact powers of two 2^e (e in [-127, 127]) -> float8_e8m0fnu bytes. Raises otherwise."""
    x = x.float()
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    ok = (m == 0.5) & (e - 1 >= -127) & (e - 1 <= 127)
    if not bool(ok.all()):
        bad = x[~ok].flatten()[0].item()
        raise ValueError(f"float32_to_e8m0: {bad!r} is not a power of two in [2^-127, 2^127]")
    return (e - 1 + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def ue8m0_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax / qmax)) computed exactly on the fp32 bits (SPEC §4.2).

    `amax / qmax` is one fp32 division (RNE); its exponent field is taken, +1 when its
    mantissa bits are non-zero. amax must be positive and normal after the division
    (callers floor it).
    """
    r = amax.float() / qmax
    bits = r.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    exp = exp + (mant != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w[n, k] = e2m1(code[n, k]) * 2^(s[n, k // 32] - 127), float32 [..., N, K]."""
    vals = e2m1_codes_to_float(unpack_e2m1(packed))
    k = vals.shape[-1]
    s = e8m0_to_float32(scale)
    if s.shape[-1] * 32 < k:
        raise ValueError(f"dequant_mxfp4: scale shape {tuple(scale.shape)} too small for K={k}")
    s = s.repeat_interleave(32, dim=-1)[..., :k]
    return vals * s


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """w[n, k] = e4m3(W[n, k]) * 2^(s[n // 128, k // 128] - 127), float32 [N, K].

    `scale` may be e8m0 bytes or float32 powers of two.
    """
    n, k = w.shape[-2:]
    s = scale.float() if scale.dtype == torch.float32 else e8m0_to_float32(scale)
    s = s.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return w.float() * s
