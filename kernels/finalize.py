"""Finalize + shared add (SPEC §4.5, §5.2): the routed top-k sum and the shared expert
output combined with one bf16 rounding, without writing the routed [T, H] sum.

    y           [T, k, H]  bfloat16  expert outputs in slot layout (slot = ascending expert
                                     id); rows of non-local routes are never read
    topk_ids    [T, k]     int32/int64  global expert ids
    shared_out  [T, H]     bfloat16 or None
    ->
    finalize_shared_add  [T, H] bf16   bf16(+0.0 + sum_local_slots y + shared)   one kernel
    finalize_partial     [T, H] f32    +0.0 + sum_local_slots y (the EP partial)
    add_shared_round     [T, H] bf16   bf16(acc + shared)
    finalize_unfused     = add_shared_round(finalize_partial(...))
    finalize_split_shared_add(parts [P, T, k, H] f32, ...) -> [T, H] bf16
                         the fused kernel on the routed down GEMM's unreduced split-K
                         partials (`routed_experts_forward(down_reduce=False)`): each local
                         slot's row is bf16(+0.0 + parts[0] + ... + parts[P-1]), as the
                         GEMM's reduce launch writes it into y; bitwise that launch followed
                         by `finalize_shared_add`, one launch fewer

Expert parallelism (SPEC §6): finalize_partial -> all_reduce(acc, fp32) ->
add_shared_round; without EP the fused kernel is used. Fused == unfused bitwise.

BLOCK_H: 1024 columns per program (16-byte loads with 4 warps) once there are enough
tokens to fill the GPU; SMALL_T_BLOCK_H (128 since session 32, 256 before) below `_SMALL_T`
tokens so a decode call still spreads over more SMs (T * H / 128 programs). NOTE (session 9, scripts/gpu_probe_finalize.py, CUDA
graphs, rotated inputs, docs/bench/2026-11-29/session9/probe_finalize_70c3d16.txt): the
crossover sits between 64 and 256 tokens (us fused, BLOCK_H 256 / 1024: H 7168 T=16 5.08 /
11.39, T=64 7.71 / 7.86, T=256 12.18 / 11.59, T=4096 140.95 / 103.20), so the rule stays.
"""

from __future__ import annotations

import torch

from dsv4_moe._types import is_int

__all__ = ["finalize_shared_add", "finalize_split_shared_add", "finalize_partial", "add_shared_round",
           "finalize_unfused"]

_SMALL_T = 64
# BLOCK_H below _SMALL_T tokens (an A/B switch: at T = 1 the grid is H / SMALL_T_BLOCK_H programs, one
# warp each). NOTE (session 32, H200, docs/bench/2026-11-30/session32/): gpu_profile_layer.py --ab
# (12 forwards per graph, 3 captures, us, 256 / 128 / 64, outputs bitwise the default's): Flash T=1
# 53.6 / 53.2 / 53.2, T=2 75.7 / 75.7 / 76.2; Pro-TP8 T=1 32.4 / 32.2 / 32.4, T=2 43.1 / 43.1 / 43.0.
# The layer bench (--graph-chain, two alternating runs, 256 / 128): Flash T=1 55.5 / 54.4 and 55.2 /
# 54.6, T=16 356.2 / 354.5 and 352.0 / 348.2; Pro-TP8 T=1 31.0 / 30.9 twice, T=16 142.5 / 141.5 and
# 141.8 / 141.4. So 128.
SMALL_T_BLOCK_H = 128


def _block_h(t: int, h: int) -> tuple[int, int]:
    import triton  # noqa: PLC0415

    bh = SMALL_T_BLOCK_H if t < _SMALL_T else 1024
    bh = min(bh, max(triton.next_power_of_2(h), 32))
    return bh, max(1, min(4, bh // 256))


def _check_y_ids(y, topk_ids, first_expert, num_local) -> tuple[int, int, int]:
    if not isinstance(y, torch.Tensor) or y.dim() != 3 or y.dtype != torch.bfloat16:
        raise ValueError(f"y: expected a [T, k, H] bfloat16 tensor, got "
                         f"{getattr(y, 'dtype', type(y))} shape {tuple(getattr(y, 'shape', ()))}")
    t, k, h = y.shape
    if h and y.stride(2) != 1:
        raise ValueError(f"y: strides {tuple(y.stride())}, expected unit stride along H")
    _check_ids(topk_ids, t, k, y.device, first_expert, num_local)
    return t, k, h


def _check_ids(topk_ids, t, k, device, first_expert, num_local) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.shape != (t, k) \
            or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected [{t}, {k}] int32/int64, got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids))} shape {tuple(getattr(topk_ids, 'shape', ()))}")
    if topk_ids.device != device:
        raise ValueError(f"topk_ids: on {topk_ids.device}, expected y's device {device}")
    if not is_int(first_expert) or first_expert < 0:
        raise ValueError(f"first_expert={first_expert!r}: expected an int >= 0")
    if not is_int(num_local) or num_local < 1:
        raise ValueError(f"num_local={num_local!r}: expected an int >= 1")


def _check_shared(shared_out, t, h, device) -> None:
    if shared_out is None:
        return
    if not isinstance(shared_out, torch.Tensor) or shared_out.shape != (t, h) \
            or shared_out.dtype != torch.bfloat16 or (h and shared_out.stride(1) != 1):
        raise ValueError(f"shared_out: expected [{t}, {h}] bfloat16 with unit column stride, got "
                         f"{getattr(shared_out, 'dtype', type(shared_out))} "
                         f"shape {tuple(getattr(shared_out, 'shape', ()))}")
    if shared_out.device != device:
        raise ValueError(f"shared_out: on {shared_out.device}, expected {device}")


def _launch_finalize(y, topk_ids, first_expert, num_local, shared_out, out, partial: bool):
    from ._finalize import _finalize_kernel
    from ._triton_utils import interpreting, pdl_options
    parts = y.shape[0] if y.dim() == 4 else 0  # [P, T, k, H] split-K partials, else [T, k, H]
    t, k, h = y.shape[-3:]
    bh, warps = _block_h(t, h)
    ids = topk_ids.contiguous()
    sh = shared_out if shared_out is not None else out
    _finalize_kernel[(t, -(-h // bh))](
        y, ids, sh, out, h, first_expert, num_local,
        y.stride(-3), y.stride(-2), ids.stride(0), sh.stride(0), out.stride(0),
        TOP_K=k, BLOCK_H=bh, HAS_SHARED=shared_out is not None, PARTIAL=partial,
        SOFTWARE_BF16=interpreting(), num_warps=warps, **pdl_options(out.device),
        stride_yp=y.stride(0) if parts else 0, PARTS=parts)
    return out


def finalize_shared_add(y: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_local: int,
                        shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """One kernel: bf16(+0.0 + local slots of y in slot order + shared_out) -> [T, H] bf16."""
    t, k, h = _check_y_ids(y, topk_ids, first_expert, num_local)
    _check_shared(shared_out, t, h, y.device)
    out = torch.empty((t, h), dtype=torch.bfloat16, device=y.device)
    if t == 0 or h == 0:
        return out
    return _launch_finalize(y, topk_ids, first_expert, num_local, shared_out, out, partial=False)


def finalize_split_shared_add(parts: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_local: int,
                              shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """`finalize_shared_add` on the down GEMM's unreduced split-K partials: parts [P, T, k, H]
    float32 (`routed_experts_forward(..., down_reduce=False)`; rows of non-local routes are
    never read). Each local slot's row is bf16(+0.0 + parts[0] + ... + parts[P-1]) (the
    reduce launch's row), then summed as `finalize_shared_add` sums y -> [T, H] bf16."""
    if not isinstance(parts, torch.Tensor) or parts.dim() != 4 or parts.dtype != torch.float32 \
            or parts.shape[0] < 1:
        raise ValueError(f"parts: expected a [P, T, k, H] float32 tensor with P >= 1, got "
                         f"{getattr(parts, 'dtype', type(parts))} shape {tuple(getattr(parts, 'shape', ()))}")
    _, t, k, h = parts.shape
    if h and parts.stride(3) != 1:
        raise ValueError(f"parts: strides {tuple(parts.stride())}, expected unit stride along H")
    _check_ids(topk_ids, t, k, parts.device, first_expert, num_local)
    _check_shared(shared_out, t, h, parts.device)
    out = torch.empty((t, h), dtype=torch.bfloat16, device=parts.device)
    if t == 0 or h == 0:
        return out
    return _launch_finalize(parts, topk_ids, first_expert, num_local, shared_out, out, partial=False)


def finalize_partial(y: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """+0.0 + local slots of y in slot order, fp32 [T, H] (the routed partial before an EP all-reduce)."""
    t, k, h = _check_y_ids(y, topk_ids, first_expert, num_local)
    out = torch.empty((t, h), dtype=torch.float32, device=y.device)
    if t == 0 or h == 0:
        return out
    return _launch_finalize(y, topk_ids, first_expert, num_local, None, out, partial=True)


def add_shared_round(acc: torch.Tensor, shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16(acc + float(shared_out)) for acc [T, H] float32 -> [T, H] bf16."""
    if not isinstance(acc, torch.Tensor) or acc.dim() != 2 or acc.dtype != torch.float32:
        raise ValueError(f"acc: expected a [T, H] float32 tensor, got "
                         f"{getattr(acc, 'dtype', type(acc))} shape {tuple(getattr(acc, 'shape', ()))}")
    t, h = acc.shape
    if h and acc.stride(1) != 1:
        raise ValueError(f"acc: strides {tuple(acc.stride())}, expected unit column stride")
    _check_shared(shared_out, t, h, acc.device)
    out = torch.empty((t, h), dtype=torch.bfloat16, device=acc.device)
    if t == 0 or h == 0:
        return out
    from ._finalize import _add_shared_round_kernel
    from ._triton_utils import interpreting, pdl_options
    bh, warps = _block_h(t, h)
    sh = shared_out if shared_out is not None else out
    _add_shared_round_kernel[(t, -(-h // bh))](
        acc, sh, out, h, acc.stride(0), sh.stride(0), out.stride(0),
        BLOCK_H=bh, HAS_SHARED=shared_out is not None, SOFTWARE_BF16=interpreting(),
        num_warps=warps, **pdl_options(out.device))
    return out


def finalize_unfused(y: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_local: int,
                     shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """The two-kernel twin of `finalize_shared_add` (routed fp32 sum written, then read)."""
    return add_shared_round(finalize_partial(y, topk_ids, first_expert, num_local), shared_out)
