"""Experts, combine and the whole MoE layer (SPEC §4.4, §4.5, §6), in plain torch.

The layer, for x [T, H] bf16:

    w, ids   = route(x)                              # fp32 weights, ids ascending
    q, sa    = act_quant(x)                          # once per token, shared by all GEMMs
    shared   = expert(q, sa, shared weights)         # FP8 blocks, bf16 out
    y[t, s]  = expert(q[t], sa[t], expert ids[t, s], route weight w[t, s])  # MXFP4, bf16
    acc      = +0.0 + y[t, 0] + y[t, 1] + ...        # fp32, ascending expert id, local routes only
    EP:  all_reduce(acc) ; acc += shared             # SPEC §4.5
    TP:  acc += shared (a partial too) ; all_reduce(acc)
    out      = bf16(acc)                             # exactly one rounding of the result
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_moe.weights.tensors import MoELayerWeights, RoutedExpertWeights, SharedExpertWeights

from .gemm import fp4_gemm, fp8_gemm
from .quant import act_quant
from .routing import route
from .swiglu import swiglu_quant

__all__ = ["expert_forward", "shared_forward", "routed_forward", "finalize", "moe_forward"]


def expert_forward(q: torch.Tensor, sa: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                   down: torch.Tensor, down_scale: torch.Tensor, *, fmt: str, limit: float,
                   route_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One expert on already-quantised rows (q, sa = act_quant(x)). fmt "fp8" | "fp4".

    Returns y [M, H] bf16.
    """
    gemm = {"fp8": fp8_gemm, "fp4": fp4_gemm}.get(fmt)
    if gemm is None:
        raise ValueError(f"expert_forward: fmt={fmt!r}, expected 'fp8' or 'fp4'")
    gu = gemm(q, sa, gate_up, gate_up_scale)
    hq, hs = swiglu_quant(gu, limit, route_weight)
    return gemm(hq, hs, down, down_scale)


def shared_forward(x: torch.Tensor, shared: SharedExpertWeights, limit: float,
                   quantised: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The shared expert: x [T, H] bf16 -> [T, H] bf16 (pass `quantised=act_quant(x)` to reuse it)."""
    q, sa = quantised if quantised is not None else act_quant(x)
    return expert_forward(q, sa, shared.gate_up, shared.gate_up_scale, shared.down, shared.down_scale,
                          fmt="fp8", limit=limit)


def routed_forward(q: torch.Tensor, sa: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   routed: RoutedExpertWeights, limit: float) -> torch.Tensor:
    """Every local route's expert output, in slot layout.

    Args:
        q, sa         [T, H] e4m3, [T, ceil(H/128)] f32   act_quant(x)
        topk_weights  [T, k] f32;  topk_ids [T, k] int (global ids)
    Returns:
        y             [T, k, H] bf16; slots routed to non-local experts are 0 and never read.
    """
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or q.dim() != 2 or q.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"routed_forward: q {tuple(q.shape)}, topk_weights {tuple(topk_weights.shape)}, topk_ids "
                         f"{tuple(topk_ids.shape)}: expected [T, H], [T, k] and [T, k] with the same T and k")
    t, k = topk_ids.shape
    h = routed.hidden
    routed = routed.with_layout("nk")  # the checkpoint byte order (a no-op unless "mma64")
    y = torch.zeros(t, k, h, dtype=torch.bfloat16, device=q.device)
    for e_local in range(routed.num_local):
        e = routed.first_expert + e_local
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y[tok, slot] = expert_forward(
            q[tok], sa[tok], routed.gate_up[e_local], routed.gate_up_scale[e_local],
            routed.down[e_local], routed.down_scale[e_local], fmt="fp4", limit=limit,
            route_weight=topk_weights[tok, slot])
    return y


def local_mask(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    return (topk_ids >= first_expert) & (topk_ids < first_expert + num_local)


def finalize(y: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """acc [T, H] f32 = +0.0 + y[:, 0] + y[:, 1] + ... over local slots, left to right.

    Slots are in ascending expert id (route() sorts them), which is SPEC §4.5's order.
    """
    if y.dim() != 3 or topk_ids.shape != y.shape[:2]:
        raise ValueError(f"finalize: y {tuple(y.shape)}, topk_ids {tuple(topk_ids.shape)}: expected [T, k, H] and "
                         f"[T, k] with the same T and k")
    t, k, h = y.shape
    valid = local_mask(topk_ids, first_expert, num_local)
    acc = torch.zeros(t, h, dtype=torch.float32, device=y.device)
    for s in range(k):
        acc = torch.where(valid[:, s, None], acc + y[:, s].float(), acc)
    return acc


def moe_forward(x: torch.Tensor, input_ids: Optional[torch.Tensor], weights: MoELayerWeights, config,
                *, group=None) -> torch.Tensor:
    """The whole MoE layer, SPEC §4 (see the module docstring). x [T, H] bf16 -> [T, H] bf16.

    With tp_size or ep_size > 1, `group` is the torch.distributed process group over
    which partial sums are all-reduced (fp32); None means the default group.
    """
    from dsv4_moe.config import MoEConfig

    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected a MoEConfig, got {type(config).__name__}")
    if not isinstance(weights, MoELayerWeights):
        raise TypeError(f"weights: expected a MoELayerWeights, got {type(weights).__name__}")
    r = weights.router
    checks = (("hidden_size", config.hidden_size, r.weight.shape[1], "the gate weight's H"),
              ("n_routed_experts", config.n_routed_experts, r.weight.shape[0], "the gate weight's E"),
              ("num_experts_per_tok", config.num_experts_per_tok,
               r.tid2eid.shape[1] if r.tid2eid is not None else config.num_experts_per_tok, "tid2eid's k"))
    for key, want, got, what in checks:
        if want != got:
            raise ValueError(f"moe_forward: config.{key}={want} but {what} is {got}: the config and the weights "
                             f"describe different layers")
    tw, ids = route(x, r.weight, r.bias, r.tid2eid, input_ids, config.num_experts_per_tok,
                    config.routed_scaling_factor)
    q, sa = act_quant(x)
    limit = config.swiglu_limit
    shared = shared_forward(x, weights.shared, limit, quantised=(q, sa))
    y = routed_forward(q, sa, tw, ids, weights.routed, limit)
    acc = finalize(y, ids, weights.routed.first_expert, weights.routed.num_local)
    return combine(acc, shared, weights, group=group)


def combine(acc: torch.Tensor, shared: torch.Tensor, weights: MoELayerWeights, *, group=None) -> torch.Tensor:
    """Add the shared expert and reduce across ranks with one final bf16 rounding (SPEC §4.5, §6)."""
    if acc.shape != shared.shape:
        raise ValueError(f"combine: acc {tuple(acc.shape)} and shared {tuple(shared.shape)}: expected the same [T, H]")
    if weights.tp_size * weights.ep_size > 1:
        check_group(weights, group)
    if weights.tp_size > 1:
        acc = acc + shared.float()
        _all_reduce(acc, group)
    else:
        if weights.ep_size > 1:
            _all_reduce(acc, group)
        acc = acc + shared.float()
    return acc.to(torch.bfloat16)


def check_group(weights: MoELayerWeights, group=None) -> None:
    """A layer sliced for tp_size or ep_size > 1 must run in a process group of exactly that many
    ranks, at the position of its slice (rank r of the group holds slice r): host-side checks only
    (no communication, so a CUDA-graph capture may run them). Every rank must also pass the same
    tokens: the all-reduce cannot check that without a sync, and a mismatched T fails inside the
    backend (gloo aborts; NCCL may hang)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tp_size/ep_size > 1 needs torch.distributed to be initialised (init_process_group)")
    size = weights.tp_size * weights.ep_size
    rank = weights.tp_rank if weights.tp_size > 1 else weights.ep_rank
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if world != size or me != rank:
        kind = "tp" if weights.tp_size > 1 else "ep"
        raise ValueError(f"{kind}_size={size}, {kind}_rank={rank}: the layer's slice does not match its process group "
                         f"(size {world}, this process's rank {me}); expected a group of {size} ranks with this "
                         f"process at rank {rank} (load_moe_layer(..., {kind}_rank=<group rank>, {kind}_size=<group "
                         f"size>, group=...))")


def _all_reduce(acc: torch.Tensor, group) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tp_size/ep_size > 1 needs torch.distributed to be initialised (init_process_group)")
    dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
