"""Triton body of `route_front`: the decode front of the MoE layer in one launch.

Grid = the router's logits GEMV grid (`gemv_blocks`). Every program
1. computes its [BLOCK_T, BLOCK_E] tile of the fp32 logits (`_logits_tile`, the GEMV's own
   body: same block shape and warps, so the same bits) and stores their scores
   sqrt(softplus(logit)) (the function the top-k kernel applies, spread over all programs
   instead of the last one's serial part);
2. quantises its share of the T x G activation groups (group j = row j // G, columns
   128 (j % G) ..; j = pid, pid + P, ...) with `quant_group_tile` on a [1, 128] tile, as
   `act_quant` does at decode (one row per program), plus the bf16 "pairs" when asked;
3. arrives on a counter (`split_k_arrive`: CTA barrier, then an acq_rel atomic at GPU
   scope). The program that arrives last reads every token's logits through L2 and routes
   them all at once (`_topk_tokens`: the top-k kernel's exact steps on a [T, E] tile, one
   pass of reductions for all tokens; a loop over tokens measured 2-5 us per token on the
   H200), then, after a
   CTA barrier that orders its own id / weight stores, aligns the routes with moe_align's
   one-launch body in moe_align's form (`_align_sorted_body` where moe_align.SMALL_SORTED
   sorts, session 29; `_align_small_body` otherwise) and resets the counter to 0.

So the outputs are bitwise those of the separate launches (router GEMV, top-k, act_quant,
moe_align), which tests/test_kernels_route_front.py checks under the interpreter and
scripts/gpu_check_layer.py on the GPU.
"""

import triton
import triton.language as tl

from ._moe_align import _align_small_body, _align_sorted_body
from ._router import _logits_tile, _topk_tokens
from ._triton_utils import e4m3_bytes_to_bf16, pdl_enter, quant_group_tile, split_k_arrive, split_k_reset


@triton.jit
def _route_front_kernel(
    x_ptr, w_ptr, logits_ptr,
    bias_ptr, tid2eid_ptr, input_ids_ptr, topk_w_ptr, topk_ids_ptr,
    q_ptr, s_ptr, p_ptr,
    route_rows_ptr, expert_counts_ptr, expert_offsets_ptr, num_blocks_ptr, sorted_ids_ptr,
    block_expert_ptr, row_expert_ptr, row_weight_ptr,
    cnt_ptr,
    T, E, stride_x, stride_w, stride_l, stride_tab, scale,
    first_expert, num_local, max_blocks,
    stride_qm, stride_sm, stride_pm,
    H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, T_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASH: tl.constexpr, APPLY_SCORES: tl.constexpr,
    QUANT_ITERS: tl.constexpr, SCALE_FMT: tl.constexpr, PAIRS: tl.constexpr, SOFTWARE: tl.constexpr,
    R_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD_A: tl.constexpr, ROWS_PAD: tl.constexpr,
    MB_PAD: tl.constexpr,
    DIAG: tl.constexpr = 0,  # probes only (wrong results): 1 = no routing / alignment, 2 = no quant
    PDL: tl.constexpr = 0,
    SORTED: tl.constexpr = False,  # the alignment by sorting (moe_align's default form), else the compares
):
    pdl_enter(PDL)
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    _logits_tile(x_ptr, w_ptr, logits_ptr, pid_e, pid_t, T, E, stride_x, stride_w, stride_l,
                 H, BLOCK_T, BLOCK_E, BLOCK_H, NUM_STAGES, APPLY_SCORES)
    nprog = tl.num_programs(0) * tl.num_programs(1)
    pid = pid_t * tl.num_programs(0) + pid_e
    G: tl.constexpr = (H + 127) // 128
    cc = tl.arange(0, 128)
    for it in tl.static_range(QUANT_ITERS if DIAG != 2 else 0):
        j = pid + it * nprog + tl.zeros([1], tl.int32)                  # [1]: this group's index
        ok = j < T * G
        row = tl.where(ok, j // G, 0).to(tl.int64)
        g = j % G
        cols = g[:, None] * 128 + cc[None, :]                          # [1, 128]
        m = ok[:, None] & (cols < H)
        xv = tl.load(x_ptr + row[:, None] * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        q, s_store = quant_group_tile(xv, SCALE_FMT, SOFTWARE)
        tl.store(q_ptr + row[:, None] * stride_qm + cols, q, mask=m)
        if PAIRS:  # H % 128 == 0 (checked by the wrapper)
            # NOTE (session 24): the pairs are quantised again from x loaded in their column
            # order (the group's 64 even columns, then its 64 odd ones: the same amax, so the
            # same scale and the same e4m3 byte per element) and stored contiguously. The
            # register split of store_pairs (act_quant's way) stored wrong odd halves on the
            # H200 in this kernel at the 8 warps of the T = 2 GEMV (scripts/
            # gpu_check_front_pairs.py; 4 warps would change the logits' bits).
            pc = g[:, None] * 128 + tl.where(cc < 64, 2 * cc, 2 * cc - 127)[None, :]
            xp = tl.load(x_ptr + row[:, None] * stride_x + pc, mask=m, other=0.0).to(tl.float32)
            qp, _ = quant_group_tile(xp, SCALE_FMT, SOFTWARE)
            v = e4m3_bytes_to_bf16(qp, SOFTWARE)
            if PAIRS == 2:  # "scaled pairs": bf16(q * s), exact (s a power of two)
                v = (v.to(tl.float32) * s_store[:, None]).to(tl.bfloat16)
            tl.store(p_ptr + row[:, None] * stride_pm + cols, v, mask=m)
        tl.store(s_ptr + row * stride_sm + g, s_store, mask=ok)
    if split_k_arrive(cnt_ptr, nprog):
        if DIAG != 1:
            _topk_tokens(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, topk_w_ptr, topk_ids_ptr,
                         T, E, stride_l, stride_tab, scale,
                         TOP_K, K_PAD, E_PAD, T_PAD, HAS_BIAS, HASH, False)
            tl.debug_barrier()
            if SORTED:
                _align_sorted_body(topk_ids_ptr, topk_w_ptr, route_rows_ptr, expert_counts_ptr, expert_offsets_ptr,
                                   num_blocks_ptr, sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                                   T * TOP_K, first_expert, num_local, max_blocks,
                                   True, R_BLOCK, BLOCK_M, E_PAD_A, ROWS_PAD, MB_PAD)
            else:
                _align_small_body(topk_ids_ptr, topk_w_ptr, route_rows_ptr, expert_counts_ptr, expert_offsets_ptr,
                                  num_blocks_ptr, sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                                  T * TOP_K, first_expert, num_local, max_blocks,
                                  True, R_BLOCK, BLOCK_M, E_PAD_A, ROWS_PAD, MB_PAD)
        split_k_reset(cnt_ptr)
