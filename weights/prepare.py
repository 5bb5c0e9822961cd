"""Layout preparation: checkpoint tensors (one rank's slices) -> the containers of
`weights.tensors`. Pure functions, no I/O, no arithmetic on values: the bytes in the
containers are the checkpoint's bytes.

    merge w1 | w3      gate_up = cat([w1, w3], dim 0): rows [0, I) gate, [I, 2I) up
    stack experts      routed tensors get a leading local-expert dim, ascending id
    dtypes             packed e2m1: checkpoint I8 bytes reinterpreted as uint8 (a view)
                       e8m0 scales stay float8_e8m0fnu, e4m3 weights stay float8_e4m3fn

The loader uses `empty_routed` + `place_expert` so a large layer is assembled in its
final buffers one expert at a time (peak memory = the layer plus one expert);
`prepare_routed` is the same thing over a list.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from dsv4_moe.config import FP8_BLOCK, MXFP4_GROUP

from .formats import as_uint8
from .tensors import RoutedExpertWeights, RouterWeights, SharedExpertWeights

__all__ = ["merge_gate_up", "prepare_router", "prepare_shared", "empty_routed", "place_expert",
           "prepare_routed", "EXPERT_KEYS"]

# The per-expert tensors `place_expert` takes, keyed like the checkpoint's suffixes.
EXPERT_KEYS = ("w1.weight", "w1.scale", "w3.weight", "w3.scale", "w2.weight", "w2.scale")


def _expect(name: str, t: torch.Tensor, dtype: torch.dtype | tuple, ndim: int) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != ndim:
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name}: got {got}, expected a {ndim}-d tensor of {[str(d) for d in dtypes]}")


def merge_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """cat([w1, w3], dim=-2): gate rows first, then up rows. Shapes must match."""
    if w1.shape != w3.shape or w1.dtype != w3.dtype:
        raise ValueError(f"merge_gate_up: w1 {w1.dtype} {list(w1.shape)} and w3 {w3.dtype} {list(w3.shape)} differ")
    return torch.cat([w1, w3], dim=-2)


def prepare_router(weight: torch.Tensor, bias: Optional[torch.Tensor],
                   tid2eid: Optional[torch.Tensor]) -> RouterWeights:
    """weight [E, H] bf16; bias [E] f32 (non-hash) or tid2eid [vocab, k] int64 (hash)."""
    _expect("router weight", weight, torch.bfloat16, 2)
    if (bias is None) == (tid2eid is None):
        raise ValueError("prepare_router: give exactly one of bias (non-hash layer) and tid2eid (hash layer)")
    if bias is not None:
        _expect("router bias", bias, torch.float32, 1)
    if tid2eid is not None:
        _expect("router tid2eid", tid2eid, torch.int64, 2)
    return RouterWeights(weight=weight, bias=bias, tid2eid=tid2eid)


def prepare_shared(t: Mapping[str, torch.Tensor]) -> SharedExpertWeights:
    """One rank's FP8 shared expert -> SharedExpertWeights.

        t["w1.weight"], t["w3.weight"]  [I, H]          float8_e4m3fn
        t["w1.scale"],  t["w3.scale"]   [I/128, Hb]     float8_e8m0fnu
        t["w2.weight"]                  [H, I]          float8_e4m3fn
        t["w2.scale"]                   [Hb, I/128]     float8_e8m0fnu

    I must be a multiple of 128 so the merged block-scale rows do not straddle the
    gate/up seam (checked).
    """
    for key in EXPERT_KEYS:
        want = torch.float8_e4m3fn if key.endswith("weight") else torch.float8_e8m0fnu
        _expect(f"shared {key}", t[key], want, 2)
    i = t["w1.weight"].shape[0]
    if i % FP8_BLOCK:
        raise ValueError(
            f"prepare_shared: intermediate {i} is not a multiple of {FP8_BLOCK}: the gate and up block scales "
            "would share a 128-row block after merging")
    return SharedExpertWeights(
        gate_up=merge_gate_up(t["w1.weight"], t["w3.weight"]),
        gate_up_scale=merge_gate_up(t["w1.scale"], t["w3.scale"]),
        down=t["w2.weight"].contiguous(),
        down_scale=t["w2.scale"].contiguous(),
    )


def empty_routed(num_local: int, hidden: int, intermediate: int, *, first_expert: int, num_experts: int,
                 device: torch.device | str = "cpu") -> RoutedExpertWeights:
    """Uninitialised RoutedExpertWeights for `num_local` experts of `intermediate` (per rank)."""
    if hidden % (2 * MXFP4_GROUP) or intermediate % MXFP4_GROUP:
        raise ValueError(f"empty_routed: hidden={hidden}, intermediate={intermediate}: expected multiples of "
                         f"{2 * MXFP4_GROUP} and {MXFP4_GROUP}")
    e, h, i, g = num_local, hidden, intermediate, MXFP4_GROUP
    return RoutedExpertWeights(
        gate_up=torch.empty(e, 2 * i, h // 2, dtype=torch.uint8, device=device),
        gate_up_scale=torch.empty(e, 2 * i, h // g, dtype=torch.float8_e8m0fnu, device=device),
        down=torch.empty(e, h, i // 2, dtype=torch.uint8, device=device),
        down_scale=torch.empty(e, h, i // g, dtype=torch.float8_e8m0fnu, device=device),
        first_expert=first_expert,
        num_experts=num_experts,
    )


def place_expert(routed: RoutedExpertWeights, local: int, t: Mapping[str, torch.Tensor]) -> None:
    """Copy one expert's checkpoint tensors into slot `local` of `routed` (in place).

        t["w1.weight"], t["w3.weight"]  [I, H/2]   int8|uint8 packed e2m1 -> gate_up[local, :I] / [I:]
        t["w1.scale"],  t["w3.scale"]   [I, H/32]  float8_e8m0fnu          -> gate_up_scale[local, ...]
        t["w2.weight"]                  [H, I/2]   int8|uint8              -> down[local]
        t["w2.scale"]                   [H, I/32]  float8_e8m0fnu          -> down_scale[local]
    """
    if routed.layout != "nk":
        raise ValueError(f"place_expert: routed.layout={routed.layout!r}: checkpoint bytes go into 'nk' "
                         f"weights (convert after loading with with_layout)")
    if not 0 <= local < routed.num_local:
        raise ValueError(f"place_expert: local={local}: expected an int in [0, {routed.num_local})")
    i = routed.intermediate
    for key in EXPERT_KEYS:
        want = (torch.int8, torch.uint8) if key.endswith("weight") else torch.float8_e8m0fnu
        _expect(f"expert {routed.first_expert + local} {key}", t[key], want, 2)
    dst = {
        "w1.weight": routed.gate_up[local, :i], "w3.weight": routed.gate_up[local, i:],
        "w1.scale": routed.gate_up_scale[local, :i], "w3.scale": routed.gate_up_scale[local, i:],
        "w2.weight": routed.down[local], "w2.scale": routed.down_scale[local],
    }
    for key, d in dst.items():
        src = t[key]
        if src.shape != d.shape:
            raise ValueError(f"place_expert: expert {routed.first_expert + local} {key} shape {list(src.shape)}, "
                             f"expected {list(d.shape)}")
        # Packed e2m1 arrives as the checkpoint's I8: reinterpret, never convert.
        d.copy_(as_uint8(src) if key.endswith("weight") else src)


def prepare_routed(experts: Sequence[Mapping[str, torch.Tensor]], *, first_expert: int,
                   num_experts: int) -> RoutedExpertWeights:
    """Stack one rank's routed experts (ascending id from `first_expert`) into
    RoutedExpertWeights; each item is a mapping as `place_expert` takes."""
    if not experts:
        raise ValueError("prepare_routed: experts is empty")
    h = experts[0]["w2.weight"].shape[0]
    i = experts[0]["w1.weight"].shape[0]
    device = experts[0]["w1.weight"].device
    routed = empty_routed(len(experts), h, i, first_expert=first_expert, num_experts=num_experts, device=device)
    for j, t in enumerate(experts):
        place_expert(routed, j, t)
    return routed
