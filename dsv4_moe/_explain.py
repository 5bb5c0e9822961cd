"""The text of `DeepseekV4MoE.explain(num_tokens)`: each stage's path and why, the shared
expert's stream, fork and L2 prefetch, SPEC §5.3's fused heterogeneous MoE, the routed
MXFP4 GEMM bodies and the shared FP8 GEMM tiles for a token count. Functions of the layer; nothing here launches or
allocates on a device (the layer's policies are asked, as its forward asks them)."""

from __future__ import annotations

import torch

from . import dispatch, layers
from ._checks import check_num_tokens


def explain(layer, num_tokens: int) -> str:
    """DeepseekV4MoE.explain: the layer's header lines, then dispatch.explain's plan and the GEMM plan."""
    check_num_tokens(num_tokens)
    c = layer.config
    head = (f"DeepseekV4MoE layer {layer.layer_idx} ({'hash' if layer.is_hash else 'top-k'} routing), "
            f"hidden {c.hidden_size}, intermediate {c.local_intermediate(layer.tp_size)} per rank, "
            f"experts {layer.first_expert}..{layer.first_expert + layer.num_local_experts - 1} of "
            f"{c.n_routed_experts}, top-{c.num_experts_per_tok}\n"
            f"routed weights in layout {layer.routed_layout!r}: {layer.routed_layout_reason}"
            f"{layout_hint(layer)}\n"
            f"shared expert: {shared_line(layer, num_tokens)}\n"
            f"{prefetch_line(layer, num_tokens)}\n"
            f"shared expert as expert {c.n_routed_experts} in the routed launch (SPEC §5.3): not taken: "
            f"{heterogeneous_reason(layer, num_tokens)}")
    if layer.device.type == "cuda" and dispatch.has_pdl(layer.device)[0]:
        mode, why = (dispatch.pdl_policy(num_tokens, layer.shared_overlap(num_tokens)[0],
                                         c.local_intermediate(layer.tp_size))
                     if dispatch.PDL_MODE == "auto"
                     else (dispatch.PDL_MODE, "dispatch.PDL_MODE"))
        head += f"\nprogrammatic dependent launch: {mode} ({why})"
    return (head + "\n" + dispatch.explain(layer.context(num_tokens)) + gemm_plan(layer, num_tokens)
            + shared_gemm_plan(layer, num_tokens))


def shared_line(layer, num_tokens: int) -> str:
    """Where the shared expert runs at num_tokens tokens (stream, fork point, split), and why."""
    if layers.PROBE_SKIP_SHARED:
        return "skipped: layers.PROBE_SKIP_SHARED is on (a timing probe: the output is not the layer's)"
    ov, why = layer.shared_overlap(num_tokens)
    if not ov:
        return why
    point = layer._shared_fork(num_tokens)
    how = (dispatch.shared_fork_policy(num_tokens, layer.config.local_intermediate(layer.tp_size))[1]
           if layers.SHARED_FORK == "auto" else f"layers.SHARED_FORK = {layers.SHARED_FORK!r}")
    split = dispatch.shared_split_policy(num_tokens, layer.config.local_intermediate(layer.tp_size))[1]
    where = {"logits": "after the router's logits launch (on the quant_in_logits front; else after the front)",
             "align": "after the routed alignment", "front": "right after the front"}[point]
    return f"{why}; forked {where} ({how}); {split}"


def prefetch_line(layer, num_tokens: int) -> str:
    """Whether and where the shared expert's weights are prefetched into the L2, and why."""
    point = layer._shared_prefetch_point(num_tokens)
    if layer.device.type != "cuda":
        point, why = "off", f"device {layer.device.type}"
    elif layers.SHARED_L2_PREFETCH != "auto":
        why = f"layers.SHARED_L2_PREFETCH = {layers.SHARED_L2_PREFETCH!r}"
    else:
        side = layer.shared_overlap(num_tokens)[0]
        why = dispatch.shared_prefetch_policy(num_tokens, layer.config.local_intermediate(layer.tp_size),
                                              layer._shared_fork(num_tokens) if side else None)[1]
    where = {"off": "not prefetched into the L2",
             "start": "prefetched into the L2 before the router's logits launch (own stream)",
             "logits": "prefetched into the L2 after the router's logits launch (own stream)"}[point]
    return f"shared expert weights {where} ({why})"


def heterogeneous_reason(layer, num_tokens: int) -> str:
    """Why the fused heterogeneous MoE (kernels/aiter_fhmoe.py) does not run this layer."""
    from .kernels.aiter_fhmoe import fhmoe_supported

    why = fhmoe_supported(layer.context(num_tokens))[1]
    if layer.device.type == "cuda" and torch.version.hip is None:
        # NOTE: SPEC §5.3's CUDA twin is not built (docs/DESIGN.md, "The fused heterogeneous MoE")
        # the side stream: dispatch.shared_overlap_policy, its measurements in its NOTEs
        return ("this package has no CUDA kernel for it (the shared expert runs as its own launches, on a side "
                f"stream where dispatch.shared_overlap_policy measured that faster); AITER's: {why}")
    return why


def _chosen(stage: str, layer, num_tokens: int):
    """The path `stage` takes at this T, or None where a forced path cannot run here (the plan's
    line for that stage says so; a forward raises)."""
    try:
        return dispatch.select(stage, layer.context(num_tokens)).name
    except RuntimeError:
        return None


def gemm_plan(layer, num_tokens: int) -> str:
    """The routed MXFP4 GEMM bodies for this T (kernels.routed_experts.routed_configs),
    when the routed stage takes the Triton path; empty otherwise."""
    if num_tokens < 1 or _chosen("routed_experts", layer, num_tokens) != "triton":
        return ""
    from .kernels import routed_experts as rx

    routed_configs = rx.routed_configs
    routes = num_tokens * layer.config.num_experts_per_tok
    parts = []
    cfgs = routed_configs(routes, layer.routed)
    for gemm, cfg in zip(("gate_up", "down"), cfgs):
        extra = "".join([f", K split {cfg.split_k} ways" if cfg.split_k > 1 else "",
                         (", bf16 activation pairs (written by act_quant)" if gemm == "gate_up" else
                          ", bf16 activation pairs (written by swiglu_quant)") if cfg.a_bf16 else "",
                         ", activation scale folded into the operand (one MMA chain over K" +
                         ((", odd-k half converted after the even-k MMA)" if cfg.fold_order == "split" else
                           ", each block's MMAs waited on)") if cfg.kind == "swap" else ")")
                         if cfg.fold_sa else
                         ", per-128-block scaling (DSV4_MOE_FOLD_SWAP=0)"
                         if cfg.kind == "swap" and rx.FOLD_ACT_SCALE and not rx.FOLD_SWAP and
                         layer.routed.layout in ("mma64", "mma64e") else "",
                         f", {cfg.maxnreg}-register cap" if cfg.maxnreg else "",
                         f", K loop unrolled {cfg.unroll}x" if cfg.unroll > 1 and cfg.kind == "swap" else
                         f", {cfg.unroll} K blocks per step" if cfg.unroll > 1 else "",
                         ", weight blocks fastest in the grid" if cfg.n_fastest else "",
                         ", each 128-block one MMA chain (one wgmma wait)" if cfg.one_chain else "",
                         ", all K blocks' weights loaded up front" if cfg.preload else ""])
        parts.append(f"{gemm} {cfg.kind} {cfg.block_m}x{cfg.block_n}, {cfg.num_warps} warps, "
                     f"{cfg.num_stages} stages{extra}")
    from .kernels.mxfp4_grouped_gemm import split_parts
    parts_up = split_parts(cfgs[0], layer.config.hidden_size)
    fused = _chosen("swiglu_quant", layer, num_tokens) not in ("unfused", None)
    if parts_up > 1 and fused and rx.SWIGLU_SUMS_SPLIT:
        between = (f"SwiGLU-quant over the {routes} routes, summing the split gate_up's {parts_up} fp32 "
                   f"partials itself (no reduce launch, same bits)")
    else:
        between = (f"SwiGLU-quant over the {routes} routes' rows (route list)"
                   if routes >= rx.SWIGLU_ROUTE_LIST_MIN_ROUTES else
                   f"SwiGLU-quant over the alignment's rows, padding skipped (< "
                   f"{rx.SWIGLU_ROUTE_LIST_MIN_ROUTES} routes)")
        if parts_up > 1:
            between += f", after the split gate_up's reduce launch ({parts_up} fp32 partials)"
    parts_down = split_parts(cfgs[1], layer.config.local_intermediate(layer.tp_size))
    after = ""
    if parts_down > 1:
        fin = _chosen("finalize", layer, num_tokens)
        after = (f"\n  after the down: the fused finalize sums its {parts_down} fp32 split-K partials itself "
                 f"(no reduce launch, same bits)" if layer._finalize_sums_down(num_tokens, "triton", fin) else
                 f"\n  after the down: a reduce launch sums its {parts_down} fp32 split-K partials ("
                 + ("routed_experts.FINALIZE_SUMS_SPLIT is off" if not rx.FINALIZE_SUMS_SPLIT else
                    f"finalize path {fin!r}" if fin != "fused" else
                    "the fp32 partial crosses ranks before the finalize's rounding") + ")")
    return (f"\n  routed GEMMs ({routes / layer.num_local_experts:.3g} routes per local expert): "
            + "; ".join(parts) + f"\n  between them: {between}" + after)


def shared_gemm_plan(layer, num_tokens: int) -> str:
    """The shared expert's two FP8 GEMM tiles for this T (kernels.fp8_block_gemm.choose_config, with
    the side stream's settings where the shared expert overlaps), when fp8_gemm takes the Triton path;
    empty otherwise."""
    if num_tokens < 1 or _chosen("fp8_gemm", layer, num_tokens) != "triton":
        return ""
    from .kernels.fp8_block_gemm import choose_config

    c = layer.config
    i = c.local_intermediate(layer.tp_size)
    side = layer.shared_overlap(num_tokens)[0]
    split = dispatch.shared_split_policy(num_tokens, i)[0] if side else None
    parts = []
    for gemm, (n, k) in (("gate_up", (2 * i, c.hidden_size)), ("down", (c.hidden_size, i))):
        cfg = choose_config(num_tokens, n, k, overlapped=side, split_k_programs_per_sm=split)
        if cfg.get("GEMV"):
            body = "CUDA-core GEMV"
        else:
            body = (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} "
                    + ("mma.sync" if cfg["BLOCK_M"] < 64 else f"wgmma (fp32 promotion every {cfg['IMPRECISE']} K)"))
        sk = cfg.get("SPLIT_K", 1)
        parts.append(f"{gemm} [{num_tokens} x {n} x {k}] {body}, "
                     + (f"exact split-K over {sk} K-block groups" if sk > 1 else "one pass"))
    return "\n  shared FP8 GEMMs: " + "; ".join(parts)


def layout_hint(layer) -> str:
    """A pointer at set_routed_layout when the layer moved to CUDA after construction."""
    r = layer.routed
    if r.layout == "nk" and r.gate_up.device.type == "cuda" and layers.choose_routed_layout(r)[0] != "nk":
        return " (now on CUDA: layer.set_routed_layout() takes the faster layout)"
    return ""
