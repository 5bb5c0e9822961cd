"""dsv4_moe.kernels — Triton kernels for the DeepSeek-V4 MoE layer.

Importing this package never imports triton: each name below is loaded from its op
module on first access. One op per module, a public wrapper (`<op>.py`) that checks
arguments and a private body (`_<op>.py`) with the @triton.jit kernels.

Where an op's function has its module's name (act_quant, swiglu_quant, moe_align,
mxfp4_grouped_gemm, l2_prefetch), `dsv4_moe.kernels.<name>` is the module - Python's import
system binds a package's submodules to its attributes, so a package-level function of that
name could not stay bound - and the function is `dsv4_moe.kernels.<name>.<name>`
(`from dsv4_moe.kernels.act_quant import act_quant`).

    act_quant            1x128 UE8M0 FP8 activation quantisation            act_quant.py
    swiglu_quant         fused clamped SwiGLU (+route weight) + FP8 quant   swiglu_quant.py
    swiglu_quant_unfused its bitwise twin (bf16 activation materialised)    swiglu_quant.py
    swiglu_quant_partials  the same on a split-K GEMM's fp32 partials        swiglu_quant.py
    fp8_block_gemm_nt    FP8 1x128 x 128x128 block-scaled GEMM, bf16 out     fp8_block_gemm.py
    fp8_scaled_mm_nt     the same through torch's blockwise scaled_mm       scaled_mm_fp8.py
    fp8_deep_gemm_nt     the same through deep_gemm (when importable)       deep_gemm_fp8.py
    route_topk           router: sqrt-softplus, biased top-k / hash, renorm router.py
    router_logits_mma    router logits on the tensor cores (T = 5-16)       router.py
    moe_align            (token, slot) pairs grouped by expert, padded      moe_align.py
    mxfp4_grouped_gemm   MXFP4 W4A8 grouped GEMM (e2m1 -> e4m3 in registers) mxfp4_grouped_gemm.py
    routed_experts_forward  align -> gate_up -> swiglu_quant -> down          routed_experts.py
    finalize_shared_add  fused top-k reduce (ascending id) + shared add     finalize.py
    finalize_unfused     its bitwise two-kernel twin                        finalize.py
    l2_prefetch          L2 prefetch of weight bytes (decode, own stream)   l2_prefetch.py
    fhmoe_capability     AITER heterogeneous fused MoE: probe, prep, routes  aiter_fhmoe.py
                         (SPEC §5.3; pure parts only, the call is not written)
"""

import importlib

# name -> the op module it is loaded from. No name here equals a module's name (see above).
_EXPORTS = {
    "swiglu_quant_unfused": "swiglu_quant", "choose_strategy": "swiglu_quant",
    "swiglu_quant_partials": "swiglu_quant",
    "fp8_block_gemm_nt": "fp8_block_gemm", "choose_config": "fp8_block_gemm",
    "fp8_scaled_mm_nt": "scaled_mm_fp8", "prepare_weight_scale": "scaled_mm_fp8",
    "scaled_mm_supported": "scaled_mm_fp8",
    "fp8_deep_gemm_nt": "deep_gemm_fp8", "deep_gemm_supported": "deep_gemm_fp8",
    "route_topk": "router", "router_logits": "router", "router_logits_mma": "router",
    "MoeAlignment": "moe_align", "align_sizes": "moe_align",
    "GemmConfig": "mxfp4_grouped_gemm",
    "select_config": "mxfp4_grouped_gemm", "split_parts": "mxfp4_grouped_gemm",
    "finalize_shared_add": "finalize", "finalize_unfused": "finalize", "finalize_partial": "finalize",
    "add_shared_round": "finalize",
    "routed_experts_forward": "routed_experts", "routed_configs": "routed_experts",
    "fhmoe_capability": "aiter_fhmoe", "prepare_shared_expert": "aiter_fhmoe", "append_shared_route": "aiter_fhmoe",
}

# the op modules whose function has the module's name
_SAME_NAME = ("act_quant", "swiglu_quant", "moe_align", "mxfp4_grouped_gemm", "l2_prefetch")

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _SAME_NAME:   # not yet imported: the module, as after any import of it
        return importlib.import_module(f"{__name__}.{name}")
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'dsv4_moe.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
