"""MXFP4 grouped GEMM, W4A8 (SPEC §4.3 `fp4_gemm`, one expert per M-block).

    q       [M_a, K]              float8_e4m3fn  activations; M_a = T (gather_a: GEMM row of
                                                 route r reads token r // k) or max_rows
                                                 (rows already in permuted order)
    sa      [M_a, ceil(K/128)]    float32        act_quant scales (powers of two)
    w4      [E_local, N, K/2]     uint8          packed e2m1, low nibble = even k; byte order
                                                 `layout`: "nk" (row-major, the checkpoint's)
                                                 or "mma64" (weights/mma_layout.py), or
                                                 "mma64e" (its words re-encoded; the same
                                                 bits as "mma64", bitwise on the H200)
    sw      [E_local, N, K/32]    e8m0 / uint8   weight scale per 32 along K
    align   MoeAlignment                          from `moe_align` (same block_m as config)
    out     [R, N] bf16 (scatter_out: row = route id t*k + slot; rows of non-local routes are
            not written) or [max_rows, N] bf16 (row = GEMM row; padding rows not written)

Used for gate_up (w [E, 2I, H/2], gather_a, out [max_rows, 2I]) and down
(w [E, H, I/2], rows in permuted order, scatter_out to [T*k, H]). K must be a multiple
of 32 (I = 384 gives 12 scale groups over 3 activation blocks; no padding).

Three kernel bodies (GemmConfig.kind): "tile" (rows x weights MMA), "swap" (weights x
rows MMA, the dequantised weight as the register operand) and "gemv" (one route per
program on the CUDA cores, for decode where most experts get one row). With "mma64"
weights the tile and swap bodies load each thread's operand bytes as 16-byte vectors
(no shared-memory byte gathers; swap SASS loop 751 -> ~510 instructions) and the swap
body serves decode too (the GEMV reads only "nk"). "mma64e" weights take the same bodies with
a cheaper conversion PTX (4 funnel shifts + 4 LOP3 per 8 weights instead of 2 PRMT + 12
shift / LOP3; the interpreted path decodes the words first). All follow
SPEC §4.3 except that the four 32-wide partials of a 128-wide activation block are
summed before the block's `acc += part * sa` (a documented deviation, docs/DESIGN.md). `select_config(num_routes,
num_local, n, k)` picks by the expected rows per expert (measured on the H200, see
select_config).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .moe_align import MoeAlignment

# Which A row the padding rows of a block load (the tile and swap bodies' A_PAD): 0 row 0 of A
# (before session 22), 1 the block's first (routed) row, 2 as 1 with the loads masked to the
# routed rows (no request at all for padding). Padding rows' products are never stored: the
# same outputs every way (tests/test_kernels_mxfp4_gemm.py; on the H200 the whole layer's, at
# T = 24 / 32 both presets). NOTE (session 22, H200, layer bench, graphs, rotated weights, us
# for 0 / 1 / 2; docs/bench/2026-11-30/session22/): Flash T=4 163.4 / 152.3 / 146.6, T=16
# 404.9 / 365.2 / 360.4, T=24 530.7 / 490.7 / 469.1, T=64 898.1 / 877.3 / 839.7; Pro-TP8 T=16
# 190.0 / 175.5 / 174.4, T=32 308.1 / 291.9 / 290.5; T = 1 level (every row is token 0 there).
# With 0, every padding row of every program read token 0's row: thousands of programs on the
# same few L2 lines, and the speed hung on where that buffer sat in memory (two captures of
# one forward 8-11 % apart, gpu_probe_capture_spread.py).
A_PAD_ROWS = 2
# Exact split-K ways of the decode swap GEMMs with 2048 <= K < 4096 (the Flash-shaped down)
# below SHORT_K_DECODE_SPLIT_MAX_ROWS rows per expert (K >= 4096 splits 4 ways below 0.05 rows,
# K >= 6144 8 ways below 0.1; see _select_mma64). A/B switches (bench --set).
# NOTE (session 23, H200, layer bench, graphs, rotated weights, two alternating runs each,
# docs/bench/2026-11-30/session23/, us, unsplit -> 2 ways): Flash T=1 71.6 / 72.2 -> 69.7 /
# 70.0; T=2 (0.047 rows) 105.1 / 105.6 -> 106.9 / 106.5, so the split stops below T = 2.
# NOTE (session 31, H200, docs/bench/2026-11-30/session31/): 4 ways at Flash T=1 was 54.8 -> 54.4
# in the profile A/B (8 ways 57.3) but 55.9 -> 56.3 and 55.9 -> 56.1 us in the layer bench (graph
# of forwards, two runs): stays 2. MID_K_SPLIT 3 (the gate_up): 54.4 -> 57.3 in the profile A/B.
# NOTE (session 49, H200, scripts/gpu_ab_layer.py - the layer bench, graph-chain - two alternating runs,
# docs/bench/2026-12-02/session49/ab_flash_t1_279ea61.txt, us): Flash T=1 2 ways 54.1 / 53.9, 4 ways
# 54.2 / 54.2; the down at 64-wide tiles (routed_experts.CONFIG_OVERRIDE=down:block_n=64) 55.8 / 55.5.
SHORT_K_DECODE_SPLIT = 2
SHORT_K_DECODE_SPLIT_MAX_ROWS = 0.03
# ... of the long-K ones: K >= 6144 (the Pro-shaped gate_up) splits LONG_K_SPLIT ways below
# LONG_K_SPLIT_MAX_ROWS rows per expert, then LONG_K_SPLIT_MID ways below
# LONG_K_SPLIT_MID_MAX_ROWS; 4096 <= K < 6144 (the Flash-shaped gate_up) MID_K_SPLIT ways below
# MID_K_SPLIT_MAX_ROWS. A/B switches (bench --set) for session 24's per-GEMM probe
# (gpu_probe_swap_rows.py, docs/bench/2026-11-30/session24/, H200, "mma64e", us, the layer
# config -> split variants): Pro-TP8 gate_up T=8 (0.125 rows, unsplit) 58.9 -> 49.9 split 4,
# 51.1 split 7; T=16 81.1 -> 83.1 split 4; Flash gate_up T=2 (split 4, fp8) 50.0 -> 39.1
# unsplit on bf16 pairs. In the layer (routed_experts.UP_SPLIT_PAIRS' note) the split-4 band
# to 0.2 rows took Pro-TP8 T=8 from 139.5 to 127.7 us and Flash T = 2 unsplit 100.0 -> 94.8,
# so the bands are 0.1 / 0.2 (was 0.1 / none) and 0.03 (was 0.05). The split-4 band only for
# N <= LONG_K_SPLIT_MID_MAX_N (the Pro-TP8 gate_up, N = 768): the Pro-TP1 layer (gate_up N =
# 6144, 8x the programs) at T = 8 took 549.6 us with it against 527.4 without (one run each).
# Session 29 (H200, gpu_profile_layer.py --weight-sets 4 --no-kernels --ab-captures 3, layer
# forwards, medians of 3 captures, us; docs/bench/2026-11-30/session29/): LONG_K_SPLIT 8 -> 7
# (the per-GEMM probe had 7 at 1.15x on L2-warm weights) Pro-TP8 T=1 32.5 -> 33.5, T=2 44.7 ->
# 45.3, T=3 59.2 -> 59.3: stays 8. MID_K_SPLIT 4 -> 2 (probe 1.03x) Flash T=1 55.6 -> 55.2
# (captures 55.5 / 55.6 / 55.6 against 55.2 / 54.9 / 55.3; the layer output bitwise): 2.
LONG_K_SPLIT = 8
LONG_K_SPLIT_MAX_ROWS = 0.1
LONG_K_SPLIT_MID = 4
# NOTE (session 43, H200, layer bench --graph-chain, docs/bench/2026-12-01/session43/, us, split-4 band
# to 0.2 rows -> to 0.3 / 0.25 rows, alternating runs): Pro-TP8 T=13 (0.203 rows) 129.3, 130.2, 130.5,
# 129.6 -> 125.6, 125.6, 125.9, 126.3; T=14 (0.219) 131.0, 132.1, 130.8, 131.0 -> 129.9, 130.2, 129.8,
# 129.9; T=15 (0.234) 136.1, 135.7 -> 139.2, 138.5; T=16 (0.25, 0.3 only) 136.6, 136.6 -> 141.8, 142.2.
# So for N <= LONG_K_SPLIT_MID_NARROW_N (the Pro-TP8 gate_up, N = 768) the band ends at 0.22 rows (T <=
# 14; was 0.2, T <= 12). T=12 117.2, 117.1 / 117.0, 116.9. Not at Pro-TP4 (N = 1536), where the band to
# 0.22 was slower (same bench, band to 0.22 / 0.2, us): T=13 265.3 / 255.9, 257.3; T=14 277.3 / 266.9,
# 268.9; T=12 246.8 / 247.9, 249.0 (the same config): it keeps 0.2.
LONG_K_SPLIT_MID_MAX_ROWS = 0.2
LONG_K_SPLIT_MID_NARROW_MAX_ROWS = 0.22
LONG_K_SPLIT_MID_NARROW_N = 1024
LONG_K_SPLIT_MID_MAX_N = 2048
MID_K_SPLIT = 2
MID_K_SPLIT_MAX_ROWS = 0.03

__all__ = ["GemmConfig", "select_config", "gemv_config", "mxfp4_grouped_gemm", "split_parts"]


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # layout flags (see _mxfp4_grouped_gemm_kernel). NOTE: a_split + scale_bcast measured
    # fastest on the H200 at every T (scripts/gpu_probe_mxfp4.py, 2026-11-29): Flash gate_up
    # T=1 112 -> 62 us, T=16 1079 -> 546 us, T=4096 (64x128) 21954 -> 4572 us; results
    # bitwise equal to the plain layout.
    a_split: bool = True
    w_kn: bool = False
    scale_bcast: bool = True
    diag: int = 0              # probes only: 1 = skip dequant, 2 = skip MMA (wrong results)
    # kernel body: "tile" (rows x weights MMA), "swap" (weights x rows MMA, the dequantised
    # weight as the register operand), "gemv" (one row per program, CUDA cores; block_m 1)
    kind: str = "tile"
    # split over K ("swap"/"gemv"): each program does cdiv(KB, split_k) 128-blocks and
    # writes per-block partials to an fp32 workspace summed in block order after (exact)
    split_k: int = 1
    # dequantise with the inline-PTX bf16x2 construction (_dequant_w); ignored (False)
    # under the Triton interpreter, which cannot run PTX; needs scale_bcast for "tile"
    asm: bool = False
    # "gemv": 128-blocks per loop iteration (independent loads in flight together);
    # "swap": Triton's loop_unroll_factor of the K loop (fewer pipeline barriers per block)
    unroll: int = 1
    # "swap" and "tile": hand the MMA its activation operand as bf16 ([64 even | 64 odd] per
    # 128-block: the `a_pairs` act_quant / swiglu_quant write with pairs=True, or converted
    # by torch in the wrapper when none are given), so the body skips the fp8 -> bf16
    # conversion and its barrier per block; same values, same MMA, so bitwise the default.
    # routed_configs turns it on where the H200 measured a gain (session 11, swap: 9-14 %;
    # session 12, tile: 5-10 %, more with a register cap on gate_up).
    a_bf16: bool = False
    # ptxas register cap per thread (None: the compiler's choice). Session 5 measured caps
    # on the prefill tile body (250 -> 128..168 registers): spills, 1.2-1.9x slower. The
    # swap body sits at 147 (3 programs per SM); 128 fits 4 with an 8-byte spill (local
    # sm_90 compile); probed in session 6 by scripts/gpu_probe_swz.py.
    maxnreg: int | None = None
    # "swap" / "tile": the activation scale folded into the bf16 activation operand (bf16(q *
    # sa), exact for power-of-two scales; with a_bf16 the caller hands "scaled pairs",
    # act_quant / swiglu_quant pairs="scaled"), so the K loop accumulates in the MMA chain: no
    # per-block `acc += part * sa`, no wait on each block's MMA, no scale loads (see the swap
    # kernel). routed_experts.routed_configs turns it on for the tile configs of the mma64
    # layout and for the swap configs with short K loops (see there). NOTE (session 16): folded, the
    # swap body's register-operand wgmma stays in flight across the K loop's back edge, and
    # ptxas < 13.3 may reuse its A registers too early (triton-lang/triton#9433): wrong,
    # run-to-run different outputs on the H200 (32-row body, 3-4 stages; scripts/
    # gpu_probe_fold32.py). The swap body therefore converts the odd-k half after the even-k
    # MMA when folded (mma64 + asm only; other folded swap launches on CUDA are refused), and
    # scripts/sass_wgmma_hazard.py checks the compiled SASS. On the H200 (session 17,
    # docs/bench/2026-11-29/session17/probe_fold32_*_d97206c.txt) that body is exact at 2, 3 and 4
    # stages, unrolled or not: 10/10 reruns bitwise on two seeds, > 1 ulp off an fp64 product
    # on <= 0.0009 % of outputs (per-block body: <= 0.0004 %); the 3-4 stage race is gone.
    fold_sa: bool = False
    # The folded swap body's ordering (see _mxfp4_grouped_gemm_swap_kernel): "wait" (both
    # halves converted, both MMAs, a wait per block; the loads stay pipelined) or "split" (the
    # odd half converted after the even MMA, behind a barrier; unpipelined loads). Same bits.
    fold_order: str = "wait"
    # "swap": launch order with the weight blocks (N) fastest, so the programs of one M-block run
    # together (its activation rows and its expert's weights read from DRAM about once); False
    # walks the M-blocks first. Same programs, same bits. routed_configs sets it on the unsplit
    # 32/64-row swap GEMMs (session 19: Flash layer T = 8192 1.10x; see routed_experts._n_fastest).
    n_fastest: bool = False
    # "swap", folded "wait" (session 33): each 128-block's two K = 64 halves as one K = 128 MMA
    # chain ([lo | hi] along K: the order of the two chained MMAs it replaces, so the same adds and
    # the same bits) with one wgmma wait per block instead of two; on bf16 pairs the block's operand
    # loads as stored. routed_experts.routed_configs sets it where the H200 measured it faster.
    one_chain: bool = False
    # "swap", folded "wait", unsplit, over exactly three 128-wide K blocks of "mma64" weights (the
    # short-K Pro-TP8 down, K = I / tp = 384): all three blocks' weight and scale loads issued
    # before the first block's MMAs instead of one block at a time behind the previous block's
    # wgmma wait (session 42's SASS). Same MMAs, same bits. routed_experts.PRO_DOWN_PRELOAD_MIN_ROWS sets it on the
    # 16 x 64 blocks from 0.5 rows per expert (session 43: Pro-TP8 T = 32-256 1-4 % faster in the layer).
    preload: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("tile", "swap", "gemv"):
            raise ValueError(f"GemmConfig.kind={self.kind!r}: expected 'tile', 'swap' or 'gemv'")
        if self.kind == "gemv":
            if self.block_m != 1:
                raise ValueError(f"GemmConfig.block_m={self.block_m}: kind 'gemv' needs block_m=1")
        elif self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"GemmConfig.block_m={self.block_m}: expected 16, 32, 64, 128 or 256")
        if self.block_n not in (16, 32, 64, 128, 256):
            raise ValueError(f"GemmConfig.block_n={self.block_n}: expected 16, 32, 64, 128 or 256")
        if self.one_chain and not (self.kind == "swap" and self.fold_sa and self.fold_order == "wait"):
            raise ValueError(f"GemmConfig.one_chain=True needs kind 'swap' with fold_sa=True and fold_order 'wait', "
                             f"got kind={self.kind!r}, fold_sa={self.fold_sa}, fold_order={self.fold_order!r}")
        if self.preload and not (self.kind == "swap" and self.fold_sa and self.fold_order == "wait"
                                 and self.split_k == 1):
            raise ValueError(f"GemmConfig.preload=True needs kind 'swap' with fold_sa=True, fold_order 'wait' and "
                             f"split_k=1, got kind={self.kind!r}, fold_sa={self.fold_sa}, "
                             f"fold_order={self.fold_order!r}, split_k={self.split_k}")
        if self.a_bf16 and self.kind == "gemv":
            raise ValueError(f"GemmConfig.a_bf16=True needs kind 'swap' or 'tile', got kind={self.kind!r}")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 24 <= self.maxnreg <= 255):
            raise ValueError(f"GemmConfig.maxnreg={self.maxnreg!r}: expected None or an int in [24, 255]")
        if not isinstance(self.unroll, int) or self.unroll < 1 or (self.unroll > 1 and self.kind == "tile"):
            raise ValueError(f"GemmConfig.unroll={self.unroll!r}: expected an int >= 1 (1 for kind 'tile')")
        if self.fold_sa and self.kind == "gemv":
            raise ValueError(f"GemmConfig.fold_sa=True needs kind 'swap' or 'tile', got kind={self.kind!r}")
        if self.n_fastest and self.kind != "swap":
            raise ValueError(f"GemmConfig.n_fastest=True needs kind 'swap', got kind={self.kind!r}")
        if self.fold_order not in ("wait", "split"):
            raise ValueError(f"GemmConfig.fold_order={self.fold_order!r}: expected 'wait' or 'split'")
        if not isinstance(self.split_k, int) or self.split_k < 1 or (self.split_k > 1 and self.kind == "tile"):
            raise ValueError(f"GemmConfig.split_k={self.split_k!r}: expected an int >= 1 (1 for kind 'tile')")


def select_config(num_routes: int, num_local: int, n: int, k: int, layout: str = "nk") -> GemmConfig:
    """Block config for R routes over E_local experts into an N x K weight (see module doc).

    By the expected rows per local expert (R / E_local, uniform routing assumed); every
    choice dequantises with the inline PTX (asm=True, bitwise equal to the fp32
    construction on the H200 at every probed shape). NOTE: from the H200 probes
    (scripts/gpu_probe_mxfp4_bodies.py, docs/bench/2026-11-29/session2/, CUDA graphs,
    Flash gate_up / Pro-TP8 gate_up in us, old default -> chosen):
      < 0.05 rows (T <= 2 at 256-384 experts; < 0.1 when K >= 6144): "gemv", one route per program, no 16-row MMA
            padding (T=1: 73.1 -> 42.7, 90.6 -> 33.1); BLOCK_N 16 / 2 warps for the long-K
            gate_up, 64 / 4 warps for down (Flash down T=1 36.9 -> 22.8)
      < 8   (T = 16 .. 256): "tile" 16 x 128 (T=64: 1357.8 -> 1110.1, 591.7 -> 477.8;
            "swap" is level on gate_up and up to 25 % slower on Pro-TP8 down)
      < 64  (T = 1024): "swap" 32 x 128 (3376.0 -> 1937.3, 1243.4 -> 894.4)
      else  (T = 4096): "tile" 64 x 128 (4596.0 -> 4076.1, 1758.8 -> 1522.6)
    Split-K (exact) never paid on these shapes (its workspace pass costs more than the
    parallelism gains), so split_k stays 1.
    """
    rows = num_routes / max(num_local, 1)
    if layout in ("mma64", "mma64e"):
        return _select_mma64(rows, k, n)
    # NOTE (session 3, after the cheaper dequantisation PTX sped the MMA bodies up 8-14 %):
    # at T = 4 on Flash the tile body passes the GEMV (probe_mxfp4_asm.txt of session 3:
    # gate_up 143.9 -> 131.5 us, down 77.8 -> 68.2); the long-K Pro-TP8 gate_up keeps the
    # unrolled GEMV (66.5 vs 78.9 us).
    if rows < 0.05 or (rows < 0.1 and k >= 6144):
        return gemv_config(k)
    if rows < 8:
        return GemmConfig(16, 128, 4, 3, asm=True)
    if rows < 64:
        return GemmConfig(32, 128, 4, 3, kind="swap", asm=True)
    return GemmConfig(64, 128, 4, 3, asm=True)


def _select_mma64(rows: float, k: int, n: int = 0) -> GemmConfig:
    """Config for "mma64" weights (the GEMV reads only "nk", so the swap body serves
    decode). NOTE: from the H200 probe of session 4 (scripts/gpu_probe_swz.py,
    docs/bench/2026-11-29/session4/, CUDA graphs, us, "nk" default -> "mma64" swap 16x128):
      T=1    Flash gate_up 41.5 (gemv) -> 43.4, down 22.2 -> 21.5; Pro-TP8 gate_up
             (K = 7168, 72 programs) 29.4 -> 44.3 unsplit, 29.8 split 8 ways (taken
             when rows < 0.1 and K >= 6144, as the nk GEMV rule; 19.9 once the
             reduce was unrolled, and Flash gate_up 39.9 split 4 ways, see below)
      T=4    Flash gate_up 135.0 (tile) -> 109.4; Pro-TP8 gate_up 63.7 -> 64.6 (split 8)
      T=16   Flash gate_up 423.4 -> 338.0, down 212.9 -> 170.1; Pro-TP8 161.5 -> 125.8
      T=64   Flash gate_up 1024.2 -> 818.3; Pro-TP8 gate_up 442.4 -> 341.7
      T=1024 (32 x 128) Flash gate_up 1785 -> 1469, Pro-TP8 down 572 -> 482
      T=4096 (tile 64 x 128) Flash gate_up 4155 -> 4352, down 1822 -> 2118: the tile
             body's shared-memory store of the dequantised tile is slower from this
             layout (3-14 % on the four GEMMs); kept, the decode gains are larger."""
    if rows < 8:
        # NOTE: with the unrolled reduce (1c65fa3, probe_swz_decode_splitk_1c65fa3.txt):
        # Flash gate_up T=1 43.7 -> 39.9 us split 4 ways (T=4 131 vs 110 unsplit: no);
        # Pro-TP8 gate_up T=1 43.7 -> 19.9 split 8 (T=4 67.0 -> 48.8); K = 2048 / 384: level
        # then; K = 2048 split 2 ways at T = 1 since session 23 (see SHORT_K_DECODE_SPLIT)
        if rows < LONG_K_SPLIT_MAX_ROWS and k >= 6144:
            split = LONG_K_SPLIT
        elif (rows < (LONG_K_SPLIT_MID_NARROW_MAX_ROWS if n <= LONG_K_SPLIT_MID_NARROW_N else LONG_K_SPLIT_MID_MAX_ROWS)
              and k >= 6144 and n <= LONG_K_SPLIT_MID_MAX_N):
            split = LONG_K_SPLIT_MID
        elif rows < MID_K_SPLIT_MAX_ROWS and 4096 <= k < 6144:
            split = MID_K_SPLIT
        elif rows < SHORT_K_DECODE_SPLIT_MAX_ROWS and k >= 2048:
            split = SHORT_K_DECODE_SPLIT
        else:
            split = 1
        return GemmConfig(16, 128, 4, 4, kind="swap", asm=True, split_k=split)
    if rows < 64:
        return GemmConfig(32, 128, 4, 3, kind="swap", asm=True)
    return GemmConfig(64, 128, 4, 3, asm=True)


def gemv_config(k: int) -> GemmConfig:
    """The "gemv" body's config for reduction length K (also used for down when gate_up
    of the same layer runs the GEMV, since both share one block_m = 1 alignment)."""
    if k < 4096:
        return GemmConfig(1, 64, 4, 4, kind="gemv", asm=True)
    # NOTE: 4 blocks per iteration for very long K (probe_mxfp4_unroll.txt: Pro-TP8
    # gate_up, K = 7168, T=1 33.1 -> 28.4 us, T=4 73.9 -> 66.5; Flash K = 4096 level)
    return GemmConfig(1, 16, 2, 4, kind="gemv", asm=True, unroll=4 if k >= 6144 else 1)


def _fail(name: str, t, expected: str) -> None:
    raise ValueError(f"{name}: expected {expected}, got "
                     f"{getattr(t, 'dtype', type(t))} shape {tuple(getattr(t, 'shape', ()))}")


def mxfp4_grouped_gemm(q: torch.Tensor, sa: torch.Tensor, w4: torch.Tensor, sw: torch.Tensor,
                       align: MoeAlignment, *, gather_a: bool, scatter_out: bool,
                       out: torch.Tensor | None = None, config: GemmConfig | None = None,
                       layout: str = "nk", a_pairs: torch.Tensor | None = None,
                       a_pairs_scaled: bool = False, reduce: bool = True) -> torch.Tensor:
    """Grouped W4A8 GEMM over the blocks of `align`; see the module docstring for layouts.

    `reduce=False` (only for a config that splits K, `split_parts(config, K) > 1`): return
    the fp32 partials [P, R, N] by route instead of `out` - each local route's output row is
    bf16(+0.0 + partials[0, r] + ... + partials[P-1, r]), the sum the reduce launch would
    make (rows of non-local routes are unspecified) - and leave the reduction to the
    consumer (`swiglu_quant_partials`); `out` is then not written.

    `a_pairs` (optional, only with config.a_bf16): `bf16_pairs(q)` made by the caller (e.g.
    by act_quant / swiglu_quant in the same kernel that wrote q), so no conversion runs here;
    with config.fold_sa they must be the scaled pairs `bf16_pairs(q, sa)` (act_quant /
    swiglu_quant pairs="scaled"), and `a_pairs_scaled=True` says they are.
    """
    for name, t, optional in (("q", q, False), ("sa", sa, False), ("w4", w4, False), ("sw", sw, False),
                              ("out", out, True), ("a_pairs", a_pairs, True)):
        if not (isinstance(t, torch.Tensor) or (optional and t is None)):
            raise TypeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        _fail("q", q, "[M, K] float8_e4m3fn")
    m_a, k = q.shape
    if k % 32:
        raise ValueError(f"q: K={k} must be a multiple of 32 (MXFP4 scale groups)")
    kb = -(-k // 128)
    if sa.dtype != torch.float32 or sa.shape != (m_a, kb):
        _fail("sa", sa, f"[{m_a}, {kb}] float32")
    if w4.dim() != 3 or w4.dtype != torch.uint8 or w4.shape[2] != k // 2:
        _fail("w4", w4, f"[E_local, N, {k // 2}] uint8 (packed e2m1)")
    e_local, n, _ = w4.shape
    if sw.dtype not in (torch.uint8, torch.float8_e8m0fnu) or sw.shape != (e_local, n, k // 32):
        _fail("sw", sw, f"[{e_local}, {n}, {k // 32}] float8_e8m0fnu/uint8")
    if not isinstance(align, MoeAlignment):
        raise ValueError(f"align: expected a MoeAlignment from moe_align, got {type(align).__name__}")
    if align.expert_counts.shape[0] != e_local:   # the kernel would read weights past the last expert
        raise ValueError(f"align: made for num_local={align.expert_counts.shape[0]} experts, but w4 holds "
                         f"E_local={e_local}")
    expected_ma = align.num_tokens if gather_a else align.max_rows
    if m_a != expected_ma and align.num_routes:
        raise ValueError(f"q: {m_a} rows, expected {expected_ma} "
                         f"({'tokens T' if gather_a else 'permuted rows max_rows'})")
    cfg = config or GemmConfig(block_m=align.block_m)
    if cfg.block_m != align.block_m:
        raise ValueError(f"config.block_m={cfg.block_m} differs from the alignment's block_m={align.block_m}")
    if layout not in ("nk", "mma64", "mma64e"):
        raise ValueError(f"layout={layout!r}: expected 'nk', 'mma64' or 'mma64e'")
    if layout in ("mma64", "mma64e"):
        from dsv4_moe.weights.mma_layout import mma64_supported  # noqa: PLC0415

        ok, why = mma64_supported(n, k)
        if not ok:
            raise ValueError(f"w4: layout {layout!r} needs whole 64 x 128 tiles: {why}")
        if cfg.kind == "gemv" or cfg.block_n % 64 or not cfg.scale_bcast:
            raise ValueError(f"config={cfg!r}: layout {layout!r} needs kind 'tile' or 'swap', block_n a "
                             f"multiple of 64 and scale_bcast")
    out_rows = align.num_routes if scatter_out else align.max_rows
    if out is None:
        out = torch.empty((out_rows, n), dtype=torch.bfloat16, device=q.device)
    elif out.dtype != torch.bfloat16 or out.shape != (out_rows, n) or out.stride(1) != 1:
        _fail("out", out, f"[{out_rows}, {n}] bfloat16, unit stride along N")
    for name, ten in (("sa", sa), ("w4", w4), ("sw", sw), ("out", out),
                      ("align.sorted_route_ids", align.sorted_route_ids)):
        if ten.device != q.device:
            raise ValueError(f"{name}: on {ten.device}, expected q's device {q.device}")
    if not reduce and split_parts(cfg, k) == 1:
        raise ValueError(f"reduce=False: config={cfg!r} does not split K={k}, so there are no partials "
                         f"to hand over (split_parts(config, K) = 1)")
    if align.num_routes == 0 or align.max_blocks == 0:
        if not reduce:  # no local route: nothing to sum, every row unspecified
            return torch.empty((split_parts(cfg, k), align.num_routes, n), dtype=torch.float32, device=q.device)
        return out
    import triton  # noqa: PLC0415

    from ._mxfp4_grouped_gemm import _mxfp4_grouped_gemm_kernel
    from ._triton_utils import interpreting, pdl_options
    q = q.contiguous()
    sa = sa.contiguous()
    w4 = w4.contiguous()
    sw = sw.contiguous().view(torch.uint8)
    swz = layout in ("mma64", "mma64e")
    enc = layout == "mma64e"
    if a_pairs is not None and a_pairs_scaled != (cfg.fold_sa and cfg.a_bf16):
        raise ValueError(f"a_pairs_scaled={a_pairs_scaled}: config.fold_sa={cfg.fold_sa} takes "
                         f"{'scaled' if cfg.fold_sa else 'plain'} pairs")
    if cfg.a_bf16:
        if k % 128:
            raise ValueError(f"config.a_bf16=True: K={k} must be a multiple of 128")
        if a_pairs is None:
            q = bf16_pairs(q, sa if cfg.fold_sa else None)
        elif (not isinstance(a_pairs, torch.Tensor) or a_pairs.dtype != torch.bfloat16
              or a_pairs.shape != q.shape or a_pairs.stride() != (k, 1) or a_pairs.device != q.device):
            _fail("a_pairs", a_pairs, f"a contiguous {list(q.shape)} bfloat16 tensor on {q.device} (bf16_pairs(q))")
        else:
            q = a_pairs
    elif a_pairs is not None:
        raise ValueError(f"a_pairs: given, but config.a_bf16 is False (config={cfg!r})")
    if cfg.fold_sa and cfg.kind == "swap" and not interpreting() and not (swz and cfg.asm):
        raise ValueError(f"config.fold_sa=True on the swap body needs layout 'mma64' or 'mma64e' and asm=True on CUDA "
                         f"(got layout={layout!r}, asm={cfg.asm}): only that body is measured and checked in "
                         f"SASS (scripts/sass_wgmma_hazard.py) against ptxas < 13.3 reusing an in-flight "
                         f"wgmma's registers")
    if cfg.preload and (k != 384 or not swz):
        raise ValueError(f"config.preload=True: needs K = 384 (three 128-wide blocks) on 'mma64' / 'mma64e' weights, "
                         f"got K={k}, layout={layout!r}")
    if cfg.kind != "tile":
        return _launch_split(q, sa, w4, sw, out, align, gather_a, scatter_out, k, n, cfg, swz, enc, reduce)
    grid = (align.max_blocks, triton.cdiv(n, cfg.block_n))
    _mxfp4_grouped_gemm_kernel[grid](
        q, sa, w4, sw, out,
        align.sorted_route_ids, align.block_expert, align.num_valid_blocks,
        n, align.num_routes, align.top_k,
        q.stride(0), sa.stride(0), w4.stride(0), w4.stride(1), sw.stride(0), sw.stride(1),
        out.stride(0),
        A_GATHER=gather_a, OUT_SCATTER=scatter_out, K=k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        SOFTWARE_BF16=interpreting(),
        A_SPLIT=cfg.a_split, W_KN=cfg.w_kn, SCALE_BCAST=cfg.scale_bcast, DIAG=cfg.diag,
        ASM=cfg.asm and cfg.scale_bcast and not interpreting(), W_SWZ=swz, W_ENC=enc, A_BF16=cfg.a_bf16,
        FOLD_SA=cfg.fold_sa, A_PAD=A_PAD_ROWS, num_warps=cfg.num_warps, **_launch_opts(cfg), **pdl_options(out.device),
    )
    return out


def _launch_opts(cfg: GemmConfig) -> dict:
    """Extra Triton launch options of a config (the interpreter ignores them)."""
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}


def bf16_pairs(q: torch.Tensor, sa: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] e4m3 -> [M, K] bf16 (exact) with each 128-block as its 64 even k then its 64
    odd k: the swap body's second operand when GemmConfig.a_bf16 is set. With `sa` [M,
    K/128] (fp32 powers of two) the scaled pairs bf16(q * sa) (exact; GemmConfig.fold_sa)."""
    m, k = q.shape
    if sa is not None:
        scaled = (q.float().view(m, k // 128, 128) * sa[:, :, None]).to(torch.bfloat16)
        return scaled.view(m, k // 128, 64, 2).transpose(2, 3).reshape(m, k).contiguous()
    out = torch.empty((m, k), dtype=torch.bfloat16, device=q.device)
    # one elementwise kernel: the cast and the permutation in a single strided copy (the
    # session-5 profile showed `.to` + `.reshape` as two copy kernels, ~5 us at T = 16)
    out.view(m, k // 128, 2, 64).copy_(q.view(m, k // 128, 64, 2).transpose(2, 3))
    return out


def _split_shape(split_k: int, k: int) -> tuple[int, int]:
    """(splits, 128-blocks per split) of a split-K launch over K."""
    kb = -(-k // 128)
    kb_per = -(-kb // min(split_k, kb))
    return -(-kb // kb_per), kb_per


def split_parts(config: GemmConfig, k: int) -> int:
    """The fp32 partials per output element that `config` writes over reduction length K
    (1: the GEMM does not split, its output is final): one per split with fold_sa, one per
    128-block without."""
    if config.kind == "tile" or _split_shape(config.split_k, k)[0] == 1:
        return 1
    return _split_shape(config.split_k, k)[0] if config.fold_sa else -(-k // 128)


def _launch_split(q, sa, w4, sw, out, align, gather_a, scatter_out, k, n, cfg, swz, enc=False, reduce=True):
    """The "swap" and "gemv" bodies, optionally split over K with an ordered reduction
    (reduce=False: the partials are returned unreduced)."""
    import triton  # noqa: PLC0415

    from ._mxfp4_grouped_gemm import _mxfp4_gemv_kernel, _mxfp4_grouped_gemm_swap_kernel, _split_k_reduce_kernel
    from ._triton_utils import interpreting, pdl_options
    kb = -(-k // 128)
    splits, kb_per = _split_shape(cfg.split_k, k)
    split = splits > 1
    r = align.num_routes
    # one fp32 partial per 128-block, summed in block order after; with fold_sa one per split
    parts = splits if cfg.fold_sa else kb
    ws = torch.empty((parts, r, n) if split else (1,), dtype=torch.float32, device=q.device)
    grid = (align.max_blocks, triton.cdiv(n, cfg.block_n), splits)
    if cfg.n_fastest:
        if align.max_blocks > 65535:  # CUDA's grid y limit
            raise ValueError(f"config.n_fastest=True: {align.max_blocks} M-blocks exceed the grid's y limit "
                             f"65535; use n_fastest=False")
        grid = (grid[1], grid[0], splits)
    args = (q, sa, w4, sw, out, ws, align.sorted_route_ids, align.block_expert, align.num_valid_blocks,
            n, r, align.top_k, q.stride(0), sa.stride(0), w4.stride(0), w4.stride(1), sw.stride(0), sw.stride(1),
            out.stride(0))
    common = dict(A_GATHER=gather_a, OUT_SCATTER=scatter_out, K=k, BLOCK_N=cfg.block_n,
                  NUM_STAGES=cfg.num_stages, KB_PER=kb_per, SPLIT=split, SOFTWARE_BF16=interpreting(),
                  ASM=cfg.asm and not interpreting(),
                  num_warps=cfg.num_warps, **_launch_opts(cfg), **pdl_options(out.device))
    if cfg.kind == "swap":
        _mxfp4_grouped_gemm_swap_kernel[grid](*args, BLOCK_M=cfg.block_m, W_SWZ=swz, W_ENC=enc, A_BF16=cfg.a_bf16,
                                              DIAG=cfg.diag, LOOP_UNROLL=cfg.unroll, FOLD_SA=cfg.fold_sa,
                                              FOLD_WAIT=cfg.fold_order == "wait", N_FASTEST=cfg.n_fastest,
                                              A_PAD=A_PAD_ROWS, ONE_CHAIN=cfg.one_chain, PRELOAD=cfg.preload,
                                              **common)
    else:
        _mxfp4_gemv_kernel[grid](*args, UNROLL=cfg.unroll, **common)
    if split and not reduce:
        return ws
    if split:
        # one route x 128 columns per program (16-byte loads, 1 warp): at decode (6 routes)
        # the 4 x 256 tiles gave 6-18 programs for the whole reduction
        br, bn = 1, 128
        _split_k_reduce_kernel[(triton.cdiv(r, br), triton.cdiv(n, bn))](
            ws, out, align.route_rows, r, n, out.stride(0), KB=parts, OUT_SCATTER=scatter_out,
            BLOCK_R=br, BLOCK_N=bn, SOFTWARE_BF16=interpreting(), num_warps=1, **pdl_options(out.device))
    return out
