"""Tensor- and expert-parallel slices of checkpoint tensors (SPEC §6). Pure functions.

Tensor parallelism (vLLM's scheme): every rank holds every expert with I/tp of the
intermediate. Rank r owns intermediate rows [i0, i1) = [r*I/tp, (r+1)*I/tp):

    tensor                     stored shape           rank r reads
    experts.e.w1|w3.weight     [I, H/2]    (packed)   rows [i0, i1)
    experts.e.w1|w3.scale      [I, H/32]              rows [i0, i1)
    experts.e.w2.weight        [H, I/2]    (packed)   cols [i0/2, i1/2)     (two e2m1 per byte)
    experts.e.w2.scale         [H, I/32]              cols [i0/32, i1/32)
    shared.w1|w3.weight        [I, H]      e4m3       rows [i0, i1)
    shared.w1|w3.scale         [I/128, H/128]         rows [i0/128, i1/128)
    shared.w2.weight           [H, I]      e4m3       cols [i0, i1)
    shared.w2.scale            [H/128, I/128]         cols [i0/128, i1/128)
    router.*                                          everything (replicated)

`MoEConfig.check_parallel` guarantees I/tp is a multiple of 32 (whole MXFP4 groups)
and, for tp > 1, of 128 (whole FP8 blocks), so no slice cuts a scale group and nothing
is padded: V4-Pro at TP8 gives I = 384 per rank, 12 MXFP4 scale groups, 3 FP8 blocks.

Expert parallelism (the official scheme): rank r holds experts [r*E/ep, (r+1)*E/ep)
in full; the router and shared expert are replicated.

An index is a tuple of `slice` objects, one per dim, or None for "the whole tensor";
the reader passes it to safetensors' `get_slice` so a rank reads only its bytes.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_moe.config import FP8_BLOCK, MXFP4_GROUP, MoEConfig

__all__ = ["Index", "tp_intermediate_range", "tp_index", "ep_experts", "apply_index", "sliced_shape"]

Index = Optional[tuple[slice, ...]]


def tp_intermediate_range(config: MoEConfig, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[i0, i1): the intermediate rows rank `tp_rank` of `tp_size` owns."""
    config.check_parallel(tp_rank=tp_rank, tp_size=tp_size)
    n = config.local_intermediate(tp_size)
    return tp_rank * n, (tp_rank + 1) * n


def tp_index(logical: str, config: MoEConfig, tp_rank: int = 0, tp_size: int = 1) -> Index:
    """The index of rank `tp_rank`'s part of the tensor with logical name `logical`
    (`names.TensorSpec.logical`), or None when the rank reads it whole."""
    i0, i1 = tp_intermediate_range(config, tp_rank, tp_size)
    parts = logical.split(".")
    if parts[0] == "router" and len(parts) == 2:
        return None
    if parts[0] == "shared" and len(parts) == 3:
        proj, kind = parts[1], parts[2]
        # Block scales are blocked along both dims; e4m3 weights are one byte per value.
        div = 1 if kind == "weight" else FP8_BLOCK
    elif parts[0] == "experts" and len(parts) == 4:
        proj, kind = parts[2], parts[3]
        # Along I: gate/up rows are whole rows (packing and groups run along H); down's
        # columns pack two e2m1 per byte and group 32 per scale.
        div = 1 if proj != "w2" else (2 if kind == "weight" else MXFP4_GROUP)
    else:
        raise ValueError(f"tp_index: logical={logical!r} is not a name from weights.names")
    if kind not in ("weight", "scale") or proj not in ("w1", "w3", "w2"):
        raise ValueError(f"tp_index: logical={logical!r} is not a name from weights.names")
    if tp_size == 1:
        return None
    # check_parallel made i0 and i1 multiples of 32 (and of 128 for tp > 1), so these
    # divisions are exact.
    cut = slice(i0 // div, i1 // div)
    if proj in ("w1", "w3"):
        return (cut, slice(None))  # output rows of gate / up
    return (slice(None), cut)  # input columns of down


def ep_experts(config: MoEConfig, ep_rank: int = 0, ep_size: int = 1) -> range:
    """Ascending global ids of the routed experts rank `ep_rank` of `ep_size` holds."""
    config.check_parallel(ep_rank=ep_rank, ep_size=ep_size)
    return config.local_experts(ep_rank, ep_size)


def sliced_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """Shape of `tensor[index]` for a tensor of `shape`; raises ValueError when the index
    does not lie inside the shape (safetensors would silently clip it)."""
    if index is None:
        return tuple(shape)
    if len(index) != len(shape):
        raise ValueError(f"index {index!r} has {len(index)} dims, tensor shape {tuple(shape)} has {len(shape)}")
    out = []
    for s, d in zip(index, shape):
        if s.step not in (None, 1):
            raise ValueError(f"index {index!r}: only unit-step slices are supported")
        start = 0 if s.start is None else s.start
        stop = d if s.stop is None else s.stop
        if not 0 <= start <= stop <= d:
            raise ValueError(f"index {index!r} lies outside shape {tuple(shape)}")
        out.append(stop - start)
    return tuple(out)


def apply_index(t: torch.Tensor, index: Index) -> torch.Tensor:
    """`t[index]` as a contiguous tensor (the in-memory twin of a sliced read)."""
    if index is None:
        return t.contiguous()
    sliced_shape(tuple(t.shape), index)
    return t[index].contiguous()
