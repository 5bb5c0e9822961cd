"""Triton bodies of the fused clamped-SwiGLU + FP8 quant (SPEC §5.1).

Per [R, 128] tile (R rows, one quant group g of the I output columns):

    g = min(gate, L)            NaN propagates; NO lower clamp on the gate
    u = clamp(up, -L, L)
    h = g / (1 + exp(-g)) * u   fp32; exp is libdevice expf, the division IEEE (div_rn):
                                the same formula and rounding as torch's CUDA F.silu
    h = h * w[row]              optional routing weight (fp32)
    hb = bf16(h)                RNE, kept in registers (never written)
    q, s = quant_group_tile(hb) the act_quant group step, shared code

Two launch strategies (seed 002):
* `group`:      grid (M_S, G), one program per quant group, 1 warp. Lowest latency for
                launch-bound decode (every program is independent, no loop overhead).
* `persistent`: grid (P, G), P = min(row blocks, PERSISTENT_PROGRAMS_PER_SM * SMs / G):
                program (p, g) loops over the [BLOCK_M, 128] tiles of group g in row
                blocks p, p + P, ...; wide rows per program give 16-byte loads and
                amortise the per-row id/weight loads; skipped rows cost one id load.
* `rows`:       grid (cdiv(R, ROWS_BLOCK), G) over a list of R row indices (the routed
                path's `route_rows`: the GEMM row of every route, -1 for non-local ones),
                one [ROWS_BLOCK, 128] tile per program: the work follows the routes, not
                the alignment's max_rows (at decode most of those rows are block padding:
                Flash T = 16 has 96 routes in 1536 rows).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._triton_utils import interpreting, pdl_enter, pdl_options, quant_group_tile, round_to_bf16, store_pairs

# NOTE: measured on the H200 (2026-11-29, session 3, docs/bench/2026-11-29/session3/):
# with 4 programs per SM ncu showed 23 % achieved occupancy and 36 % of DRAM peak at
# I=2048, M=8192 (the tile loop is not pipelined, so warps in flight are what hides
# latency). Session 6 (docs/bench/2026-11-29/session6/, after cutting the instructions
# per element from ~55 to ~43): us at 16 / 32 / 64 programs per SM, I=2048 M=8192
# 34.3 / 30.9 / 31.4, I=3072 M=8192 48.2 / 44.8 / 44.5, I=2048 M=4096 18.4 / 18.4 / 18.1;
# 16-row tiles of 4 warps beat 8 x 2 and 32 x 4, and a register prefetch of the next tile
# (PERSISTENT_PREFETCH, 95 registers) or a 64-register cap were slower. ncu at 16 per SM:
# issue slots 62 % busy, DRAM 50 %, 72 registers (7 programs resident per SM). Re-tune
# with scripts/gpu_check_shared.py --parts t_swiglu (its sweep columns in the JSON).
PERSISTENT_PROGRAMS_PER_SM = 32
PERSISTENT_BLOCK_M = 16
PERSISTENT_NUM_WARPS = 4
PERSISTENT_PREFETCH = False
PERSISTENT_MAXNREG = None  # ptxas register cap (None: the compiler's choice)
ROWS_BLOCK = 16
ROWS_NUM_WARPS = 4
# NOTE: up to ROWS_SMALL_MAX_R listed rows one row per program (1 warp, as "group"), else
# 16-row tiles of 4 warps. H200, session 13 (docs/bench/2026-11-29/session13/
# probe_swiglu_rows_924e2de.txt, graphs, us, one row / 16-row tiles): Flash (I = 2048)
# 6 rows 2.98 / 4.78, 24 rows 3.63 / 4.52, 48 rows 3.73 / 3.97, 96 rows 3.05 / 3.91, 384
# rows 8.62 / 3.90; Pro-TP8 (I = 384) 96 rows 2.21 / 2.62, 384 rows 3.52 / 3.56, 1536 rows
# 7.06 / 3.53. The row-range strategies over the alignment's max_rows took 3.1-13.5 us at
# 6-96 routes and 35-87 us at 384-6144 (Flash).
ROWS_SMALL_MAX_R = 128


@triton.jit
def _swiglu_load(gu_ptr, rw_ptr, ids_ptr, map_ptr, rows, g, M, I, stride_gm,
                 HAS_RW: tl.constexpr, HAS_IDS: tl.constexpr, HAS_MAP: tl.constexpr):
    """Loads of one [R, 128] tile: raw gate / up (input dtype), routing weight, row filter."""
    in_m = rows < M
    ok = in_m
    if HAS_IDS:
        eid = tl.load(ids_ptr + rows, mask=in_m, other=-1)
        ok = ok & (eid >= 0)
        if HAS_MAP:
            loc = tl.load(map_ptr + eid, mask=ok, other=-1)
            ok = ok & (loc >= 0)
    cols = g * 128 + tl.arange(0, 128)
    mask = ok[:, None] & (cols < I)[None, :]
    base = gu_ptr + rows[:, None] * stride_gm + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0)
    up = tl.load(base + I, mask=mask, other=0.0)
    if HAS_RW:
        w = tl.load(rw_ptr + rows, mask=ok, other=0.0)
    else:
        w = ok.to(tl.float32)  # unused
    return gate, up, w, ok


@triton.jit
def _swiglu_compute_store(
    gate, up, w, ok, q_ptr, s_ptr, p_ptr,
    rows, g, M, M_S, I, limit,
    stride_qm, stride_sm, stride_sg, stride_pm,
    SCALE_FMT: tl.constexpr, HAS_RW: tl.constexpr, USE_LIBDEVICE: tl.constexpr, PAIRS: tl.constexpr,
):
    cols = g * 128 + tl.arange(0, 128)
    mask = ok[:, None] & (cols < I)[None, :]
    up = tl.clamp(up.to(tl.float32), -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    gate = tl.minimum(gate.to(tl.float32), limit, propagate_nan=tl.PropagateNan.ALL)
    if USE_LIBDEVICE:
        e = libdevice.exp(-gate)
    else:  # interpreter: numpy exp (libdevice is not interpreted)
        e = tl.exp(-gate)
    h = tl.math.div_rn(gate, 1.0 + e) * up
    if HAS_RW:
        h = h * w[:, None]
    # masked entries loaded 0 (and weight 0), so h = 0 / (1 + 1) * 0 = +0 there already
    hb = round_to_bf16(h, not USE_LIBDEVICE)
    q, s_store = quant_group_tile(hb, SCALE_FMT, not USE_LIBDEVICE)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    if PAIRS:  # bf16(q) in the "pairs" layout (act_quant's pairs output; I % 128 == 0)
        store_pairs(p_ptr + rows * stride_pm + g * 128, q, ok, not USE_LIBDEVICE, s_store, PAIRS == 2)
    # Rows M..M_S-1 (padded column-major scales) write the scale of an all-zero group.
    s_mask = ok | ((rows >= M) & (rows < M_S))
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, s_store, mask=s_mask)


@triton.jit
def _swiglu_quant_group_kernel(
    gu_ptr, q_ptr, s_ptr, rw_ptr, ids_ptr, map_ptr, p_ptr,
    M, M_S, I, limit,
    stride_gm, stride_qm, stride_sm, stride_sg, stride_pm,
    SCALE_FMT: tl.constexpr, HAS_RW: tl.constexpr, HAS_IDS: tl.constexpr, HAS_MAP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, PAIRS: tl.constexpr = 0,
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    rows = row + tl.arange(0, 1)
    gate, up, w, ok = _swiglu_load(gu_ptr, rw_ptr, ids_ptr, map_ptr, rows, g, M, I, stride_gm,
                                   HAS_RW, HAS_IDS, HAS_MAP)
    _swiglu_compute_store(gate, up, w, ok, q_ptr, s_ptr, p_ptr, rows, g, M, M_S, I, limit,
                          stride_qm, stride_sm, stride_sg, stride_pm, SCALE_FMT, HAS_RW, USE_LIBDEVICE, PAIRS)


@triton.jit
def _swiglu_quant_persistent_kernel(
    gu_ptr, q_ptr, s_ptr, rw_ptr, ids_ptr, map_ptr, p_ptr,
    M, M_S, I, limit, row_blocks,
    stride_gm, stride_qm, stride_sm, stride_sg, stride_pm,
    SCALE_FMT: tl.constexpr, HAS_RW: tl.constexpr, HAS_IDS: tl.constexpr, HAS_MAP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, BLOCK_M: tl.constexpr, PREFETCH: tl.constexpr = False,
    PAIRS: tl.constexpr = 0,
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    pdl_enter(PDL)
    # Grid (P, G): program (p, g) walks row blocks p, p + P, ... of quant group g. The
    # programs of one row block (all g) start together, so the gate and up halves of those
    # rows stream through L2 together; no integer division per tile (the earlier flat
    # tile loop spent ~3 instructions per element on tile // G and tile % G).
    # PREFETCH: the next tile's loads are issued before this tile's math (a register
    # double buffer; Triton does not pipeline this loop by itself).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    g = tl.program_id(1)
    if PREFETCH:
        rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        gate, up, w, ok = _swiglu_load(gu_ptr, rw_ptr, ids_ptr, map_ptr, rows, g, M, I, stride_gm,
                                       HAS_RW, HAS_IDS, HAS_MAP)
        for rb in range(pid, row_blocks, nprog):
            rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            nrows = rows + nprog * BLOCK_M   # past M_S on the last lap: masked, nothing read
            gate_n, up_n, w_n, ok_n = _swiglu_load(gu_ptr, rw_ptr, ids_ptr, map_ptr, nrows, g, M, I, stride_gm,
                                                   HAS_RW, HAS_IDS, HAS_MAP)
            _swiglu_compute_store(gate, up, w, ok, q_ptr, s_ptr, p_ptr, rows, g, M, M_S, I, limit,
                                  stride_qm, stride_sm, stride_sg, stride_pm, SCALE_FMT, HAS_RW, USE_LIBDEVICE, PAIRS)
            gate, up, w, ok = gate_n, up_n, w_n, ok_n
    else:
        for rb in range(pid, row_blocks, nprog):
            rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            gate, up, w, ok = _swiglu_load(gu_ptr, rw_ptr, ids_ptr, map_ptr, rows, g, M, I, stride_gm,
                                           HAS_RW, HAS_IDS, HAS_MAP)
            _swiglu_compute_store(gate, up, w, ok, q_ptr, s_ptr, p_ptr, rows, g, M, M_S, I, limit,
                                  stride_qm, stride_sm, stride_sg, stride_pm, SCALE_FMT, HAS_RW, USE_LIBDEVICE, PAIRS)


@triton.jit
def _swiglu_quant_rows_kernel(
    gu_ptr, q_ptr, s_ptr, rw_ptr, ids_ptr, map_ptr, p_ptr, rows_ptr,
    M, M_S, I, limit, R,
    stride_gm, stride_qm, stride_sm, stride_sg, stride_pm,
    SCALE_FMT: tl.constexpr, HAS_RW: tl.constexpr, HAS_IDS: tl.constexpr, HAS_MAP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, BLOCK_R: tl.constexpr, PAIRS: tl.constexpr = 0,
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    """Program (pb, g): the rows rows[pb * BLOCK_R ...] (entries < 0 skipped) of group g."""
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    row = tl.load(rows_ptr + r, mask=r < R, other=-1)
    rows = tl.where(row >= 0, row, M).to(tl.int64)  # M: out of range, so masked everywhere
    gate, up, w, ok = _swiglu_load(gu_ptr, rw_ptr, ids_ptr, map_ptr, rows, g, M, I, stride_gm,
                                   HAS_RW, HAS_IDS, HAS_MAP)
    _swiglu_compute_store(gate, up, w, ok, q_ptr, s_ptr, p_ptr, rows, g, M, M_S, I, limit,
                          stride_qm, stride_sm, stride_sg, stride_pm, SCALE_FMT, HAS_RW, USE_LIBDEVICE, PAIRS)


@triton.jit
def _swiglu_quant_partials_kernel(
    ws_ptr, q_ptr, s_ptr, rw_ptr, p_ptr, rows_ptr,
    M, M_S, I, limit, R,
    stride_qm, stride_sm, stride_sg, stride_pm,
    NUM_PARTS: tl.constexpr, SCALE_FMT: tl.constexpr, HAS_RW: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, PAIRS: tl.constexpr = 0,
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    """Program (r, g): route r's group g, its gate / up columns summed from the split-K
    GEMM's fp32 partials ws [NUM_PARTS, R, 2I] in part order from +0.0 and rounded to bf16
    (what `_split_k_reduce_kernel` writes to the GEMM row rows[r]), then the rows kernel's
    steps at that row. rows[r] outside [0, M) (< 0: a route not on this rank): nothing
    loaded or stored."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    g = tl.program_id(1)
    row = tl.load(rows_ptr + r, mask=r < R, other=-1)
    ok = (row >= 0) & (row < M)
    rows = tl.where(ok, row, M).to(tl.int64)  # M: out of range, so masked everywhere
    cols = g * 128 + tl.arange(0, 128)
    mask = ok[:, None] & (cols < I)[None, :]
    base = ws_ptr + r[:, None] * (2 * I) + cols[None, :]
    acc_g = tl.zeros([1, 128], dtype=tl.float32)
    acc_u = tl.zeros([1, 128], dtype=tl.float32)
    # NOTE: unrolled like _split_k_reduce_kernel (independent loads issue together; the adds
    # stay in part order)
    for p in tl.static_range(NUM_PARTS):
        acc_g += tl.load(base + p * R * (2 * I), mask=mask, other=0.0)
        acc_u += tl.load(base + p * R * (2 * I) + I, mask=mask, other=0.0)
    gate = round_to_bf16(acc_g, not USE_LIBDEVICE).to(tl.bfloat16)
    up = round_to_bf16(acc_u, not USE_LIBDEVICE).to(tl.bfloat16)
    if HAS_RW:
        w = tl.load(rw_ptr + rows, mask=ok, other=0.0)
    else:
        w = ok.to(tl.float32)  # unused
    _swiglu_compute_store(gate, up, w, ok, q_ptr, s_ptr, p_ptr, rows, g, M, M_S, I, limit,
                          stride_qm, stride_sm, stride_sg, stride_pm, SCALE_FMT, HAS_RW, USE_LIBDEVICE, PAIRS)


def launch_swiglu_quant_partials(ws, q_u8, s, rw, rows, m: int, m_s: int, limit: float,
                                 scale_fmt_code: int, pairs=None, pairs_scaled: bool = False) -> None:
    parts, r, two_i = ws.shape
    i = two_i // 2
    dummy = ws  # never dereferenced when the matching flag is off
    if r:
        _swiglu_quant_partials_kernel[(r, triton.cdiv(i, 128))](
            ws, q_u8, s, rw if rw is not None else dummy, pairs if pairs is not None else dummy, rows,
            m, m_s, i, float(limit), r, q_u8.stride(0), s.stride(0), s.stride(1),
            pairs.stride(0) if pairs is not None else 0,
            NUM_PARTS=parts, SCALE_FMT=scale_fmt_code, HAS_RW=rw is not None, USE_LIBDEVICE=not interpreting(),
            PAIRS=0 if pairs is None else 2 if pairs_scaled else 1, num_warps=1, **pdl_options(ws.device))


def launch_swiglu_quant(gate_up, q_u8, s, rw, ids, emap, m_s: int, limit: float,
                        scale_fmt_code: int, strategy: str, num_sms: int, pairs=None, rows=None,
                        pairs_scaled: bool = False) -> None:
    m = gate_up.shape[0]
    i = gate_up.shape[1] // 2
    g = triton.cdiv(i, 128)
    dummy = gate_up  # never dereferenced when the matching HAS_* flag is False
    args = (gate_up, q_u8, s, rw if rw is not None else dummy, ids if ids is not None else dummy,
            emap if emap is not None else dummy, pairs if pairs is not None else dummy)
    flags = dict(SCALE_FMT=scale_fmt_code, HAS_RW=rw is not None, HAS_IDS=ids is not None,
                 HAS_MAP=emap is not None, USE_LIBDEVICE=not interpreting(),
                 PAIRS=0 if pairs is None else 2 if pairs_scaled else 1)
    strides = (gate_up.stride(0), q_u8.stride(0), s.stride(0), s.stride(1),
               pairs.stride(0) if pairs is not None else 0)
    if strategy == "rows":
        r = rows.shape[0]
        br, nw = (1, 1) if r <= ROWS_SMALL_MAX_R else (ROWS_BLOCK, ROWS_NUM_WARPS)
        if r:
            _swiglu_quant_rows_kernel[(triton.cdiv(r, br), g)](
                *args, rows, m, m_s, i, float(limit), r, *strides, **flags, BLOCK_R=br,
                num_warps=nw, **pdl_options(gate_up.device))
    elif strategy == "group":
        _swiglu_quant_group_kernel[(m_s, g)](*args, m, m_s, i, float(limit), *strides, **flags, num_warps=1,
                                             **pdl_options(gate_up.device))
    elif strategy == "persistent":
        bm = PERSISTENT_BLOCK_M
        row_blocks = triton.cdiv(m_s, bm)
        nprog = max(1, min(row_blocks, PERSISTENT_PROGRAMS_PER_SM * num_sms // g))
        _swiglu_quant_persistent_kernel[(nprog, g)](*args, m, m_s, i, float(limit), row_blocks, *strides,
                                                    **flags, BLOCK_M=bm, PREFETCH=PERSISTENT_PREFETCH,
                                                    num_warps=PERSISTENT_NUM_WARPS, **pdl_options(gate_up.device),
                                                    **({} if PERSISTENT_MAXNREG is None else
                                                       {"maxnreg": PERSISTENT_MAXNREG}))
    else:
        raise ValueError(f"swiglu_quant: strategy={strategy!r}, expected 'group', 'persistent' or 'rows'")
