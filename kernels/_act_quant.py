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
    PAIRS: tl.constexpr = False,  # also write bf16(q) in the "pairs" layout (K % 128 == 0)
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = g * 128 + tl.arange(0, 128)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s_store = quant_group_tile(x, SCALE_FMT, SOFTWARE)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    if PAIRS:  # K % 128 == 0: whole groups, only the row mask
        store_pairs(p_ptr + rows * stride_pm + g * 128, q, rows < M, SOFTWARE)
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, s_store, mask=rows < M_S)


def launch_act_quant(x, q_u8, s, m_s: int, scale_fmt_code: int, pairs=None) -> None:
    """x [M, K] bf16 (unit column stride), q_u8 [M, K] uint8 view, s [M_S, G] any strides,
    pairs None or [M, K] bf16 (unit column stride, K % 128 == 0)."""
    m, k = x.shape
    g = triton.cdiv(k, 128)
    # NOTE: 4 rows x 128 cols = 512 elements per program: big enough for 16-byte loads with
    # 1 warp... and small enough that M = 1..8 decode does not waste lanes. Re-tune with
    # scripts/bench_swiglu_quant.py (act_quant rows) if it ever shows up in a profile.
    block_m = 1 if m_s <= 16 else 4
    grid = (triton.cdiv(m_s, block_m), g)
    _act_quant_kernel[grid](
        x, q_u8, s, pairs if pairs is not None else x, m, m_s, k,
        x.stride(0), q_u8.stride(0), s.stride(0), s.stride(1), pairs.stride(0) if pairs is not None else 0,
        SCALE_FMT=scale_fmt_code, BLOCK_M=block_m, SOFTWARE=interpreting(), PAIRS=pairs is not None,
        num_warps=1 if block_m == 1 else 2,
        **pdl_options(x.device),
    )
