"""Router (SPEC §4.1): fp32 logits -> sqrt(softplus) -> biased top-k or hash table ->
unbiased weights renormalised and scaled, ids sorted ascending per token.

    x            [T, H]        bfloat16
    weight       [E, H]        bfloat16 (or float32, pre-converted once by the caller)
    bias         [E]           float32            non-hash layers, else None
    tid2eid      [vocab, k]    int64 / int32      hash layers, else None
    input_ids    [T]           int64 / int32      hash layers, else None; PRECONDITION: every id in
                                                  [0, vocab) - read on the device, not checked here
                                                  (a check would sync the host; DeepseekV4MoE checks
                                                  it in eager forwards)
    ->
    topk_weights [T, k]        float32   w / sum(w) * routed_scaling_factor
    topk_ids     [T, k]        int32     ascending per token (weights permuted with them)

Design (measured with `scripts/gpu_check_router.py`; `gpu_check_routed.py` times the stage):
* logits, fp32 accumulation (bf16 x bf16 products are exact in fp32, so only the
  summation order can differ from `x.float() @ W.float().T`): for T <= GEMV_MAX_T on a
  GPU a Triton GEMV over the gate weight (one launch), up to MMA_MAX_T a Triton
  tensor-core kernel split over H whose partials the top-k kernel sums in order on a GPU
  (MMA_PARTIALS_IN_TOPK; elsewhere, and with it off, the kernel's own ordered reduction in
  the same launch), else one cuBLAS call (`logits_impl` forces any);
* scores `sqrt(softplus(logits))`: on a GPU computed inside the top-k kernel with
  libdevice `log1p`/`exp` and the IEEE square root, bitwise torch's CUDA `softplus` +
  `sqrt` for every fp32 input (exhaustive H200 check in `scripts/gpu_check_router.py`);
  elsewhere (CPU, the Triton interpreter, which has no libdevice) torch's own ops
  (`scores_impl` forces either). Equal scores matter: a 1-ulp difference could flip a
  near-tie in the selection;
* one Triton kernel does selection, gather, renormalisation, scaling and the per-token
  sort.
* at T = 1 on a layer without a hash table the top-k program can also write moe_align's
  alignment of the token's k routes (`align`; TOPK_ALIGN_T1, the layer's rule in
  dsv4_moe.stages.topk_aligns): its ids are distinct, so every local route is its own block, in
  ascending id - the routed stage's alignment launch goes.
At T = 1 that is 2 launches where cuBLAS + softplus + sqrt + top-k took 5 (about 12 us of
kernels on the H200, session-4 profile). Nothing reads device values on the host, so the
whole router can be captured in a CUDA graph.

Hash-table rows must hold ids in [0, E); an out-of-range id would gather a 0 score
(checking it would need a host sync, so it is the loader's job).
"""

from __future__ import annotations

import torch

from dsv4_moe._types import is_int, is_real

__all__ = ["route_topk", "router_logits", "router_logits_gemv", "router_logits_mma", "gemv_blocks", "gemv_prewait",
           "mma_blocks", "logits_path", "logits_fn",
           "GEMV_MAX_T", "GEMV_PREWAIT", "MMA_MAX_T", "MMA_PARTIALS_IN_TOPK", "check_route_args"]

_E_MAX = 4096  # one register vector per token; DeepSeek-V4 has E <= 384
# NOTE: the logits GEMV replaces cuBLAS up to this many tokens. H200, CUDA graphs, gate
# weights rotated over 32 copies (docs/bench/2026-11-29/session5/check_router_239523e.txt),
# whole router in us, cuBLAS + in-kernel scores vs GEMV + in-kernel scores:
#   Flash (E 256, H 4096)  T=1 10.95 vs 7.52, T=2 10.98 vs 7.71, T=4 10.93 vs 8.07,
#                          T=8 11.08 vs 11.17, T=16 11.13 vs 13.09
#   Pro   (E 384, H 7168)  T=1 11.71 vs 9.47, T=2 11.64 vs 9.90, T=4 11.72 vs 11.19,
#                          T=8 11.93 vs 18.98
# (the session-4 router, cuBLAS + torch softplus + sqrt + top-k: 14.2-15.3 us at T <= 4).
GEMV_MAX_T = 4
# NOTE (session 30 built, session 31 measured and removed): a token-loop form of the GEMV for T =
# 3-8 (one whole gate row per program, all its bytes in flight at once, then a loop over the
# program's tokens) gave WRONG layers on the H200 at 8 warps - rel err 0.9 at T = 3 for Pro-TP8 and
# Flash in the layer bench, also with the gate_up's bf16 pairs off, so not session 24's store_pairs
# issue; the interpreter tests and gpu_check_front_pairs (route_front against route_topk, the same
# tile code on both sides) could not see it; cause not found - and at 4 warps it was right but
# slower than this GEMV (layer, graph of forwards, us: Pro-TP8 T=3 59.0 vs 57.5, Flash 106.3 vs
# 105.0; T = 4-8 it was level or 3-4 us slower at 8 warps; docs/bench/2026-11-30/session31/).
# The whole-row GEMV forms (T <= 2, BLOCK_H >= H) load their gate rows before the PDL wait
# (`_router_logits_kernel` PREWAIT): the gate weight is static, so its DRAM round trip overlaps the
# previous kernel's tail (in a graph of forwards, the previous layer's finalize). Same bits.
# H200, session 31 (layer bench, graph of forwards, us, off / on, two runs at Flash): Flash T=1
# 56.7 / 56.1 and 56.7 / 56.4, T=2 74.9 / 74.1 and 74.7 / 74.3; Pro-TP8 T=1 31.3 / 31.1, T=2 41.7 /
# 42.5 (the profile A/B: Flash T=1 55.6 / 54.8, T=2 76.3 / 75.6, Pro-TP8 T=1 32.6 / 32.5, T=2
# 43.2 / 43.4). So on at T = 1 and, up to GEMV_PREWAIT_MAX_H, at T = 2. A/B switch: False = off.
GEMV_PREWAIT = True
GEMV_PREWAIT_MAX_H = 4096
# NOTE (session 26): from GEMV_MAX_T + 1 to MMA_MAX_T tokens the logits come from a Triton
# tensor-core kernel split over H with an in-kernel ordered reduction (`router_logits_mma`,
# one launch) instead of cuBLAS, whose split-K GEMM + reduce took 6.4-7.2 us end to end at T =
# 8-16 inside a graph of forwards (scripts/gpu_timeline_layer.py; Flash and Pro). bf16 gate
# weights only (an fp32 gate goes to cuBLAS). H200 (gpu_check_router.py --parts time, 32
# rotated gate copies in a graph, us, logits only; docs/bench/2026-11-30/session26/), cuBLAS
# against K chunks of 256 / 512 / 1024: Flash T=8 7.04 / 4.47 / 4.55 / 5.70, T=16 7.21 / 4.65 /
# 4.69 / 5.82, T=32 7.24 / 6.01 / 5.54 / 6.63, T=64 7.36 / 8.45 / 7.02 / 7.76; Pro T=8 7.44 /
# 6.46 / 5.49 / 6.28, T=16 7.70 / 6.85 / 5.81 / 6.56, T=32 7.82 / 9.69 / 7.26 / 7.22, T=64 8.20 /
# 12.79 / 9.24 / 9.00. In the layer with chunks of 256 (12 forwards per graph, 3 captures, us,
# kernel / cuBLAS): Flash T=8 207.6 / 209.4, T=16 351.3 / 352.8; Pro T=8 100.3 / 100.1, T=16
# 161.0 / 160.9, T=32 280.8 / 276.4, T=64 392.3 / 385.1; with chunks of 512: Pro T=16 157.0 /
# 159.1, T=32 275.8 / 273.9 (captures 274.7-276.9 / 273.6-276.9). So chunks of 512, to T = 16.
# A/B switch: MMA_MAX_T = 0.
MMA_MAX_T = 16
# The tensor-core logits (T = 5-16) are split over H; their partials used to be summed by each
# tile's last program in the same launch (an arrival counter: a CTA barrier and an acq_rel atomic
# after every program's store, then one program's ordered sum). With MMA_PARTIALS_IN_TOPK the
# launch only stores the partials and the top-k kernel, which reads the logits anyway, sums them
# in the same order (`_topk_token` PARTS): the same logits bit for bit, no fence and no serial sum
# between the two launches. NOTE (session 44, H200, the layer bench, graph-chain, alternating, us,
# on / off; docs/bench/2026-12-01/session44/all_call6_d67574d.log): Pro-TP8 T=5 69.6, 69.6 / 70.4,
# 70.5; T=8 91.3, 90.9 / 91.9, 91.7; T=9 95.7, 96.2 / 96.8, 97.0; T=12 115.3, 115.3 / 116.8, 117.0;
# T=16 135.7, 136.4 / 137.6, 137.4; Flash T=8 196.3 / 197.0. Tried after the same session's split-K
# gate_up with its SwiGLU-quant in its tail (a per-program arrival over ~1300 programs) made the
# layer 4-9 us slower. A/B switch (False: the arrival in the logits launch).
MMA_PARTIALS_IN_TOPK = True
# K chunk per program of router_logits_mma (a multiple of 128): H / MMA_K_PER splits
MMA_K_PER = 512
# gate rows per program of router_logits_mma (a power of two >= 16) and its warps.
# NOTE (session 27, H200, gpu_check_router.py --parts time, 32 rotated gate copies in a graph,
# logits only, us, chunks of 512, 64 / 32 / 16 rows, 4 warps; docs/bench/2026-11-30/session27/):
# Flash T=8 4.65 / 4.48 / 4.43, T=16 4.82 / 4.50 / 4.42; Pro T=8 5.69 / 5.60 / 5.88, T=16 6.05 /
# 5.89 / 6.13 (chunks of 256 or 1024, 8 or 2 warps: no better). So 32 rows (168 programs at Pro).
MMA_BLOCK_E = 32
MMA_NUM_WARPS = 4
# NOTE (session 45, d6f6a8e, measured and removed in the next commit): the loop's K step is 128, so a
# chunk of 512 is four steps of which Triton's 3-stage pipeline has two in flight (offline sm_90a SASS:
# two cp.async groups before the first MMA). A step of 256 puts the whole chunk in flight before the
# first MMA (72 registers, same MMA chain: the logits, the partials and route_topk's outputs equal bit for
# bit natively at T = 5, 9, 16). The layer did not move (H200, layer bench --graph-chain, alternating,
# us, 128 / 256; docs/bench/2026-12-01/session45/all_call1_d6f6a8e.log): Pro-TP8 T=5 70.3, 70.3 / 70.3,
# 70.2; T=8 92.1, 91.5 / 91.7, 92.1; T=9 96.5, 96.1 / 96.4, 96.4; T=12 116.6, 116.0 / 116.9, 116.3; T=16
# 136.0, 135.9 / 137.2, 136.5; Flash T=5 138.0, 137.3 / 136.8, 137.1; T=16 331.1, 330.4 / 329.1, 329.6.
# The timeline at T = 9 has the launch at 5.38 / 5.41 us either way: its time is not the K loop's round
# trips. A step of 512 (one dot) compiles to serialised 16-byte loads and no cp.async (offline).
# act_quant(x) inside the logits launch (route_topk's `act_quant`; the decode front's
# "quant_in_logits" path) where the logits are the Triton GEMV / tensor-core kernel. A/B
# switch (False: the separate act_quant launch).
QUANT_IN_LOGITS = True
# The top-k kernel's launch: warps per token program (0: 4 for E > 256, else 2) and the packed
# selection (one int64 max per round instead of max + min + sum, _router._topk_token) up to
# TOPK_PACKED_MAX_T tokens; same bits either way. A/B switches. NOTE (session 25, H200,
# gpu_check_router.py --parts topk, docs/bench/2026-11-30/session25/, route_topk (GEMV or cuBLAS
# logits + top-k) in a graph of 32 calls on rotated gate weights, us per call, default ->
# packed): Flash T=1 5.68 -> 5.08, T=4 6.68 -> 6.08, T=16 10.08 -> 9.49, T=256 11.10 -> 10.60,
# T=1024 14.74 -> 14.68; Pro T=1 7.49 -> 6.68, T=4 9.88 -> 9.07, T=16 11.06 -> 10.26, T=256 12.64
# -> 12.01, T=1024 21.88 -> 22.42; ids and weights bitwise at every T. One warp: slower on Pro
# (T=1 7.64). Layer bench (one run each, us, default -> packed): Pro-TP8 T=1 45.4 / 45.8 ->
# 45.1, T=4 82.5 / 82.3 -> 81.7, T=8 125.9 / 125.9 -> 124.8, T=16 166.9 / 166.2 -> 165.2; Flash
# T=1 66.4 -> 65.8, T=2 94.3 -> 93.4, T=4 137.9 -> 138.7.
TOPK_WARPS = 0
TOPK_PACKED = True
TOPK_PACKED_MAX_T = 256
# NOTE (session 47, 55b1d31, measured and reverted): the packed picks carried as scalars - each round a
# tuple `tl.reduce` of (key, unbiased score), then the rank among the picks and the ascending-id
# renormalisation sum in scalar code, so no reduction, layout conversion or CTA barrier after the rounds.
# The same bits (tests/test_kernels_router.py natively, 56 passed), 17 CTA barriers against 24, but 1504
# SASS instructions per thread against 1392 at T = 5-16 (the score riding in every round's shuffles and
# shared-memory pass; scripts/sass_route_topk.py), and the layer slower everywhere (H200, graph-chain,
# alternating, us, scalar / vector; docs/bench/2026-12-02/session47/all_call5_55b1d31.log): Pro-TP8 T=1
# 31.7, 31.7 / 31.3, 31.3; T=9 97.6, 97.5 / 96.1, 96.3; T=16 137.4, 138.4 / 136.3, 135.6; Flash T=1 55.6 /
# 55.4, T=8 197.2 / 195.6. At one CTA per SM this kernel's time follows its instruction count (ncu, session
# 47: ~4.8 cycles per issued instruction), not its barriers.
# At T = 1 (no hash table) the layer's decode front can have the top-k program write the routed alignment
# (route_topk's `align`, _router._align_one_token), so the alignment launch between the top-k and the
# routed gate_up goes; dsv4_moe.stages.topk_aligns decides where (measured: ~1.1 us faster at Flash T = 1,
# ~2.9 at Pro-TP1, ~0.5 slower at Pro-TP8; its NOTE). A/B switch (False: never; moe_align's launch).
TOPK_ALIGN_T1 = True
_LOGITS_IMPLS = ("auto", "gemv", "mma", "mm")
_SCORES_IMPLS = ("auto", "kernel", "torch")
_MM_OUT_DTYPE_OK: dict[str, bool] = {}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_logits_args(fn: str, x, weight) -> None:
    """x [T, H] bf16 and weight [E, H] bf16 / float32 on x's device, for the three logits paths
    (the Triton ones read H from x: a narrower weight would be read past its rows)."""
    _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == torch.bfloat16,
           f"{fn}: x: expected a [T, H] bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)} "
           f"shape {tuple(getattr(x, 'shape', ()))}")
    _check(isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == x.shape[1]
           and weight.dtype in (torch.bfloat16, torch.float32),
           f"{fn}: weight: expected [E, H={x.shape[1]}] bfloat16/float32, got "
           f"{getattr(weight, 'dtype', type(weight).__name__)} shape {tuple(getattr(weight, 'shape', ()))}")
    _check(weight.device == x.device, f"{fn}: weight is on {weight.device}, x on {x.device}")


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, H] bf16 @ [E, H]^T -> [T, E] float32 with fp32 accumulation.

    A float32 `weight` is used as is; a bf16 one goes through `torch.mm(...,
    out_dtype=float32)` on CUDA (no fp32 copy of the gate weight per call), falling
    back to `x.float() @ weight.float().T` where that overload is missing.
    """
    _check_logits_args("router_logits", x, weight)
    if weight.dtype == torch.float32:
        return x.float() @ weight.t()
    if x.is_cuda:
        key = str(x.device)
        if _MM_OUT_DTYPE_OK.get(key, True):
            try:
                out = torch.mm(x, weight.t(), out_dtype=torch.float32)
                _MM_OUT_DTYPE_OK[key] = True
                return out
            except (RuntimeError, TypeError):
                _MM_OUT_DTYPE_OK[key] = False  # NOTE: decided on the first (eager) call
    return x.float() @ weight.float().t()


def gemv_prewait(t: int, h: int, block_h: int) -> bool:
    """Whether the logits GEMV loads its gate rows before its PDL wait (GEMV_PREWAIT): only in
    the whole-row forms (block_h >= h, where that load is the only one), at T = 1 and, for
    hidden sizes up to GEMV_PREWAIT_MAX_H, at T = 2 (see the note above GEMV_PREWAIT)."""
    return bool(GEMV_PREWAIT) and block_h >= h and (t == 1 or h <= GEMV_PREWAIT_MAX_H)


def gemv_blocks(t: int, h: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_H, num_warps) of the logits GEMV for T tokens (hidden size h):
    1-2 gate rows per program (128-384 programs for E = 256-384), up to 8 tokens per program,
    and the [BLOCK_T, BLOCK_E, BLOCK_H] product at <= 64 fp32 per thread. For T <= 2 (with
    h given, up to 8192) a program takes its whole gate row in one step, so all its loads are
    in flight at once."""
    bt = min(8, 1 << max(0, t - 1).bit_length())
    if h is not None and t <= 2 and h <= 8192:
        # NOTE: H200, session 10 (gpu_check_router.py --parts time, 32 rotated gate copies,
        # docs/bench/2026-11-29/session10/check_router_time_8359f1f.txt), us, BLOCK_H 1024 ->
        # whole row: Pro T=1 4.49 -> 3.96 (4 warps), T=2 4.99 -> 4.37 (8 warps); Flash T=1
        # 2.87 -> 2.67, T=2 3.14 -> 2.96. At T = 4 the whole row exceeds 64 fp32 per thread
        # (Flash T=4 with 8 warps: 3.45 vs 3.51, not taken).
        warps = 4 if t == 1 else 8
        return bt, 1, max(64, 1 << (h - 1).bit_length()), warps
    be = 1 if t == 1 else 2  # NOTE: T=1 Flash 3.71 -> 3.54 us, Pro 5.23 -> 5.11 with one gate row
    bh = max(64, min(1024, 8192 // (bt * be)))
    return bt, be, bh, 4


def _quant_args(quant, programs: int, groups: int) -> dict:
    """The logits kernels' act_quant arguments for `quant` = (q_u8, s, pairs, pairs_code) or None:
    `groups` 128-column groups per row of `programs` programs (the grid's first dimension)."""
    if quant is None:
        return {}
    q_u8, s, p, code = quant
    return dict(q_ptr=q_u8, s_ptr=s, p_ptr=p if p is not None else q_u8, stride_q=q_u8.stride(0),
                stride_s=s.stride(0), stride_p=p.stride(0) if p is not None else 0, quant_step=programs,
                QUANT=True, PAIRS=code, QUANT_ROUNDS=-(-groups // programs))


def router_logits_gemv(x: torch.Tensor, weight: torch.Tensor,
                       blocks: tuple[int, int, int, int] | None = None, quant=None) -> torch.Tensor:
    """[T, H] bf16 @ [E, H]^T -> [T, E] float32 by the Triton GEMV (`_router_logits_kernel`);
    `blocks` overrides `gemv_blocks(T)` (probes). `quant` (q_u8, s, pairs, pairs_code): the
    same launch also writes act_quant(x) there (route_topk's `act_quant`)."""
    import triton  # noqa: PLC0415

    from ._router import _router_logits_kernel
    from ._triton_utils import interpreting, pdl_options
    _check_logits_args("router_logits_gemv", x, weight)
    t, h = x.shape
    e = weight.shape[0]
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    bt, be, bh, warps = blocks or gemv_blocks(t, h)
    x = x.contiguous()
    weight = weight.contiguous()
    pdl = pdl_options(x.device)
    _router_logits_kernel[(triton.cdiv(e, be), triton.cdiv(t, bt))](
        x, weight, out, t, e, x.stride(0), weight.stride(0), out.stride(0),
        H=h, BLOCK_T=bt, BLOCK_E=be, BLOCK_H=bh, NUM_STAGES=3, num_warps=warps,
        PREWAIT=gemv_prewait(t, h, bh), **pdl,
        **_quant_args(quant, triton.cdiv(e, be), triton.cdiv(h, 128)), SOFTWARE=interpreting())
    return out


def mma_blocks(t: int, e: int, h: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_E, BLOCK_T, BLOCK_K, K_PER, SPLITS) of router_logits_mma for T tokens, E
    experts, hidden size H: MMA_BLOCK_E gate rows x up to 64 tokens per tile (the tokens are
    the MMA's N, padded to 16), H in chunks of MMA_K_PER (E = 384, H = 7168, 64 rows: 6 x 14
    programs)."""
    bt = min(64, max(16, 1 << max(0, t - 1).bit_length()))
    k_per = min(MMA_K_PER, -(-h // 128) * 128)
    return MMA_BLOCK_E, bt, 128, k_per, -(-h // k_per)


def router_logits_mma(x: torch.Tensor, weight: torch.Tensor,
                      blocks: tuple[int, int, int, int, int] | None = None,
                      num_warps: int | None = None, quant=None, reduce: bool = True) -> torch.Tensor:
    """[T, H] bf16 @ [E, H]^T (bf16) -> [T, E] float32 by the Triton tensor-core kernel
    (`_router_logits_mma_kernel`, one launch); `blocks` overrides `mma_blocks` and
    `num_warps` MMA_NUM_WARPS (probes); `quant` as in router_logits_gemv.

    reduce=False: the split-K partials [P, T, E] instead (P = the splits over H; [1, T, E], the
    logits, when H is not split): logits = +0.0 + partials[0] + ... + partials[P-1] in fp32,
    the sum the kernel's last program would make - left to the top-k kernel (PARTS)."""
    import triton  # noqa: PLC0415

    from ._router import _router_logits_mma_kernel
    from ._triton_utils import interpreting, pdl_options
    from .split_k import tile_counters
    _check_logits_args("router_logits_mma", x, weight)
    t, h = x.shape
    e = weight.shape[0]
    _check(weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16,
           f"router_logits_mma: x and weight must be bfloat16, got {x.dtype} / {weight.dtype}")
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if t == 0:
        return out if reduce else out.view(1, t, e)
    be, bt, bk, k_per, splits = blocks or mma_blocks(t, e, h)
    _check(k_per % bk == 0 and splits * k_per >= h,
           f"router_logits_mma: blocks={blocks!r}: K_PER must be a multiple of BLOCK_K and cover H={h}")
    grid = (triton.cdiv(e, be), splits, triton.cdiv(t, bt))
    ws = torch.empty((splits, t, e) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    cnt = tile_counters(x.device, grid[0] * grid[2])
    x = x.contiguous()
    weight = weight.contiguous()
    _router_logits_mma_kernel[grid](
        x, weight, out, ws, cnt, t, e, x.stride(0), weight.stride(0), out.stride(0),
        H=h, BLOCK_E=be, BLOCK_T=bt, BLOCK_K=bk, K_PER=k_per, SPLITS=splits, SOFTWARE=interpreting(),
        num_warps=num_warps or MMA_NUM_WARPS, **pdl_options(x.device),
        **_quant_args(quant, grid[0], k_per // 128), ARRIVE=reduce)
    if reduce:
        return out
    return ws if splits > 1 else out.view(1, t, e)


def logits_path(t: int, weight_dtype: torch.dtype, logits_impl: str = "auto", cuda: bool = True) -> str:
    """Which logits route_topk takes for T tokens and a gate weight of this dtype: "gemv",
    "mma" or "mm" (cuBLAS / torch)."""
    auto = logits_impl == "auto" and cuda
    if logits_impl == "gemv" or (auto and t <= GEMV_MAX_T):
        return "gemv"
    if logits_impl == "mma" or (auto and t <= MMA_MAX_T and weight_dtype == torch.bfloat16):
        return "mma"
    return "mm"


def logits_fn(path: str):
    """The logits function of a `logits_path` result ("gemv", "mma" or "mm")."""
    fns = {"gemv": router_logits_gemv, "mma": router_logits_mma, "mm": router_logits}
    _check(path in fns, f"path={path!r}: expected one of {tuple(fns)}")
    return fns[path]


def check_route_args(x, weight, bias, tid2eid, input_ids, top_k, routed_scaling_factor):
    """Validate route_topk's (and route_front's) router arguments; -> (T, H, E, hashed)."""
    _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == torch.bfloat16,
           f"x: expected a [T, H] bfloat16 tensor, got {getattr(x, 'dtype', type(x))} "
           f"shape {tuple(getattr(x, 'shape', ()))}")
    t, h = x.shape
    _check(isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == h
           and weight.dtype in (torch.bfloat16, torch.float32),
           f"weight: expected [E, {h}] bfloat16/float32, got {getattr(weight, 'dtype', type(weight).__name__)} "
           f"shape {tuple(getattr(weight, 'shape', ()))}")
    e = weight.shape[0]
    _check(e <= _E_MAX, f"weight: E={e} experts exceeds the kernel's limit {_E_MAX}")
    _check(is_int(top_k) and 1 <= top_k <= e,
           f"top_k={top_k!r}: expected an int in [1, E={e}]")
    _check(is_real(routed_scaling_factor)
           and 0 < routed_scaling_factor < float("inf"),
           f"routed_scaling_factor={routed_scaling_factor!r}: expected a finite number > 0")
    for name, ten in (("bias", bias), ("tid2eid", tid2eid), ("input_ids", input_ids)):
        _check(ten is None or isinstance(ten, torch.Tensor),
               f"{name}: expected a torch.Tensor or None, got {type(ten).__name__}")
    hashed = tid2eid is not None
    if hashed:
        _check(bias is None, "bias: hash layers have no selection bias; expected None with tid2eid")
        _check(tid2eid.dim() == 2 and tid2eid.shape[1] == top_k
               and tid2eid.dtype in (torch.int64, torch.int32),
               f"tid2eid: expected [vocab, {top_k}] int64/int32, got {tid2eid.dtype} shape {tuple(tid2eid.shape)}")
        _check(input_ids is not None and input_ids.shape == (t,)
               and input_ids.dtype in (torch.int64, torch.int32),
               f"input_ids: hash routing needs [T={t}] int64/int32 token ids, got "
               f"{None if input_ids is None else (input_ids.dtype, tuple(input_ids.shape))}")
    elif bias is not None:
        _check(bias.shape == (e,) and bias.dtype == torch.float32,
               f"bias: expected [{e}] float32, got {bias.dtype} shape {tuple(bias.shape)}")
    for name, ten in (("weight", weight), ("bias", bias), ("tid2eid", tid2eid), ("input_ids", input_ids)):
        if ten is not None:
            _check(ten.device == x.device, f"{name}: on {ten.device}, expected x's device {x.device}")
    return t, h, e, hashed


def route_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None,
               top_k: int, routed_scaling_factor: float, *, logits_impl: str = "auto",
               scores_impl: str = "auto", act_quant: "bool | str | None" = None,
               after_logits=None, align: "tuple[int, int, int] | None" = None) -> tuple:
    """Route T tokens to top_k of E experts; see the module docstring for layouts.

    logits_impl: "auto" | "gemv" (Triton GEMV) | "mma" (Triton tensor-core kernel, bf16 weight)
    | "mm" (cuBLAS / torch); scores_impl:
    "auto" | "kernel" (in the top-k kernel, GPU only) | "torch".
    act_quant: None, or the `pairs` argument of `act_quant` (False, True, "scaled"): the
    logits launch also quantises x (fp32 scales; bitwise `act_quant(x, pairs=...)`, the same
    Triton body) and the call returns (topk_weights, topk_ids, q, sa[, pairs]). Needs the
    Triton logits (`logits_path` "gemv" or "mma"), else ValueError.
    after_logits: None, or a callable run between the logits launch and the top-k launch with
    act_quant's outputs (q, sa[, pairs]) - e.g. to fork work that needs only the quantised x
    onto another stream before the top-k is enqueued. Needs act_quant.
    align: None, or (num_local, first_expert, block_m): the top-k program also writes
    `moe_align(topk_ids, num_local, first_expert, block_m, topk_weights)` - the same MoeAlignment,
    entry for entry - and the call returns it last. One token (T = 1) and no hash table only
    (ValueError otherwise): the k ids are then distinct, each local one its own block."""
    from ._triton_utils import interpreting  # noqa: PLC0415

    _check(logits_impl in _LOGITS_IMPLS, f"logits_impl={logits_impl!r}: expected one of {_LOGITS_IMPLS}")
    _check(scores_impl in _SCORES_IMPLS, f"scores_impl={scores_impl!r}: expected one of {_SCORES_IMPLS}")
    t, h, e, hashed = check_route_args(x, weight, bias, tid2eid, input_ids, top_k, routed_scaling_factor)
    aligned = None
    if align is not None:
        from .moe_align import check_align_args, new_alignment  # noqa: PLC0415

        _check(isinstance(align, tuple) and len(align) == 3,
               f"align={align!r}: expected None or a tuple (num_local, first_expert, block_m)")
        check_align_args(*align)
        _check(t == 1, f"align={align!r}: the top-k aligns one token's routes only, x has T={t} tokens "
                       f"(moe_align aligns any T)")
        _check(not hashed, f"align={align!r}: not for a hash-routed layer (a table row may repeat an id)")
        aligned = new_alignment(top_k, top_k, align[0], align[2], x.device)

    on_gpu = x.is_cuda and not interpreting()
    _check(scores_impl != "kernel" or on_gpu,
           f"scores_impl='kernel' needs a CUDA tensor outside the Triton interpreter (libdevice); "
           f"x is on {x.device}, interpreting={interpreting()}")
    out_w = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    out_ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    quant, extra = None, ()
    if act_quant is not None:
        from .act_quant import check_pairs_out, pairs_scaled  # noqa: PLC0415

        scaled = pairs_scaled(act_quant, "route_topk")
        q = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=x.device)
        sa = torch.empty((t, -(-h // 128)), dtype=torch.float32, device=x.device)
        p = check_pairs_out(None, t, h, x.device, "route_topk") if act_quant else None
        quant = (q.view(torch.uint8), sa, p, 0 if p is None else 2 if scaled else 1)
        extra = (q, sa) + ((p,) if act_quant else ())
    if t == 0:
        return (out_w, out_ids) + extra
    path = logits_path(t, weight.dtype, logits_impl, x.is_cuda)
    _check(quant is None or path != "mm",
           f"act_quant={act_quant!r}: x is quantised inside the Triton logits launch, but logits_impl="
           f"{logits_impl!r} takes cuBLAS / torch here (T={t}, weight {weight.dtype}, {x.device}); see logits_path")
    apply_scores = scores_impl == "kernel" or (scores_impl == "auto" and on_gpu)
    # the tensor-core logits' split-K partials go to the top-k kernel unreduced (it sums them)
    # where the scores are made there (MMA_PARTIALS_IN_TOPK; see the note above it)
    in_topk = path == "mma" and apply_scores and MMA_PARTIALS_IN_TOPK
    if path == "mm":
        logits = logits_fn(path)(x, weight)
    elif in_topk:
        logits = router_logits_mma(x, weight, quant=quant, reduce=False)   # [P, T, E]
    else:
        logits = logits_fn(path)(x, weight, quant=quant)
    if after_logits is not None:
        _check(quant is not None, "after_logits: needs act_quant (it is handed the quantised x)")
        after_logits(*extra)
    scores = logits if apply_scores else torch.sqrt(torch.nn.functional.softplus(logits))
    parts = logits.shape[0] if in_topk else 1
    import triton  # noqa: PLC0415  (lazy: importing dsv4_moe.kernels never needs triton)

    from ._router import _route_topk_kernel
    from ._triton_utils import pdl_options
    dummy = scores
    al = {}
    if aligned is not None:
        a = aligned
        al = dict(route_rows_ptr=a.route_rows, expert_counts_ptr=a.expert_counts, expert_offsets_ptr=a.expert_offsets,
                  num_blocks_ptr=a.num_valid_blocks, sorted_ids_ptr=a.sorted_route_ids, block_expert_ptr=a.block_expert,
                  row_expert_ptr=a.row_expert, row_weight_ptr=a.row_weight, first_expert=align[1],
                  num_local=align[0], max_blocks=a.max_blocks, ALIGN=True, BLOCK_M=a.block_m,
                  ROWS_PAD=triton.next_power_of_2(a.max_rows), MB_PAD=max(2, triton.next_power_of_2(a.max_blocks)),
                  EL_PAD=triton.next_power_of_2(align[0] + 1))
    _route_topk_kernel[(t,)](
        scores, bias.contiguous() if bias is not None else dummy,   # the kernel indexes bias[col]
        tid2eid.contiguous() if hashed else dummy,
        input_ids.contiguous() if hashed else dummy,
        out_w, out_ids,
        e, scores.stride(-2), tid2eid.shape[1] if hashed else 0,
        float(routed_scaling_factor),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
        HAS_BIAS=bias is not None, HASH=hashed, APPLY_SCORES=apply_scores,
        num_warps=TOPK_WARPS if TOPK_WARPS else (4 if e > 256 else 2),
        PACKED=TOPK_PACKED and t <= TOPK_PACKED_MAX_T, PARTS=parts, part_stride=t * e if parts > 1 else 0,
        # NOTE: libdevice without flush-to-zero, as nvcc builds torch: with Triton's default
        # (ftz) the scores of 2,180,453 fp32 logits in [-103.97, -87.34] (torch's softplus
        # is subnormal there) came out 0 instead of torch's value (exhaustive H200 check)
        enable_reflect_ftz=False,
        **al,
        **pdl_options(x.device),
    )
    return (out_w, out_ids) + extra + ((aligned,) if aligned is not None else ())
