"""act_quant — per-row, per-128-column UE8M0 FP8 quantisation of activations (SPEC §4.2).

For each row m and each 128-column group g of a bf16 input:

    amax = max |x[m, g]|            (fp32; NaN entries ignored, like CUDA's fmaxf)
    amax = max(amax, 1e-4)          (the floor keeps all-zero groups finite)
    s    = 2^ceil(log2(amax / 448)) (exactly, on the fp32 bits: the UE8M0 scale)
    q    = e4m3(clamp(x / s, -448, 448))   round-to-nearest-even

s is a power of two, so x / s is exact and the only rounding is the e4m3 cast. The
last group may be narrower than 128 when K is not a multiple of 128.
"""

from __future__ import annotations

import torch

from dsv4_moe.weights.formats import E4M3_MAX, ue8m0_scale

__all__ = ["act_quant", "ACT_QUANT_AMAX_FLOOR", "group_amax", "scale_to_e8m0_bits"]

ACT_QUANT_AMAX_FLOOR = 1e-4


def group_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """[M, K] -> [M, ceil(K/block)] fp32 max |x| per group, NaN ignored, floor applied."""
    m, k = x.shape
    nb = -(-k // block)
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if nb * block != k:
        a = torch.nn.functional.pad(a, (0, nb * block - k))
    amax = a.view(m, nb, block).amax(dim=-1)
    return torch.clamp(amax, min=ACT_QUANT_AMAX_FLOOR)


def scale_to_e8m0_bits(s: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales (or +inf) -> e8m0 bytes (the fp32 exponent field)."""
    return ((s.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_groups(x: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """q = e4m3(clamp(x / s_group, ±448)) for fp32 scales s [M, ceil(K/block)]."""
    k = x.shape[1]
    s_full = s.repeat_interleave(block, dim=1)[:, :k]
    y = torch.clamp(x.float() / s_full, -E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn)


def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations to FP8 e4m3 with one UE8M0 scale per `block` columns.

    Args:
        x      [M, K]              bfloat16
    Returns:
        q      [M, K]              float8_e4m3fn
        s      [M, ceil(K/block)]  float32, exact powers of two (row-major)
    """
    if x.dim() != 2:
        raise ValueError(f"act_quant: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"act_quant: x.dtype={x.dtype}, expected torch.bfloat16")
    amax = group_amax(x, block)
    s = ue8m0_scale(amax, E4M3_MAX)
    return quantize_groups(x, s, block), s
