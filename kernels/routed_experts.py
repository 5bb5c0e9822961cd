"""Routed experts on CUDA (SPEC §4.4 for every local route), composed from four kernels:

    align = moe_align(topk_ids, E_local, first_expert, BLOCK_M, topk_weights)
    gu    = mxfp4_grouped_gemm(q, sa, gate_up)          [max_rows, 2I] bf16, rows gathered
                                                         by token = route // k
    hq,hs = swiglu_quant(gu, limit, route_weight=align.row_weight,
                         expert_ids=align.row_expert)   clamp, silu*up, * route weight
                                                         (BEFORE w2), bf16, act_quant;
                                                         padding rows (-1) skipped
    y     = mxfp4_grouped_gemm(hq, hs, down)            rows scattered to slot r = t*k + slot

    q             [T, H]            float8_e4m3fn   act_quant(x)
    sa            [T, ceil(H/128)]  float32
    topk_weights  [T, k]            float32
    topk_ids      [T, k]            int32/int64     global ids
    routed        RoutedExpertWeights (weights/tensors.py)
    ->  y         [T, k, H]         bfloat16        slots of non-local routes are not written

Numerics: each GEMM follows SPEC §4.3 except for summing a 128-block's four 32-wide
partials before scaling (docs/DESIGN.md: a deviation, 1 ulp on <= 0.024 % of outputs), and
swiglu_quant is bitwise its reference on the same device, so y equals
`dsv4_moe.reference.routed_forward` except where that re-association moves a bf16
rounding of gu (and from there, rarely, an FP8 code of hq). No host syncs: capturable.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from dsv4_moe.weights.tensors import RoutedExpertWeights

from .moe_align import MoeAlignment, moe_align
from .mxfp4_grouped_gemm import GemmConfig, gemv_config, mxfp4_grouped_gemm, select_config

__all__ = ["routed_experts_forward", "routed_configs"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def routed_configs(num_routes: int, routed: RoutedExpertWeights) -> tuple[GemmConfig, GemmConfig]:
    """(gate_up config, down config); both share BLOCK_M because they share one alignment."""
    i, h = routed.intermediate, routed.hidden
    up = select_config(num_routes, routed.num_local, 2 * i, h, routed.layout)
    down = select_config(num_routes, routed.num_local, h, i, routed.layout)
    if up.kind == "gemv" and down.kind != "gemv":  # e.g. Pro-TP8 T=4: long-K gate_up keeps the GEMV
        down = gemv_config(i)
    if down.block_m != up.block_m:
        down = dataclasses.replace(down, block_m=up.block_m)
    # NOTE: gate_up's activations as bf16 [even | odd] pairs (GemmConfig.a_bf16; bitwise the
    # fp8 operand). H200 probe, session 5 (docs/bench/2026-11-29/session5/probe_swz_4b8412e.txt,
    # "mma64" swap, conversion by torch included, us): Flash gate_up T=16 340.8 -> 308.6,
    # T=1024 1459.6 -> 1338.9; Pro-TP8 gate_up T=16 150.3 -> 141.1, T=1024 675.0 -> 653.3.
    # Not at T <= 4 (split-K decode: level or slower unsplit) and not for down (Pro-TP8 down
    # T=16 82.2 -> 113.5, T=1024 484.4 -> 744.8).
    rows = num_routes / max(routed.num_local, 1)
    if up.kind == "swap" and up.split_k == 1 and routed.layout == "mma64" and rows >= 0.2 and h % 128 == 0:
        up = dataclasses.replace(up, a_bf16=True)
    # NOTE: the short-K down GEMM (Pro-TP8: K = I/tp = 384, three 128-blocks) on the swap
    # body: the K loop unrolled twice (fewer pipeline barriers per block) and, for 16-row
    # blocks from 0.05 routes per expert, a 128-register cap (147 -> 128 registers, 3 -> 4
    # programs per SM, an 8-byte spill). H200 probe, session 10 (docs/bench/2026-11-29/
    # session10/probe_swz_unroll_down_50ef385.txt, graphs, us, before -> now, bitwise):
    # T=1 10.1 -> 7.8, T=4 25.1 -> 22.3, T=16 73.2 -> 67.7, T=64 202.2 -> 192.6, T=256
    # 301.9 -> 298.4, T=1024 700.9 -> 487.0 (the 32-row block spills under the cap: it
    # was applied there unmeasured until session 10). The unroll is slower on every
    # long-K GEMM (Flash down 0.94-0.99x, every gate_up 0.78-0.84x; probe_swz_unroll_492f56e.txt).
    # The cap alone (session 6, probe_swz_regs_b805197.txt): Pro-TP8 down T=4 25.1 -> 23.9,
    # T=16 80.6 -> 78.5, T=64 206.9 -> 195.6, T=256 314.2 -> 303.2; every gate_up level or
    # slower.
    if down.kind == "swap" and routed.layout == "mma64" and i <= 1024:
        down = dataclasses.replace(down, unroll=2,
                                   maxnreg=128 if rows >= 0.05 and down.block_m == 16 else None)
    return up, down


def routed_experts_forward(q: torch.Tensor, sa: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, routed: RoutedExpertWeights, limit: float,
                           swiglu: str = "fused", *, configs: tuple[GemmConfig, GemmConfig] | None = None,
                           return_alignment: bool = False):
    """y [T, k, H] bf16 for every local route (see the module docstring).

    `swiglu` picks the SwiGLU-quant between the GEMMs: "fused" (one kernel) or "unfused"
    (its bitwise twin, the bf16 activation materialised) - the A/B of SPEC §5.1.
    """
    if swiglu not in ("fused", "unfused"):
        raise ValueError(f"swiglu={swiglu!r}: expected 'fused' or 'unfused'")
    if not isinstance(routed, RoutedExpertWeights):
        raise ValueError(f"routed: expected RoutedExpertWeights, got {type(routed).__name__}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected a [T, k] int tensor, got {getattr(topk_ids, 'shape', type(topk_ids))}")
    t, k = topk_ids.shape
    h, i = routed.hidden, routed.intermediate
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn or q.shape != (t, h):
        raise ValueError(f"q: expected [{t}, {h}] float8_e4m3fn, got "
                         f"{getattr(q, 'dtype', type(q))} shape {tuple(getattr(q, 'shape', ()))}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
            or topk_weights.shape != (t, k):
        raise ValueError(f"topk_weights: expected [{t}, {k}] float32, got "
                         f"{getattr(topk_weights, 'dtype', type(topk_weights))} "
                         f"shape {tuple(getattr(topk_weights, 'shape', ()))}")
    if not (float(limit) > 0):
        raise ValueError(f"limit={limit!r}: expected > 0")
    y = torch.empty((t * k, h), dtype=torch.bfloat16, device=q.device)
    cfg_up, cfg_down = configs or routed_configs(t * k, routed)
    align: MoeAlignment = moe_align(topk_ids, routed.num_local, routed.first_expert, cfg_up.block_m,
                                    topk_weights)
    if t * k == 0:
        return (y.view(t, k, h), align) if return_alignment else y.view(t, k, h)
    from .swiglu_quant import swiglu_quant, swiglu_quant_unfused  # SPEC §5.1

    gu = mxfp4_grouped_gemm(q, sa, routed.gate_up, routed.gate_up_scale, align,
                            gather_a=True, scatter_out=False, config=cfg_up, layout=routed.layout)
    # NOTE: the persistent strategy loops to a runtime bound, which the Triton interpreter
    # (numpy 2) cannot run; under TRITON_INTERPRET use the one-program-per-group strategy
    # (same numerics: both are bitwise the reference swiglu_quant).
    if swiglu == "fused":
        strategy = "group" if _interpreting() else None
        hq, hs = swiglu_quant(gu, limit=float(limit), route_weight=align.row_weight,
                              expert_ids=align.row_expert, strategy=strategy)
    else:
        hq, hs = swiglu_quant_unfused(gu, limit=float(limit), route_weight=align.row_weight,
                                      expert_ids=align.row_expert)
    mxfp4_grouped_gemm(hq, hs, routed.down, routed.down_scale, align,
                       gather_a=False, scatter_out=True, out=y, config=cfg_down, layout=routed.layout)
    return (y.view(t, k, h), align) if return_alignment else y.view(t, k, h)
