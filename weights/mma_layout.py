"""The "mma64" byte layout of packed MXFP4 weights (pure functions, no arithmetic on values).

The checkpoint stores each expert's packed e2m1 bytes row-major ("nk": [N, K/2], row n,
byte j = k 2j (low nibble) and 2j+1 (high nibble)). The Hopper kernels
(kernels/_mxfp4_grouped_gemm.py `W_SWZ`, loads in _mxfp4_dequant.py) want each thread's bytes of a wgmma A-operand
fragment to be 16 contiguous bytes, so a [BLOCK_N, 64]-byte tile lands in registers
with 16-byte loads and no shared-memory shuffle. "mma64" permutes the bytes of every
64-row x 64-byte tile (64 rows x one 128-wide K block, 4096 bytes) for that:

    tile (t, b)  = rows 64t .. 64t+63, bytes 64b .. 64b+63 (k 128b .. 128b+127)
                   stored contiguously at byte offset t * 64 * (K/2) + b * 4096
    inside it    row n = 64t + (n5 n4 n3 n2 n1 n0), byte j = 64b + (k5 k4 k3 k2 k1 k0)
                 (binary digits) sits at r * 256 + c with
                 r = k5 n5 n4 n2              (most to least significant)
                 c = n1 n0 k2 k1 k4 k3 n3 k0

Why these bits: Triton's wgmma A-operand layout for a [64 x 64] tile over 4 warps gives
the thread (lane, warp) rows n = lane / 4 + 16 * warp and n + 8, and bytes
2q, 2q + 1 (q = lane % 4) plus {0, 8, 16, 24} in each 32-byte half of the block. The digits
above put each half's 16 bytes of a thread (2 rows x 8 bytes) in one 16-byte vector, in
the register order the operand wants (k0 first, so a 32-bit register holds a k-pair);
the kernel's reshape/permute of the loaded vectors then is the operand layout itself
(no shared-memory shuffle; checked in the compiled ttgir).

The tensor keeps its shape [..., N, K/2] and dtype uint8; only the byte order changes,
so shapes checks, `.to()` and memory size are unchanged. It needs N % 64 == 0 and
K % 128 == 0 (`mma64_supported`); other widths keep "nk" (nothing is padded).
Scales are not permuted. `to_mma64` and `from_mma64` are inverse permutations.
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "mma64_supported", "to_mma64", "from_mma64", "convert_layout"]

LAYOUTS = ("nk", "mma64")

# digits of (n within the 64-row tile, byte within the 64-byte block), most significant
# first: [n5 n4 n3 n2 n1 n0] and [k5 k4 k3 k2 k1 k0]; positions in the view below:
# 0 ..., 1 tile t, 2 n5, 3 n4, 4 n3, 5 n2, 6 n1, 7 n0, 8 block b, 9 k5, 10 k4, 11 k3,
# 12 k2, 13 k1, 14 k0. The stored order is t, b, k5 n5 n4 n2 | n1 n0 k2 k1 k4 k3 n3 k0.
_TO_MMA64 = (0, 1, 8, 9, 2, 3, 5, 6, 7, 12, 13, 10, 11, 4, 14)
_FROM_MMA64 = tuple(sorted(range(15), key=lambda i: _TO_MMA64[i]))


def mma64_supported(n: int, k: int) -> tuple[bool, str]:
    """Whether an [N, K] MXFP4 weight (K unpacked) can take the "mma64" layout."""
    if n % 64:
        return False, f"N={n} is not a multiple of 64"
    if k % 128:
        return False, f"K={k} is not a multiple of 128"
    return True, f"N={n}, K={k}: whole 64 x 128 tiles"


def _check(w4: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(w4, torch.Tensor) or w4.dtype != torch.uint8 or w4.dim() < 2:
        raise TypeError(f"{name}: expected a [..., N, K/2] uint8 tensor of packed e2m1, got "
                        f"{getattr(w4, 'dtype', type(w4).__name__)} {list(getattr(w4, 'shape', []))}")
    n, kh = w4.shape[-2], w4.shape[-1]
    ok, why = mma64_supported(n, 2 * kh)
    if not ok:
        raise ValueError(f"{name}: shape {list(w4.shape)} cannot take the 'mma64' layout: {why}")
    return n, kh


def _permute(w4: torch.Tensor, order: tuple[int, ...], name: str, source_mma64: bool) -> torch.Tensor:
    n, kh = _check(w4, name)
    lead = w4.shape[:-2]
    x = w4.reshape(-1, n, kh)
    if source_mma64:  # view the stored bytes with the stored digit order, then restore
        x = x.reshape(x.shape[0], n // 64, kh // 64, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2)
        x = x.permute(*order)
    else:
        x = x.reshape(x.shape[0], n // 64, 2, 2, 2, 2, 2, 2, kh // 64, 2, 2, 2, 2, 2, 2)
        x = x.permute(*order)
    return x.contiguous().reshape(*lead, n, kh)


def to_mma64(w4: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] uint8 in "nk" order -> the same bytes in "mma64" order (a new tensor)."""
    return _permute(w4, _TO_MMA64, "w4", source_mma64=False)


def from_mma64(w4: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_mma64`."""
    return _permute(w4, _FROM_MMA64, "w4", source_mma64=True)


def convert_layout(w4: torch.Tensor, source: str, target: str) -> torch.Tensor:
    """w4 in layout `source` -> layout `target` (the same tensor when they are equal)."""
    for arg, v in (("source", source), ("target", target)):
        if v not in LAYOUTS:
            raise ValueError(f"{arg}={v!r}: expected one of {LAYOUTS}")
    if source == target:
        return w4
    return to_mma64(w4) if target == "mma64" else from_mma64(w4)
