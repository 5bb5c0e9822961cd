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


def act_quant_reference(x):
    return R.act_quant(x)


def fp8_gemm_reference(q, sa, w, sw):
    return R.fp8_gemm(q, sa, w, sw)


def swiglu_quant_reference(gate_up, limit):
    return R.swiglu_quant(gate_up, limit)


def routed_experts_reference(q, sa, topk_w, topk_ids, routed, limit, swiglu="reference"):
    return R.routed_forward(q, sa, topk_w, topk_ids, routed, limit)


def finalize_reference(y, topk_ids, shared_out, first_expert, num_local):
    return (R.finalize(y, topk_ids, first_expert, num_local) + shared_out.float()).to(torch.bfloat16)


def finalize_partial_reference(y, topk_ids, first_expert, num_local):
    return R.finalize(y, topk_ids, first_expert, num_local)


# --------------------------------------------------------------------------- kernels
def _kernel(name: str):
    import importlib

    return importlib.import_module(f"dsv4_moe.kernels.{name}")


def _importable(name: str) -> tuple[bool, str]:
    try:
        _kernel(name)
    except Exception as e:
        return False, f"dsv4_moe.kernels.{name} not importable ({type(e).__name__}: {e})"
    return True, f"kernels.{name}"


def router_triton_supported(ctx: DispatchContext):
    return _importable("router")


def router_triton(x, router, input_ids, top_k, scale):
    w, ids = _kernel("router").route_topk(x, router.weight, router.bias, router.tid2eid, input_ids, top_k, scale)
    return w, ids


def act_quant_triton_supported(ctx: DispatchContext):
    return _importable("act_quant")


def act_quant_triton(x):
    return _kernel("act_quant").act_quant(x)


def fp8_gemm_triton_supported(ctx: DispatchContext):
    return _importable("fp8_block_gemm")


def fp8_gemm_triton(q, sa, w, sw):
    return _kernel("fp8_block_gemm").fp8_block_gemm_nt(q, sa, w, sw)


def fp8_gemm_scaled_mm_supported(ctx: DispatchContext):
    ok, why = _importable("scaled_mm_fp8")
    if not ok:
        return ok, why
    # NOTE: scaled_mm is a candidate only where the H200 run proved it equal to the
    # reference; the kernel module's own predicate decides (shapes, torch version).
    fn = getattr(_kernel("scaled_mm_fp8"), "dispatch_supported", None)
    if fn is None:
        return False, "scaled_mm path not validated on this platform (no dispatch_supported in kernels.scaled_mm_fp8)"
    return fn(ctx)


def fp8_gemm_scaled_mm(q, sa, w, sw):
    return _kernel("scaled_mm_fp8").fp8_block_gemm_scaled_mm(q, sa, w, sw)


def fp8_gemm_deep_gemm_supported(ctx: DispatchContext):
    ok, why = _importable("deep_gemm_fp8")
    if not ok:
        return ok, why
    return _kernel("deep_gemm_fp8").supported(ctx)


def fp8_gemm_deep_gemm(q, sa, w, sw):
    return _kernel("deep_gemm_fp8").fp8_gemm_nt(q, sa, w, sw)


def swiglu_quant_fused_supported(ctx: DispatchContext):
    return _importable("swiglu_quant")


def swiglu_quant_unfused_supported(ctx: DispatchContext):
    return _importable("swiglu_quant")


def swiglu_quant_fused(gate_up, limit):
    return _kernel("swiglu_quant").swiglu_quant(gate_up, limit=limit)


def swiglu_quant_unfused(gate_up, limit):
    return _kernel("swiglu_quant").swiglu_quant_unfused(gate_up, limit=limit)


def routed_experts_triton_supported(ctx: DispatchContext):
    return _importable("routed_experts")


def routed_experts_triton(q, sa, topk_w, topk_ids, routed, limit, swiglu="fused"):
    return _kernel("routed_experts").routed_experts_forward(q, sa, topk_w, topk_ids, routed, limit,
                                                            swiglu=swiglu)


def finalize_fused_supported(ctx: DispatchContext):
    return _importable("finalize")


def finalize_unfused_supported(ctx: DispatchContext):
    return _importable("finalize")


def finalize_fused(y, topk_ids, shared_out, first_expert, num_local):
    return _kernel("finalize").finalize_shared_add(y, topk_ids, first_expert, num_local, shared_out)


def finalize_unfused(y, topk_ids, shared_out, first_expert, num_local):
    return _kernel("finalize").finalize_unfused(y, topk_ids, first_expert, num_local, shared_out)


def finalize_partial_kernel(y, topk_ids, first_expert, num_local):
    return _kernel("finalize").finalize_partial(y, topk_ids, first_expert, num_local)
