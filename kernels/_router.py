"""Triton body of `route_topk`: biased top-k, unbiased gather, renormalise, sort by id.

One program per token. The token's E scores (fp32, already `sqrt(softplus(logits))`)
sit in one register vector of E_PAD lanes (E <= 512 in every DeepSeek-V4 config).
Selection is k rounds of "max, then the lowest index holding it" — the lowest-index
tie-break is what `torch.topk` does on CPU and CUDA for exact ties in practice, but it
is not documented, so tests count ties instead of relying on it. The k chosen
(id, weight) pairs are then written at their rank among the k ids (a k x k compare),
which sorts them ascending by id without a sort network and keeps duplicate hash
ids (if a table ever had them) in table order. The renormalisation sum then runs left
to right in that ascending-id order, as the reference pins it, so given equal scores
the weights are bitwise equal.
"""

import triton
import triton.language as tl


@triton.jit
def _route_topk_kernel(
    scores_ptr,        # [T, E] f32, row stride stride_s
    bias_ptr,          # [E] f32 (HAS_BIAS)
    tid2eid_ptr,       # [vocab, TOP_K] int (HASH), row stride stride_tab
    input_ids_ptr,     # [T] int (HASH)
    out_w_ptr,         # [T, TOP_K] f32
    out_ids_ptr,       # [T, TOP_K] int32
    E, stride_s, stride_tab,
    scale,             # routed_scaling_factor, fp32
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, E_PAD)
    in_range = col < E
    scores = tl.load(scores_ptr + t * stride_s + col, mask=in_range, other=0.0)
    kk = tl.arange(0, K_PAD)
    sel_ids = tl.full([K_PAD], 0, tl.int32)
    sel_w = tl.zeros([K_PAD], tl.float32)
    if HASH:
        tok = tl.load(input_ids_ptr + t).to(tl.int64)
        for j in tl.static_range(TOP_K):
            e = tl.load(tid2eid_ptr + tok * stride_tab + j).to(tl.int32)
            s = tl.sum(tl.where(col == e, scores, 0.0), axis=0)
            sel_ids = tl.where(kk == j, e, sel_ids)
            sel_w = tl.where(kk == j, s, sel_w)
    else:
        biased = scores
        if HAS_BIAS:
            biased = scores + tl.load(bias_ptr + col, mask=in_range, other=0.0)
        biased = tl.where(in_range, biased, float("-inf"))
        for j in tl.static_range(TOP_K):
            m = tl.max(biased, axis=0)
            e = tl.min(tl.where(biased == m, col, E_PAD), axis=0)
            hit = col == e
            s = tl.sum(tl.where(hit, scores, 0.0), axis=0)  # the unbiased score
            sel_ids = tl.where(kk == j, e, sel_ids)
            sel_w = tl.where(kk == j, s, sel_w)
            biased = tl.where(hit, float("-inf"), biased)
    # rank of slot j among the k ids: ties (hash duplicates) broken by slot order
    valid = kk < TOP_K
    a = sel_ids[:, None]
    b = sel_ids[None, :]
    before = ((b < a) | ((b == a) & (kk[None, :] < kk[:, None]))) & valid[None, :]
    rank = tl.sum(before.to(tl.int32), axis=1)
    # renormalisation sum left to right in ascending-id order (the order DESIGN.md pins)
    wsum = tl.sum(tl.where((rank == 0) & valid, sel_w, 0.0), axis=0)
    for r in tl.static_range(1, TOP_K):
        wsum += tl.sum(tl.where((rank == r) & valid, sel_w, 0.0), axis=0)
    w = sel_w / wsum * scale
    tl.store(out_ids_ptr + t * TOP_K + rank, sel_ids, mask=valid)
    tl.store(out_w_ptr + t * TOP_K + rank, w, mask=valid)
