"""Stage implementations with one signature per stage, as dispatch.STAGES names them.

Each stage has a reference adapter (plain torch, any device) and adapters over the
kernels in dsv4_moe.kernels, plus the shape predicates those kernels need. Signatures:

    router          (x, router: RouterWeights, input_ids, top_k, scale) -> (w f32[T,k], ids int64[T,k] asc)
    act_quant       (x bf16[M,K]) -> (q e4m3[M,K], s f32[M,ceil(K/128)])
    fp8_gemm        (q, sa, w, sw) -> bf16[M,N]
    swiglu_quant    (gate_up bf16[M,2I], limit) -> (q e4m3[M,I], s f32[M,ceil(I/128)])
    routed_experts  (q, sa, topk_w, topk_ids, routed, limit, swiglu) -> y bf16[T,k,H]
    finalize        (y, topk_ids, shared_out bf16[T,H], first_expert, num_local) -> bf16[T,H]
    finalize partial(y, topk_ids, first_expert, num_local) -> f32[T,H]   (for EP/TP reduces)
"""

from __future__ import annotations

import torch

from dsv4_moe import reference as R

from .dispatch import DispatchContext

# --------------------------------------------------------------------------- reference
def router_reference(x, router, input_ids, top_k, scale):
    return R.route(x, router.weight, router.bias, router.tid2eid, input_ids, top_k, scale)


def act_quant_reference(x, pairs=False):
    q, s = R.act_quant(x)
    if not pairs:
        return q, s
    # bf16(q) (exact) with each 128-column group as its 64 even then 64 odd columns
    # (act_quant's "pairs" output, kernels/act_quant.py); "scaled": bf16(q * s) (exact)
    m, k = q.shape
    v = q.float().view(m, k // 128, 128)
    if pairs == "scaled":
        v = v * s[:, :, None]
    return q, s, v.to(torch.bfloat16).view(m, k // 128, 64, 2).transpose(2, 3).reshape(m, k)


def fp8_gemm_reference(q, sa, w, sw):
    return R.fp8_gemm(q, sa, w, sw)


def swiglu_quant_reference(gate_up, limit):
    return R.swiglu_quant(gate_up, limit)


def routed_experts_reference(q, sa, topk_w, topk_ids, routed, limit, swiglu="reference", q_pairs=None,
                             align=None):
    # align (the fused front's alignment) is only ever given with the Triton routed path
    return R.routed_forward(q, sa, topk_w, topk_ids, routed, limit)


def finalize_reference(y, topk_ids, shared_out, first_expert, num_local):
    return (R.finalize(y, topk_ids, first_expert, num_local) + shared_out.float()).to(torch.bfloat16)


def finalize_partial_reference(y, topk_ids, first_expert, num_local):
    return R.finalize(y, topk_ids, first_expert, num_local)


# --------------------------------------------------------------------------- kernels
_KERNEL_MODULES: dict = {}


def _kernel(name: str):
    """dsv4_moe.kernels.<name>, imported on first use (then a dict lookup: an eager forward
    asks ~20 times, and importlib's lookup cost ~4 us each)."""
    mod = _KERNEL_MODULES.get(name)
    if mod is None:
        import importlib

        mod = _KERNEL_MODULES[name] = importlib.import_module(f"dsv4_moe.kernels.{name}")
    return mod


def _importable(name: str) -> tuple[bool, str]:
    try:
        _kernel(name)
    except Exception as e:
        return False, f"dsv4_moe.kernels.{name} not importable ({type(e).__name__}: {e})"
    return True, f"kernels.{name}"


def router_triton_supported(ctx: DispatchContext):
    ok, why = _importable("router")
    if not ok:
        return ok, why
    gpu = ctx.device.type == "cuda"
    rt = _kernel("router")
    gemv_max, mma_max = rt.GEMV_MAX_T, rt.MMA_MAX_T
    prewait = " with its gate rows loaded before the PDL wait" if ctx.hidden and rt.gemv_prewait(
        ctx.num_tokens, ctx.hidden, rt.gemv_blocks(ctx.num_tokens, ctx.hidden)[2]) else ""
    logits = (f"logits by the Triton GEMV (T <= {gemv_max}){prewait}" if gpu and ctx.num_tokens <= gemv_max
              else f"logits by the Triton tensor-core kernel (T <= {mma_max}, bf16 gate" + (
                  ", its split-K partials summed by the top-k kernel)" if rt.MMA_PARTIALS_IN_TOPK else ")")
              if gpu and ctx.num_tokens <= mma_max
              else "logits by cuBLAS (fp32 out)" if gpu else "logits by torch matmul")
    scores = ("sqrt(softplus) in the top-k kernel (libdevice, bitwise torch's)" if gpu
              else "sqrt(softplus) by torch (no libdevice off the GPU)")
    return True, f"{why}: {logits}; {scores}"


def router_triton(x, router, input_ids, top_k, scale):
    # NOTE: the logits path named explicitly (route_topk's "auto" picks by T on CUDA only), so
    # the Triton interpreter runs the same logits kernels as the GPU (and the front's
    # quant_in_logits path, which needs them, gives this path's bits there too)
    rt = _kernel("router")
    w, ids = rt.route_topk(x, router.weight, router.bias, router.tid2eid, input_ids, top_k, scale,
                           logits_impl=rt.logits_path(x.shape[0], router.weight.dtype))
    return w, ids


def front_fused_supported(ctx: DispatchContext):
    """The decode front in one launch (kernels/route_front.py): only where the three stages
    it merges (router, act_quant, routed_experts' alignment) take their Triton paths."""
    ok, why = _importable("route_front")
    if not ok:
        return ok, why
    from . import dispatch  # noqa: PLC0415
    from .kernels._triton_utils import interpreting  # noqa: PLC0415

    if interpreting():
        return False, "Triton interpreter (the scores need libdevice)"
    for stage in ("router", "act_quant", "routed_experts"):
        chosen = dispatch.plan_stage(stage, ctx).chosen.name
        if chosen != "triton":
            return False, f"stage {stage!r} takes its {chosen!r} path, not the Triton one the front merges"
    # NOTE: 64 is the largest BLOCK_M a decode-sized routed config uses (the row bound only grows with it)
    ok, why = _kernel("route_front").front_limits(ctx.num_tokens, ctx.top_k, ctx.num_local_experts, 64,
                                                   ctx.num_experts, ctx.hidden)
    if not ok:
        return ok, why
    return True, f"router logits + top-k + act_quant + moe_align in one launch ({why})"


def front_fused(ctx, x, router, input_ids, top_k, scale, routed, pairs, after_logits=None):
    """-> (topk_w, topk_ids, q, sa, q_pairs | None, align) in one launch; align's BLOCK_M is
    the routed gate_up config's (routed_experts_forward checks it)."""
    block_m = _kernel("routed_experts").routed_configs(x.shape[0] * top_k, routed)[0].block_m
    return _kernel("route_front").route_front(x, router.weight, router.bias, router.tid2eid, input_ids, top_k,
                                              scale, num_local=routed.num_local, first_expert=routed.first_expert,
                                              block_m=block_m, pairs=pairs)


def routed_align(topk_w, topk_ids, routed):
    """The triton routed path's alignment (moe_align at its gate_up config's BLOCK_M), for
    callers that want it launched before something else (the layer's shared-expert fork)."""
    rx = _kernel("routed_experts")
    block_m = rx.routed_configs(topk_ids.numel(), routed)[0].block_m
    return _kernel("moe_align").moe_align(topk_ids, routed.num_local, routed.first_expert, block_m, topk_w)


def front_quant_in_logits_supported(ctx: DispatchContext):
    """act_quant inside the router's logits launch (route_topk's `act_quant`): where the router
    and act_quant stages take their Triton paths and the logits are the Triton GEMV / MMA
    kernel (T <= router.MMA_MAX_T), unless router.QUANT_IN_LOGITS is off."""
    ok, why = _importable("router")
    if not ok:
        return ok, why
    from . import dispatch  # noqa: PLC0415

    router = _kernel("router")
    if not router.QUANT_IN_LOGITS:
        return False, "switched off (kernels/router.py QUANT_IN_LOGITS)"
    for stage in ("router", "act_quant"):
        chosen = dispatch.plan_stage(stage, ctx).chosen.name
        if chosen != "triton":
            return False, f"stage {stage!r} takes its {chosen!r} path, not the Triton one this merges"
    path = router.logits_path(ctx.num_tokens, ctx.router_dtype)
    if path == "mm":
        return False, (f"T={ctx.num_tokens}: the logits are cuBLAS here (Triton GEMV to T={router.GEMV_MAX_T}, "
                       f"tensor-core kernel to T={router.MMA_MAX_T} for a bf16 gate)")
    aligned, why_align = topk_aligns(ctx)
    return True, (f"act_quant inside the router's {path} logits launch (one launch fewer, the same bits)"
                  + (f"; {why_align}" if aligned else ""))


TOPK_ALIGN_MIN_INTERMEDIATE = 2048   # per-rank intermediate from which topk_aligns takes it (its NOTE)


def topk_aligns(ctx: DispatchContext) -> tuple[bool, str]:
    """Whether the decode front's top-k program also writes the routed alignment (route_topk's
    `align`, kernels/router.py TOPK_ALIGN_T1): one token, no hash table, the Triton routed stage,
    a per-rank intermediate of at least TOPK_ALIGN_MIN_INTERMEDIATE (where it measured faster)."""
    from . import dispatch  # noqa: PLC0415

    if not _kernel("router").TOPK_ALIGN_T1:
        return False, "switched off (kernels/router.py TOPK_ALIGN_T1)"
    if ctx.num_tokens != 1:
        return False, f"T={ctx.num_tokens}: the top-k aligns one token's routes only"
    if ctx.is_hash:
        return False, "hash-routed layer (a table row may repeat an id)"
    if dispatch.plan_stage("routed_experts", ctx).chosen.name != "triton":
        return False, "the routed stage is not the Triton one whose alignment this is"
    # NOTE (session 48, H200, the layer bench with --graph-chain, --set ...router.TOPK_ALIGN_T1=1 / =0,
    # alternating, us; docs/bench/2026-12-02/session48/): Flash (I = 2048) T=1 53.7, 53.6, 54.0 / 54.7,
    # 54.8, 55.0 - ~1.1 faster; Pro-TP8 (I = 384) T=1 31.8, 31.5, 31.7 / 31.2, 31.1, 31.1 - ~0.5 slower;
    # Pro-TP1 (I = 3072) T=1 111.1, 111.5 / 114.0, 114.3 - ~2.9 faster. At Pro-TP8 the alignment launch
    # sits beside the shared expert's GEMV (forked after the logits), which holds the SMs the routed
    # gate_up waits for (session 30's timeline), so removing it saves nothing and the top-k's extra ~216
    # instructions per thread cost. The rule takes the measured side of each: on from I = 2048
    # (Pro-TP2 / TP4 and Flash-TP2, I = 768-1536, are not measured and stay off).
    if ctx.intermediate < TOPK_ALIGN_MIN_INTERMEDIATE:
        return False, (f"I = {ctx.intermediate} per rank < {TOPK_ALIGN_MIN_INTERMEDIATE}: measured slower on the "
                       f"H200 at Pro-TP8 (I = 384), the alignment launch already off the critical path")
    return True, "the top-k program also writes the routed alignment (T = 1: no moe_align launch)"


def front_quant_in_logits(ctx, x, router, input_ids, top_k, scale, routed, pairs, after_logits=None):
    """-> (topk_w, topk_ids, q, sa, q_pairs | None, align | None): the router's logits launch also
    quantises x; at T = 1 (`topk_aligns`) the top-k program also writes the routed alignment at the
    routed gate_up config's BLOCK_M, elsewhere align is None (the routed stage aligns itself).
    `after_logits(q, sa[, pairs])` runs between the logits and the top-k launches (route_topk's)."""
    rt = _kernel("router")
    align = None
    if topk_aligns(ctx)[0]:
        block_m = _kernel("routed_experts").routed_configs(top_k, routed)[0].block_m
        align = (routed.num_local, routed.first_expert, block_m)
    w, ids, q, sa, *p = rt.route_topk(x, router.weight, router.bias, router.tid2eid, input_ids, top_k, scale,
                                      logits_impl=rt.logits_path(x.shape[0], router.weight.dtype), act_quant=pairs,
                                      after_logits=after_logits, align=align)
    aligned = p.pop() if align is not None else None
    return w, ids, q, sa, (p[0] if p else None), aligned


def front_separate_preferred(ctx: DispatchContext):
    # NOTE: H200, session 14 (docs/bench/2026-11-29/session14/bench_*_front_ab_bb91af8.txt: the
    # layer bench, CUDA graphs, rotated router / shared weights and inputs, real routing, us,
    # separate / fused): Flash T=1 83.7 / 83.3, T=2 125.6 / 129.6, T=3 164.7 / 163.9, T=4 189.3 /
    # 189.5; Pro-TP8 T=1 52.7 / 53.0, T=2 74.0 / 72.1, T=3 96.6 / 96.1, T=4 107.2 / 111.0. The
    # front kernel saves three launches but its last program's serial top-k + alignment (4-9 us,
    # scripts/gpu_probe_front.py) costs what they cost; the 4-12 % gains of the un-rotated
    # A/B (profile_layer_front_ab_*.txt) did not hold in the bench. So the separate launches
    # stay the default and the fused front is taken only when forced.
    return True, ("router, act_quant and the routed alignment as separate launches (the one-launch front "
                  "measured level in the H200 layer bench; force_paths(front='fused') takes it)")


def front_separate(ctx, x, router, input_ids, top_k, scale, routed, pairs, after_logits=None):
    """The same outputs from the router and act_quant stages' own paths (align None: the
    routed stage aligns itself). `after_logits` is not called here (x is quantised after the
    router), nor by front_fused (one launch): the caller sees that and forks after the front."""
    from . import dispatch  # noqa: PLC0415

    topk_w, topk_ids = dispatch.select("router", ctx).impl(x, router, input_ids, top_k, scale)
    q, sa, *q_pairs = dispatch.select("act_quant", ctx).impl(x, pairs=pairs)
    return topk_w, topk_ids, q, sa, (q_pairs[0] if q_pairs else None), None


def act_quant_triton_supported(ctx: DispatchContext):
    return _importable("act_quant")


def act_quant_triton(x, pairs=False):
    return _kernel("act_quant").act_quant(x, pairs=pairs)


def fp8_gemm_triton_supported(ctx: DispatchContext):
    return _importable("fp8_block_gemm")


def fp8_gemm_triton(q, sa, w, sw):
    from . import dispatch  # noqa: PLC0415

    return _kernel("fp8_block_gemm").fp8_block_gemm_nt(q, sa, w, sw, overlapped=dispatch.on_side_stream(),
                                                       split_k_programs_per_sm=dispatch.side_stream_split_k())


def _gemm_shapes(ctx: DispatchContext):
    """The two shared-expert GEMMs of a stage: gate_up [T, H] x [2I, H]^T, down [T, I] x [H, I]^T."""
    return ((ctx.num_tokens, 2 * ctx.intermediate, ctx.hidden), (ctx.num_tokens, ctx.hidden, ctx.intermediate))


# NOTE: torch's blockwise scaled_mm (cuBLASLt) runs on the H200 with the padded K/128
# scale layout (scripts/gpu_check_shared.py, BENCHMARKS.md), 2.3-3.5x faster than the
# Triton kernel at M = 4096, but its FP8 wgmma accumulates a whole 128-wide block in
# reduced precision: 4.6-7.1 % of bf16 outputs off the float64-summed reference (M = 1 to
# 4096) against 0 % (M <= 16) and 2.6 % (M = 4096) for the Triton kernel. It is closed by
# default for that accuracy gap; DSV4_MOE_SCALED_MM=prefill opens it from
# SCALED_MM_MIN_TOKENS tokens on (decode stays on the Triton GEMV, 3-5x faster there).
SCALED_MM_VALIDATED: tuple[bool, str] = (
    False, "blockwise scaled_mm less accurate than the Triton kernel on the H200 "
           "(4.6-7.1% of outputs off the reference vs <= 2.6%): closed by choice")
SCALED_MM_MIN_TOKENS = 1024
SCALED_MM_MODES = ("off", "prefill")


def scaled_mm_mode() -> str:
    """DSV4_MOE_SCALED_MM: "off" (default) or "prefill" (opt in to the faster, less accurate
    cuBLASLt GEMM for the shared expert from SCALED_MM_MIN_TOKENS tokens)."""
    import os  # noqa: PLC0415
    raw = os.environ.get("DSV4_MOE_SCALED_MM", "off").strip().lower() or "off"
    if raw not in SCALED_MM_MODES:
        raise ValueError(f"DSV4_MOE_SCALED_MM={raw!r}: expected one of {SCALED_MM_MODES}")
    return raw


def fp8_gemm_scaled_mm_supported(ctx: DispatchContext):
    ok, why = _importable("scaled_mm_fp8")
    if not ok:
        return ok, why
    if not SCALED_MM_VALIDATED[0]:
        if scaled_mm_mode() == "off":
            return False, SCALED_MM_VALIDATED[1] + " (DSV4_MOE_SCALED_MM=prefill opts in)"
        if ctx.num_tokens < SCALED_MM_MIN_TOKENS:
            return False, (f"DSV4_MOE_SCALED_MM=prefill: T={ctx.num_tokens} < {SCALED_MM_MIN_TOKENS} "
                           "(decode keeps the Triton kernel)")
    for m, n, k in _gemm_shapes(ctx):
        ok, why = _kernel("scaled_mm_fp8").scaled_mm_supported(m, n, k, ctx.device)
        if not ok:
            return ok, why
    if not SCALED_MM_VALIDATED[0]:
        why = f"DSV4_MOE_SCALED_MM=prefill, T >= {SCALED_MM_MIN_TOKENS}: {why} (less accurate, opted in)"
    return True, why


def fp8_gemm_scaled_mm(q, sa, w, sw):
    mod = _kernel("scaled_mm_fp8")
    m, kb = sa.shape
    m4 = (m + 3) // 4 * 4
    sa_cm = torch.zeros(kb, m4, dtype=torch.float32, device=sa.device).t()  # strides (1, M4)
    sa_cm[:m] = sa
    return mod.fp8_scaled_mm_nt(q, sa_cm, w, mod.prepare_weight_scale(sw))


def fp8_gemm_deep_gemm_supported(ctx: DispatchContext):
    ok, why = _importable("deep_gemm_fp8")
    if not ok:
        return ok, why
    for m, n, k in _gemm_shapes(ctx):
        ok, why = _kernel("deep_gemm_fp8").deep_gemm_supported(m, n, k, ctx.device)
        if not ok:
            return ok, why
    return True, why


def fp8_gemm_deep_gemm(q, sa, w, sw):
    return _kernel("deep_gemm_fp8").fp8_deep_gemm_nt(q, sa, w, sw)


def swiglu_quant_fused_supported(ctx: DispatchContext):
    return _importable("swiglu_quant")


def swiglu_quant_unfused_supported(ctx: DispatchContext):
    return _importable("swiglu_quant")


def swiglu_quant_fused(gate_up, limit):
    return _kernel("swiglu_quant").swiglu_quant(gate_up, limit=limit)


def swiglu_quant_unfused(gate_up, limit):
    return _kernel("swiglu_quant").swiglu_quant_unfused(gate_up, limit=limit)


# The MXFP4 GEMM folds each e8m0 weight scale into a bf16 weight exactly only for scale
# bytes in [0, 128] (kernels/_mxfp4_grouped_gemm.py); the layer measures the range once.
ROUTED_SCALE_BYTES = (0, 128)


def routed_experts_triton_supported(ctx: DispatchContext):
    lo, hi = ctx.routed_scale_range
    if lo < ROUTED_SCALE_BYTES[0] or hi > ROUTED_SCALE_BYTES[1]:
        return False, (f"routed e8m0 scale bytes span [{lo}, {hi}], outside [{ROUTED_SCALE_BYTES[0]}, "
                       f"{ROUTED_SCALE_BYTES[1]}] where the bf16 scale folding is exact")
    return _importable("routed_experts")


def routed_experts_triton(q, sa, topk_w, topk_ids, routed, limit, swiglu="fused", q_pairs=None, align=None,
                          down_reduce=True):
    # the reference SwiGLU-quant is not a kernel: with swiglu_quant forced to "reference"
    # the routed GEMMs still use the fused kernel, which is bitwise the reference.
    return _kernel("routed_experts").routed_experts_forward(
        q, sa, topk_w, topk_ids, routed, limit, "unfused" if swiglu == "unfused" else "fused", q_pairs=q_pairs,
        align=align, down_reduce=down_reduce)


def routed_down_to_finalize(num_routes, routed):
    """Whether the triton routed path should hand its down GEMM's split-K partials to the fused
    finalize (`finalize_fused_split`) at this size, instead of reducing them in a launch."""
    return _kernel("routed_experts").finalize_sums_split(num_routes, routed)


def routed_wants_pairs(num_routes, routed):
    """The `pairs` argument of act_quant for the triton routed path's gate_up at this size:
    False, True (bf16 activation pairs) or "scaled" (bf16(q * s), for a fold_sa config)."""
    rx = _kernel("routed_experts")
    return rx.pairs_mode(rx.routed_configs(num_routes, routed)[0])


def finalize_fused_supported(ctx: DispatchContext):
    return _importable("finalize")


def finalize_unfused_supported(ctx: DispatchContext):
    return _importable("finalize")


def finalize_fused(y, topk_ids, shared_out, first_expert, num_local):
    return _kernel("finalize").finalize_shared_add(y, topk_ids, first_expert, num_local, shared_out)


def finalize_fused_split(parts, topk_ids, shared_out, first_expert, num_local):
    return _kernel("finalize").finalize_split_shared_add(parts, topk_ids, first_expert, num_local, shared_out)


def finalize_unfused(y, topk_ids, shared_out, first_expert, num_local):
    return _kernel("finalize").finalize_unfused(y, topk_ids, first_expert, num_local, shared_out)


def finalize_partial_kernel(y, topk_ids, first_expert, num_local):
    return _kernel("finalize").finalize_partial(y, topk_ids, first_expert, num_local)
