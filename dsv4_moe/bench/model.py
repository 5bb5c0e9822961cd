"""Byte and FLOP model of one DeepSeek-V4 MoE layer forward — the one place these are counted.

A forward must at least read every weight byte it uses once and read its input / write its
output once; anything else (intermediates, routing metadata) is the implementation's cost,
not the work's. So the model counts *unique* bytes:

    routed   packed e2m1 codes + e8m0 scales of every distinct LOCAL expert the routing hits
             per expert: gate_up 2I*H/2 + 2I*H/32, down H*I/2 + H*I/32        (I per rank)
    shared   FP8 e4m3 weights 2I*H + H*I + e8m0 block scales
             (2I/128)*ceil(H/128) + ceil(H/128)*ceil(I/128)
    router   bf16 gate weight E*H*2 + fp32 bias E*4 (non-hash layers); hash layers read the
             tid2eid rows of their tokens instead of the bias, T*k*8 (int64) + the ids T*8
    act      x in T*H*2 (bf16) + out T*H*2 (bf16)

and FLOPs (multiply-add = 2):

    routed   2 * n_local_routes * (2I*H + H*I)     n_local_routes = routes to local experts
    shared   2 * T * (2I*H + H*I)
    router   2 * T * E * H

The floor of a forward is max(bytes / copy_bw, flops / mm_rate) with the copy bandwidth
(read + write counted) and the dense FP8 matmul rate measured on the same device.

Scopes (`Work` rows): "layer" = everything; "router", "act_quant", "shared", "routed",
"finalize" are the parts, so a stage or a peer that does one part is measured against that part's own work.
"routed" includes x in and the [T, H] combined output, as the routed peers produce it;
"finalize" counts its own inputs (the expert rows and the shared output), which are
intermediates of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dsv4_moe._types import is_int

__all__ = [
    "Work", "LayerDims", "routed_expert_bytes", "shared_expert_bytes", "router_bytes",
    "count_routes", "layer_work", "floor_us", "SCOPES",
]

SCOPES = ("layer", "router", "act_quant", "shared", "routed", "finalize")

_FP8_BLOCK = 128
_MXFP4_GROUP = 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerDims:
    """The per-rank shape the byte model needs.

    hidden        H
    intermediate  I on this rank (moe_intermediate_size / tp_size)
    num_experts   E, global (the router scores all of them)
    top_k         k
    first_expert, num_local   the local expert id range [first, first + num_local)
    hash_layer    routes by tid2eid (no bias read; tid2eid rows read)
    """

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    first_expert: int = 0
    num_local: Optional[int] = None
    hash_layer: bool = False

    def __post_init__(self) -> None:
        for key in ("hidden", "intermediate", "num_experts", "top_k"):
            v = getattr(self, key)
            if not is_int(v) or v <= 0:
                raise ValueError(f"LayerDims.{key}={v!r}: expected a positive int")
        if self.num_local is None:
            object.__setattr__(self, "num_local", self.num_experts)
        if not (0 <= self.first_expert and self.first_expert + self.num_local <= self.num_experts):
            raise ValueError(
                f"LayerDims: local experts [{self.first_expert}, {self.first_expert + self.num_local}) "
                f"not inside [0, num_experts={self.num_experts})")
        if self.hidden % (2 * _MXFP4_GROUP) or self.intermediate % _MXFP4_GROUP:
            raise ValueError(
                f"LayerDims: hidden={self.hidden} must be a multiple of {2 * _MXFP4_GROUP} and "
                f"intermediate={self.intermediate} of {_MXFP4_GROUP} (MXFP4 groups)")

    @classmethod
    def from_config(cls, config, *, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
                    hash_layer: bool = False) -> "LayerDims":
        """From a `MoEConfig` and the parallel split (SPEC §6)."""
        n_local = config.n_routed_experts // ep_size
        return cls(hidden=config.hidden_size, intermediate=config.moe_intermediate_size // tp_size,
                   num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                   first_expert=ep_rank * n_local, num_local=n_local, hash_layer=hash_layer)


def routed_expert_bytes(hidden: int, intermediate: int) -> int:
    """Bytes of ONE MXFP4 routed expert (gate_up + down, codes + e8m0 scales)."""
    h, i = hidden, intermediate
    gate_up = 2 * i * h // 2 + 2 * i * h // _MXFP4_GROUP
    down = h * i // 2 + h * i // _MXFP4_GROUP
    return gate_up + down


def shared_expert_bytes(hidden: int, intermediate: int) -> int:
    """Bytes of the FP8 shared expert: e4m3 weights + 128x128 e8m0 block scales."""
    h, i = hidden, intermediate
    weights = 2 * i * h + h * i
    scales = _cdiv(2 * i, _FP8_BLOCK) * _cdiv(h, _FP8_BLOCK) + _cdiv(h, _FP8_BLOCK) * _cdiv(i, _FP8_BLOCK)
    return weights + scales


def router_bytes(dims: LayerDims, num_tokens: int) -> int:
    """bf16 gate weight + fp32 bias (non-hash) or the tokens' tid2eid rows and ids (hash)."""
    b = dims.num_experts * dims.hidden * 2
    if dims.hash_layer:
        b += num_tokens * dims.top_k * 8 + num_tokens * 8
    else:
        b += dims.num_experts * 4
    return b


def count_routes(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> tuple[int, int]:
    """(distinct local experts hit, number of local routes) from topk_ids [T, k].

    A route is local when its expert id lies in [first_expert, first_expert + num_local);
    ids of -1 (dropped) or of other ranks' experts count for neither number.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"count_routes: topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    ids = topk_ids.reshape(-1).long()
    local = ids[(ids >= first_expert) & (ids < first_expert + num_local)]
    return int(torch.unique(local).numel()), int(local.numel())


@dataclass(frozen=True)
class Work:
    """Unique bytes and FLOPs of one scope of a forward at num_tokens tokens."""

    scope: str
    num_tokens: int
    bytes: int
    flops: int
    unique_experts: int = 0
    local_routes: int = 0

    def floor_us(self, copy_bytes_per_s: float, mm_flops_per_s: float) -> float:
        return floor_us(self.bytes, self.flops, copy_bytes_per_s, mm_flops_per_s)

    def as_dict(self) -> dict:
        return {"scope": self.scope, "num_tokens": self.num_tokens, "bytes": self.bytes, "flops": self.flops,
                "unique_experts": self.unique_experts, "local_routes": self.local_routes}


def layer_work(dims: LayerDims, num_tokens: int, topk_ids: Optional[torch.Tensor] = None, *,
               unique_experts: Optional[int] = None, local_routes: Optional[int] = None) -> dict[str, Work]:
    """Work of every scope (SCOPES) at num_tokens tokens.

    Pass either topk_ids [T, k] (counted with `count_routes`) or both unique_experts and
    local_routes (e.g. means over several rotated routings).
    """
    t = num_tokens
    if not is_int(t) or t < 0:
        raise ValueError(f"layer_work: num_tokens={t!r}: expected an int >= 0")
    if topk_ids is not None:
        if topk_ids.shape[0] != t:
            raise ValueError(f"layer_work: topk_ids has {topk_ids.shape[0]} rows, num_tokens={t}")
        unique_experts, local_routes = count_routes(topk_ids, dims.first_expert, dims.num_local)
    elif unique_experts is None or local_routes is None:
        raise ValueError("layer_work: pass topk_ids or both unique_experts and local_routes")
    h, i = dims.hidden, dims.intermediate
    act_in = t * h * 2
    act_out = t * h * 2
    per_tok_flops = 2 * (2 * i * h + h * i)
    routed_b = int(round(unique_experts * routed_expert_bytes(h, i)))
    shared_b = shared_expert_bytes(h, i)
    router_b = router_bytes(dims, t)
    routed_f = int(round(local_routes * per_tok_flops))
    shared_f = t * per_tok_flops
    router_f = 2 * t * dims.num_experts * h
    out = {
        "layer": Work("layer", t, routed_b + shared_b + router_b + act_in + act_out,
                      routed_f + shared_f + router_f, unique_experts, local_routes),
        "router": Work("router", t, router_b + act_in, router_f),
        # act_quant as a stage: reads x, writes e4m3 codes + one fp32 scale per 128 columns.
        "act_quant": Work("act_quant", t, act_in + t * h + t * _cdiv(h, 128) * 4, 0),
        "shared": Work("shared", t, shared_b + act_in + act_out, shared_f),
        "routed": Work("routed", t, routed_b + act_in + act_out, routed_f, unique_experts, local_routes),
        # As a stage on its own, finalize must read the local expert rows y [routes, H] bf16
        # and the shared output [T, H] bf16 and write [T, H] bf16; inside a fused layer these
        # are intermediates and do not count towards "layer".
        "finalize": Work("finalize", t, int(round(local_routes * h * 2)) + act_in + act_out, 0,
                         unique_experts, local_routes),
    }
    return out


def floor_us(nbytes: float, flops: float, copy_bytes_per_s: float, mm_flops_per_s: float) -> float:
    """max(bytes / copy bandwidth, flops / matmul rate) in microseconds."""
    if not (copy_bytes_per_s > 0 and mm_flops_per_s > 0):
        raise ValueError(f"floor_us: rates must be > 0, got copy={copy_bytes_per_s!r} mm={mm_flops_per_s!r}")
    return max(nbytes / copy_bytes_per_s, flops / mm_flops_per_s) * 1e6
