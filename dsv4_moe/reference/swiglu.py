"""The clamped SwiGLU between the two expert GEMMs (SPEC §4.4 steps 2-5).

    g = gate_up[:, :I].float(); u = gate_up[:, I:].float()   (w1 = gate, w3 = up)
    u = clamp(u, -L, L)
    g = min(g, L)            # NOTE: the gate has NO lower clamp (DeepSeek-V4 quirk)
    h = silu(g) * u          # fp32, silu NOT rounded to bf16 first (vLLM does; we don't)
    h = w_route * h          # routed experts only: weight applied BEFORE w2
    h = bf16(h)              # the one rounding point, then act_quant for the w2 GEMM
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .quant import act_quant

__all__ = ["swiglu", "swiglu_quant"]


def swiglu(gate_up: torch.Tensor, limit: float, route_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Args:
        gate_up       [M, 2I]  bfloat16 (gate columns first, then up)
        limit         float    swiglu_limit (10.0 for every V4 config)
        route_weight  [M]      float32 or None
    Returns: h [M, I] float32 (not yet rounded)
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu: gate_up must be [M, 2I], got shape {tuple(gate_up.shape)}")
    i = gate_up.shape[1] // 2
    g = gate_up[:, :i].float()
    u = gate_up[:, i:].float()
    u = torch.clamp(u, -limit, limit)
    g = torch.clamp(g, max=limit)
    h = F.silu(g) * u
    if route_weight is not None:
        if route_weight.shape != (gate_up.shape[0],):
            raise ValueError(f"swiglu: route_weight.shape={tuple(route_weight.shape)}, expected {(gate_up.shape[0],)}")
        h = h * route_weight.float()[:, None]
    return h


def swiglu_quant(gate_up: torch.Tensor, limit: float, route_weight: Optional[torch.Tensor] = None,
                 block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant(bf16(swiglu(gate_up))): q [M, I] float8_e4m3fn, s [M, ceil(I/128)] float32."""
    return act_quant(swiglu(gate_up, limit, route_weight).to(torch.bfloat16), block)
