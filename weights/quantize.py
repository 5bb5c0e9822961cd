"""The checkpoint quantisers: MXFP4 (routed experts) and FP8 128x128 blocks (shared
expert), as DeepSeek's converter produces them. Bit-exact, vectorised, CPU or GPU.

MXFP4, per 32 consecutive values along K (the last dim):

    amax  = max(|x|) over the group, floored at 6 * 2^-126   (zero groups get scale 2^-126, e8m0 byte 1)
    s     = 2^ceil(log2(amax / 6))                           formats.ue8m0_scale: one fp32 division, exact ceil on the bits
    y     = clamp(x / s, -6, 6)                              x / s is exact (s is a power of two)
    code  = nearest e2m1 value to y; a tie goes to the even code (mantissa bit 0), which is
            IEEE round-half-to-even on e2m1: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    sign  = sign bit of y (bit 3), so negatives that round to 0 give code 8 (-0), as an IEEE cast does
    bytes = two codes per byte, low nibble = even k (formats.pack_e2m1)

FP8, per 128x128 block (edge blocks cover what is left):

    amax  = max(|w|) over the block, floored at 1e-4 (the floor act_quant uses, SPEC §4.2)
    s     = 2^ceil(log2(amax / 448))                         formats.ue8m0_scale
    q     = e4m3(clamp(w / s, -448, 448))                    torch's float -> float8_e4m3fn cast, round-to-nearest-even

Inputs are converted to float32 first; non-finite inputs raise (weights are finite, and a
NaN would silently poison a whole group's scale).
"""

from __future__ import annotations

import torch

from dsv4_moe.config import FP8_BLOCK, MXFP4_GROUP

from .formats import E2M1_MAX, E4M3_MAX, float32_to_e8m0, pack_e2m1, ue8m0_scale

__all__ = ["quantize_mxfp4", "quantize_fp8_block", "e2m1_round", "MXFP4_AMAX_FLOOR", "FP8_AMAX_FLOOR"]

# 6 * 2^-126: amax / 6 is then the smallest normal fp32, so ue8m0_scale's bit trick holds
# and an all-zero group gets scale byte 1 instead of a division by zero.
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0 ** -126
FP8_AMAX_FLOOR = 1e-4

# Midpoints between consecutive e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; +inf closes the table.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, float("inf"))


# Work in chunks of about this many values: temporaries stay cache-sized and are reused
# by the allocator instead of page-faulting fresh 32 MB buffers per op (a V4-Flash expert
# matrix is 8M values; on the 2-core CI box whole-tensor temporaries were ~3x slower).
_CHUNK_VALUES = 1 << 18


def _check_float(name: str, w: torch.Tensor) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {getattr(w, 'dtype', type(w))}")
    return w if w.dtype == torch.float32 else w.float()


def _check_finite(name: str, amax: torch.Tensor) -> None:
    # amax propagates NaN and inf, so checking the (small) per-group maxima suffices.
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{name}: input has non-finite values; weights must be finite to quantise")


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """float32 y with |y| <= 6 -> uint8 e2m1 codes (0..15), nearest value, ties to the even code.

    Rounding is one fp32 addition: the e2m1 step is 0.5 on [0, 2), 1 on [2, 4), 2 on
    [4, 6], and `(a + M) - M` with M = 2^22, 2^23, 2^24 respectively rounds a to a
    multiple of that step with the hardware's round-half-to-even, which is exactly
    "ties to the even code" (the even multiple has mantissa bit 0).
    """
    a = y.abs()
    m = ((a.clamp_min(1.0).view(torch.int32) & 0x7F800000) + (22 << 23)).view(torch.float32)
    q = (a + m).sub_(m)
    # q in {0, .5} -> code 2q; q >= 1 -> (fp32 exponent - 126) * 2 + top mantissa bit.
    code = torch.where(q < 1, (q * 2).to(torch.int32), (q.view(torch.int32) >> 22) - 252)
    code |= torch.signbit(y).to(torch.int32) << 3
    return code.to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantise along the last dim.

        w        [..., N, K]     float (K a multiple of 32)
        returns  packed [..., N, K/2]   uint8 (two e2m1 codes, low nibble = even k)
                 scale  [..., N, K/32]  float8_e8m0fnu
    """
    x = _check_float("quantize_mxfp4: w", w)
    if x.dim() < 1 or x.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"quantize_mxfp4: shape {tuple(w.shape)}: last dim must be a multiple of {MXFP4_GROUP}")
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    packed = torch.empty(rows.shape[0], k // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows.shape[0], k // MXFP4_GROUP, dtype=torch.float8_e8m0fnu, device=x.device)
    step = max(1, _CHUNK_VALUES // k)
    for r0 in range(0, rows.shape[0], step):
        g = rows[r0:r0 + step].reshape(-1, k // MXFP4_GROUP, MXFP4_GROUP)
        amax = g.abs().amax(dim=-1, keepdim=True)
        _check_finite("quantize_mxfp4: w", amax)
        s = ue8m0_scale(amax.clamp_min_(MXFP4_AMAX_FLOOR), E2M1_MAX)
        y = (g / s).clamp_(-E2M1_MAX, E2M1_MAX)
        packed[r0:r0 + step] = pack_e2m1(e2m1_round(y).reshape(-1, k))
        scale[r0:r0 + step] = float32_to_e8m0(s.squeeze(-1))
    return packed.reshape(*x.shape[:-1], k // 2), scale.reshape(*x.shape[:-1], k // MXFP4_GROUP)


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8-quantise in block x block tiles.

        w        [N, K]                                     float
        returns  q     [N, K]                               float8_e4m3fn
                 scale [ceil(N/block), ceil(K/block)]       float8_e8m0fnu
    """
    x = _check_float("quantize_fp8_block: w", w)
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_block: w shape {tuple(w.shape)}: expected 2 dims [N, K]")
    n, k = x.shape
    nb, kb = -(-n // block), -(-k // block)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(nb, kb, dtype=torch.float8_e8m0fnu, device=x.device)
    for b in range(nb):
        rows = x[b * block:(b + 1) * block]
        # Zero padding never raises a block's amax, so edge blocks see only their own values.
        xp = torch.nn.functional.pad(rows, (0, kb * block - k))
        amax = xp.abs().reshape(rows.shape[0], kb, block).amax(dim=(0, 2))
        _check_finite("quantize_fp8_block: w", amax)
        s = ue8m0_scale(amax.clamp_min_(FP8_AMAX_FLOOR), E4M3_MAX)
        s_cols = s.repeat_interleave(block)[:k]
        q[b * block:(b + 1) * block] = (rows / s_cols).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scale[b] = float32_to_e8m0(s)
    return q, scale
