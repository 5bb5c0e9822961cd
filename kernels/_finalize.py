"""Triton bodies of the finalize (SPEC §4.5, §5.2).

Grid (T, cdiv(H, BLOCK_H)): one program per (token, hidden chunk), BLOCK_H / (32 *
num_warps) contiguous bf16 per thread (8 at BLOCK_H = 1024, 4 warps: 16-byte loads).

    acc = +0.0 (fp32)
    for slot in 0..k-1 (slots are in ascending expert id):
        if topk_ids[t, slot] is local:  acc = acc + float(y[t, slot, cols])
    fused:    out = bf16(acc + float(shared[t, cols]))      (shared optional)
    partial:  acc_out = acc                                  (fp32, for the EP all-reduce)
    add_shared_round: out = bf16(acc + float(shared))

With PARTS > 0 (`finalize_split_shared_add`) y is the down GEMM's unreduced split-K fp32
partials [PARTS, T, k, H], and each local slot's row is first made as the split-K reduce
launch makes it: v = bf16(+0.0 + y[0] + ... + y[PARTS-1]), then acc = acc + float(v) - the
same adds and roundings as reduce-then-finalize, one launch fewer.

A non-local slot is skipped with a select, not added as 0 (-0.0 + 0.0 would turn a
-0.0 sum into +0.0) and never loaded (its y row is unspecified, maybe NaN). The fused
and split paths execute the same fp32 adds in the same order with one rounding, so they
are bitwise equal; nothing here is reordered by the compiler (no multiplies to contract
into FMAs).
"""

import triton
import triton.language as tl

from ._triton_utils import pdl_enter, round_to_bf16


@triton.jit
def _routed_sum(y_ptr, ids_ptr, t, cols, col_ok, first_expert, num_local,
                stride_yt, stride_ys, stride_it, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                stride_yp=0, PARTS: tl.constexpr = 0, SOFTWARE_BF16: tl.constexpr = False):
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * stride_it + s).to(tl.int32) - first_expert
        local = (e >= 0) & (e < num_local)
        if PARTS == 0:
            v = tl.load(y_ptr + t * stride_yt + s * stride_ys + cols, mask=col_ok & local, other=0.0).to(tl.float32)
        else:  # the split-K reduce's row: bf16 of the in-order fp32 sum of the partials
            v = tl.zeros([BLOCK_H], dtype=tl.float32)
            off = t * stride_yt + s * stride_ys  # int64 (t is): no overflow over the parts
            for p in tl.static_range(PARTS):
                v += tl.load(y_ptr + off + cols, mask=col_ok & local, other=0.0)
                off += stride_yp
            if SOFTWARE_BF16:
                v = round_to_bf16(v, True)
            v = v.to(tl.bfloat16).to(tl.float32)
        acc = tl.where(local, acc + v, acc)
    return acc


@triton.jit
def _finalize_kernel(y_ptr, ids_ptr, shared_ptr, out_ptr, H, first_expert, num_local,
                     stride_yt, stride_ys, stride_it, stride_st, stride_ot,
                     TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                     HAS_SHARED: tl.constexpr, PARTIAL: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
                     PDL: tl.constexpr = 0, stride_yp=0, PARTS: tl.constexpr = 0):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = _routed_sum(y_ptr, ids_ptr, t, cols, col_ok, first_expert, num_local,
                      stride_yt, stride_ys, stride_it, TOP_K, BLOCK_H, stride_yp, PARTS, SOFTWARE_BF16)
    if PARTIAL:
        tl.store(out_ptr + t * stride_ot + cols, acc, mask=col_ok)
    else:
        if HAS_SHARED:
            acc = acc + tl.load(shared_ptr + t * stride_st + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SOFTWARE_BF16:
            acc = round_to_bf16(acc, True)  # interpreter: its fp32 -> bf16 cast truncates
        tl.store(out_ptr + t * stride_ot + cols, acc.to(tl.bfloat16), mask=col_ok)


@triton.jit
def _add_shared_round_kernel(acc_ptr, shared_ptr, out_ptr, H, stride_at, stride_st, stride_ot,
                             BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr,
                             SOFTWARE_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.load(acc_ptr + t * stride_at + cols, mask=col_ok, other=0.0)
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + t * stride_st + cols, mask=col_ok, other=0.0).to(tl.float32)
    if SOFTWARE_BF16:
        acc = round_to_bf16(acc, True)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(tl.bfloat16), mask=col_ok)
