"""fp8_block_gemm_nt — FP8 GEMM with 1x128 activation and 128x128 weight block scales (Triton).

    out[m, n] = bf16( sum_kb  dot(q[m, kb], w[n, kb]) * sa[m, kb] * sw[n // 128, kb] )

The shared expert's two GEMMs (SPEC §4.3), "NT": both operands K-contiguous, as stored
in the checkpoint. Any M >= 1, N, K (K need not be a multiple of 128; the last block is
partial) -- I = 384 (N = 768 for gate_up, K = 384 for down) is served unpadded.

`choose_config(M, N, K)` picks tiles (see its comments); any config can be forced with
`config=` (the GPU sweep in scripts/gpu_check_shared.py does). Triton is imported lazily.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["fp8_block_gemm_nt", "choose_config", "NUM_SMS_H200"]

_BLOCK = 128
NUM_SMS_H200 = 132


def choose_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_H200) -> dict:
    """Tile config for an [M, K] x [N, K]^T FP8 GEMM.

    Decode (M <= 16): weight-bandwidth bound, a GEMV in disguise. BLOCK_M = 16 (the
    smallest wgmma M Triton uses), and BLOCK_N as small as needed to put a program on
    ~90% of the SMs: N = 4096 -> BN 32 = 128 programs; N = 768 (V4-Pro TP8 gate_up)
    -> BN 16 = 48 programs (no split-K: it would reorder the cross-block sum, §4.3).
    Deep pipelines (5 stages) keep several 128-wide K blocks of weights in flight.
    Mid M (<= 128): 64-row tiles. Prefill: 128 x 128 (or 128 x 256 when there are
    enough tiles to fill the GPU twice), 8 warps, 3-4 stages.
    NOTE: starting points from the H200's shape (132 SMs, 228 KB smem); re-tune from the
    `gemm_sweep` rows of scripts/gpu_check_shared.py.
    """
    if m <= 16:
        bn = 64
        while bn > 16 and -(-n // bn) < 0.9 * num_sms:  # 128 programs on 132 SMs is enough
            bn //= 2
        return dict(BLOCK_M=16, BLOCK_N=bn, GROUP_M=1, num_warps=4, num_stages=5, IMPRECISE=32)
    if m <= 128:
        bn = 128 if -(-m // 64) * -(-n // 128) >= num_sms else 64
        return dict(BLOCK_M=64, BLOCK_N=bn, GROUP_M=8, num_warps=4, num_stages=4, IMPRECISE=32)
    tiles_256 = -(-m // 128) * -(-n // 256)
    if n >= 2048 and tiles_256 >= 2 * num_sms:
        return dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3, IMPRECISE=32)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4, IMPRECISE=32)


def fp8_block_gemm_nt(q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, *,
                      out: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """Block-scaled FP8 GEMM, bf16 output.

    Args:
        q    [M, K]                      float8_e4m3fn  activations, unit column stride
        sa   [>=M, ceil(K/128)]          float32        activation scales, any strides (the
                                                        row-major and padded column-major
                                                        act_quant layouts both work)
        w    [N, K]                      float8_e4m3fn  weights, unit column stride
        sw   [ceil(N/128), ceil(K/128)]  float8_e8m0fnu | uint8 (e8m0 bytes) | float32
        out  [M, N]                      bfloat16, optional, unit column stride
        config                           optional tile dict (choose_config's keys)
    Returns: out [M, N] bfloat16. M = 0 returns an empty tensor without a launch.
    """
    fn = "fp8_block_gemm_nt"
    for name, t in (("q", q), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{fn}: {name} must be a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{fn}: {name}.dtype={t.dtype}, expected torch.float8_e4m3fn")
        if t.numel() and t.stride(1) != 1:
            raise ValueError(f"{fn}: {name}.stride()={tuple(t.stride())}, expected unit column stride")
    m, k = q.shape
    n, kw = w.shape
    if kw != k or k == 0:
        raise ValueError(f"{fn}: q.shape={tuple(q.shape)} and w.shape={tuple(w.shape)} need the same K > 0")
    if n == 0:
        raise ValueError(f"{fn}: w.shape={tuple(w.shape)} has N=0")
    kb = -(-k // _BLOCK)
    if sa.dtype != torch.float32 or sa.dim() != 2 or sa.shape[0] < m or sa.shape[1] != kb:
        raise ValueError(f"{fn}: sa must be float32 [>={m}, {kb}], got {sa.dtype} {tuple(sa.shape)}")
    if sw.dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32):
        raise ValueError(f"{fn}: sw.dtype={sw.dtype}, expected float8_e8m0fnu, uint8 (e8m0 bytes) or float32")
    if tuple(sw.shape) != (-(-n // _BLOCK), kb):
        raise ValueError(f"{fn}: sw.shape={tuple(sw.shape)}, expected {(-(-n // _BLOCK), kb)}")
    for name, t in (("sa", sa), ("w", w), ("sw", sw)):
        if t.device != q.device:
            raise ValueError(f"{fn}: {name}.device={t.device}, expected q's device {q.device}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or (out.numel() and out.stride(1) != 1):
        raise ValueError(f"{fn}: out must be bfloat16 {(m, n)} with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    if m == 0:
        return out
    cfg = dict(config) if config is not None else choose_config(m, n, k)
    if not 0 < cfg.get("IMPRECISE", 32) <= _BLOCK:
        raise ValueError(f"{fn}: config IMPRECISE={cfg['IMPRECISE']}, expected 1..128 (tl.dot max_num_imprecise_acc)")
    from ._fp8_block_gemm import launch_fp8_block_gemm
    from ._triton_utils import interpreting

    sw_k = sw.view(torch.uint8) if sw.dtype == torch.float8_e8m0fnu else sw
    launch_fp8_block_gemm(q.view(torch.uint8), sa, w.view(torch.uint8), sw_k, out, cfg, interpreting())
    return out
