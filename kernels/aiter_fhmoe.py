"""Optional adapter to AMD AITER's heterogeneous fused MoE (SPEC §5.3, seed 004): the FP8
shared expert as expert E (weight 1.0, a (k+1)-th route) inside AITER's MXFP4 `fused_moe`
launch on gfx950, with its native FP8 weights and native width (I = 384 stays 384).

Built here and tested on the CPU (tests/test_aiter_fhmoe.py, with a fake `aiter`):

    fhmoe_capability(M)      AITER's own query `aiter.fhmoe.supports_dsv4_i384_fhmoe(M)` must
                             return literally True, and `aiter.fused_moe.fused_moe` must take
                             the five shared-expert parameters; a missing module, an
                             exception, a truthy non-bool or a missing parameter closes it
    fhmoe_shape_ok(...)      the one shape AITER's dedicated config covers: H 7168, I/rank
                             384, 384 routed experts, top-6, no expert parallelism
    expand_block_scales      128x128 e8m0 block scales -> AITER's 1x32 granularity, columns
                             padded with the neutral byte 0x7F (2^0)
    prepare_shared_expert    w1 [1, 2I, H], w2 [1, H, I] (views of the native FP8 tensors),
                             w1_scale [2I, H/32], w2_scale [H, I/32 rounded up to 8]
                             (12 -> 16 columns at I = 384, the pad 0x7F)
    append_shared_route      topk ids / weights [T, k] -> [T, k+1], column k = E, weight 1.0

NOT built: the `fused_moe` call and AITER's weight shuffles for its kernels. No gfx950
machine was available to run them, and AITER's fused path is a different numerics mode
from this package's separate path (its own GEMMs), so `fhmoe_supported` always closes with
that reason and the layer runs the separate path (`DeepseekV4MoE.explain()` says so).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from dsv4_moe._types import is_int

__all__ = ["FHMOE_SHARED_PARAMS", "FHMOE_SHAPE", "NEUTRAL_E8M0", "W2_SCALE_COL_ALIGN", "fhmoe_capability",
           "fhmoe_shape_ok", "expand_block_scales", "FHMoESharedExpert", "prepare_shared_expert",
           "append_shared_route", "fhmoe_supported"]

FHMOE_SHARED_PARAMS = ("shared_w1", "shared_w2", "shared_w1_scale", "shared_w2_scale", "shared_expert_id")
FHMOE_SHAPE = dict(hidden=7168, intermediate=384, num_experts=384, top_k=6)
NEUTRAL_E8M0 = 0x7F       # 2^0: a padded scale column multiplies by one
W2_SCALE_COL_ALIGN = 8    # AITER reads the down projection's scale columns in groups of 8


def fhmoe_capability(num_tokens) -> tuple[bool, str]:
    """(ok, reason): whether the installed AITER says its heterogeneous fused MoE covers a
    call with `num_tokens` MoE input rows. Fails closed on anything unexpected."""
    if not is_int(num_tokens) or num_tokens < 1:
        return False, f"num_tokens={num_tokens!r}: expected an int >= 1"
    try:
        from aiter import fhmoe  # noqa: PLC0415
        from aiter import fused_moe as fused_moe_mod  # noqa: PLC0415
    except Exception as e:  # ImportError without ROCm, or a broken install
        return False, f"aiter.fhmoe not importable ({type(e).__name__}: {e})"
    supports = getattr(fhmoe, "supports_dsv4_i384_fhmoe", None)
    if not callable(supports):
        return False, "aiter.fhmoe has no supports_dsv4_i384_fhmoe (an AITER without the physical-I384 config)"
    try:
        covered = supports(num_tokens)
    except Exception as e:
        return False, f"aiter.fhmoe.supports_dsv4_i384_fhmoe({num_tokens}) raised {type(e).__name__}: {e}"
    if covered is not True:
        return False, f"aiter.fhmoe.supports_dsv4_i384_fhmoe({num_tokens}) returned {covered!r}, not True"
    fn = getattr(fused_moe_mod, "fused_moe", None)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        return False, f"aiter.fused_moe.fused_moe has no readable signature ({type(e).__name__}: {e})"
    missing = [p for p in FHMOE_SHARED_PARAMS if p not in params]
    if missing:
        return False, f"aiter.fused_moe.fused_moe lacks the shared-expert parameters {missing}"
    return True, f"AITER covers M = {num_tokens} with the shared-expert fused_moe"


def fhmoe_shape_ok(hidden: int, intermediate: int, num_experts: int, top_k: int,
                   ep_size: int = 1) -> tuple[bool, str]:
    """(ok, reason): the layer shape AITER's dedicated FHMoE config was built for."""
    got = dict(hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k)
    if got != FHMOE_SHAPE:
        return False, f"shape {got} is not the one AITER's FHMoE config covers {FHMOE_SHAPE}"
    if ep_size != 1:
        return False, f"ep_size={ep_size}: the fused shared expert is validated without expert parallelism"
    return True, "V4-Pro TP8 per-rank shape"


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int, *, col_align: int = 1) -> torch.Tensor:
    """[ceil(rows/128), ceil(cols/128)] e8m0 block scales -> [rows, ceil(cols/32) rounded up
    to col_align] e8m0: each block's byte repeated over its 128 rows and its four 32-wide
    column groups; padding columns hold NEUTRAL_E8M0."""
    if not isinstance(scale, torch.Tensor) or scale.dim() != 2 or scale.dtype not in (torch.float8_e8m0fnu,
                                                                                      torch.uint8):
        raise ValueError(f"scale: expected a 2-D float8_e8m0fnu/uint8 tensor, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}")
    if rows < 1 or cols < 1 or cols % 32:
        raise ValueError(f"rows={rows}, cols={cols}: expected >= 1 and cols a multiple of 32")
    want = (-(-rows // 128), -(-cols // 128))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale.shape={tuple(scale.shape)}: expected {want} for a [{rows}, {cols}] weight")
    b = scale.view(torch.uint8)
    g = cols // 32
    out = b.repeat_interleave(128, dim=0)[:rows].repeat_interleave(4, dim=1)[:, :g]
    width = -(-g // col_align) * col_align
    if width > g:
        pad = torch.full((rows, width - g), NEUTRAL_E8M0, dtype=torch.uint8, device=b.device)
        out = torch.cat([out, pad], dim=1)
    return out.contiguous().view(torch.float8_e8m0fnu)


@dataclass
class FHMoESharedExpert:
    """The shared expert in the layout AITER's heterogeneous fused_moe takes (see module doc)."""
    w1: torch.Tensor        # [1, 2I, H] float8_e4m3fn (gate rows then up rows, as stored)
    w2: torch.Tensor        # [1, H, I] float8_e4m3fn
    w1_scale: torch.Tensor  # [2I, H/32] float8_e8m0fnu
    w2_scale: torch.Tensor  # [H, ceil(I/32 / 8) * 8] float8_e8m0fnu, padding 0x7F


def prepare_shared_expert(shared) -> FHMoESharedExpert:
    """A SharedExpertWeights (weights/tensors.py) -> FHMoESharedExpert: the FP8 weights as
    views (no copy, no padding of I), the block scales expanded."""
    h, i = shared.hidden, shared.intermediate
    if tuple(shared.gate_up.shape) != (2 * i, h) or shared.gate_up.dtype != torch.float8_e4m3fn:
        raise ValueError(f"shared.gate_up: expected [{2 * i}, {h}] float8_e4m3fn, got {shared.gate_up.dtype} "
                         f"{tuple(shared.gate_up.shape)}")
    if shared.down.dtype != torch.float8_e4m3fn:
        raise ValueError(f"shared.down: expected float8_e4m3fn, got {shared.down.dtype}")
    return FHMoESharedExpert(
        w1=shared.gate_up.unsqueeze(0), w2=shared.down.unsqueeze(0),
        w1_scale=expand_block_scales(shared.gate_up_scale, 2 * i, h),
        w2_scale=expand_block_scales(shared.down_scale, h, i, col_align=W2_SCALE_COL_ALIGN))


def append_shared_route(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        shared_expert_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] routes -> [T, k+1] with the shared expert appended as `shared_expert_id`
    (the routed expert count E) with weight 1.0 (SPEC §5.3)."""
    if not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor) \
            or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids / topk_weights: expected equal [T, k] tensors, got "
                         f"{tuple(getattr(topk_ids, 'shape', ()))} / {tuple(getattr(topk_weights, 'shape', ()))}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids / topk_weights: expected int32/int64 ids and float weights, got "
                         f"{topk_ids.dtype} / {topk_weights.dtype}")
    if not is_int(shared_expert_id) or shared_expert_id < 0:
        raise ValueError(f"shared_expert_id={shared_expert_id!r}: expected an int >= 0 (the routed expert count)")
    t = topk_ids.shape[0]
    ids = torch.cat([topk_ids, topk_ids.new_full((t, 1), shared_expert_id)], dim=1)
    weights = torch.cat([topk_weights, topk_weights.new_ones((t, 1))], dim=1)
    return ids, weights


def fhmoe_supported(ctx) -> tuple[bool, str]:
    """(ok, reason) for a layer forward (a dispatch.DispatchContext). Always closed for now:
    after the platform, shape and AITER checks it names what is not built."""
    from dsv4_moe import dispatch  # noqa: PLC0415

    ok, why = dispatch.is_gfx950(ctx.device)
    if not ok:
        return False, f"not a ROCm gfx950 device ({why})"
    ok, why = fhmoe_shape_ok(ctx.hidden, ctx.intermediate, ctx.num_experts, ctx.top_k, ctx.ep_size)
    if not ok:
        return False, why
    ok, why = fhmoe_capability(ctx.num_tokens)
    if not ok:
        return False, why
    return False, (f"{why}, but this package's call into AITER's fused_moe (and its weight shuffles) is not "
                   f"written: no gfx950 machine to validate it on, and the fused kernel's numerics differ from "
                   f"the separate path's")
