"""The same layer with quantisation switched off: dequantised weights, activations kept
in float32 or float64, no act_quant and no bf16 rounding points. Used to compare the
semantics (routing, clamp, weight placement, combine) with transformers'
`DeepseekV4SparseMoeBlock` in fp32 (SPEC §7), where the quantised numerics cannot
match by construction.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_moe.weights.formats import dequant_fp8_block, dequant_mxfp4
from dsv4_moe.weights.tensors import MoELayerWeights

from .routing import route

__all__ = ["dequantised_weights", "moe_forward_unquantised"]


def dequantised_weights(weights: MoELayerWeights, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """{'shared_gate_up' [2I,H], 'shared_down' [H,I], 'gate_up' [E,2I,H], 'down' [E,H,I]} in dtype."""
    s, r = weights.shared, weights.routed
    return {
        "shared_gate_up": dequant_fp8_block(s.gate_up, s.gate_up_scale).to(dtype),
        "shared_down": dequant_fp8_block(s.down, s.down_scale).to(dtype),
        "gate_up": dequant_mxfp4(r.gate_up, r.gate_up_scale).to(dtype),
        "down": dequant_mxfp4(r.down, r.down_scale).to(dtype),
    }


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float,
            w: Optional[torch.Tensor]) -> torch.Tensor:
    i = gate_up.shape[0] // 2
    gu = x @ gate_up.T
    g = torch.clamp(gu[:, :i], max=limit)
    u = torch.clamp(gu[:, i:], -limit, limit)
    h = F.silu(g) * u
    if w is not None:
        h = h * w[:, None]
    return h @ down.T


def moe_forward_unquantised(x: torch.Tensor, input_ids: Optional[torch.Tensor], weights: MoELayerWeights,
                            config, dtype=torch.float32,
                            dequantised: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """x [T, H] (any float dtype, computed in `dtype`) -> [T, H] in `dtype`. Single rank only."""
    if weights.tp_size != 1 or weights.ep_size != 1:
        raise ValueError("moe_forward_unquantised: single-rank weights only (tp_size = ep_size = 1)")
    d = dequantised if dequantised is not None else dequantised_weights(weights, dtype)
    r = weights.router
    xd = x.to(dtype)
    tw, ids = route(xd, r.weight.to(dtype), r.bias, r.tid2eid, input_ids, config.num_experts_per_tok,
                    config.routed_scaling_factor)
    out = torch.zeros_like(xd)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        out.index_add_(0, tok, _expert(xd[tok], d["gate_up"][e], d["down"][e], config.swiglu_limit,
                                       tw[tok, slot].to(dtype)))
    return out + _expert(xd, d["shared_gate_up"], d["shared_down"], config.swiglu_limit, None)
