"""Triton bodies of `route_topk`: the decode logits GEMV, and biased top-k, unbiased
gather, renormalise, sort by id (with the sqrt(softplus) scores applied in-kernel on GPUs).

Top-k: one program per token. The token's E scores (fp32 `sqrt(softplus(logits))`, given
or computed from the logits by `_sqrt_softplus`) sit in one register vector of E_PAD lanes (E <= 512 in every DeepSeek-V4 config).
Selection is k rounds of "max, then the lowest index holding it" (up to
router.TOPK_PACKED_MAX_T tokens as one packed (score, index) int64 max per round, the same
pick; see _topk_token) — the lowest-index
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
from triton.language.extra import libdevice

from ._act_quant import act_quant_group
from ._triton_utils import pdl_enter, split_k_arrive, split_k_reset


@triton.jit
def _sqrt_softplus(logit):
    """sqrt(softplus(logit)) in fp32 with torch's CUDA formula and rounding (GPU only:
    libdevice): softplus(x) = x if x > 20 else log1p(exp(x)) (beta 1, threshold 20; the
    `/ beta` of torch's kernel is exact), then the IEEE square root. Bitwise equal to
    `torch.sqrt(F.softplus(x))` on the H200 for every fp32 input when the kernel is
    compiled with `enable_reflect_ftz=False` (libdevice without flush-to-zero, as nvcc
    builds torch; route_topk does): all 2^32 bit patterns checked by
    scripts/gpu_check_router.py --parts scores."""
    sp = tl.where(logit > 20.0, logit, libdevice.log1p(libdevice.exp(logit)))
    return tl.sqrt_rn(sp)


@triton.jit
def _router_logits_kernel(
    x_ptr,             # [T, H] bf16, row stride stride_x
    w_ptr,             # [E, H] bf16 / f32, row stride stride_w
    out_ptr,           # [T, E] f32, row stride stride_o
    T, E, stride_x, stride_w, stride_o,
    H: tl.constexpr,   # NOTE: constexpr (a model constant) so the interpreter can run the loop
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
    q_ptr=None, s_ptr=None, p_ptr=None,  # QUANT: act_quant(x) outputs (see _quant_share)
    stride_q=0, stride_s=0, stride_p=0, quant_step=1,
    QUANT: tl.constexpr = False, PAIRS: tl.constexpr = 0, QUANT_ROUNDS: tl.constexpr = 1,
    SOFTWARE: tl.constexpr = False,
    PREWAIT: tl.constexpr = False,  # router.gemv_prewait: the gate rows loaded before the PDL wait
):
    """logits[t, e] = sum_h x[t, h] * W[e, h] on the CUDA cores, fp32 accumulation.

    Every bf16 x bf16 product is exact in fp32, so only the summation order differs from
    the reference (as with cuBLAS). Grid (cdiv(E, BLOCK_E), cdiv(T, BLOCK_T)): for decode
    the gate weight (E x H) is spread over ~E / BLOCK_E programs that each stream
    BLOCK_E rows once, where cuBLAS's split-K GEMV needs a second (reduce) launch.
    QUANT: the programs also quantise x (act_quant, fp32 scales), group g by program
    g mod quant_step (= the grid's first dimension) of the token tile's row of programs.
    PREWAIT (BLOCK_H >= H, the whole-row forms of T <= 2): the program's gate rows - static weights, which
    no kernel of the forward writes - are loaded before pdl_enter's wait, so their DRAM round
    trip overlaps the previous kernel's tail; x and everything after the wait as before."""
    if PREWAIT:
        w_pre = _gate_rows(w_ptr, tl.program_id(0), E, stride_w, H, BLOCK_E, BLOCK_H)
        pdl_enter(PDL)
        _logits_tile(x_ptr, w_ptr, out_ptr, tl.program_id(0), tl.program_id(1), T, E, stride_x, stride_w,
                     stride_o, H, BLOCK_T, BLOCK_E, BLOCK_H, NUM_STAGES, False, True, w_pre)
    else:
        pdl_enter(PDL)
        _logits_tile(x_ptr, w_ptr, out_ptr, tl.program_id(0), tl.program_id(1), T, E, stride_x, stride_w,
                     stride_o, H, BLOCK_T, BLOCK_E, BLOCK_H, NUM_STAGES, False)
    if QUANT:
        _quant_share(x_ptr, q_ptr, s_ptr, p_ptr, tl.program_id(1), T, stride_x, stride_q, stride_s, stride_p,
                     tl.program_id(0), quant_step, 0, (H + 127) // 128, H, BLOCK_T, QUANT_ROUNDS, PAIRS, SOFTWARE)


@triton.jit
def _quant_share(x_ptr, q_ptr, s_ptr, p_ptr, pid_t, T, stride_x, stride_q, stride_s, stride_p,
                 first, step, g0, g1, H: tl.constexpr, BLOCK_T: tl.constexpr, ROUNDS: tl.constexpr,
                 PAIRS: tl.constexpr, SOFTWARE: tl.constexpr):
    """act_quant of token tile pid_t, groups g0 + first + i * step < g1 for i < ROUNDS (the same
    `act_quant_group` body as the act_quant kernel: the same bits). fp32 scales [T, G]
    row-major, so the scale's row stride is stride_s and its group stride 1."""
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    for i in tl.static_range(ROUNDS):
        g = g0 + first + i * step
        if g < g1:
            act_quant_group(x_ptr, q_ptr, s_ptr, p_ptr, rows, g, T, T, H,
                            stride_x, stride_q, stride_s, 1, stride_p, 0, SOFTWARE, PAIRS)


@triton.jit
def _router_logits_mma_kernel(
    x_ptr,             # [T, H] bf16, row stride stride_x
    w_ptr,             # [E, H] bf16, row stride stride_w
    out_ptr,           # [T, E] f32, row stride stride_o
    ws_ptr,            # [SPLITS, T, E] f32 partials (SPLITS > 1)
    cnt_ptr,           # [cdiv(E, BLOCK_E) * cdiv(T, BLOCK_T)] int32 arrival counters, left at 0
    T, E, stride_x, stride_w, stride_o,
    H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER: tl.constexpr, SPLITS: tl.constexpr, SOFTWARE: tl.constexpr,
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
    q_ptr=None, s_ptr=None, p_ptr=None,  # QUANT: act_quant(x) outputs (see _quant_share)
    stride_q=0, stride_s=0, stride_p=0, quant_step=1,
    QUANT: tl.constexpr = False, PAIRS: tl.constexpr = 0, QUANT_ROUNDS: tl.constexpr = 1,
    ARRIVE: tl.constexpr = True,  # False (SPLITS > 1): only the partials; the top-k kernel sums them
):
    """logits[t, e] = sum_h x[t, h] * W[e, h] on the tensor cores (weights x tokens, so a
    [BLOCK_E, BLOCK_T] tile per program and K_PER of H), fp32 accumulation; bf16 x bf16
    products are exact in fp32, so only the summation order differs from the reference (as
    with cuBLAS). Grid (cdiv(E, BLOCK_E), SPLITS, cdiv(T, BLOCK_T)): with SPLITS > 1 each
    program stores its partial and the last one of a tile to arrive (`split_k_arrive`) sums
    the SPLITS partials in split order from +0.0 - deterministic, one launch. ARRIVE=False:
    the partials only (no counter, no fence, no reduction); `_topk_token` (PARTS = SPLITS)
    then makes the same sum itself.
    SOFTWARE (the interpreter, whose bf16 dot is not exact): fp32 operands, IEEE dot.
    QUANT: the programs of each K chunk also quantise x's 128-column groups of that chunk
    (act_quant, fp32 scales), group j of the chunk by gate-row program j mod quant_step (=
    the grid's first dimension)."""
    pdl_enter(PDL)
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    ee = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    tt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    e_ok = ee < E
    t_ok = tt < T
    w_ptrs = w_ptr + tl.where(e_ok, ee, 0).to(tl.int64)[:, None] * stride_w + kk[None, :]
    x_ptrs = x_ptr + tl.where(t_ok, tt, 0).to(tl.int64)[None, :] * stride_x + kk[:, None]
    acc = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
    k0 = pid_s * K_PER
    for k in tl.range(0, K_PER, BLOCK_K):
        k_ok = (k0 + k + kk) < H
        w = tl.load(w_ptrs + (k0 + k), mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs + (k0 + k), mask=k_ok[:, None] & t_ok[None, :], other=0.0)
        if SOFTWARE:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    o_off = tt.to(tl.int64)[None, :] * stride_o + ee[:, None]
    ok = e_ok[:, None] & t_ok[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + o_off, acc, mask=ok)
    else:
        w_off = tt.to(tl.int64)[None, :] * E + ee[:, None]
        tl.store(ws_ptr + pid_s * T * E + w_off, acc, mask=ok)
        if ARRIVE:  # (nested, not `and`: the arrival must not be emitted without it)
            tile = pid_t * tl.num_programs(0) + pid_e
            if split_k_arrive(cnt_ptr + tile, SPLITS):
                tot = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    tot += tl.load(ws_ptr + s * T * E + w_off, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + o_off, tot, mask=ok)
                split_k_reset(cnt_ptr + tile)
    if QUANT:
        _quant_share(x_ptr, q_ptr, s_ptr, p_ptr, pid_t, T, stride_x, stride_q, stride_s, stride_p,
                     pid_e, quant_step, k0 // 128, tl.minimum(k0 + K_PER, (H + 127) // 128 * 128) // 128, H,
                     BLOCK_T, QUANT_ROUNDS, PAIRS, SOFTWARE)


@triton.jit
def _gate_rows(w_ptr, pid_e, E, stride_w, H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """The raw [BLOCK_E, BLOCK_H] gate rows of program pid_e (0 past E and past H): the one load
    of the whole-row forms (BLOCK_H >= H), as `_logits_tile` issues it."""
    ee = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    hh = tl.arange(0, BLOCK_H)
    w_ptrs = w_ptr + tl.where(ee < E, ee, 0).to(tl.int64)[:, None] * stride_w + hh[None, :]
    return tl.load(w_ptrs, mask=(hh < H)[None, :], other=0.0)


@triton.jit
def _logits_tile(x_ptr, w_ptr, out_ptr, pid_e, pid_t, T, E, stride_x, stride_w, stride_o,
                 H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                 NUM_STAGES: tl.constexpr, SCORES: tl.constexpr,
                 W_GIVEN: tl.constexpr = False, w_given=0):
    """One [BLOCK_T, BLOCK_E] tile of the logits (the GEMV's program body; also run by
    `_route_front_kernel`, so both give the same bits for the same block shape and warps).
    SCORES: store sqrt(softplus(logit)) instead (GPU only; the same function the top-k kernel
    applies to the logits it loads, so the same bits).
    W_GIVEN (BLOCK_H >= H): `w_given` is `_gate_rows`'s load, made by the caller (before its PDL
    wait); the same values, the same arithmetic."""
    tt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    ee = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    hh = tl.arange(0, BLOCK_H)
    t_ok = tt < T
    e_ok = ee < E
    w_ptrs = w_ptr + tl.where(e_ok, ee, 0).to(tl.int64)[:, None] * stride_w + hh[None, :]
    if W_GIVEN:  # the one step of the loop below (BLOCK_H >= H), its weight load made already
        x_ptrs = x_ptr + tl.where(t_ok, tt, 0).to(tl.int64)[:, None] * stride_x + hh[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        x = tl.load(x_ptrs, mask=(hh < H)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w_given.to(tl.float32)[None, :, :], axis=2)
        if SCORES:
            acc = _sqrt_softplus(acc)
        o_ptrs = out_ptr + tt.to(tl.int64)[:, None] * stride_o + ee[None, :]
        tl.store(o_ptrs, acc, mask=t_ok[:, None] & e_ok[None, :])
    else:  # NOTE: if / else, not an early return (Triton compiles the code after a return too)
        x_ptrs = x_ptr + tl.where(t_ok, tt, 0).to(tl.int64)[:, None] * stride_x + hh[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for h0 in tl.range(0, H, BLOCK_H, num_stages=NUM_STAGES):
            h_ok = (h0 + hh) < H
            x = tl.load(x_ptrs + h0, mask=h_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + h0, mask=h_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if SCORES:
            acc = _sqrt_softplus(acc)
        o_ptrs = out_ptr + tt.to(tl.int64)[:, None] * stride_o + ee[None, :]
        tl.store(o_ptrs, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _route_topk_kernel(
    scores_ptr,        # [T, E] f32, row stride stride_s: scores, or logits when APPLY_SCORES
    bias_ptr,          # [E] f32 (HAS_BIAS)
    tid2eid_ptr,       # [vocab, TOP_K] int (HASH), row stride stride_tab
    input_ids_ptr,     # [T] int (HASH)
    out_w_ptr,         # [T, TOP_K] f32
    out_ids_ptr,       # [T, TOP_K] int32
    E, stride_s, stride_tab,
    scale,             # routed_scaling_factor, fp32
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
    APPLY_SCORES: tl.constexpr = False,  # GPU only: read logits, apply _sqrt_softplus here
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
    PACKED: tl.constexpr = False,  # one packed (score, index) max per round (_topk_token)
    PARTS: tl.constexpr = 1,  # > 1: scores_ptr holds PARTS logit partials [PARTS, T, E] (_topk_token)
    part_stride=0,            # elements between two partials (T * E)
    # ALIGN (one token, no hash table): the same program also writes moe_align's alignment of its
    # k routes (_align_one_token); the pointers and sizes below are moe_align's (MoeAlignment)
    route_rows_ptr=None, expert_counts_ptr=None, expert_offsets_ptr=None, num_blocks_ptr=None,
    sorted_ids_ptr=None, block_expert_ptr=None, row_expert_ptr=None, row_weight_ptr=None,
    first_expert=0, num_local=1, max_blocks=1,
    ALIGN: tl.constexpr = False, BLOCK_M: tl.constexpr = 16, ROWS_PAD: tl.constexpr = 16,
    MB_PAD: tl.constexpr = 2, EL_PAD: tl.constexpr = 2,
):
    pdl_enter(PDL)
    sel_ids, w, rank, below, n_low, n_local = _topk_token(
        scores_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, out_w_ptr, out_ids_ptr,
        tl.program_id(0).to(tl.int64), E, stride_s, stride_tab, scale,
        TOP_K, K_PAD, E_PAD, HAS_BIAS, HASH, APPLY_SCORES, PACKED, PARTS, part_stride,
        ALIGN, EL_PAD, first_expert, num_local)
    if ALIGN:
        _align_one_token(sel_ids, w, rank, below, n_low, n_local,
                         route_rows_ptr, expert_counts_ptr, expert_offsets_ptr, num_blocks_ptr,
                         sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                         first_expert, num_local, max_blocks, TOP_K, K_PAD, BLOCK_M, ROWS_PAD, MB_PAD, EL_PAD)


@triton.jit
def _align_count_pick(e, below, n_low, n_local, first_expert, num_local, EL_PAD: tl.constexpr):
    """One selection round's pick e (a scalar) into the alignment's counts: per local expert ex
    the local picks below it (`below`, the expert offsets / BLOCK_M), and the picks below the
    local range (`n_low`) and in it (`n_local`)."""
    ex = tl.arange(0, EL_PAD)
    le = e - first_expert
    is_local = (le >= 0) & (le < num_local)
    below += ((le < ex) & is_local).to(tl.int32)
    return below, n_low + (le < 0).to(tl.int32), n_local + is_local.to(tl.int32)


@triton.jit
def _align_one_token(sel_ids, w, rank, below, n_low, n_local,
                     route_rows_ptr, expert_counts_ptr, expert_offsets_ptr, num_blocks_ptr,
                     sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                     first_expert, num_local, max_blocks,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_PAD: tl.constexpr,
                     MB_PAD: tl.constexpr, EL_PAD: tl.constexpr):
    """moe_align of one token's k routes, from the top-k's registers: the k ids are distinct (no
    hash table), so each local expert holds one route and one BLOCK_M-row block, and the blocks run
    in ascending id. The rounds counted, per local expert, the local picks below it, and the picks
    below the local range (n_low) and in it (n_local = the valid blocks). Slot j's route id is its
    rank (the outputs are stored ascending) and, when local, its block is rank - n_low. Every
    output entry gets moe_align's value (tests/test_kernels_router.py compares them): the k slots
    are stored where they land and the fills everywhere else - disjoint address sets, so no
    barrier orders them - except the histogram, zeroed and then (after a CTA barrier, which orders
    the program's global writes) set to 1 at the local picks.
    NOTE (session 48, scripts/sass_route_topk.py, sm_90a, 4 warps, E 384, k 6): the top-k alone is
    1208 SASS instructions per thread with 24 CTA barriers; with this alignment 1424 and 25. The
    first form ([E, k] compare-sums after the rounds) took 2200 and 46; the histogram counted in
    the rounds as the offsets are, 1520 and 24."""
    kk = tl.arange(0, K_PAD)
    valid = kk < TOP_K
    le = sel_ids - first_expert
    local = valid & (le >= 0) & (le < num_local)
    pos = rank - n_low
    tl.store(num_blocks_ptr, n_local)
    tl.store(route_rows_ptr + rank, tl.where(local, pos * BLOCK_M, -1), mask=valid)
    tl.store(block_expert_ptr + pos, le, mask=local)
    mb = tl.arange(0, MB_PAD)
    tl.store(block_expert_ptr + mb, tl.full([MB_PAD], -1, tl.int32), mask=(mb >= n_local) & (mb < max_blocks))
    tl.store(sorted_ids_ptr + pos * BLOCK_M, rank, mask=local)
    tl.store(row_expert_ptr + pos * BLOCK_M, le, mask=local)
    row = tl.arange(0, ROWS_PAD)
    fill = (row < max_blocks * BLOCK_M) & (((row % BLOCK_M) != 0) | (row // BLOCK_M >= n_local))
    tl.store(sorted_ids_ptr + row, tl.full([ROWS_PAD], TOP_K, tl.int32), mask=fill)
    tl.store(row_expert_ptr + row, tl.full([ROWS_PAD], -1, tl.int32), mask=fill)
    if row_weight_ptr is not None:
        tl.store(row_weight_ptr + pos * BLOCK_M, w, mask=local)
        tl.store(row_weight_ptr + row, tl.zeros([ROWS_PAD], tl.float32), mask=fill)
    ex = tl.arange(0, EL_PAD)
    tl.store(expert_offsets_ptr + ex, below * BLOCK_M, mask=ex <= num_local)
    tl.store(expert_counts_ptr + ex, tl.zeros([EL_PAD], tl.int32), mask=ex < num_local)
    tl.debug_barrier()   # orders the zeros before the ones (CTA barriers order a program's global writes)
    tl.store(expert_counts_ptr + le, tl.full([K_PAD], 1, tl.int32), mask=local)


@triton.jit
def _topk_token(scores_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, out_w_ptr, out_ids_ptr,
                t, E, stride_s, stride_tab, scale,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                HAS_BIAS: tl.constexpr, HASH: tl.constexpr, APPLY_SCORES: tl.constexpr,
                PACKED: tl.constexpr = False, PARTS: tl.constexpr = 1, part_stride=0,
                ALIGN: tl.constexpr = False, EL_PAD: tl.constexpr = 2, first_expert=0, num_local=1):
    """Route token t (the top-k program's body; `_topk_tokens` is its all-tokens-at-once
    twin). PARTS > 1: the logits are the split-K partials of `_router_logits_mma_kernel`
    (ARRIVE=False), summed here in split order from +0.0 - the sum that kernel's last
    program makes, so the same logits bit for bit. Selection, gather and the renormalisation are exact selects and a fixed
    left-to-right sum, so the result does not depend on the program's warps.

    PACKED: each round is one int64 max over keys (order-preserving bits of the biased
    score) << 32 | (E_PAD - 1 - index), which yields the largest score and, among exact
    ties, the lowest index - the same pick as max + lowest-index min - and the unbiased
    scores of the k picks are gathered once after the rounds (the same one-element
    select-sums), so the same bits with one block-wide reduction per round instead of
    three. The biased score gets + 0.0 first so that -0.0 and +0.0 tie, as they compare
    equal in the unpacked rounds.

    Returns (ids, weights, rank) of the k slots in selection order, rank being each slot's place in
    the stored (ascending-id) order, and (ALIGN, no hash table) each round's pick counted by
    `_align_count_pick`, from which `_align_one_token` aligns."""
    col = tl.arange(0, E_PAD)
    in_range = col < E
    if PARTS == 1:
        scores = tl.load(scores_ptr + t * stride_s + col, mask=in_range, other=0.0)
    else:
        scores = tl.zeros([E_PAD], dtype=tl.float32)
        for p in tl.static_range(PARTS):
            scores += tl.load(scores_ptr + p * part_stride + t * stride_s + col, mask=in_range, other=0.0)
    if APPLY_SCORES:
        scores = _sqrt_softplus(scores)
    kk = tl.arange(0, K_PAD)
    sel_ids = tl.full([K_PAD], 0, tl.int32)
    sel_w = tl.zeros([K_PAD], tl.float32)
    below = tl.zeros([EL_PAD], tl.int32)
    n_low = 0
    n_local = 0
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
        if PACKED:
            bits = (biased + 0.0).to(tl.int32, bitcast=True)
            ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order = float order
            key = (ordered.to(tl.int64) << 32) | (E_PAD - 1 - col).to(tl.int64)
            for j in tl.static_range(TOP_K):
                kmax = tl.max(key, axis=0)
                e = (E_PAD - 1 - (kmax & 0xFFFFFFFF)).to(tl.int32)
                sel_ids = tl.where(kk == j, e, sel_ids)
                key = tl.where(col == e, -9223372036854775807 - 1, key)
                if ALIGN:
                    below, n_low, n_local = _align_count_pick(e, below, n_low, n_local, first_expert, num_local,
                                                              EL_PAD)
            valid_k = kk < TOP_K
            sel_w = tl.sum(tl.where((col[None, :] == sel_ids[:, None]) & valid_k[:, None], scores[None, :], 0.0),
                           axis=1)  # the unbiased scores
        else:
            for j in tl.static_range(TOP_K):
                m = tl.max(biased, axis=0)
                e = tl.min(tl.where(biased == m, col, E_PAD), axis=0)
                hit = col == e
                s = tl.sum(tl.where(hit, scores, 0.0), axis=0)  # the unbiased score
                sel_ids = tl.where(kk == j, e, sel_ids)
                sel_w = tl.where(kk == j, s, sel_w)
                biased = tl.where(hit, float("-inf"), biased)
                if ALIGN:
                    below, n_low, n_local = _align_count_pick(e, below, n_low, n_local, first_expert, num_local,
                                                              EL_PAD)
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
    # div_rn: IEEE division, torch's `/` (Triton's default fp32 `/` is div.full.f32, up to 2 ulp off)
    w = tl.math.div_rn(sel_w, wsum) * scale
    tl.store(out_ids_ptr + t * TOP_K + rank, sel_ids, mask=valid)
    tl.store(out_w_ptr + t * TOP_K + rank, w, mask=valid)
    return sel_ids, w, rank, below, n_low, n_local


@triton.jit
def _topk_tokens(scores_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, out_w_ptr, out_ids_ptr,
                 T, E, stride_s, stride_tab, scale,
                 TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, T_PAD: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HASH: tl.constexpr, APPLY_SCORES: tl.constexpr):
    """`_topk_token` for all T <= T_PAD tokens at once, one row each: every step is the same
    exact operation per row (max, lowest index holding it, a select-sum of one element, the
    rank compare, the same left-to-right renormalisation sum and divide), so each row is
    bitwise `_topk_token`'s result, in one pass of reductions instead of T. Run by the last
    program of `_route_front_kernel`, reading the other programs' logits through L2."""
    tt = tl.arange(0, T_PAD)
    t_ok = tt < T
    t64 = tl.where(t_ok, tt, 0).to(tl.int64)
    col = tl.arange(0, E_PAD)
    in_range = col < E
    m2 = t_ok[:, None] & in_range[None, :]
    scores = tl.load(scores_ptr + t64[:, None] * stride_s + col[None, :], mask=m2, other=0.0, cache_modifier=".cg")
    if APPLY_SCORES:
        scores = _sqrt_softplus(scores)
    kk = tl.arange(0, K_PAD)
    sel_ids = tl.full([T_PAD, K_PAD], 0, tl.int32)
    sel_w = tl.zeros([T_PAD, K_PAD], tl.float32)
    if HASH:
        tok = tl.load(input_ids_ptr + t64, mask=t_ok, other=0).to(tl.int64)
        for j in tl.static_range(TOP_K):
            e = tl.load(tid2eid_ptr + tok * stride_tab + j, mask=t_ok, other=0).to(tl.int32)
            s = tl.sum(tl.where(col[None, :] == e[:, None], scores, 0.0), axis=1)
            sel_ids = tl.where(kk[None, :] == j, e[:, None], sel_ids)
            sel_w = tl.where(kk[None, :] == j, s[:, None], sel_w)
    else:
        biased = scores
        if HAS_BIAS:
            biased = scores + tl.load(bias_ptr + col, mask=in_range, other=0.0)[None, :]
        biased = tl.where(in_range[None, :], biased, float("-inf"))
        for j in tl.static_range(TOP_K):
            m = tl.max(biased, axis=1)
            e = tl.min(tl.where(biased == m[:, None], col[None, :], E_PAD), axis=1)
            hit = col[None, :] == e[:, None]
            s = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # the unbiased score
            sel_ids = tl.where(kk[None, :] == j, e[:, None], sel_ids)
            sel_w = tl.where(kk[None, :] == j, s[:, None], sel_w)
            biased = tl.where(hit, float("-inf"), biased)
    valid = kk < TOP_K
    a = sel_ids[:, :, None]
    b = sel_ids[:, None, :]
    before = ((b < a) | ((b == a) & (kk[None, None, :] < kk[None, :, None]))) & valid[None, None, :]
    rank = tl.sum(before.to(tl.int32), axis=2)                               # [T_PAD, K_PAD]
    wsum = tl.sum(tl.where((rank == 0) & valid[None, :], sel_w, 0.0), axis=1)
    for r in tl.static_range(1, TOP_K):
        wsum += tl.sum(tl.where((rank == r) & valid[None, :], sel_w, 0.0), axis=1)
    w = tl.math.div_rn(sel_w, wsum[:, None]) * scale
    dst = t64[:, None] * TOP_K + rank
    ok = t_ok[:, None] & valid[None, :]
    tl.store(out_ids_ptr + dst, sel_ids, mask=ok)
    tl.store(out_w_ptr + dst, w, mask=ok)
