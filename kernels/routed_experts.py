"""Routed experts on CUDA (SPEC §4.4 for every local route), composed from four kernels:

    align = moe_align(topk_ids, E_local, first_expert, BLOCK_M, topk_weights)
    gu    = mxfp4_grouped_gemm(q, sa, gate_up)          [max_rows, 2I] bf16, rows gathered
                                                         by token = route // k
    hq,hs = swiglu_quant(gu, limit, route_weight=align.row_weight,
                         rows=align.route_rows)         clamp, silu*up, * route weight
                                                         (BEFORE w2), bf16, act_quant; only
                                                         the rows of local routes
    y     = mxfp4_grouped_gemm(hq, hs, down)            rows scattered to slot r = t*k + slot

A gate_up split over K (decode) returns its fp32 partials (reduce=False) and
swiglu_quant_partials sums them before the SwiGLU, so gu is never written (SWIGLU_SUMS_SPLIT).

    q             [T, H]            float8_e4m3fn   act_quant(x)
    q_pairs       [T, H] or None    bfloat16        act_quant(x, pairs=True)[2]: bf16(q) in
                                                    the "pairs" layout, for a gate_up config
                                                    with a_bf16 (down's come from swiglu_quant)
    sa            [T, ceil(H/128)]  float32
    topk_weights  [T, k]            float32
    topk_ids      [T, k]            int32/int64     global ids
    routed        RoutedExpertWeights (weights/tensors.py)
    ->  y         [T, k, H]         bfloat16        slots of non-local routes are not written

Numerics: each GEMM follows SPEC §4.3 except for summing a 128-block's four 32-wide
partials before scaling (docs/DESIGN.md: a deviation, 1 ulp on <= 0.024 % of outputs), and
swiglu_quant is bitwise its reference on the same device, so y equals
`dsv4_moe.reference.routed_forward` except where that re-association moves a bf16
rounding of gu (and from there, rarely, an FP8 code of hq). No host syncs: capturable.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from dsv4_moe._types import is_real
from dsv4_moe.weights.mma_layout import TILED_LAYOUTS
from dsv4_moe.weights.tensors import RoutedExpertWeights

from .moe_align import MoeAlignment, moe_align
from .mxfp4_grouped_gemm import GemmConfig, gemv_config, mxfp4_grouped_gemm, select_config, split_parts

__all__ = ["routed_experts_forward", "routed_configs", "pairs_mode", "down_split_parts", "finalize_sums_split"]

# The SwiGLU-quant between the GEMMs computes the rows of the route list (session 13) from
# this many routes on; below it (and with a huge value, always) the row-range strategies
# over all max_rows rows, filtered by row_expert, as before. Same bits either way.
# NOTE: H200 A/B in the layer (scripts/gpu_profile_layer.py --ab dsv4_moe.kernels.
# routed_experts.SWIGLU_ROUTE_LIST_MIN_ROUTES=..., graphs, us, max_rows walk -> route list;
# docs/bench/2026-11-29/session13/profile_layer_ab_*.txt): Flash T=1 (6 routes) 77.2 ->
# 82.6 and 78.3 -> 79.9 in two runs (the kernel alone: 3.13 -> 2.98), Pro-TP8 T=1 44.5 ->
# 43.7 (a third run, profile_layer_ab_t1_t8_f7337f0.txt: Flash 77.3 -> 82.5, Pro-TP8 43.5 ->
# 43.1); from 12 routes the list wins: Flash T=2 138.2 -> 135.0, T=3 167.7 -> 162.2, T=4
# 193.3 -> 186.9, T=8 292.0 -> 287.4, T=16 486.7 -> 476.7, T=64 1142.0 -> 1112.0, T=256
# 1549.7 -> 1517.9, T=1024 2218.5 -> 2153.9; Pro-TP8 T=2 68.7 -> 68.0, T=3 85.6 -> 84.2, T=4
# 105.0 -> 103.7, T=64 524.5 -> 510.3, T=1024 1194.0 -> 1184.7.
SWIGLU_ROUTE_LIST_MIN_ROUTES = 12

# A split-K gate_up (decode: Pro-TP8 T <= 14, Pro-TP4 T <= 12, Flash-shaped T = 1) hands its fp32 partials
# to the fused SwiGLU-quant, which sums them in order and rounds to bf16 as the reduce launch
# did (`swiglu_quant_partials`): one launch fewer, the same bits (the unfused twin keeps
# the reduce launch). NOTE (session 26, H200, gpu_profile_layer.py --ab, 12 forwards per graph,
# 3 captures, us, on / off; docs/bench/2026-11-30/session26/): Pro-TP8 T=1 34.0 / 35.0, T=8
# 101.1 / 102.6, T=12 135.1 / 136.6. A/B switch.
SWIGLU_SUMS_SPLIT = True

# A split-K down GEMM (decode: Flash-shaped T = 1) can likewise hand its fp32 partials to the
# fused finalize + shared add, which makes each route's row as the reduce launch does (bf16 of
# the in-order sum) before adding it (`finalize.finalize_split_shared_add`): one launch fewer on
# the critical path, the same bits (the layer's unfused finalize keeps the reduce launch). Used by
# DeepseekV4MoE when the fused finalize runs without TP/EP (`finalize_sums_split`). Session 32,
# built on the CPU; A/B switch (gpu_profile_layer.py --ab ...FINALIZE_SUMS_SPLIT=,1).
FINALIZE_SUMS_SPLIT = True

# The routed GEMMs can take their activation scale folded into the bf16 operand
# (GemmConfig.fold_sa; act_quant / swiglu_quant write "scaled pairs"): by default all of them
# do (the swap GEMMs since session 17, see the end of this note; DSV4_MOE_FOLD_SWAP=0 not). False (env
# DSV4_MOE_FOLD_ACT_SCALE=0) restores the per-block `acc += part * sa` body, whose sums
# follow SPEC §4.3 more closely (A/B: scripts/gpu_profile_layer.py --ab
# dsv4_moe.kernels.routed_experts.FOLD_ACT_SCALE=,1 - an empty value is False).
# NOTE: H200, session 15 (docs/bench/2026-11-29/session15/probe_foldsa_*.txt, the layer's
# configs, graphs, weights not rotated, us default -> folded): Flash gate_up T=1 (split 4)
# 35.4 -> 29.8, T=4 94.0 -> 90.5, T=16 266.7 -> 246.9, T=64 702.2 -> 645.7; Flash down T=1
# 20.2 -> 19.4, T=4 52.4 -> 48.1, T=16 134.5 -> 127.8, T=64 348.6 -> 326.9; Pro-TP8 gate_up
# T=1 (split 8) 17.5 -> 15.1, T=4 44.8 -> 37.5, T=16 109.0 -> 102.2, T=64 279.8 -> 261.0;
# Pro-TP8 down T=4 20.7 -> 18.0, T=16 67.7 -> 59.3, T=64 188.1 -> 163.7, but T=1 6.7 -> 7.5
# (kept unfolded below 0.05 rows per expert). The sm_90a loop: 484 -> 425 SASS
# instructions per 128-k step (Flash gate_up, T = 16), 128 registers without a spill. Probed
# up to 1.5 rows per expert (T = 64), the range folded in session 15 (larger T: below). Second
# run with the landed code (probe_foldsa_bd8cf7f.txt): 1.03-1.24x on every 16-row GEMM, 0.000-
# 0.015 % of GEMM outputs differ from the per-block body (1 ulp); the layer against the CPU
# reference (gpu_check_layer_quick_bd8cf7f.txt): Flash T=1/4/16 0.049 / 0.104 / 0.369 % of
# outputs differ (per-block body: 0.024 / 0.018 / 0.021 %), Pro-TP8 0.000 / 0.010 / 0.011 %
# (0.000 / 0.003 / 0.003 %), all at most 1 ulp (the layer tolerance: 10 %, 8 ulp). The extra
# layer differences are FP8 codes of the SwiGLU-quant output that flip when a gate_up sum
# moves by an ulp.
# Beyond decode (session 16, probe_foldsa_3a21113.txt, same method, per-block -> folded, us):
# the 16-row swap GEMMs Flash T=256 gate_up 850.8 -> 755.1, down 410.6 -> 384.8; Pro-TP8
# T=256 412.3 -> 374.9 / 289.0 -> 271.6, T=1024 586.3 -> 536.6 / 426.0 -> 352.6; the tile
# (prefill) GEMMs Flash T=4096 3814.6 -> 3452.7 / 1798.4 -> 1759.8, T=8192 6539.1 -> 6011.7 /
# 3160.1 -> 3088.3, Pro-TP8 T=8192 2397.0 -> 2087.0 / 1632.8 -> 1624.5; 0.000-0.012 % of
# outputs differ from the per-block body. So every 16-row swap and tile config folds. The
# 32-row swap configs gained most (Flash T=1024 gate_up 1241.3 -> 899.7, Pro-TP8 T=4096
# 1289.5 -> 976.4 / 1113.4 -> 800.5) but the folded 32-row gate_up (3 pipeline stages, unroll
# 1) is wrong on the H200: outputs that change from run to run, up to 2.4e6 ulps off in 0.1-
# 0.6 % of them, the layer's relative error 5.9e-3 instead of 9e-5 (probe_fold32_2368def.txt:
# 0/10 reruns bitwise; the same at 4 stages). At 2 stages it is exact and deterministic (10/10
# reruns, bitwise the folded 16-row body) and still fast: Flash T=1024 gate_up 1242.4 ->
# 1014.5, Pro-TP8 T=4096 1294.3 -> 1078.2. The down GEMMs (probe_fold32_down_50c338f.txt,
# their configs unroll the K loop twice): 3 stages unroll 1 races on Flash too (0/10 reruns),
# 2 stages unroll 2 is exact: Flash T=1024 610.8 -> 549.1, Pro-TP8 T=4096 1091.8 -> 796.9.
# So a folded 32-row swap config ran 2 stages (until session 17, below); the layer (bench_swap32_ab_50c338f.txt, fold
# of the 32-row configs on / off, us): Flash T=1024 1843.1 / 2046.4, Pro-TP8 T=2048 1378.3 /
# 1673.7, T=4096 2346.8 / 2879.9, level elsewhere.
# NOTE (session 16, after those runs): the cause is ptxas. Folded, a block's second MMA is
# still in flight when the next block's dequant writes registers, and ptxas before 13.3
# (Triton 3.6 bundles 12.8) may hand that dequant the registers the in-flight wgmma still
# reads as its A operand (triton-lang/triton#9433). scripts/sass_wgmma_hazard.py finds such
# writes in the SASS of EVERY folded swap config measured above: 175-198 of them, the 16-row
# decode defaults of session 15 included; the per-block and tile bodies have none. The
# 16-row ones were only lucky in timing. The folded swap body now converts the odd-k half
# after the even-k MMA, behind a barrier (kernels/_mxfp4_grouped_gemm.py): 0 hazards in every
# config, checked by tests/test_sass_wgmma_hazard.py.
# NOTE (session 17, that body on the H200: docs/bench/2026-11-29/session17/probe_fold32_*_d97206c.txt,
# probe_foldsa_d97206c.txt): exact at 2-4 stages (10/10 reruns bitwise, two seeds), but slower
# than the per-block body on long K loops (Flash gate_up T=16 284.6 -> 334.9 us, T=1024 1244.0
# -> 1404.3) and faster on short ones (Pro-TP8 down T=1024 428.4 -> 364.8). The SASS says why:
# the barrier stops Triton pipelining the loop's loads (plain LDG + STS per block, no cp.async).
# So a second ordering, GemmConfig.fold_order "wait": both halves converted, both MMAs, then
# the accumulator through an opaque move, which makes each block's MMAs retire before the loop
# goes on - hazard-free in SASS, loads pipelined, 426 instead of 484 SASS per 128-k step (Flash
# gate_up T=16), 151 instead of 216 registers (32-row). Same bits as "split" (5 reruns each).
# H200 (probe_foldsa_syncs_a1037d2.txt, graphs, us, per-block / "split" / "wait"):
#   Flash gate_up T=1 (split 4) 37.2 / 34.8 / 31.3, T=4 93.5 / 116.0 / 87.3, T=16 294.9 /
#     367.4 / 274.6, T=64 680.2 / 829.3 / 622.3, T=256 850.0 / 1072.9 / 767.4, T=1024 (32
#     rows) 1225.8 / 1389.7 / 929.2
#   Flash down T=1 21.3 / 20.8 / 20.6, T=4 53.0 / 56.9 / 49.1, T=16 147.2 / 170.2 / 138.3,
#     T=64 344.3 / 394.9 / 315.1, T=256 426.6 / 521.5 / 389.8, T=1024 605.3 / 715.9 / 540.0
#   Pro-TP8 gate_up T=1 (split 8) 18.5 / 15.3 / 15.2, T=4 46.5 / 43.7 / 37.6, T=16 111.0 /
#     113.7 / 105.2, T=64 262.8 / 307.4 / 245.2, T=256 413.0 / 536.3 / 387.8, T=1024 565.6 /
#     744.3 / 529.4, T=4096 (32 rows) 1300.9 / 1603.6 / 987.7
#   Pro-TP8 down (K = 384: 3 blocks, unrolled) T=1 7.87 / 7.86 / 7.75, T=4 21.3 / 19.1 /
#     19.6, T=16 69.4 / 63.6 / 65.1, T=64 178.6 / 163.0 / 166.9, T=256 290.6 / 266.5 /
#     275.6, T=1024 417.7 / 357.3 / 409.2, T=4096 (32 rows) 1096.5 / 855.8 / 811.7
# So every swap GEMM folds: "split" for 16-row blocks over at most SPLIT_ORDER_MAX_BLOCKS K
# blocks (nothing to pipeline), "wait" otherwise. DSV4_MOE_FOLD_SWAP=0 keeps the swap GEMMs
# per-block; the tile GEMMs fold as above (no register operand, no hazard).
SPLIT_ORDER_MAX_BLOCKS = 4
FOLD_ACT_SCALE = os.environ.get("DSV4_MOE_FOLD_ACT_SCALE", "1").strip() not in ("0", "", "false", "off")
FOLD_SWAP = os.environ.get("DSV4_MOE_FOLD_SWAP", "1").strip() not in ("0", "", "false", "off")
# The unsplit swap GEMMs on 32- and 64-row blocks launch with the weight blocks fastest in
# the grid (GemmConfig.n_fastest: the programs resident together share one block of
# activation rows instead of one weight block; same bits). DSV4_MOE_N_FASTEST=0 keeps the
# m-blocks fastest everywhere (the A/B switch of the measurement in _n_fastest's note).
N_FASTEST = os.environ.get("DSV4_MOE_N_FASTEST", "1").strip() not in ("0", "", "false", "off")
N_FASTEST_MIN_BLOCK_M = 32
# NOTE (session 31, H200, measured and removed): persistent decode grids for the 16-row swap GEMMs
# (session 30's GemmConfig.persistent) were slower at every T and programs-per-SM count tried;
# figures in _mxfp4_grouped_gemm_swap_kernel's docstring.
# So was (session 31) the down GEMM's programs asking the L2 for their weight tile before their PDL
# wait (level at Pro-TP8 T=1, 1-15 us slower elsewhere).
# Rows per local expert from which the Flash-shaped (I >= 2048) folded swap GEMMs take 64-row
# blocks (see _base_configs' session 18-20 notes).
FLASH_SWAP64_MIN_ROWS = 40.0
# ... and the Pro-shaped (I <= 1024) ones.
PRO_SWAP64_MIN_ROWS = 40.0
# Rows per local expert from which the Pro-shaped GEMMs leave 16-row blocks for 32-row ones
# (session 11: 24; session 20 on "mma64e" with the weight blocks fastest: 16).
PRO_SWAP32_MIN_ROWS = 16.0
# Rows per local expert below which the Pro-shaped 16-row gate_up on "mma64e" takes a
# 128-register cap (see _mma64e_configs), and the register cap of the Pro-shaped (I <= 1024)
# short-K down on 16-row blocks there: A/B switches (scripts/gpu_profile_layer.py --ab).
# NOTE (session 21, docs/bench/2026-11-30/session21/, H200): lifting the gate_up cap from 2
# rows per expert was 1.08-1.11x on the GEMM at T = 256 / 512 but level at 64 / 128 / 768, and
# the layer level at T = 64-256, 0.98x at 512 / 768; a 96-register cap on the down (5 programs
# per SM, no spill, 0 hazards) was 1.03-1.08x on the GEMM at T = 4-512 and 0-3 % in the layer,
# inside the spread between captures of one forward (up to 11 %). Both stay as they were.
# Session 25 (docs/bench/2026-11-30/session25/, on bf16 pairs since session 24, A_PAD 2): the 96
# cap on the down 1.09-1.17x per GEMM at T = 4-256 (probe, 3 rounds: T=16 53.3 -> 51.4 us, T=256
# 234.0 -> 218.2); in the layer bench (graphs, rotated weights, two alternating runs each, us,
# 128 -> 96) T=4 82.6 / 82.0 -> 82.8 / 82.2, T=8 125.6 / 124.8 -> 125.1 / 125.1, T=16 169.3 /
# 169.5 -> 168.8 / 168.8, T=32 283.5 / 284.1 -> 281.7 / 281.3, T=64 397.1 / 397.6 -> 393.5 /
# 392.7, T=256 620.9 / 621.0 -> 616.3 / 619.5, T=512 693.8 / 693.8 -> 691.0 / 693.8: small
# but never slower from T = 8, so 96 (96 registers, no stack, 0 hazards offline on sm_90a).
# PRO_UP16_MAXNREG: the gate_up's cap; 112 (112 registers, no stack, 0 hazards) was 1.02-1.05x
# per GEMM at T = 16-256 in that probe (T=16 81.5 -> 77.4 us), in the layer (as above, 128 ->
# 112) T=16 169.5 / 169.1 -> 168.3 / 167.8, T=24 223.8 / 223.5 -> 223.3 / 223.7, T=32 281.6 /
# 281.7 -> 281.6 / 281.2, T=64 395.5 / 393.6 -> 393.9 / 393.7, T=128 536.1 / 533.7 -> 532.1 /
# 534.0, T=256 614.7 / 614.8 -> 614.9 / 612.2, T=512 687.3 / 680.5 -> 678.4 / 682.6: level to
# 0.7 %, never slower, so 112.
PRO_UP16_CAP_MAX_ROWS = float("inf")
PRO_UP16_MAXNREG = 112
# Session 29 (H200, gpu_profile_layer.py --weight-sets 4 --no-kernels --ab-captures 3 --presets
# pro-tp8 --ab ...PRO_DOWN16_MAXNREG=96,64, medians of 3 captures, us, e2ca2ef; both bitwise the
# default): on the 16 x 64 tiles below (72 registers under the 96 cap, 7 programs per SM; 63 under a
# 64 cap, no stack, 0 SASS hazards offline, 8 per SM) T=4 65.8 -> 65.4, T=8 94.1 -> 93.2, T=16
# 147.8 -> 146.5, T=32 267.5 -> 265.8: small, never slower, so 64.
PRO_DOWN16_MAXNREG = 64
# Weight rows per program (block_n) of that capped Pro-shaped 16-row down. NOTE (session 28, H200,
# scripts/gpu_probe_swap_rows.py --presets pro-tp8 --gemms down --enc-variants, 3 interleaved
# rounds, min, us, docs/bench/2026-11-30/session28/probe_swap_rows_downvar_d80e85f.txt; every
# variant bitwise the layer config): 16 x 128 -> 16 x 64 tiles T=8 29.8 -> 27.5, T=16 51.2 ->
# 46.6, T=32 86.7 -> 80.1 (16 x 256: 34.0 / 56.5 / 94.6; 3 or 5 stages, no unroll, a 128 cap:
# within 1.5 %; an 80 cap 0.90-0.95x). Three 128-k steps per program leave little to pipeline;
# twice the programs at half the weight rows keep more loads in flight per SM. In the layer
# (gpu_profile_layer.py --ab ...PRO_DOWN16_BLOCK_N=128,64, us, 391a458): T=4 69.2 / 66.7, T=8 97.2 /
# 93.7, T=16 151.8 / 147.0, T=32 274.8 / 268.2, T=64 386.8 / 376.8, T=256 630.2 / 613.5, T=512
# 694.2 / 693.5 (from T = 512 the down is uncapped and keeps 16 x 128). On the long-K Flash GEMMs the same tiles are 0.89-0.94x, so only here.
PRO_DOWN16_BLOCK_N = 64
# The same for the uncapped Pro-shaped 16-row down below PRO_DOWN16_SMALL_MAX_ROWS rows per local
# expert (T = 1-3 at top-6 over 384 experts: 6-18 experts, 336-1008 programs on 16 x 128 tiles,
# 2.5-7.6 per SM, each with three 128-k steps); 64 doubles the programs in flight, as the capped
# range gained from (66 registers, 0 hazards offline). Same bits (only the N split changes).
# NOTE (session 29, H200, gpu_profile_layer.py --weight-sets 4 --no-kernels --ab-captures 3
# --presets pro-tp8 --tokens 1,2,3 --ab ...PRO_DOWN16_SMALL_BLOCK_N=128,64, medians of 3 captures,
# us, e2ca2ef; bitwise): T=1 32.8 / 32.7, T=2 45.9 / 44.3, T=3 59.1 / 58.6. So 64.
PRO_DOWN16_SMALL_BLOCK_N = 64
PRO_DOWN16_SMALL_MAX_ROWS = 1.0
# A 64-register cap on it (66 -> 64 registers, no stack, 0 hazards offline: 8 programs per SM
# instead of 7) was level in the layer (session 29, same tool, us, none / 64: T=1 32.6 / 32.4, T=2
# 44.9 / 45.1, T=3 58.9 / 58.6), so it stays uncapped.
# NOTE (sessions 41-42): the K-loop unroll of the short-K (I <= 1024 per rank) 16-row swap down,
# Pro-TP8 T <= 256, stays 2 (see the NOTE in _routed_configs). Its sm_90a SASS
# (`python scripts/sass_wgmma_hazard.py --loads`, docs/bench/2026-12-01/session41/sass_loads_cpu.txt)
# has no cp.async - each 128-block's loads issue after the previous block's MMAs, three serial round
# trips per program - while unroll 1 lets Triton pipeline all three blocks' loads before the first MMA
# (64 registers, no stack, 0 hazards offline). Timed on the H200 in session 42 (the A/B switch
# PRO_DOWN_UNROLL, since removed; docs/bench/2026-12-01/session42/, bitwise), unroll 2 / 1, us:
# gpu_profile_layer.py --weight-sets 4 --ab-captures 3, Pro-TP8 T=1 32.4 / 34.1, T=4 62.9 / 66.0, T=8
# 90.9 / 96.0, T=16 141.4 / 150.3, T=64 369.0 / 394.3, T=256 590.2 / 629.9; the layer bench
# (--graph-chain, two alternating runs) T=1 31.3, 31.4 / 33.3, 33.3, T=8 92.5, 92.7 / 97.9, 98.4,
# T=16 137.5, 137.7 / 146.3, 146.2, T=64 353.9, 353.5 / 376.2, 376.3: the pipelined loop is 5-7 %
# slower, so the 8 programs per SM hide the round trips. Why the pipelined form loses (it stages the
# operands through shared memory) was not measured. Offline only: unroll 3 compiles to unroll 2's load
# schedule; 4, above the trip count, to a rolled loop with no cp.async.
# Rows per local expert from which the short-K down (K = I / tp = 384, three 128-blocks: Pro-TP8) on
# 16 x 64 blocks (Pro-TP8 T <= 256) issues all three blocks' weight and scale loads before its first MMA
# (GemmConfig.preload), its register cap kept. math.inf: never (an A/B switch). Why: in the loop the
# folded "wait" body's per-block wgmma wait keeps each block's loads behind the previous block's MMAs
# (sm_90a SASS: 8 of 18 LDGs before the first HGMMA; 14 of 18 with preload, the other 4 two blocks'
# activation rows; 0 hazards; T = 4: 64 registers and a 16-byte stack under the 64 cap, 74 uncapped).
# NOTE (sessions 42-43; built on the CPU in 42, timed in 43, H200, docs/bench/2026-12-01/session43/,
# every output bitwise the default's): gpu_profile_layer.py --weight-sets 4 --ab-captures 3, Pro-TP8,
# off / on / on uncapped, us: T=1 32.6 / 32.9 / 32.9, T=4 62.6 / 63.7 / 63.1, T=8 90.4 / 91.2 / 90.8,
# T=16 141.6 / 141.1 / 141.2, T=64 369.1 / 363.9 / 368.2, T=256 596.8 / 588.8 / 598.3; on the
# 16 x 128 and 32 / 64-row blocks it loses: T=512 643.7 / 704.0 / 702.3, T=1024 783.5 / 840.3 / 838.8,
# T=4096 1827.2 / 1878.8 / 1998.4, T=8192 3172.9 / 3298.5 / 3487.9. The layer bench (--graph-chain),
# off, on, on uncapped, off: T=8 91.9, 93.1, 92.8, 92.5; T=16 136.9, 136.7, 137.0, 136.9; T=32 236.9,
# 235.5, 236.5, 238.5; T=64 350.3, 345.7, 350.5, 353.0; T=128 476.8, 467.4, 474.3, 476.7; T=256 559.8,
# 539.2, 552.5, 553.4; T=512 625.5 / 686.0 (on). So on, capped, from 0.5 rows (T = 32) on the 16 x 64
# blocks only. The rule against inf, alternating (f18f91c, then 3a26c64): T=16 137.1, 137.1 / 136.6,
# 137.0; T=32 234.5, 234.5, 236.0, 236.0, 234.8 / 237.7, 237.6, 239.3, 239.0, 238.4; T=64 345.0, 346.2 /
# 352.7, 351.4; T=128 467.9, 465.8, 486.9, 465.5, 465.7 / 478.6, 476.3, 480.7, 476.1, 486.5 (two modes,
# ~466 and ~477-487, on both sides); T=256 557.2, 547.6, 576.5, 571.1, 569.1 / 557.6, 559.6, 577.7,
# 578.6, 577.3. Why it loses at T <= 8 (a few hundred programs, 8 per SM, mostly one row each) was not
# measured.
PRO_DOWN_PRELOAD_MIN_ROWS = 0.5
# NOTE (session 32, H200, gpu_profile_layer.py --ab, 12 forwards per graph, 3 captures, us, and the
# layer bench --graph-chain, two runs; docs/bench/2026-11-30/session32/): the split-K 16-row decode
# gate_up (Flash-shaped T = 1, Pro-shaped T <= 12) with a 128-register cap (uncapped 130 / 132
# registers on "mma64e", 3 programs per SM; capped 127 / 128, 4 per SM, no spill, no SASS hazard)
# or on 16 x 64 tiles (63-66 registers, twice the programs) was slower everywhere it applies:
# profile Flash T=1 54.1 / 58.4 (cap) and 54.0 / 58.1 (16 x 64); Pro-TP8 T=1 32.5 / 35.1 and 32.7 /
# 35.5, T=4 63.0 / 63.2 and 62.9 / 68.6, T=8 91.5 / 92.6 and 91.1 / 101.6; layer bench Flash T=1
# 55.4-55.6 / 62.1 / 61.3-61.4 (default / cap / 16 x 64), Pro-TP8 T=1 31.0 / 33.5 / 33.8-33.9, T=8
# 92.4-92.6 / 93.5-93.8 / 103.6-103.7. A likely cause (not measured): 4 gate_up programs of 128 x
# 128 registers take all 64K of an SM, leaving none to the shared expert's GEMV that runs beside
# them. Removed.
# Rows per local expert from which the Pro-shaped (I <= 1024) short-K down on 16-row blocks takes
# its activations as bf16 pairs (swiglu_quant writes them; same bits as fp8). NOTE (session 24,
# H200, layer bench, graphs, rotated weights, two alternating runs each, docs/bench/2026-11-30/
# session24/, us, fp8 (inf) -> pairs from 0 rows): Pro-TP8 T=1 49.1 / 49.3 -> 50.0 / 50.0, T=4
# 86.1 / 86.3 -> 85.7 / 85.8, T=8 139.2 / 140.8 -> 137.9 / 137.4, T=16 173.4 / 173.9 -> 169.3
# / 169.3, T=32 289.1 / 291.2 -> 283.8 / 283.9, T=64 405.6 / 406.0 -> 396.4 / 397.3, T=256
# 635.1 / 638.1 -> 622.9 / 624.3; so pairs from 0.05 rows (T >= 4). (Session 11 had them level,
# on "mma64", before the A_PAD_ROWS fix of session 22.)
PRO_DOWN_PAIRS_MIN_ROWS = 0.05
# Rows per local expert from which the Flash-shaped (I >= 2048) 16-row gate_up on bf16 pairs
# takes a 128-register cap (see _base_configs; an A/B switch). NOTE (session 23, H200, layer
# bench, graphs, rotated weights, two alternating runs each, docs/bench/2026-11-30/session23/,
# us, from 0.2 -> from 0.05 rows): Flash T=3 127.5 / 127.6 -> 127.1 / 127.8, T=4 146.1 /
# 145.9 -> 143.2 / 144.0, T=6 198.1 / 198.9 -> 193.9 / 193.4, T=8 237.7 / 239.3 -> 231.6 /
# 232.8; same bits. (Session 6 had measured the cap slower at T = 4, before the A_PAD_ROWS
# fix of session 22 and the "mma64e" weights.)
FLASH_UP16_CAP_MIN_ROWS = 0.0
# ... and from which the Flash-shaped (I >= 2048) 16-row down takes one. NOTE (session 23,
# H200, layer bench as above, us, no cap -> from 0.2 rows): Flash T=16 360.9 / 356.2 -> 353.3
# / 351.9, T=24 461.5 / 463.0 -> 457.9 / 458.3, T=32 571.5 / 572.0 -> 568.2 / 564.8, T=64
# 806.6 / 811.0 -> 806.2 / 810.0, T=128 1019.0 / 1014.4 -> 1007.4 / 997.9, T=256 1126.1 /
# 1119.2 -> 1119.8 / 1125.8; same bits (136 -> 128 registers: 4 programs per SM, no stack).
FLASH_DOWN16_CAP_MIN_ROWS = 0.2
# The caps themselves (A/B switches; 128 = 4 programs per SM, 96 = 5 where shared memory allows).
FLASH_UP16_MAXNREG = 128
FLASH_DOWN16_MAXNREG = 128
# Rows per local expert from which the Flash-shaped (I >= 2048) down takes its activations as
# bf16 pairs (swiglu_quant writes them; see _base_configs; the split-K down of T = 1 keeps
# fp8). NOTE (session 23, H200, layer bench as above, us, from 0.2 -> from 0.05 rows): Flash
# T=3 127.4 / 126.8 -> 121.7 / 122.9, T=4 143.1 / 143.6 -> 137.5 / 138.3 (2.51 / 2.49 TB/s),
# T=6 195.6 / 195.1 -> 188.0 / 188.1, T=8 231.6 / 233.0 -> 223.7 / 224.3; then from 0.05 ->
# from 0 (T = 2, 0.047 rows): 105.7 / 105.1 -> 99.7 / 100.3. T = 1 unsplit on pairs 70.0 /
# 69.9 against the 2-way split on fp8 70.0 / 69.8: level, the split stays. Same bits
# everywhere. (Session 11 had pairs level at T = 4, on "mma64", before the A_PAD_ROWS fix.)
FLASH_DOWN_PAIRS_MIN_ROWS = 0.0
# Rows per local expert from which the unsplit swap gate_up takes bf16 pairs, and whether the
# split-K decode gate_up takes them too (A/B switches). NOTE (session 24, H200, layer bench,
# graphs, rotated weights, two alternating runs each, docs/bench/2026-11-30/session24/, us):
# with the Flash-shaped gate_up unsplit at T = 2 (mxfp4_grouped_gemm.MID_K_SPLIT_MAX_ROWS 0.05
# -> 0.03; on pairs and capped at 128 registers there, so UP_PAIRS_MIN_ROWS and
# FLASH_UP16_CAP_MIN_ROWS 0.05 -> 0) and the split-K gate_up on pairs: Flash T=1 70.0 / 69.8
# -> 66.3 / 66.8, T=2 100.0 / 99.5 -> 93.5 / 95.2 (T = 2 unsplit alone: 94.8 / 94.3; T = 1
# unsplit on pairs instead: 68.9 / 69.6); Pro-TP8, split on pairs and split 4 ways up to 0.2
# rows (mxfp4_grouped_gemm.LONG_K_SPLIT_MID_MAX_ROWS): T=1 50.3 / 50.4 -> 45.6 / 45.5, T=2
# 65.3 / 65.3 -> 62.2 / 62.3, T=4 85.8 / 85.3 -> 82.6 / 82.5, T=8 139.5 / 139.4 -> 127.7 /
# 127.6, T=16 168.8 / 167.7 -> 167.9 / 167.9. A 128-register cap on the split gate_up on pairs
# (130-133 registers without, offline sm_90a) was slower: Pro-TP8 T=1 48.3 / 48.8.
UP_PAIRS_MIN_ROWS = 0.0
UP_SPLIT_PAIRS = True


def routed_configs(num_routes: int, routed: RoutedExpertWeights) -> tuple[GemmConfig, GemmConfig]:
    """(gate_up config, down config); both share BLOCK_M because they share one alignment."""
    return _routed_configs(num_routes, routed.num_local, routed.intermediate, routed.hidden, routed.layout,
                           FOLD_ACT_SCALE, FOLD_SWAP, N_FASTEST)


def down_split_parts(num_routes: int, routed: RoutedExpertWeights) -> int:
    """How many fp32 partials per output the routed down GEMM writes at this size (1: it does
    not split K, so there is nothing for a consumer to sum)."""
    return split_parts(routed_configs(num_routes, routed)[1], routed.intermediate)


def finalize_sums_split(num_routes: int, routed: RoutedExpertWeights) -> bool:
    """Whether the layer's fused finalize should sum the down GEMM's split-K partials itself
    at this size (FINALIZE_SUMS_SPLIT and a down that splits)."""
    return FINALIZE_SUMS_SPLIT and down_split_parts(num_routes, routed) > 1


@functools.lru_cache(maxsize=4096)
def _routed_configs(num_routes: int, num_local: int, i: int, h: int, layout: str, fold: bool,
                    fold_swap: bool, n_fastest: bool = False) -> tuple[GemmConfig, GemmConfig]:
    """routed_configs on the shapes and the module switches it reads (memoised: an eager
    forward asks twice, ~70 us of host time each on the H200's host before)."""
    up, down = _base_configs(num_routes, num_local, i, h, layout, fold and fold_swap)
    if fold and layout in TILED_LAYOUTS:
        up, down = _fold(up, h, fold_swap), _fold(down, i, fold_swap)
        # NOTE: folded ("wait"), the Flash-shaped 32-row down is faster with its K loop rolled
        # (H200, probe_fold32_down_ff7d770.txt, Flash T=1024, us: unroll 2 555.4, unroll 1
        # 505.0; per-block unroll 2 606.8); the short-K Pro-TP8 one keeps it (814.8 vs 859.1).
        if down.fold_sa and down.kind == "swap" and down.block_m == 32 and i >= 2048:
            down = dataclasses.replace(down, unroll=1)
    if layout == "mma64e":
        up, down = _mma64e_configs(up, down, i, num_routes / max(num_local, 1))
        up, down = _one_chain(up, num_routes, num_local, "gate_up"), _one_chain(down, num_routes, num_local, "down")
        down = _preload(down, i, num_routes / max(num_local, 1))
    if n_fastest:
        up, down = _n_fastest(up, num_routes, num_local), _n_fastest(down, num_routes, num_local)
    if CONFIG_OVERRIDE:
        up, down = _override(up, "gate_up"), _override(down, "down")
    return up, down


# A/B probe switch (session 34): fields of the chosen GemmConfigs replaced at every size, e.g.
# "gate_up:one_chain=1,num_stages=6;down:block_n=128" (set through the benches' --set). Empty: the
# rules above alone. block_m and kind are not overridable (both GEMMs share one alignment).
CONFIG_OVERRIDE = ""


def _override(cfg: GemmConfig, gemm: str) -> GemmConfig:
    """cfg with the fields CONFIG_OVERRIDE gives for `gemm` ("gate_up" / "down") replaced."""
    fields = {f.name: f for f in dataclasses.fields(GemmConfig)}
    changes = {}
    for part in filter(None, (p.strip() for p in CONFIG_OVERRIDE.split(";"))):
        name, sep, items = part.partition(":")
        if not sep or name.strip() not in ("gate_up", "down"):
            raise ValueError(f"routed_experts.CONFIG_OVERRIDE={CONFIG_OVERRIDE!r}: {part!r} should read "
                             f"'gate_up:FIELD=VALUE,...' or 'down:FIELD=VALUE,...'")
        for item in filter(None, (i.strip() for i in items.split(","))):
            key, eq, value = (x.strip() for x in item.partition("="))
            if not eq or key not in fields or key in ("block_m", "kind"):
                raise ValueError(f"routed_experts.CONFIG_OVERRIDE={CONFIG_OVERRIDE!r}: {item!r} should be FIELD=VALUE "
                                 f"with FIELD a GemmConfig field other than block_m / kind")
            if name.strip() == gemm:
                changes[key] = _field_value(key, value, getattr(cfg, key))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _field_value(key: str, value: str, current):
    """VALUE parsed as GemmConfig field `key`'s type (bool 0/1/true/false, int, str; "none" for None)."""
    if value.lower() == "none" and key == "maxnreg":
        return None
    if isinstance(current, bool):
        if value.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"routed_experts.CONFIG_OVERRIDE: {key}={value!r}: expected 0/1/true/false")
        return value.lower() in ("1", "true")
    if isinstance(current, int) or key == "maxnreg":
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"routed_experts.CONFIG_OVERRIDE: {key}={value!r}: expected an int") from None
    return value


# Rows per local expert from which the folded 16-row swap GEMMs run each 128-block as one MMA
# chain (GemmConfig.one_chain: one wgmma wait per block instead of two; same bits). A/B switch
# (a large value turns it off). NOTE (session 33, H200, docs/bench/2026-11-30/session33/, every
# output bitwise the two-chain body's): gpu_profile_layer.py --ab (12 forwards per graph, 3
# captures, us, two chains / one) Flash T=1 52.9 / 54.6, T=2 75.6 / 77.6, T=4 127.7 / 123.8, T=16
# 342.5 / 333.4; Pro-TP8 T=1 32.3 / 34.2, T=2 43.0 / 43.5, T=4 62.8 / 62.3, T=16 144.6 / 143.2. The
# layer bench (--graph-chain) on every 16-row GEMM: Flash T=1 55.0 / 59.7, T=2 73.8 / 75.7, T=4
# 122.2 / 118.3, T=16 343.9 / 332.4; Pro-TP8 T=1 31.0 / 33.0, T=2 41.7 / 41.7, T=4 64.1 / 63.9, T=16
# 141.3 / 140.4. So from Flash T = 4 (0.09 rows) and Pro-TP8 T = 16 (0.25), never on a split-K
# GEMM (the T = 1 ones) nor under a register cap below 112 (it spills there: the Pro-TP8 down's 64).
ONE_CHAIN_MIN_ROWS = 0.08
# Which split-K GEMMs (the T = 1 ones) also take one chain: "off", "gate_up", "down" or "both".
# A/B switch for session 33's lead 3 (the T = 1 loss): "off" is what measured fastest.
ONE_CHAIN_SPLIT_K = "off"
_ONE_CHAIN_SPLIT_K = ("off", "gate_up", "down", "both")


def _one_chain(cfg: GemmConfig, num_routes: int, num_local: int, gemm: str = "gate_up") -> GemmConfig:
    """cfg as one MMA chain per 128-block where that measured faster (unsplit GEMMs from
    ONE_CHAIN_MIN_ROWS; split-K ones where ONE_CHAIN_SPLIT_K names them). `gemm`: "gate_up" / "down"."""
    if ONE_CHAIN_SPLIT_K not in _ONE_CHAIN_SPLIT_K:
        raise ValueError(f"routed_experts.ONE_CHAIN_SPLIT_K={ONE_CHAIN_SPLIT_K!r}: expected one of "
                         f"{', '.join(map(repr, _ONE_CHAIN_SPLIT_K))}")
    if cfg.split_k > 1:  # split-K: only where the switch names this GEMM, at any row count
        wanted = ONE_CHAIN_SPLIT_K in (gemm, "both")
    else:
        wanted = num_routes / max(num_local, 1) >= ONE_CHAIN_MIN_ROWS
    if (wanted and cfg.kind == "swap" and cfg.fold_sa and cfg.fold_order == "wait" and cfg.block_m == 16
            and (cfg.maxnreg is None or cfg.maxnreg >= 112)):
        return dataclasses.replace(cfg, one_chain=True)
    return cfg


def _mma64e_configs(up: GemmConfig, down: GemmConfig, i: int, rows: float = 0.0) -> tuple[GemmConfig, GemmConfig]:
    """The configs on the re-encoded weights ("mma64e": fewer conversion instructions, so
    other register counts and a different balance between the loads and the math)."""
    # NOTE (session 20, docs/bench/2026-11-30/session20/probe_enc_variants_f2c7f46.txt, H200,
    # graphs, 3 interleaved rounds, us, min, each variant bitwise the "mma64" layer config):
    # - the Pro-shaped 16-row gate_up compiles to 129 registers on mma64e (128 on mma64), so
    #   3 programs per SM instead of 4; a 128-register cap restores 4: Pro-TP8 T=16 109.4 ->
    #   99.6 (mma64: 104.7), T=64 225.4 -> 225.7, T=1024 499.3 -> 491.5.
    # - the short-K (3 blocks) Pro-TP8 down: the "split" ordering that mma64 measured faster
    #   (session 17) loses on mma64e at T = 1024, 414.5 -> 330.2 with "wait" (mma64 "split":
    #   360.0); level at T = 1 / 4 / 16 / 64 (7.0 / 17.2 / 56.2 / 154.7 -> 7.0 / 17.2 / 55.9
    #   / 154.0).
    if (up.kind == "swap" and up.block_m == 16 and up.split_k == 1 and i <= 1024 and up.a_bf16
            and up.maxnreg is None and rows < PRO_UP16_CAP_MAX_ROWS):
        # the session-25 caps were measured folded; per-block (DSV4_MOE_FOLD_SWAP=0) they spill
        # (offline sm_90a: 40 / 120 stack bytes), so that body keeps 128
        up = dataclasses.replace(up, maxnreg=PRO_UP16_MAXNREG if up.fold_sa else 128)
    if down.kind == "swap" and down.block_m == 16 and i <= 1024 and down.maxnreg == 128:
        down = dataclasses.replace(down, maxnreg=PRO_DOWN16_MAXNREG if down.fold_sa else 128,
                                   block_n=PRO_DOWN16_BLOCK_N if down.fold_sa else down.block_n)
    elif (down.kind == "swap" and down.block_m == 16 and i <= 1024 and down.maxnreg is None and down.fold_sa
          and down.split_k == 1 and rows < PRO_DOWN16_SMALL_MAX_ROWS):
        down = dataclasses.replace(down, block_n=PRO_DOWN16_SMALL_BLOCK_N)
    up, down = [dataclasses.replace(c, fold_order="wait") if c.fold_sa and c.fold_order == "split" else c
                for c in (up, down)]
    return up, down


def _preload(down: GemmConfig, i: int, rows: float) -> GemmConfig:
    """The down config with GemmConfig.preload where PRO_DOWN_PRELOAD_MIN_ROWS asks for it: the folded
    "wait" unsplit 16 x 64 swap configs over K = I = 384, from that many rows per local expert."""
    if not (rows >= PRO_DOWN_PRELOAD_MIN_ROWS and i == 384 and down.kind == "swap" and down.block_m == 16
            and down.block_n == 64 and down.fold_sa and down.fold_order == "wait" and down.split_k == 1):
        return down
    return dataclasses.replace(down, preload=True)


def _n_fastest(cfg: GemmConfig, num_routes: int, num_local: int) -> GemmConfig:
    """cfg launched with its weight blocks fastest in the grid where that applies (unsplit
    swap configs on blocks of at least N_FASTEST_MIN_BLOCK_M rows, while the alignment's
    worst-case block count fits the grid's y dimension)."""
    # NOTE (session 19, H200, layer bench A/B, docs/bench/2026-11-30/session19/ab_*_a7665d0.json,
    # graphs, us, m-fastest -> n-fastest, same rel_err): Flash T=512 1721.7 -> 1695.4, T=1024
    # 1856.3 -> 1784.0, T=2048 2450.8 -> 2269.2, T=4096 4757.3 -> 4525.1, T=8192 8668.2 ->
    # 7912.1; Pro-TP8 T=2048 1394.8 -> 1369.2, T=4096 2150.1 -> 2107.2, T=8192 3852.4 -> 3530.6.
    # The 16-row decode blocks: 0.98-1.01x per GEMM (probe_decode_twins_a7665d0.txt), noise.
    max_blocks = -(-num_routes // max(cfg.block_m, 1)) + min(num_local, num_routes)
    if (cfg.kind == "swap" and cfg.split_k == 1 and cfg.block_m >= N_FASTEST_MIN_BLOCK_M
            and max_blocks <= 65535):
        return dataclasses.replace(cfg, n_fastest=True)
    return cfg


def _base_configs(num_routes: int, num_local: int, i: int, h: int, layout: str,
                  fold_swap: bool = True) -> tuple[GemmConfig, GemmConfig]:
    """The GEMM configs before the fold of the activation scale; `fold_swap`: the swap
    configs will be folded (the 64-row swap blocks need it)."""
    up = select_config(num_routes, num_local, 2 * i, h, layout)
    down = select_config(num_routes, num_local, h, i, layout)
    if up.kind == "gemv" and down.kind != "gemv":  # e.g. Pro-TP8 T=4: long-K gate_up keeps the GEMV
        down = gemv_config(i)
    if down.block_m != up.block_m:
        down = dataclasses.replace(down, block_m=up.block_m)
    # NOTE: bf16 activation pairs (GemmConfig.a_bf16: each 128-block as its 64 even then 64
    # odd k, bitwise the fp8 operand) written by the kernel that makes the fp8 activations
    # (act_quant / swiglu_quant with pairs=True; routed_experts_forward's q_pairs), so no
    # conversion launch. H200 probe, session 11 (docs/bench/2026-11-29/session11/
    # probe_swz_pairs_*.txt, "mma64", graphs, us, fp8 -> bf16 pairs, bitwise):
    #   gate_up, unsplit swap from 0.05 routes per expert: Flash T=4 104.6 -> 95.4, T=16
    #     309.9 -> 274.6, T=64 794.9 -> 693.2, T=1024 (32 rows) 1398.4 -> 1211.0; Pro-TP8
    #     T=16 119.2 -> 107.4, T=256 475.0 -> 412.0 (not split-K decode: Flash T=1 37.0 -> 41.8;
    #     session 24, on A_PAD 2 and "mma64e": split-K too and from 0 rows, see UP_SPLIT_PAIRS)
    #   down, K = I >= 2048 from 0.2 routes per expert: Flash T=16 160.5 -> 138.3, T=64
    #     379.1 -> 329.4, T=256 482.5 -> 416.3, T=1024 743.3 -> 611.4 (32 rows, unrolled
    #     twice; 658.8 not); not at T=4 (51.9 -> 52.3) and not the short-K Pro-TP8 down
    #     at T <= 256 (fp8 with the cap below: level). Session 23 (layer bench, A_PAD 2,
    #     "mma64e"): the down gains from T = 2 (FLASH_DOWN_PAIRS_MIN_ROWS)
    #   Pro-TP8 (K = I/tp <= 1024) in the 32-row band, both GEMMs on pairs, the down K loop
    #     unrolled twice (probe_swz_pairs_pro_band_4a115bc.txt): below 24 rows per expert
    #     16-row blocks (T=512: gate_up 661.8 -> 411.9, down 551.0 -> 306.5; T=1024: 644.5
    #     -> 564.3, 498.8 -> 421.3), above them 32-row blocks (T=2048: 921.1 -> 795.7,
    #     709.4 -> 641.1; 16-row blocks 978.1 / 692.2).
    rows = num_routes / max(num_local, 1)
    mma64 = layout in TILED_LAYOUTS
    whole = h % 128 == 0 and i % 128 == 0
    # NOTE (session 12, docs/bench/2026-11-29/session12/probe_swz_prefill_pairs*_9a8ab78.txt,
    # H200, graphs, uniform routing, us, the config before -> now, bitwise): the tile body on
    # bf16 pairs takes the Flash-shaped GEMMs (I >= 2048) from 40 rows per expert, where two
    # 32-row swap blocks cost more than one 64-row tile: T=2048 gate_up 2326.6 (swap32 pairs)
    # -> 2047.5, down 1187.5 (swap32 pairs u2) -> 987.2; T=4096 4227.1 (tile fp8) -> 3962.0,
    # 2039.6 -> 1894.9; T=8192 7311.4 -> 6949.6, 3563.7 -> 3319.8 (at 36 rows, T=1536, level:
    # 1987.0 + 977.1 vs 2037.8 + 927.3). The Pro-style (I <= 1024) 32-row swap band now runs
    # to 96 rows per expert: T=4096 gate_up 1554.4 (tile fp8) -> 1327.6, down 970.4 -> 1088.5
    # (2524.8 -> 2416.1 together); at T=8192 the tile keeps both (4250.5 vs 4492.2), and the
    # tile on pairs is slower on the short-K down (1299.9 vs 970.4 at T=4096).
    # From 64 rows per expert the gate_up tile on pairs also gains from two pipeline stages
    # and a 168-register cap (3 programs per SM instead of 2; probe_swz_tile_pairs_caps_
    # 08f8dfa.txt, us, 3 stages uncapped -> 2 stages capped): Flash T=4096 3973.9 -> 3767.5,
    # T=8192 6911.3 -> 6639.8; Pro-TP8 T=8192 2514.7 -> 2406.9 (tile fp8: 2610.5). The down
    # GEMMs lose with it (Flash 1844.1 -> 1908.5 at T=4096), and the short-K Pro-TP8 down
    # keeps fp8 activations.
    # NOTE (session 18, docs/bench/2026-11-30/session18/probe_swap_rows_*.txt, H200, graphs,
    # uniform routing, us, the tile config above -> 64-row folded swap, bitwise): the "wait"
    # ordering of the folded swap body (session 17) needs few enough registers for 64-row
    # blocks on one warpgroup (194-212 without a cap, no spill), and the weights then stay
    # the register operand - no shared-memory round trip and no wait on each MMA right after
    # it, as the tile body has. With 3 stages and a 168-register cap (3 programs per SM):
    #   Flash T=2048 gate_up 1842.0 -> 1338.5, down 938.0 -> 699.8; T=8192 6056.7 -> 4218.4,
    #     3084.2 -> 2250.3 (1.34-1.44x; T=1536, 36 rows per expert: level with the 32-row
    #     swap, 1538.5 / 764.4 vs 1580.0 / 742.3; T=1280: the 32-row swap 1.4x faster)
    #   Pro-TP8 T=8192 gate_up 2076.4 -> 1603.2 (no cap), the short-K down 1625.9 -> 1447.7
    #     (unrolled twice; the 32-row swap 1355.1 but its gate_up 1948.4); T=4096 (64 rows)
    #     gate_up 1014.7 (32-row swap) -> 972.9, down 824.1 -> 799.8.
    # 8 warps, 128- and 256-row blocks, 2 stages, a 128-register cap and 64-wide weight
    # tiles were slower at every size probed. Only the folded body fits: per-block
    # (DSV4_MOE_FOLD_SWAP=0 or DSV4_MOE_FOLD_ACT_SCALE=0) the 64-row swap needs 255 registers
    # and spills, so there the tile configs below stay, as for shapes off these rules.
    # Session 19 (probe_flash_band_eb89f4e.txt, weight blocks fastest, 3 rounds, us, 32-row ->
    # 64-row swap, gate_up + down): 34 rows (T=1450) 2183.6 -> 2353.1, 36 rows (T=1536) 2239.9
    # -> 2017.6 (level in an earlier run: 2272.9 -> 2281.7), 39.8 rows (T=1700) 2519.7 ->
    # 2191.0, so the 64-row band started at 36 rows (was 40). Session 20, on "mma64e"
    # (probe_flash_band_6ee9d37.txt, us, 32-row -> 64-row): 30 rows (T=1280) 1456.4 -> 2475.0,
    # 36 rows (T=1536) 1980.1 -> 2249.5, 39.8 rows (T=1700) 2134.3 -> 2105.8: back to 40.
    swap64 = GemmConfig(64, 128, 4, 3, kind="swap", asm=True, a_bf16=True)
    if fold_swap and mma64 and whole and i >= 2048 and rows >= FLASH_SWAP64_MIN_ROWS:
        up = dataclasses.replace(swap64, maxnreg=168)
        return up, up
    if fold_swap and mma64 and whole and i <= 1024 and rows >= PRO_SWAP64_MIN_ROWS:
        # NOTE (session 19, docs/bench/2026-11-30/session19/probe_pro_3df8c5a.txt, H200,
        # graphs, 3 interleaved rounds, us, weight blocks fastest): the short-K down with a
        # 168-register cap (188 -> 168, 2 -> 3 programs per SM): T=4096 745.1 -> 658.1,
        # T=8192 1232.6 -> 1094.5 (the cap on gate_up: not measured faster, see above).
        # Session 19 (probe_pro_band_5ee6f48.txt, us, 32-row -> 64-row, gate_up + down):
        # 32 rows (T=2048) 1086.1 -> 1147.2, 48 rows (T=3072) 1461.3 -> 1131.6, 56 rows
        # (T=3600) 1565.6 -> 1307.5: the band starts at 40 rows (was 64).
        return swap64, dataclasses.replace(swap64, unroll=2, maxnreg=168)
    capped = GemmConfig(64, 128, 4, 2, asm=True, a_bf16=True, maxnreg=168)
    if mma64 and whole and i >= 2048 and rows >= 40:
        down = GemmConfig(64, 128, 4, 3, asm=True, a_bf16=True)
        return (capped if rows >= 64 else down), down
    if mma64 and whole and i <= 1024 and 64 <= rows < 96:
        up = GemmConfig(32, 128, 4, 3, kind="swap", asm=True, a_bf16=True)
        return up, dataclasses.replace(up, unroll=2)
    if mma64 and whole and i <= 1024 and rows >= 96:
        return capped, GemmConfig(64, 128, 4, 3, asm=True)
    if mma64 and i <= 1024 and up.kind == "swap" and up.block_m == 32 and whole:
        # NOTE (session 20, docs/bench/2026-11-30/session20/probe_pro_band_6ee9d37.txt, H200,
        # "mma64e", 3 interleaved rounds, us, gate_up + down): at 16 rows per expert (T = 1024)
        # the 16-row blocks 437.0 + 421.0, the 32-row ones (weight blocks fastest, the down
        # unrolled) 407.4 + 318.9 (1.18x): the 32-row band now starts at 16 rows (was 24).
        if rows < PRO_SWAP32_MIN_ROWS:
            up = GemmConfig(16, 128, 4, 4, kind="swap", asm=True, a_bf16=True)
        else:
            up = dataclasses.replace(up, a_bf16=True)
        return up, dataclasses.replace(up, unroll=2)
    if (up.kind == "swap" and up.split_k > 1 and mma64 and h % 128 == 0
            and UP_SPLIT_PAIRS):
        up = dataclasses.replace(up, a_bf16=True)
    if up.kind == "swap" and up.split_k == 1 and mma64 and rows >= UP_PAIRS_MIN_ROWS and h % 128 == 0:
        up = dataclasses.replace(up, a_bf16=True)
        # NOTE: a 128-register cap on the Flash-shaped gate_up (I >= 2048) on pairs from 0.2
        # rows per expert, 16-row blocks: three interleaved H200 runs (probe_swz_cap_ab*_
        # 428106e.txt, medians, us) T=16 270.7 -> 266.4, T=64 657.0 -> 637.5, T=256 868.4
        # -> 840.6 (136 registers: slower); at T=4 98.5 vs 95.6 and on Pro-TP8 gate_up
        # (113.0 vs 108.6 at T=16) slower (probe_swz_pairs_variants_269c2f5.txt). Session 23:
        # from 0.05 rows (T >= 3), see FLASH_UP16_CAP_MIN_ROWS; session 24: from 0 (T = 2 unsplit).
        if i >= 2048 and rows >= FLASH_UP16_CAP_MIN_ROWS and up.block_m == 16:
            up = dataclasses.replace(up, maxnreg=FLASH_UP16_MAXNREG)
    if (down.kind == "swap" and down.split_k == 1 and mma64 and i >= 2048 and i % 128 == 0
            and rows >= FLASH_DOWN_PAIRS_MIN_ROWS):
        down = dataclasses.replace(down, a_bf16=True, unroll=2 if down.block_m == 32 else 1)
    if (down.kind == "swap" and down.block_m == 16 and down.split_k == 1 and mma64 and i >= 2048
            and rows >= FLASH_DOWN16_CAP_MIN_ROWS):
        down = dataclasses.replace(down, maxnreg=FLASH_DOWN16_MAXNREG)
    # NOTE: the short-K down GEMM (Pro-TP8: K = I/tp = 384, three 128-blocks) on the swap
    # body: the K loop unrolled twice (fewer pipeline barriers per block) and, for 16-row
    # blocks from 0.05 routes per expert, a 128-register cap (147 -> 128 registers, 3 -> 4
    # programs per SM, an 8-byte spill). H200 probe, session 10 (docs/bench/2026-11-29/
    # session10/probe_swz_unroll_down_50ef385.txt, graphs, us, before -> now, bitwise):
    # T=1 10.1 -> 7.8, T=4 25.1 -> 22.3, T=16 73.2 -> 67.7, T=64 202.2 -> 192.6, T=256
    # 301.9 -> 298.4, T=1024 700.9 -> 487.0 (the 32-row block spills under the cap: it
    # was applied there unmeasured until session 10). The unroll is slower on every
    # long-K GEMM (Flash down 0.94-0.99x, every gate_up 0.78-0.84x; probe_swz_unroll_492f56e.txt).
    # The cap alone (session 6, probe_swz_regs_b805197.txt): Pro-TP8 down T=4 25.1 -> 23.9,
    # T=16 80.6 -> 78.5, T=64 206.9 -> 195.6, T=256 314.2 -> 303.2; every gate_up level or
    # slower.
    if down.kind == "swap" and mma64 and i <= 1024:
        pairs = down.a_bf16 or (down.split_k == 1 and i % 128 == 0 and rows >= PRO_DOWN_PAIRS_MIN_ROWS)
        down = dataclasses.replace(down, unroll=2, a_bf16=pairs,
                                   maxnreg=128 if rows >= 0.05 and down.block_m == 16 else None)
    return up, down


def _fold(cfg: GemmConfig, k: int, fold_swap: bool) -> GemmConfig:
    """cfg with the activation scale folded into the operand (tile bodies; swap bodies with
    `fold_swap`; whole 128-blocks only)."""
    if cfg.kind == "gemv" or k % 128 or (cfg.kind == "swap" and not fold_swap):
        return cfg
    return fold_config(cfg, k)


def fold_config(cfg: GemmConfig, k: int) -> GemmConfig:
    """The folded twin of a swap / tile config over a K-wide reduction (GemmConfig.fold_sa),
    with the swap body's ordering the H200 measured faster (see FOLD_SWAP's note)."""
    short = cfg.block_m == 16 and -(-(k // 128) // cfg.split_k) <= SPLIT_ORDER_MAX_BLOCKS
    return dataclasses.replace(cfg, fold_sa=True, fold_order="split" if cfg.kind == "swap" and short else "wait")


def pairs_mode(cfg: GemmConfig) -> "bool | str":
    """The `pairs` argument the quantiser feeding a GEMM with config `cfg` takes: False, True
    (bf16(q) pairs) or "scaled" (bf16(q * s), for fold_sa)."""
    return ("scaled" if cfg.fold_sa else True) if cfg.a_bf16 else False


def routed_experts_forward(q: torch.Tensor, sa: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, routed: RoutedExpertWeights, limit: float,
                           swiglu: str = "fused", *, configs: tuple[GemmConfig, GemmConfig] | None = None,
                           return_alignment: bool = False, q_pairs: torch.Tensor | None = None,
                           align: MoeAlignment | None = None, down_reduce: bool = True):
    """y [T, k, H] bf16 for every local route (see the module docstring).

    `swiglu` picks the SwiGLU-quant between the GEMMs: "fused" (one kernel) or "unfused"
    (its bitwise twin, the bf16 activation materialised) - the A/B of SPEC §5.1.
    `q_pairs`: act_quant(x, pairs=pairs_mode(gate_up config))'s third output (bf16(q), or
    bf16(q * s) for a fold_sa config, in the "pairs" layout), used by gate_up when its config
    takes bf16 activations (else the GEMM converts q itself, one more launch); the down
    GEMM's pairs come from swiglu_quant.
    `align`: `moe_align(topk_ids, routed.num_local, routed.first_expert, BLOCK_M, topk_weights)`
    made by the caller (route_front computes it in the router's launch); its BLOCK_M must be
    the gate_up config's.
    `down_reduce=False` (only when the down config splits K, `down_split_parts(T * k, routed) > 1`):
    return the down's fp32 partials [P, T, k, H] instead of y (each local route's y row is
    bf16(+0.0 + parts[0] + ... + parts[P-1]); rows of other routes unspecified), for
    `finalize.finalize_split_shared_add`.
    """
    if swiglu not in ("fused", "unfused"):
        raise ValueError(f"swiglu={swiglu!r}: expected 'fused' or 'unfused'")
    if not isinstance(routed, RoutedExpertWeights):
        raise ValueError(f"routed: expected RoutedExpertWeights, got {type(routed).__name__}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected a [T, k] int tensor, got {getattr(topk_ids, 'shape', type(topk_ids))}")
    t, k = topk_ids.shape
    h, i = routed.hidden, routed.intermediate
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn or q.shape != (t, h):
        raise ValueError(f"q: expected [{t}, {h}] float8_e4m3fn, got "
                         f"{getattr(q, 'dtype', type(q))} shape {tuple(getattr(q, 'shape', ()))}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
            or topk_weights.shape != (t, k):
        raise ValueError(f"topk_weights: expected [{t}, {k}] float32, got "
                         f"{getattr(topk_weights, 'dtype', type(topk_weights))} "
                         f"shape {tuple(getattr(topk_weights, 'shape', ()))}")
    if not is_real(limit) or not 0 < limit < float("inf"):
        raise ValueError(f"limit={limit!r}: expected a finite number > 0")
    if not isinstance(sa, torch.Tensor):
        raise TypeError(f"sa: expected a torch.Tensor (act_quant's scales), got {type(sa).__name__}")
    if configs is not None and not (isinstance(configs, tuple) and len(configs) == 2
                                    and all(isinstance(c, GemmConfig) for c in configs)):
        raise ValueError(f"configs={configs!r}: expected None or (gate_up GemmConfig, down GemmConfig)")
    y = torch.empty((t * k, h), dtype=torch.bfloat16, device=q.device)
    cfg_up, cfg_down = configs or routed_configs(t * k, routed)
    if q_pairs is not None and not (isinstance(q_pairs, torch.Tensor) and cfg_up.a_bf16):
        raise ValueError(f"q_pairs: given ({type(q_pairs).__name__}), but the gate_up config {cfg_up!r} does not take "
                         f"bf16 activation pairs (a_bf16=False): pass None")
    down_parts = split_parts(cfg_down, i)
    if not down_reduce and down_parts == 1:
        raise ValueError(f"down_reduce=False: the down config {cfg_down!r} does not split K={i}, so there are no "
                         f"partials to hand over")
    if align is None:
        align = moe_align(topk_ids, routed.num_local, routed.first_expert, cfg_up.block_m, topk_weights)
    elif not isinstance(align, MoeAlignment) or align.block_m != cfg_up.block_m or align.num_routes != t * k \
            or align.top_k != k or align.row_weight is None or align.expert_counts.shape != (routed.num_local,):
        raise ValueError(f"align: expected a MoeAlignment of these {t * k} routes over {routed.num_local} local "
                         f"experts with BLOCK_M = {cfg_up.block_m} and row weights, got block_m="
                         f"{getattr(align, 'block_m', None)}, num_routes={getattr(align, 'num_routes', None)} "
                         f"({type(align).__name__})")
    if t * k == 0:
        out = y.view(t, k, h) if down_reduce else y.new_empty((down_parts, t, k, h), dtype=torch.float32)
        return (out, align) if return_alignment else out
    from ._triton_utils import interpreting
    from .swiglu_quant import swiglu_quant, swiglu_quant_partials, swiglu_quant_unfused  # SPEC §5.1

    # the split-K gate_up hands its partials to the SwiGLU-quant, which sums them (SWIGLU_SUMS_SPLIT)
    partials = swiglu == "fused" and SWIGLU_SUMS_SPLIT and split_parts(cfg_up, h) > 1
    gu = mxfp4_grouped_gemm(q, sa, routed.gate_up, routed.gate_up_scale, align,
                            gather_a=True, scatter_out=False, config=cfg_up, layout=routed.layout,
                            a_pairs=q_pairs if cfg_up.a_bf16 else None,
                            a_pairs_scaled=cfg_up.fold_sa and cfg_up.a_bf16 and q_pairs is not None,
                            reduce=not partials)
    # NOTE (session 13): from SWIGLU_ROUTE_LIST_MIN_ROUTES routes the SwiGLU-quant works on the
    # route list (align.route_rows: the GEMM row of each local route), not on the
    # alignment's max_rows rows - at decode most of those are block padding (Flash T = 16:
    # 96 routes in 1536 rows; the persistent grid over all of them took 12.9 us in the
    # session-11 profile, the list 3.1). Same rows computed, same bits
    # (tests/test_kernels_swiglu_quant.py). The route list holds exactly the rows with a
    # local route (row_expert >= 0), so no per-row expert filter (and its dependent id
    # load) is needed.
    use_list = t * k >= SWIGLU_ROUTE_LIST_MIN_ROUTES
    sel = dict(rows=align.route_rows) if use_list else dict(expert_ids=align.row_expert)
    if partials:
        hq, hs, *hp = swiglu_quant_partials(gu, align.route_rows, align.max_rows, limit=float(limit),
                                            route_weight=align.row_weight, pairs=pairs_mode(cfg_down))
    elif swiglu == "fused":
        if not use_list and interpreting():  # the persistent grid's runtime-bound loop
            sel["strategy"] = "group"
        hq, hs, *hp = swiglu_quant(gu, limit=float(limit), route_weight=align.row_weight,
                                   pairs=pairs_mode(cfg_down), **sel)
    else:
        hq, hs, *hp = swiglu_quant_unfused(gu, limit=float(limit), route_weight=align.row_weight,
                                           pairs=pairs_mode(cfg_down), **sel)
    out = mxfp4_grouped_gemm(hq, hs, routed.down, routed.down_scale, align,
                             gather_a=False, scatter_out=True, out=y, config=cfg_down, layout=routed.layout,
                             a_pairs=hp[0] if hp else None, a_pairs_scaled=bool(hp) and cfg_down.fold_sa,
                             reduce=down_reduce)
    out = out.view(t, k, h) if down_reduce else out.view(down_parts, t, k, h)
    return (out, align) if return_alignment else out
