"""Triton body of act_quant: one program per (BLOCK_M rows x one 128-column group).

The grid is (cdiv(M_S, BLOCK_M), G). Rows in [M, M_S) exist only for the padded
column-major scale layout torch's scaled_mm wants: they read nothing (all-zero group ->
floored amax) and write only their scale, so the padding is deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_utils import interpreting, pdl_enter, pdl_options, quant_group_tile, store_pairs


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, p_ptr,
    M, M_S, K,
    stride_xm, stride_qm, stride_sm, stride_sg, stride_pm,
    SCALE_FMT: tl.constexpr, BLOCK_M: tl.constexpr, SOFTWARE: tl.constexpr,
    PAIRS: tl.constexpr = 0,  # also write bf16(q) in the "pairs" layout (K % 128 == 0); 2: bf16(q * s)
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    pdl_enter(PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    act_quant_group(x_ptr, q_ptr, s_ptr, p_ptr, rows, tl.program_id(1), M, M_S, K,
                    stride_xm, stride_qm, stride_sm, stride_sg, stride_pm, SCALE_FMT, SOFTWARE, PAIRS)


@triton.jit
def act_quant_group(x_ptr, q_ptr, s_ptr, p_ptr, rows, g, M, M_S, K,
                    stride_xm, stride_qm, stride_sm, stride_sg, stride_pm,
                    SCALE_FMT: tl.constexpr, SOFTWARE: tl.constexpr, PAIRS: tl.constexpr):
    """Quantise 128-column group g of the rows `rows` (int64 [R]; rows >= M read nothing,
    rows >= M_S write nothing): the act_quant kernel's program, also run inside the router's
    logits launch (`route_topk(..., act_quant=...)`), so both give the same bits."""
    cols = g * 128 + tl.arange(0, 128)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s_store = quant_group_tile(x, SCALE_FMT, SOFTWARE)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    if PAIRS:  # K % 128 == 0: whole groups, only the row mask
        store_pairs(p_ptr + rows * stride_pm + g * 128, q, rows < M, SOFTWARE, s_store, PAIRS == 2)
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, s_store, mask=rows < M_S)


def launch_act_quant(x, q_u8, s, m_s: int, scale_fmt_code: int, pairs=None, *, block_m=None,
                     num_warps=None, pairs_scaled: bool = False) -> None:
    """x [M, K] bf16 (unit column stride), q_u8 [M, K] uint8 view, s [M_S, G] any strides,
    pairs None or [M, K] bf16 (unit column stride, K % 128 == 0). block_m / num_warps:
    probes only (scripts/gpu_probe_act_quant.py); None = the tuned choice."""
    m, k = x.shape
    g = triton.cdiv(k, 128)
    # NOTE: one row per program at decode (M <= 16: no wasted lanes), 4 rows x 128 columns
    # up to M = 128; above, bigger programs. H200, session 12 (scripts/gpu_probe_act_quant.py,
    # docs/bench/2026-11-29/session12/probe_act_quant*_58f3e40.txt, graphs, 4 rotated inputs,
    # us, 4 rows / 2 warps -> chosen, K = 4096 / 7168, pairs written): M=256 3.27 -> 2.55 /
    # 5.16 -> 3.38 (8 rows, 4 warps); M=1024 11.24 -> 5.81 / 18.28 -> 9.78, M=8192 80.17 ->
    # 47.08 / 139.28 -> 86.40 (32 rows, 8 warps: 3.4-3.8 TB/s, was 1.3-2.1); same bits.
    if block_m is None:
        block_m = 1 if m_s <= 16 else 4 if m_s < 128 else 8 if m_s < 512 else 32
    if num_warps is None:
        num_warps = {1: 1, 4: 2, 8: 4}.get(block_m, 8)
    grid = (triton.cdiv(m_s, block_m), g)
    _act_quant_kernel[grid](
        x, q_u8, s, pairs if pairs is not None else x, m, m_s, k,
        x.stride(0), q_u8.stride(0), s.stride(0), s.stride(1), pairs.stride(0) if pairs is not None else 0,
        SCALE_FMT=scale_fmt_code, BLOCK_M=block_m, SOFTWARE=interpreting(),
        PAIRS=0 if pairs is None else 2 if pairs_scaled else 1,
        num_warps=num_warps,
        **pdl_options(x.device),
    )
