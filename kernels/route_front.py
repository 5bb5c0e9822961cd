"""The decode front of the MoE layer in one launch (`_route_front.py` has the body):

    router logits (the Triton GEMV)  ->  sqrt(softplus), top-k, renormalise   (route_topk)
    act_quant(x) [+ bf16 pairs]                                              (act_quant)
    moe_align(topk_ids, ..., topk_weights), one-program path                 (moe_align)

    x            [T, H]   bfloat16
    weight       [E, H]   bfloat16 / float32   gate weight; bias / tid2eid / input_ids as route_topk
    ->  topk_weights [T, k] float32, topk_ids [T, k] int32,
        q [T, H] float8_e4m3fn, sa [T, ceil(H/128)] float32 (act_quant's "fp32" format),
        q_pairs [T, H] bfloat16 or None (act_quant(x, pairs=True)[2]),
        align MoeAlignment (block_m, num_local, first_expert as given, row weights included)

Bitwise the separate launches (same Triton bodies: `_logits_tile`, `_topk_tokens` (the
top-k kernel's exact steps, all tokens at once),
`quant_group_tile`, `_align_small_body`; the logits grid and warps are the GEMV's), in one
launch instead of four: the last program to finish its logits tile routes and aligns
(an arrival counter from `split_k.tile_counters`, left at 0 for the next launch and for
CUDA-graph replay). No host sync. Limits (`front_limits` names the one that fails): T <=
FRONT_MAX_T (the GEMV's range), R = T*k <= 64 routes with the one-program alignment's row
bound, E <= 4096, pairs only with H % 128 == 0, a CUDA device outside the Triton
interpreter (the scores use libdevice) - except with `_raw_logits=True`, for tests under
the interpreter only: then the selection runs on the raw logits (no sqrt(softplus)), like
`_route_topk_kernel` launched with APPLY_SCORES=False.
"""

from __future__ import annotations

import torch

from . import moe_align as moe_align_mod
from .moe_align import SMALL_MAX_ROWS, align_sizes, check_align_args, new_alignment
from .router import GEMV_MAX_T, check_route_args, gemv_blocks

__all__ = ["route_front", "front_limits", "FRONT_MAX_T", "FRONT_MAX_ROUTES"]

# NOTE: the GEMV's range (router.GEMV_MAX_T): above it the logits come from cuBLAS, which
# cannot host the rest.
FRONT_MAX_T = GEMV_MAX_T
FRONT_MAX_ROUTES = 64  # moe_align's one-program path (its route tile)


def front_limits(num_tokens: int, top_k: int, num_local: int, block_m: int, num_experts: int = 256,
                 hidden: int = 128, pairs: bool = False) -> tuple[bool, str]:
    """(ok, reason): whether route_front takes these sizes (shapes only, no device)."""
    r = num_tokens * top_k
    if not 1 <= num_tokens <= FRONT_MAX_T:
        return False, f"T = {num_tokens} tokens: the one-launch front covers 1 <= T <= {FRONT_MAX_T}"
    if r > FRONT_MAX_ROUTES:
        return False, f"R = {r} routes > {FRONT_MAX_ROUTES} (the one-program alignment)"
    if align_sizes(r, num_local, block_m)[1] > SMALL_MAX_ROWS:
        return False, f"the alignment's rows exceed {SMALL_MAX_ROWS}"
    if num_experts > 4096:
        return False, f"E = {num_experts} experts > 4096"
    if pairs and hidden % 128:
        return False, f"bf16 pairs need H % 128 == 0, H = {hidden}"
    return True, f"T = {num_tokens} <= {FRONT_MAX_T}, R = {r} routes"


def route_front(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None, top_k: int,
                routed_scaling_factor: float, *, num_local: int, first_expert: int, block_m: int,
                pairs: "bool | str" = False, _raw_logits: bool = False, _diag: int = 0,
                _warps: int | None = None):
    """(topk_weights, topk_ids, q, sa, q_pairs | None, align); see the module docstring."""
    import triton  # noqa: PLC0415

    from ._route_front import _route_front_kernel
    from ._triton_utils import SCALE_FMTS, interpreting, pdl_options
    from .split_k import tile_counters

    from .act_quant import pairs_scaled

    scaled = pairs_scaled(pairs, "route_front")
    if _warps is not None and _warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"_warps={_warps!r}: expected None or a power of two from 1 to 16")
    t, h, e, hashed = check_route_args(x, weight, bias, tid2eid, input_ids, top_k, routed_scaling_factor)
    check_align_args(num_local, first_expert, block_m)
    ok, why = front_limits(t, top_k, num_local, block_m, e, h, pairs)
    if not ok:
        raise ValueError(f"route_front: {why}")
    if x.stride(1) != 1:
        raise ValueError(f"x.stride()={tuple(x.stride())}: expected unit column stride")
    if _raw_logits != interpreting():
        raise ValueError(f"_raw_logits={_raw_logits}: the raw-logits selection is for tests under the Triton "
                         f"interpreter only, and the interpreter cannot compute the scores (interpreting="
                         f"{interpreting()})")
    if not interpreting() and x.device.type != "cuda":
        raise ValueError(f"x: on {x.device}; route_front runs on a CUDA device (or under the Triton interpreter)")
    dev = x.device
    r = t * top_k
    g = -(-h // 128)
    f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
    logits = torch.empty((t, e), **f32)
    out_w = torch.empty((t, top_k), **f32)
    out_ids = torch.empty((t, top_k), **i32)
    q = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=dev)
    sa = torch.empty((t, g), **f32)
    q_pairs = torch.empty((t, h), dtype=torch.bfloat16, device=dev) if pairs else None
    align = new_alignment(r, top_k, num_local, block_m, dev)
    max_blocks, max_rows = align.max_blocks, align.max_rows
    # the last program aligns in moe_align's default form (session 29: by sorting where it would)
    sorted_align = moe_align_mod.SMALL_SORTED and r <= moe_align_mod.SORTED_MAX_ROUTES
    bt, be, bh, warps = gemv_blocks(t, h)
    warps = _warps or warps  # probes only (scripts/gpu_check_front_pairs.py)
    grid = (triton.cdiv(e, be), triton.cdiv(t, bt))
    nprog = grid[0] * grid[1]
    x = x.contiguous()
    weight = weight.contiguous()
    dummy = logits
    _route_front_kernel[grid](
        x, weight, logits,
        bias.contiguous() if bias is not None else dummy, tid2eid.contiguous() if hashed else dummy,
        input_ids.contiguous() if hashed else dummy, out_w, out_ids,
        q.view(torch.uint8), sa, q_pairs if pairs else x,
        align.route_rows, align.expert_counts, align.expert_offsets, align.num_valid_blocks,
        align.sorted_route_ids, align.block_expert, align.row_expert, align.row_weight,
        tile_counters(dev, 1),
        t, e, x.stride(0), weight.stride(0), logits.stride(0), tid2eid.shape[1] if hashed else 0,
        float(routed_scaling_factor), first_expert, num_local, max_blocks,
        q.stride(0), sa.stride(0), q_pairs.stride(0) if pairs else 0,
        H=h, BLOCK_T=bt, BLOCK_E=be, BLOCK_H=bh, NUM_STAGES=3,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
        T_PAD=triton.next_power_of_2(t),
        HAS_BIAS=bias is not None, HASH=hashed, APPLY_SCORES=not _raw_logits,
        QUANT_ITERS=triton.cdiv(t * g, nprog), SCALE_FMT=SCALE_FMTS["fp32"],
        PAIRS=0 if not pairs else 2 if scaled else 1,
        SOFTWARE=interpreting(), DIAG=_diag,
        R_BLOCK=max(2, triton.next_power_of_2(r)), BLOCK_M=block_m,
        E_PAD_A=max(triton.next_power_of_2(num_local), 64),
        ROWS_PAD=triton.next_power_of_2(max_rows), MB_PAD=triton.next_power_of_2(max_blocks),
        SORTED=sorted_align,
        num_warps=warps,
        # NOTE: libdevice without flush-to-zero, as route_topk (kernels/router.py says why)
        enable_reflect_ftz=False,
        **pdl_options(dev),
    )
    return out_w, out_ids, q, sa, q_pairs, align
