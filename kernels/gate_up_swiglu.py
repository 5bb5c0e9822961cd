"""gate_up_swiglu_quant — the routed split-K gate_up GEMM with the SwiGLU-quant in its tail.

    q [T, H] e4m3 (+ scaled bf16 pairs), sa, gate_up weights, align  ->  hq [M, I] e4m3,
    hs [M, I/128] fp32, hp [M, I] bf16 pairs (with `pairs`)

Bitwise the two launches it replaces (the unfused twin of this fusion):

    ws = mxfp4_grouped_gemm(q, sa, w4, sw, align, gather_a=True, scatter_out=False,
                            config=config, ..., reduce=False)                 # [P, R, 2I] fp32
    hq, hs, *hp = swiglu_quant_partials(ws, align.route_rows, align.max_rows, limit=limit,
                                        route_weight=align.row_weight, pairs=pairs)

In one launch: every program of the split gate_up stores its fp32 partial as before, then
counts itself in at its (M-block, quant group) - the quant group g of the I outputs needs the
gate N-block g and the up N-block G + g of every split (BLOCK_N 128, G = I / 128) - and the
program that arrives last runs swiglu_quant_partials' tile code (`swiglu_partials_tile`, the
same Triton function) on that block's routes: sums the partials in split order from +0.0,
rounds to bf16, clamps, SwiGLU, route weight, bf16, UE8M0 quant. So the SwiGLU-quant launch
and its dependent-launch gap leave the decode critical path; the partials still go through
the L2. Counters: `split_k.tile_counters` (left at 0 for the next launch and for CUDA-graph
replay). No host sync.

Limits (`tail_limits` names the one that fails): a folded (fold_sa) split-K "swap" config
with block_n 128, I = N / 2 a multiple of 128, scale format "fp32" (row-major), and the
alignment's row weights. Where they fail the caller keeps the two launches
(`routed_experts_forward`; `explain()` says which ran).
"""

from __future__ import annotations

import torch

from .moe_align import MoeAlignment
from .mxfp4_grouped_gemm import GemmConfig, mxfp4_grouped_gemm, split_parts

__all__ = ["gate_up_swiglu_quant", "tail_limits"]


def tail_limits(config: GemmConfig, n: int, k: int) -> tuple[bool, str]:
    """(ok, reason): whether the gate_up of N = 2I outputs over K with `config` can run the
    SwiGLU-quant in its tail (shapes and config only, no device)."""
    if not isinstance(config, GemmConfig):
        return False, f"config {config!r} is not a GemmConfig"
    if config.kind != "swap" or not config.fold_sa:
        return False, f"the {config.kind} body{'' if config.fold_sa else ' unfolded'} has no SwiGLU tail (swap, fold_sa)"
    if split_parts(config, k) < 2:
        return False, f"the gate_up does not split K = {k} (split_k {config.split_k}): no partials to finish"
    if config.block_n != 128:
        return False, f"block_n {config.block_n}: the tail's quant groups need block_n 128"
    if n % 256:
        return False, f"I = {n // 2 if n % 2 == 0 else n / 2} is not a multiple of 128 (one quant group per N-block)"
    return True, f"split-K {split_parts(config, k)} gate_up, I = {n // 2}: SwiGLU-quant in the GEMM's tail"


def gate_up_swiglu_quant(q: torch.Tensor, sa: torch.Tensor, w4: torch.Tensor, sw: torch.Tensor,
                         align: MoeAlignment, *, config: GemmConfig, layout: str = "nk",
                         a_pairs: torch.Tensor | None = None, a_pairs_scaled: bool = False,
                         limit: float = 10.0, pairs: "bool | str" = False) -> tuple[torch.Tensor, ...]:
    """The routed gate_up (`mxfp4_grouped_gemm(..., gather_a=True, scatter_out=False,
    reduce=False)`, arguments as there) and `swiglu_quant_partials(..., route_weight=
    align.row_weight, pairs=pairs)` on its partials, in one launch; the same outputs, bit for
    bit: (hq [M, I] e4m3, hs [M, I/128] fp32[, hp [M, I] bf16]), M = align.max_rows; rows
    holding no route keep whatever bytes the fresh buffers had, as swiglu_quant_partials'."""
    from .swiglu_quant import _check_limit, _outputs, _pairs_out
    from .act_quant import pairs_scaled, scale_fmt_code

    fn = "gate_up_swiglu_quant"
    if not isinstance(w4, torch.Tensor) or w4.dim() != 3:
        raise ValueError(f"{fn}: w4 must be a [E_local, 2I, K/2] uint8 tensor, got "
                         f"{getattr(w4, 'dtype', type(w4))} {tuple(getattr(w4, 'shape', ()))}")
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise ValueError(f"{fn}: q must be a [T, K] float8_e4m3fn tensor, got "
                         f"{getattr(q, 'dtype', type(q))} {tuple(getattr(q, 'shape', ()))}")
    n, k = w4.shape[1], q.shape[1]
    ok, why = tail_limits(config, n, k)
    if not ok:
        raise ValueError(f"{fn}: config={config!r}, N={n}, K={k}: {why}")
    _check_limit(fn, limit)
    if not isinstance(align, MoeAlignment) or align.row_weight is None:
        raise ValueError(f"{fn}: align must be a MoeAlignment with row weights (moe_align(..., topk_weights)), got "
                         f"{type(align).__name__}{'' if not isinstance(align, MoeAlignment) else ' without row weights'}")
    i, m = n // 2, align.max_rows
    scaled = pairs_scaled(pairs, fn, "fp32")
    hq, hs = _outputs(fn, m, i, "fp32", q.device, None, None)
    hp = _pairs_out(fn, pairs, None, m, i, q.device)
    outs = (hq, hs, hp) if pairs else (hq, hs)
    if align.num_routes == 0 or align.max_blocks == 0 or m == 0:
        return outs
    from ._triton_utils import interpreting
    from .split_k import tile_counters

    rw = align.row_weight
    if rw.dtype != torch.float32 or rw.shape != (m,) or rw.device != q.device:
        raise ValueError(f"{fn}: align.row_weight must be float32 [{m}] on {q.device}, got {rw.dtype} "
                         f"{tuple(rw.shape)} on {rw.device}")
    tail = dict(SWIGLU_TAIL=True, cnt_ptr=tile_counters(q.device, align.max_blocks * (i // 128)),
                hq_ptr=hq.view(torch.uint8), hs_ptr=hs, rw_ptr=rw, hp_ptr=hp if hp is not None else hs,
                limit=float(limit), M_ROWS=m, stride_hqm=hq.stride(0), stride_hsm=hs.stride(0),
                stride_hsg=hs.stride(1), stride_hpm=hp.stride(0) if hp is not None else 0,
                TAIL_PARTS=split_parts(config, k), TAIL_SCALE_FMT=scale_fmt_code("fp32", fn),
                TAIL_PAIRS=0 if hp is None else 2 if scaled else 1, TAIL_LIBDEVICE=not interpreting())
    mxfp4_grouped_gemm(q, sa, w4, sw, align, gather_a=True, scatter_out=False, config=config, layout=layout,
                       a_pairs=a_pairs, a_pairs_scaled=a_pairs_scaled, reduce=False, _swiglu_tail=tail)
    return outs
