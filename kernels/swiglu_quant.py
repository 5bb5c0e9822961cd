"""swiglu_quant — fused clamped SwiGLU + bf16 rounding + UE8M0 FP8 quant (SPEC §4.4, §5.1).

Reads the GEMM1 output `gate_up` once and writes FP8 codes plus scales; the bf16
activation h is never written to memory:

    g = gate_up[:, :I].float();  u = gate_up[:, I:].float()
    u = clamp(u, -L, L);  g = min(g, L)          # the gate has NO lower clamp
    h = silu(g) * u                              # fp32; silu(g) = g / (1 + exp(-g))
    h = h * route_weight[row]                    # optional (routed experts, before w2)
    q, s = act_quant(bf16(h))                    # §4.2, scale_fmt as in act_quant

`pairs=True` also writes bf16(q) in act_quant's "pairs" layout (the routed down GEMM's
second operand with GemmConfig.a_bf16; I % 128 == 0); skipped rows keep its bytes too.

Row filtering (routed experts under EP): rows with expert_ids[row] == -1, or with
expert_map[expert_ids[row]] == -1, are skipped: their q rows and scales are left
untouched (pass out_q / out_s to keep what was there). `rows` (int32 [R], e.g.
`MoeAlignment.route_rows`) instead lists the rows to compute (entries < 0 skipped; each
row at most once): the kernel's work then follows R, not M (strategy "rows").

`swiglu_quant_partials` takes a split-K GEMM's fp32 partials [P, R, 2I] instead of gate_up
and sums them first (in order from +0.0, one bf16 rounding: what the GEMM's reduce launch
writes), so the routed decode path skips that launch; bitwise the reduce + `rows`.

`swiglu_quant_unfused` is the twin made of separate torch ops + act_quant, with the bf16
activation materialised; fused and unfused are bitwise equal on the same device (the
contract of SPEC §5). Strategy choice: `choose_strategy` below.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .act_quant import act_quant, alloc_scales, check_pairs_out, check_scales_out, pairs_scaled, scale_fmt_code

from dsv4_moe._types import is_int, is_real

__all__ = ["swiglu_quant", "swiglu_quant_partials", "swiglu_quant_unfused", "choose_strategy",
           "PERSISTENT_MIN_ELEMENTS", "PERSISTENT_I_MULTIPLE"]

_BLOCK = 128

# NOTE: crossover between the one-program-per-group launch (best while launch-bound) and
# the persistent grid, in output elements M*I. Measured on the H200 (2026-11-29,
# docs/bench/2026-11-29/gpu_check_shared_run1.txt, group / persistent us): I=2048 M=1
# 5.45 / 8.35, M=256 (0.5M) 10.44 / 10.39, M=1024 (2M) 15.29 / 12.42, M=8192 82.6 / 57.4;
# I=384 M=1024 (0.4M) 5.49 / 5.87, M=4096 (1.6M) 14.53 / 13.44. Persistent starts to win
# between 0.5M and 1.5M elements, so 1M (seed 002's figure for its CUDA kernels) stays.
# Re-measure with scripts/gpu_check_shared.py --parts t_swiglu.
PERSISTENT_MIN_ELEMENTS = 1 << 20
# NOTE (session 35, H200, Triton 3.6; scripts/gpu_probe_native_bounds.py --parts swiglu,
# docs/bench/2026-11-30/session35/probe_native_bounds_*.txt): the persistent kernel wrote wrong
# codes at odd columns (every quant group, the scales right) for I = 136, 152, 200, 216 and 1000
# (I % 16 == 8) at 4 and 40 rows, under 1, 2 or 4 warps with 16- or 32-row tiles (not under 8 warps
# or with 4- or 1-row tiles); right for I % 16 in (0, 4) (100, 144, 176, 192, 196, 208, 256, 384,
# 1008) and in the group and rows kernels, which run the same tile code (_swiglu_load /
# _swiglu_compute_store), and in the interpreter. The
# same kernel assembled by the CUDA 13.0 toolkit's ptxas (TRITON_PTXAS_PATH) was right at every
# width and layout (probe_swiglu_ptxas13_*.txt): a fault of the ptxas 12.8 that Triton 3.6 bundles.
# So the persistent grid is taken only for I % PERSISTENT_I_MULTIPLE == 0 (every DeepSeek-V4
# width: I / tp is a multiple of the MXFP4 group, 32), whatever the ptxas; other widths run
# "group" (choose_strategy), and asking for "persistent" there is a ValueError.
PERSISTENT_I_MULTIPLE = 16


def choose_strategy(m: int, intermediate: int, filtered: bool) -> str:
    """'persistent' when the output has at least PERSISTENT_MIN_ELEMENTS elements and I is a
    multiple of PERSISTENT_I_MULTIPLE, otherwise 'group' (filtered or not: `filtered` is kept
    for callers).

    NOTE: sessions 1-3 took the persistent grid for every filtered input (seed 002:
    skipping dominates); the H200 profile of session 4 (scripts/gpu_profile_layer.py)
    measured the routed call at Flash T=1 (96 rows, 90 of them padding) at 5.05 us
    persistent, where the shared expert's unfiltered 1-row call took 1.42 us grouped: a
    small filtered input is launch-bound like any other. Large ones keep the grid."""
    if m * intermediate >= PERSISTENT_MIN_ELEMENTS and intermediate % PERSISTENT_I_MULTIPLE == 0:
        return "persistent"
    return "group"


def _check_rows(fn, rows, m, device, scale_fmt):
    if rows is None:
        return
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int32 or rows.dim() != 1 or rows.device != device:
        raise ValueError(f"{fn}: rows must be an int32 [R] tensor on {device}, got "
                         f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}")
    if rows.numel() > 1 and rows.stride(0) != 1:
        raise ValueError(f"{fn}: rows must be contiguous, stride {rows.stride()}")
    if scale_fmt == "fp32_cm":
        raise ValueError(f"{fn}: rows is not supported with scale_fmt='fp32_cm' (its padded scale rows "
                         f"are written by the row-range strategies only)")


def _check_limit(fn, limit):
    if not is_real(limit) or not 0 < limit < float("inf"):
        raise ValueError(f"{fn}: limit={limit!r}: expected a finite number > 0 (swiglu_limit, 10.0 in V4)")


def _check_inputs(fn, gate_up, route_weight, expert_ids, expert_map):
    for name, t in (("route_weight", route_weight), ("expert_ids", expert_ids), ("expert_map", expert_map)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 2:
        raise ValueError(f"{fn}: gate_up must be a 2-D tensor [M, 2I], got "
                         f"{tuple(gate_up.shape) if isinstance(gate_up, torch.Tensor) else type(gate_up).__name__}")
    if gate_up.dtype != torch.bfloat16:
        raise ValueError(f"{fn}: gate_up.dtype={gate_up.dtype}, expected torch.bfloat16")
    m, two_i = gate_up.shape
    if two_i == 0 or two_i % 2:
        raise ValueError(f"{fn}: gate_up.shape={tuple(gate_up.shape)}, last dim must be 2I > 0 (even)")
    if m > 0 and gate_up.stride(1) != 1:
        raise ValueError(f"{fn}: gate_up.stride()={tuple(gate_up.stride())}, expected unit column stride")
    dev = gate_up.device
    if route_weight is not None:
        if route_weight.dtype != torch.float32 or tuple(route_weight.shape) != (m,) or route_weight.device != dev:
            raise ValueError(f"{fn}: route_weight must be float32 [{m}] on {dev}, got {route_weight.dtype} "
                             f"{tuple(route_weight.shape)} on {route_weight.device}")
        if m > 1 and route_weight.stride(0) != 1:
            raise ValueError(f"{fn}: route_weight must be contiguous, stride {route_weight.stride()}")
    if expert_map is not None and expert_ids is None:
        raise ValueError(f"{fn}: expert_map given without expert_ids")
    if expert_ids is not None:
        if expert_ids.dtype != torch.int32 or tuple(expert_ids.shape) != (m,) or expert_ids.device != dev:
            raise ValueError(f"{fn}: expert_ids must be int32 [{m}] on {dev}, got {expert_ids.dtype} "
                             f"{tuple(expert_ids.shape)} on {expert_ids.device}")
        if m > 1 and expert_ids.stride(0) != 1:
            raise ValueError(f"{fn}: expert_ids must be contiguous, stride {expert_ids.stride()}")
    if expert_map is not None:
        if expert_map.dtype != torch.int32 or expert_map.dim() != 1 or expert_map.device != dev:
            raise ValueError(f"{fn}: expert_map must be int32 [E] on {dev}, got {expert_map.dtype} "
                             f"{tuple(expert_map.shape)} on {expert_map.device}")
        if expert_map.numel() > 1 and expert_map.stride(0) != 1:
            raise ValueError(f"{fn}: expert_map must be contiguous, stride {expert_map.stride()}")
    return m, two_i // 2


def _outputs(fn, m, i, scale_fmt, device, out_q, out_s):
    g = -(-i // _BLOCK)
    if out_q is None:
        out_q = torch.empty(m, i, dtype=torch.float8_e4m3fn, device=device)
    elif (out_q.dtype != torch.float8_e4m3fn or tuple(out_q.shape) != (m, i)
          or (m and out_q.stride(1) != 1)):
        raise ValueError(f"{fn}: out_q must be float8_e4m3fn {(m, i)} with unit column stride, got "
                         f"{out_q.dtype} {tuple(out_q.shape)} strides {tuple(out_q.stride())}")
    if out_s is None:
        out_s = alloc_scales(m, g, scale_fmt, device)
    else:
        check_scales_out(out_s, m, g, scale_fmt, device, fn)
    return out_q, out_s


def _pairs_out(fn, pairs, out_pairs, m, i, device):
    if out_pairs is not None and not pairs:
        raise ValueError(f"{fn}: out_pairs given with pairs=False")
    return check_pairs_out(out_pairs, m, i, device, fn, dim="I") if pairs else None


def swiglu_quant(gate_up: torch.Tensor, *, limit: float = 10.0,
                 route_weight: Optional[torch.Tensor] = None,
                 expert_ids: Optional[torch.Tensor] = None,
                 expert_map: Optional[torch.Tensor] = None,
                 scale_fmt: str = "fp32",
                 out_q: Optional[torch.Tensor] = None, out_s: Optional[torch.Tensor] = None,
                 strategy: Optional[str] = None, pairs: "bool | str" = False,
                 out_pairs: Optional[torch.Tensor] = None,
                 rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """Fused clamped SwiGLU + FP8 group quant (one Triton launch; none when M = 0).

    Args:
        gate_up       [M, 2I]  bfloat16, unit column stride; gate columns [0, I), up [I, 2I)
        limit         float    swiglu_limit L (10.0 for every V4 config)
        route_weight  [M]      float32 or None, multiplied into h before the bf16 rounding
        expert_ids    [M]      int32 or None; rows with -1 are skipped
        expert_map    [E]      int32 or None; rows with expert_map[expert_ids] == -1 skipped
                               (PRECONDITION: expert_ids < E - read on the device, not checked:
                               a check would sync the host)
        scale_fmt     str      "fp32" | "e8m0" | "fp32_cm" | "amax" (see act_quant)
        out_q, out_s           optional preallocated outputs (skipped rows keep their bytes)
        strategy      str      None (choose_strategy; "rows" when `rows` is given) | "group" |
                               "persistent" | "rows"
        pairs         bool     also return bf16(q) in the "pairs" layout (act_quant; "scaled":
                               bf16(q * s), see act_quant)
        out_pairs     [M, I]   bfloat16, optional preallocated pairs output (pairs=True)
        rows          [R]      int32 or None: compute only these rows (entries outside [0, M)
                               skipped, each row at most once; the expert filters still apply);
                               strategy "rows"
    Returns:
        q  [M, I] float8_e4m3fn;  s  scales in `scale_fmt`'s layout, G = ceil(I/128);
        p  [M, I] bfloat16, only with pairs=True
    """
    fn = "swiglu_quant"
    code = scale_fmt_code(scale_fmt, fn)
    scaled = pairs_scaled(pairs, fn, scale_fmt)
    _check_limit(fn, limit)
    m, i = _check_inputs(fn, gate_up, route_weight, expert_ids, expert_map)
    _check_rows(fn, rows, m, gate_up.device, scale_fmt)
    out_q, out_s = _outputs(fn, m, i, scale_fmt, gate_up.device, out_q, out_s)
    p = _pairs_out(fn, pairs, out_pairs, m, i, gate_up.device)
    m_s = out_s.shape[0]
    if m_s == 0:
        return (out_q, out_s, p) if pairs else (out_q, out_s)
    if strategy is None:
        strategy = "rows" if rows is not None else choose_strategy(m, i, expert_ids is not None)
    if strategy not in ("group", "persistent", "rows"):
        raise ValueError(f"{fn}: strategy={strategy!r}, expected None, 'group', 'persistent' or 'rows'")
    if strategy == "persistent" and i % PERSISTENT_I_MULTIPLE:
        raise ValueError(f"{fn}: strategy='persistent' needs I % {PERSISTENT_I_MULTIPLE} == 0, got I={i} (its kernel "
                         f"wrote wrong codes at such widths on the H200, see the NOTE above PERSISTENT_I_MULTIPLE); "
                         f"use None (auto), 'group' or 'rows'")
    if (strategy == "rows") != (rows is not None):
        raise ValueError(f"{fn}: strategy={strategy!r} with rows={'given' if rows is not None else None}: "
                         f"strategy 'rows' and the rows argument go together")
    from ._swiglu_quant import launch_swiglu_quant

    num_sms = (torch.cuda.get_device_properties(gate_up.device).multi_processor_count
               if gate_up.device.type == "cuda" else 4)
    s_view = out_s.view(torch.uint8) if out_s.dtype == torch.float8_e8m0fnu else out_s
    launch_swiglu_quant(gate_up, out_q.view(torch.uint8), s_view, route_weight, expert_ids, expert_map,
                        m_s, limit, code, strategy, num_sms, p, rows, pairs_scaled=scaled)
    return (out_q, out_s, p) if pairs else (out_q, out_s)


def swiglu_quant_partials(partials: torch.Tensor, rows: torch.Tensor, num_rows: int, *, limit: float = 10.0,
                          route_weight: Optional[torch.Tensor] = None, scale_fmt: str = "fp32",
                          out_q: Optional[torch.Tensor] = None, out_s: Optional[torch.Tensor] = None,
                          pairs: "bool | str" = False,
                          out_pairs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """`swiglu_quant(gate_up, rows=rows, ...)` on the split-K partials of gate_up, with the
    reduction folded in (one launch instead of the GEMM's reduce kernel and this one):

        gate_up[rows[r]] = bf16(+0.0 + partials[0, r] + partials[1, r] + ...)   (fp32 adds, in order)

    which is what `mxfp4_grouped_gemm(..., reduce=True)` writes, so the outputs are bitwise
    those of the reduce followed by `swiglu_quant(..., rows=rows)`; gate_up is never written.

    Args:
        partials      [P, R, 2I]  float32  `mxfp4_grouped_gemm(..., reduce=False)`: route r's
                                           P partial sums (non-local routes' are never read)
        rows          [R]         int32    the GEMM row of each route, < 0 where not local
                                           (`MoeAlignment.route_rows`; each row at most once)
        num_rows      int                  M, the rows of q / s / pairs (the alignment's max_rows)
        limit, route_weight [M], scale_fmt ("fp32" | "e8m0" | "amax"), out_q, out_s, pairs,
        out_pairs                          as `swiglu_quant`; rows never listed keep their bytes
    Returns:
        q [M, I] float8_e4m3fn;  s [M, G];  p [M, I] bfloat16, only with pairs
    """
    fn = "swiglu_quant_partials"
    code = scale_fmt_code(scale_fmt, fn)
    scaled = pairs_scaled(pairs, fn, scale_fmt)
    _check_limit(fn, limit)
    if not isinstance(partials, torch.Tensor) or partials.dim() != 3 or partials.dtype != torch.float32:
        raise ValueError(f"{fn}: partials must be a float32 [P, R, 2I] tensor, got "
                         f"{getattr(partials, 'dtype', type(partials))} "
                         f"{tuple(getattr(partials, 'shape', ()))}")
    p_n, r, two_i = partials.shape
    if p_n < 1 or two_i == 0 or two_i % 2:
        raise ValueError(f"{fn}: partials.shape={tuple(partials.shape)}, expected P >= 1 and an even 2I > 0")
    if not partials.is_contiguous():
        raise ValueError(f"{fn}: partials must be contiguous, strides {tuple(partials.stride())}")
    if not is_int(num_rows) or num_rows < 0:
        raise ValueError(f"{fn}: num_rows={num_rows!r}, expected an int >= 0")
    m, i, dev = num_rows, two_i // 2, partials.device
    if rows is None:
        raise ValueError(f"{fn}: rows is required (the output row of each of the {r} routes)")
    _check_rows(fn, rows, m, dev, scale_fmt)
    if route_weight is not None and not isinstance(route_weight, torch.Tensor):
        raise TypeError(f"{fn}: route_weight: expected a torch.Tensor or None, got {type(route_weight).__name__}")
    if rows.shape[0] != r:
        raise ValueError(f"{fn}: rows has {rows.shape[0]} entries, partials {r} routes")
    if route_weight is not None and (route_weight.dtype != torch.float32 or tuple(route_weight.shape) != (m,)
                                     or route_weight.device != dev or (m > 1 and route_weight.stride(0) != 1)):
        raise ValueError(f"{fn}: route_weight must be a contiguous float32 [{m}] on {dev}, got "
                         f"{route_weight.dtype} {tuple(route_weight.shape)} on {route_weight.device}")
    out_q, out_s = _outputs(fn, m, i, scale_fmt, dev, out_q, out_s)
    p = _pairs_out(fn, pairs, out_pairs, m, i, dev)
    if m and r:
        from ._swiglu_quant import launch_swiglu_quant_partials

        s_view = out_s.view(torch.uint8) if out_s.dtype == torch.float8_e8m0fnu else out_s
        launch_swiglu_quant_partials(partials, out_q.view(torch.uint8), s_view, route_weight, rows, m,
                                     out_s.shape[0], limit, code, p, pairs_scaled=scaled)
    return (out_q, out_s, p) if pairs else (out_q, out_s)


def swiglu_quant_unfused(gate_up: torch.Tensor, *, limit: float = 10.0,
                         route_weight: Optional[torch.Tensor] = None,
                         expert_ids: Optional[torch.Tensor] = None,
                         expert_map: Optional[torch.Tensor] = None,
                         scale_fmt: str = "fp32",
                         out_q: Optional[torch.Tensor] = None, out_s: Optional[torch.Tensor] = None,
                         pairs: "bool | str" = False, out_pairs: Optional[torch.Tensor] = None,
                         rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """The unfused twin of `swiglu_quant` (same arguments and outputs, no `strategy`):
    separate torch ops with the bf16 activation materialised, then the Triton
    `act_quant`; filtered rows are copied out with torch indexing. Bitwise equal to the
    fused kernel on the same device; it exists as the fallback and the A/B baseline."""
    fn = "swiglu_quant_unfused"
    scale_fmt_code(scale_fmt, fn)
    pairs_scaled(pairs, fn, scale_fmt)
    _check_limit(fn, limit)
    m, i = _check_inputs(fn, gate_up, route_weight, expert_ids, expert_map)
    _check_rows(fn, rows, m, gate_up.device, scale_fmt)
    out_q, out_s = _outputs(fn, m, i, scale_fmt, gate_up.device, out_q, out_s)
    p = _pairs_out(fn, pairs, out_pairs, m, i, gate_up.device)
    ret = (out_q, out_s, p) if pairs else (out_q, out_s)
    if out_s.shape[0] == 0:
        return ret
    g = gate_up[:, :i].float()
    u = gate_up[:, i:].float()
    u = torch.clamp(u, -limit, limit)
    g = torch.clamp(g, max=limit)  # NOTE: no lower clamp on the gate (SPEC §4.4)
    h = F.silu(g) * u
    if route_weight is not None:
        h = h * route_weight[:, None]
    hb = h.to(torch.bfloat16)
    if expert_ids is None and rows is None:
        act_quant(hb, scale_fmt=scale_fmt, out_q=out_q, out_s=out_s, pairs=pairs, out_pairs=p)
        return ret
    q, s, *qp = act_quant(hb, scale_fmt=scale_fmt, pairs=pairs)
    keep = torch.ones(m, dtype=torch.bool, device=gate_up.device)
    if rows is not None:  # listed rows only: a spare slot m takes the entries outside [0, M)
        # NOTE: index_fill_ with a Python scalar (no host-to-device copy: `listed[idx] = True`
        # copies a CPU scalar tensor, which breaks CUDA-graph capture of the unfused layer)
        listed = torch.zeros(m + 1, dtype=torch.bool, device=gate_up.device)
        listed.index_fill_(0, torch.where((rows >= 0) & (rows < m), rows, m).long(), True)
        keep = listed[:m]
    if expert_ids is not None:
        keep = keep & (expert_ids >= 0)
    if expert_map is not None:
        keep = keep & (expert_map[expert_ids.clamp_min(0).long()] >= 0)
    # torch.where keeps the launch count fixed (CUDA-graph friendly, no host sync).
    out_q.view(torch.uint8).copy_(torch.where(keep[:, None], q.view(torch.uint8), out_q.view(torch.uint8)))
    if pairs:
        p.copy_(torch.where(keep[:, None], qp[0], p))
    s_rows = out_s[:m]
    keep_s = keep[:, None]
    if out_s.dtype == torch.float8_e8m0fnu:
        s_rows.view(torch.uint8).copy_(torch.where(keep_s, s.view(torch.uint8), s_rows.view(torch.uint8)))
    else:
        s_rows.copy_(torch.where(keep_s, s[:m], s_rows))
        if out_s.shape[0] > m:  # padded rows of "fp32_cm": the all-zero-group scale, as fused
            out_s[m:].copy_(s[m:])
    return ret
