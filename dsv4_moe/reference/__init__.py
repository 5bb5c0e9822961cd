"""dsv4_moe.reference — SPEC §4 in plain torch: the canonical numerics, CPU-runnable.

Every kernel in dsv4_moe.kernels is tested against these functions on the same
quantised inputs. Loops are allowed here; clarity beats speed.
"""

from .gemm import fp4_gemm, fp8_gemm
from .moe import combine, expert_forward, finalize, local_mask, moe_forward, routed_forward, shared_forward
from .quant import act_quant
from .routing import renormalise, route, router_scores
from .swiglu import swiglu, swiglu_quant
from .unquantised import dequantised_weights, moe_forward_unquantised

__all__ = [
    "act_quant", "fp8_gemm", "fp4_gemm", "route", "router_scores", "renormalise", "swiglu", "swiglu_quant",
    "expert_forward", "shared_forward", "routed_forward", "finalize", "local_mask", "combine", "moe_forward",
    "dequantised_weights", "moe_forward_unquantised",
]
