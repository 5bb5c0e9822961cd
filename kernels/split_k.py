"""Per-tile arrival counters for the in-kernel ("last program reduces") exact split-K.

An exact split-K GEMM writes each K block's scaled partial to an fp32 workspace and sums
them in block order from +0.0 (bitwise the single pass). Instead of a second launch for
that sum, every program of a split tile bumps the tile's counter after its partials are
stored (`split_k_arrive`, release/acquire at GPU scope after a CTA barrier: the CUTLASS
semaphore pattern); the program that arrives last sums the tile's partials in block order,
writes the bf16 result and sets the counter back to 0, so the buffer is ready for the
next launch and for CUDA-graph replay without a memset.

Used by the shared expert's split-K FP8 GEMV (M = 1), where it measured 0.4-1.9 us faster
per GEMM on the H200 (session 6). The routed MXFP4 swap body and the FP8 tile body
measured slower with it (the last program's serial reduction and its registers) and keep
their second launch; BENCHMARKS.md has the figures.

`tile_counters(device, n)` hands out one zeroed int32 buffer per (device, stream), grown on
demand: kernels on one stream run one after the other, so they can share it. Two kernels
that share a stream's buffer must not run concurrently, which holds for work issued to
one stream; the buffer of a CUDA graph's capture stream is allocated (zeroed) in the
graph's memory pool on first use.
"""

from __future__ import annotations

import torch

__all__ = ["tile_counters"]

_COUNTERS: dict[tuple, torch.Tensor] = {}


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters for split-K tiles on the current
    stream of `device` (kernels leave every counter they use at 0)."""
    if n < 0:
        raise ValueError(f"tile_counters: n={n}, expected >= 0")
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        # NOTE: grown to a power of two (at least 4096) so shape changes rarely reallocate
        size = max(4096, 1 << max(n - 1, 0).bit_length())
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
