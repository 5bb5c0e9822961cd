"""Triton body of `mxfp4_grouped_gemm`: W4A8 grouped GEMM over `moe_align` blocks.

Grid (max_blocks, cdiv(N, BLOCK_N)); a program whose M-block index is past the device
scalar num_valid_blocks returns at once, so the grid is sized from shapes only.

Per program: the BLOCK_M rows of one expert (route ids from the permutation; the
sentinel R marks rows without a route, which read row 0 and are never stored), a
BLOCK_N slice of that expert's output features, and a loop over K in 128-wide blocks kb
(one activation scale each):

    w   = bf16(e2m1(w4[e, n, k]) * 2^(sw[e, n, k // 32] - 127))   exact, built on the bits
    a   = bf16(q[rows, k])                                          exact (e4m3 -> bf16; or read
                                                                    as the bf16 pairs, A_BF16)
    p   = dot(a, w^T)                       bf16 MMA, fp32 accumulation over the 128 k
    acc = acc + p * sa[row, kb]             exact product (power of two)

NOTE: Triton's own `tl.dot_scaled(e4m3, e2m1)` (which also upcasts to bf16 on Hopper) was
measured slower at every T (Flash gate_up T=1 80.6 vs 62.5 us, T=4096 7701 vs 4553 us)
and not bitwise equal to this path at T >= 256 (docs/bench/2026-11-29/
probe_mxfp4_dot_scaled.txt), so it is not used.

Why bf16 MMA and not FP8 MMA: every product q * e2m1 * 2^s is exact in fp32 either way,
but Hopper's FP8 wgmma keeps only ~14 bits while accumulating inside the instruction
(measured on the H200: 1.5-2.6% of bf16 outputs off the reference at M >= 64 tiles),
and applying the per-32 weight scale after an FP8 MMA needs a K=32 MMA per scale group
(measured 0.4-0.5 TB/s). NOTE (session 5, commit 239523e, reverted): an FP8 tile body
that folds each 32-group's scale into the e4m3 weight relative to the row's largest scale
in the 128-block (exact for spreads <= 8; PTX via f16x2 + cvt.e4m3x2) and runs FP8 wgmma
was measured at T = 4096 (docs/bench/2026-11-29/session5/probe_fp8_tile_239523e.txt):
never faster (best of 8 configs: Flash gate_up 4097 us vs 4152 for this bf16 body, Pro-TP8
down 1093 vs 938) and 4.5-6.2 % of outputs off this body's: the prefill tile is not bound
by the MMA rate. The same ncu (Flash gate_up T=4096, ncu_prefill_tile_be1c6ff.txt): 250 registers
per thread, so 2 programs (8 warps) per SM; 54 % of cycles with no eligible warp, issue
slots 46 % busy: latency-bound at low occupancy. Capping registers (ptx .maxnreg 128 /
152 / 168, probe_maxnreg_308c9ed.txt) spills and is 1.2-1.9x slower at T = 1024-4096.
Folding the e8m0 scale into a bf16 weight is exact for scale
bytes in [0, 128] (the fp32 factor 2^(s-1) must be a normal fp32; real checkpoints sit
near 120), so one 128-deep bf16 MMA per activation block does the
whole block. NOTE: SPEC §4.3 makes the 32-wide sub-block the unit (`acc += partial_j *
sa * sw_j` per j, in order); summing the four 32-wide partials of a 128-block before the
one `acc += part * sa` re-associates across sub-blocks, a deviation from the contract
(0-0.024 % of layer outputs off the reference by 1 ulp, measured), not an in-block
freedom; docs/DESIGN.md ("Numerics decisions") has the figures and the open decision. The dispatch predicate rejects
layers whose scale bytes leave [0, 128] (checked once at load).

e2m1 magnitude code c = e1 e0 m: value 2^(e-1) (1 + m/2) for e = c >> 1 >= 1, 0.5 for
c = 1, 0 for c = 0. The weight dequantisation (fp32 construction, the inline-PTX
versions) and the "mma64" operand loads live in `_mxfp4_dequant.py`.
"""

import triton
import triton.language as tl

from ._mxfp4_dequant import (_dequant_w, _dequant_w_asm, _dequant_w_swz_asm, _dequant_w_swz_asm_half, _mma64e_decode,
                             _mma64_tile_ptrs, _mma64_unswizzle,
                             _nibbles_to_f32)
from ._triton_utils import pdl_enter, round_to_bf16


@triton.jit
def _opaque_f32(x):
    """x itself, through inline PTX the compiler cannot see into, so the MMAs that produced x
    must retire first (a wgmma wait) - the folded swap body's per-block fence."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _a_rows(sorted_ids_ptr, pid_m, rows, route, row_ok, R, top_k, A_GATHER: tl.constexpr,
            BLOCK_M: tl.constexpr, A_PAD: tl.constexpr):
    """The A row (int64) each GEMM row of block pid_m loads: the route's token (A_GATHER) or
    the row itself; a padding row (row_ok False) loads A_PAD 0: row 0 of A; 1: the block's
    first row's (always a route: an expert's rows are packed from its first block row);
    2: as 1, and the A loads are masked to the routed rows (no request for padding).
    The padding rows' products are never stored, so all three give the same outputs.
    NOTE (session 22, H200): with A_PAD 0 every padding row of every program reads token 0's
    row - at decode 15 of a 16-row block's rows, so thousands of programs hammer the same few
    L2 lines - and the Flash gate_up at T = 24 ran 270 or 317 us depending only on where that
    one [T, K] buffer sat in memory (docs/bench/2026-11-30/session22/)."""
    if A_GATHER:
        arow = route // top_k
    else:
        arow = rows
    if A_PAD == 0:
        first = 0
    else:
        r0 = tl.load(sorted_ids_ptr + pid_m * BLOCK_M)
        if A_GATHER:
            first = tl.where(r0 < R, r0 // top_k, 0)
        else:
            first = pid_m * BLOCK_M
    return tl.where(row_ok, arow, first).to(tl.int64)


@triton.jit
def _mxfp4_grouped_gemm_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_blocks_ptr,
    N, R, top_k,
    stride_am, stride_sam,
    stride_we, stride_wn,
    stride_swe, stride_swn,
    stride_om,
    A_GATHER: tl.constexpr,     # True: A row = route // top_k (tokens); False: A row = GEMM row
    OUT_SCATTER: tl.constexpr,  # True: out row = route id; False: out row = GEMM row
    K: tl.constexpr,            # NOTE: constexpr because the interpreter (numpy 2) cannot run a
                                # loop to a runtime bound; K is H or I/tp, a model constant
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    SOFTWARE_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast truncates
    SELECT_SUBNORMAL: tl.constexpr = False,
    A_SPLIT: tl.constexpr = False,      # activations loaded contiguous, split even/odd in registers
    W_KN: tl.constexpr = False,         # weight tile loaded K-major (no transpose before the dot)
    SCALE_BCAST: tl.constexpr = False,  # 4 scale bytes per row, broadcast over 16 columns in registers
    DIAG: tl.constexpr = 0,             # probes only (scripts/gpu_probe_mxfp4.py): 1 skip dequant, 2 skip MMA
    ASM: tl.constexpr = False,          # bf16 weights built by inline PTX (_dequant_w), GPU only
    W_SWZ: tl.constexpr = False,        # weights in the "mma64" layout (weights/mma_layout.py);
                                        # needs SCALE_BCAST, BLOCK_N % 64 == 0 and K % 128 == 0
    W_ENC: tl.constexpr = False,        # ... re-encoded per word ("mma64e"; needs W_SWZ)
    A_BF16: tl.constexpr = False,  # activations given as bf16 pairs (as in the swap body; K % 128 == 0)
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
    FOLD_SA: tl.constexpr = False,  # as the swap body's (GemmConfig.fold_sa): one MMA chain over K
    A_PAD: tl.constexpr = 1,  # the A row a padding row reads (_a_rows; mxfp4_grouped_gemm.A_PAD_ROWS)
):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ids_ptr + rows)
    row_ok = route < R
    arow = _a_rows(sorted_ids_ptr, pid_m, rows, route, row_ok, R, top_k, A_GATHER, BLOCK_M, A_PAD)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)

    # NOTE: the K loop works on 64 packed bytes = 128 k per step, de-interleaved: the low
    # nibbles (even k) and the high nibbles (odd k) are two [BLOCK_N, 64] weight tiles
    # multiplied with the even and odd activation columns. This avoids joining the
    # nibbles into k order (a register shuffle that dominated the first version: 0.4-0.5
    # TB/s measured on the H200); the sum over the block is the same set of exact products.
    kh = tl.arange(0, 64)
    k4 = tl.arange(0, 4)
    kk = tl.arange(0, 128)
    if A_BF16:
        a_ptrs = a_ptr + arow[:, None] * stride_am + kh[None, :]
    elif A_SPLIT:
        a_ptrs = a_ptr + arow[:, None] * stride_am + kk[None, :]
    else:
        a_ptrs = a_ptr + arow[:, None] * stride_am + 2 * kh[None, :]
    if W_SWZ:
        w_ptrs = _mma64_tile_ptrs(w_ptr + e * stride_we, pid_n, N, stride_wn, BLOCK_N)
    elif W_KN:  # weight tile loaded as [64 bytes along K, BLOCK_N]: the dot's B without a transpose
        w_ptrs = w_ptr + e * stride_we + n_safe[None, :] * stride_wn + kh[:, None]
    else:
        w_ptrs = w_ptr + e * stride_we + n_safe[:, None] * stride_wn + kh[None, :]
    sa_ptrs = sa_ptr + arow * stride_sam
    if SCALE_BCAST:
        sw_ptrs = sw_ptr + e * stride_swe + n_safe[:, None] * stride_swn + k4[None, :]
    elif W_KN:
        sw_ptrs = sw_ptr + e * stride_swe + n_safe[None, :] * stride_swn + (kh // 16)[:, None]
    else:
        sw_ptrs = sw_ptr + e * stride_swe + n_safe[:, None] * stride_swn + (kh // 16)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in tl.range(0, (K + 127) // 128, num_stages=NUM_STAGES):
        k0 = kb * 128
        if A_BF16 and A_PAD == 2:
            a_even = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)
            a_odd = tl.load(a_ptrs + k0 + 64, mask=row_ok[:, None], other=0.0)
        elif A_BF16:  # whole blocks (the wrapper checks K % 128 == 0): [64 even | 64 odd] as stored
            a_even = tl.load(a_ptrs + k0)
            a_odd = tl.load(a_ptrs + k0 + 64)
        elif A_SPLIT and K % 128 == 0:  # whole blocks: no K mask (as in the swap body)
            a = tl.load(a_ptrs + k0)
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, 64, 2)))
        elif A_SPLIT:
            a = tl.load(a_ptrs + k0, mask=(k0 + kk)[None, :] < K, other=0.0)
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, 64, 2)))
        else:
            amask = (k0 // 2 + kh)[None, :] < K // 2
            a_even = tl.load(a_ptrs + k0, mask=amask, other=0.0)
            a_odd = tl.load(a_ptrs + k0 + 1, mask=amask, other=0.0)
        if W_KN:
            kmask = (k0 // 2 + kh)[:, None] < K // 2
        else:
            kmask = (k0 // 2 + kh)[None, :] < K // 2
        if W_SWZ:  # whole 128-blocks and 64-row tiles (the layout's precondition): no K mask
            raw = tl.load(w_ptrs + kb * 4096)
            if W_ENC and not ASM:  # the PTX decodes "mma64e" words in registers; this path first
                raw = _mma64e_decode(raw, BLOCK_N)
            packed_u8 = _mma64_unswizzle(raw, BLOCK_N)
        elif K % 128 == 0:
            packed_u8 = tl.load(w_ptrs + k0 // 2)
        else:
            packed_u8 = tl.load(w_ptrs + k0 // 2, mask=kmask, other=0)
        packed = packed_u8.to(tl.int32)
        if SCALE_BCAST:
            if K % 128 == 0:
                sb4 = tl.load(sw_ptrs + k0 // 32)
            else:
                sb4 = tl.load(sw_ptrs + k0 // 32, mask=(k0 // 32 + k4)[None, :] < K // 32, other=127)
            if ASM and W_SWZ:
                w_lo, w_hi = _dequant_w_swz_asm(packed_u8, sb4, BLOCK_N, W_ENC)
            elif ASM:
                w_lo, w_hi = _dequant_w_asm(packed_u8, sb4, BLOCK_N)
            else:
                w_lo, w_hi = _dequant_w(packed_u8, sb4, BLOCK_N, SELECT_SUBNORMAL)
                w_lo = w_lo.to(tl.bfloat16)
                w_hi = w_hi.to(tl.bfloat16)
        else:
            sbyte = tl.load(sw_ptrs + k0 // 32, mask=kmask, other=127).to(tl.int32)
            scale = ((sbyte + 126) << 23).to(tl.float32, bitcast=True)  # 2^(s-1); exact for s <= 128
            if DIAG == 1:  # probe: no conversion (wrong values; isolates load + MMA cost)
                w_lo = packed.to(tl.bfloat16)
                w_hi = w_lo
            else:
                f_lo, f_hi = _nibbles_to_f32(packed, packed, SELECT_SUBNORMAL)
                w_lo = (f_lo * scale).to(tl.bfloat16)
                w_hi = (f_hi * scale).to(tl.bfloat16)
        if W_KN:
            b_lo = w_lo
            b_hi = w_hi
        else:
            b_lo = tl.trans(w_lo)
            b_hi = tl.trans(w_hi)
        if FOLD_SA and not A_BF16:  # q * sa in bf16 (exact); "scaled pairs" come pre-scaled
            s_f = tl.load(sa_ptrs + kb)
            a_even = (a_even.to(tl.float32) * s_f[:, None]).to(tl.bfloat16)
            a_odd = (a_odd.to(tl.float32) * s_f[:, None]).to(tl.bfloat16)
        if FOLD_SA and SOFTWARE_BF16:
            acc = tl.dot(a_even.to(tl.float32), b_lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a_odd.to(tl.float32), b_hi.to(tl.float32), acc, input_precision="ieee")
        elif FOLD_SA:
            acc = tl.dot(a_even.to(tl.bfloat16), b_lo, acc)
            acc = tl.dot(a_odd.to(tl.bfloat16), b_hi, acc)
        elif SOFTWARE_BF16:
            # NOTE: the Triton 3.6 interpreter multiplies bf16 dot operands as raw integers
            # (measured: errors ~1e10); fp32 operands hold the same exact values there.
            part = tl.dot(a_even.to(tl.float32), b_lo.to(tl.float32), input_precision="ieee")
            part = tl.dot(a_odd.to(tl.float32), b_hi.to(tl.float32), part, input_precision="ieee")
        elif DIAG == 2:  # probe: no MMA (isolates load + conversion cost)
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + tl.sum(b_lo.to(tl.float32) + b_hi.to(tl.float32), axis=0)[None, :] + tl.sum(a_even.to(tl.float32) + a_odd.to(tl.float32), axis=1)[:, None]
        else:
            part = tl.dot(a_even.to(tl.bfloat16), b_lo)
            part = tl.dot(a_odd.to(tl.bfloat16), b_hi, part)
        if not FOLD_SA:
            s_a = tl.load(sa_ptrs + kb)
            acc += part * s_a[:, None]

    if OUT_SCATTER:
        orow = tl.where(row_ok, route, 0).to(tl.int64)
    else:
        orow = rows.to(tl.int64)
    o_ptrs = out_ptr + orow[:, None] * stride_om + n[None, :]
    if SOFTWARE_BF16:
        acc = round_to_bf16(acc, True)  # RNE on the bits; the cast below is then exact
    tl.store(o_ptrs, acc.to(tl.bfloat16), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _mxfp4_grouped_gemm_swap_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr,
    sorted_ids_ptr, block_expert_ptr, num_blocks_ptr,
    N, R, top_k,
    stride_am, stride_sam,
    stride_we, stride_wn,
    stride_swe, stride_swn,
    stride_om,
    A_GATHER: tl.constexpr, OUT_SCATTER: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    KB_PER: tl.constexpr,       # 128-wide K blocks per program (all of them when not split)
    SPLIT: tl.constexpr,        # True: write each block's scaled partial to ws[kb, route, n]
    SOFTWARE_BF16: tl.constexpr,
    SELECT_SUBNORMAL: tl.constexpr = False,
    ASM: tl.constexpr = False,
    W_SWZ: tl.constexpr = False,   # weights in the "mma64" layout (as in _mxfp4_grouped_gemm_kernel)
    W_ENC: tl.constexpr = False,   # ... re-encoded per word ("mma64e"; needs W_SWZ)
    A_BF16: tl.constexpr = False,  # activations given as bf16, each 128-block as [64 even k | 64 odd k]
                                   # (K % 128 == 0): the MMA's second operand loads as is
    DIAG: tl.constexpr = 0,        # probes only (gpu_probe_swz.py --diag): 1 skip dequant, 2 skip MMA
    LOOP_UNROLL: tl.constexpr = 1,  # Triton loop_unroll_factor of the K loop (GemmConfig.unroll)
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
    FOLD_SA: tl.constexpr = False,  # GemmConfig.fold_sa: the activation scale in the operand
    FOLD_WAIT: tl.constexpr = True,  # folded: wait on each block's MMAs (GemmConfig.fold_order "wait"), else "split"
    N_FASTEST: tl.constexpr = False,  # grid (N blocks, M blocks, splits) instead of (M, N, splits)
    A_PAD: tl.constexpr = 1,  # the A row a padding row reads (_a_rows; mxfp4_grouped_gemm.A_PAD_ROWS)
    ONE_CHAIN: tl.constexpr = False,  # folded "wait": both halves as one K = 128 MMA chain (GemmConfig.one_chain)
    PRELOAD: tl.constexpr = False,  # GemmConfig.preload: every K block's weight and scale loads before the first MMA
):
    """Swapped operands: out^T[n, rows] = W[n, k] . A^T[k, rows]. The dequantised weight
    tile is the MMA's first operand (kept in registers on Hopper: no shared-memory round
    trip), the BLOCK_M routed rows (16 at decode) are the second. Same per-block products
    and the same block-order accumulation as _mxfp4_grouped_gemm_kernel.

    FOLD_SA: the second operand is bf16(q * sa) (exact: sa is a power of two; A_BF16 reads
    "scaled pairs" made by the quantiser, else the body scales q itself), so the MMA chain
    accumulates every block in turn into acc - no per-block `acc += part * sa`, no wait on
    each block's MMA before it, no scale loads in the loop (H200, session 15: 1.04-1.20x on
    the decode GEMMs). The products are the same exact values; the fp32 sums are associated
    per MMA step instead of per 128-block (the deviation docs/DESIGN.md describes). With
    SPLIT each program writes its one partial to ws[pid_k] (ws [splits, R, N]).

    NOTE (session 30 built, session 31 measured and removed): a persistent 1-D grid whose
    programs walked the (M-block, N-block, split) items in a loop flattened with the K loop
    (Triton pipelined the next item's loads into the current one's K steps) was slower at every
    size tried: `gpu_profile_layer.py --ab ...PERSISTENT_DOWN=0,1,2,4` (programs per SM), us,
    Pro-TP8 T=1 32.6 / 43.3 / 37.7 / 35.4, T=8 92.6 / 151.1 / 116.0 / 100.3; Flash T=1 55.4 /
    62.2 / 59.2 / 58.2; the gate_up (=0,1,2) Pro-TP8 T=1 32.5 / 43.2 / 38.2, Flash T=8 205.5 /
    329.2 / 255.7 (bitwise; docs/bench/2026-11-30/session31/). One program per item stays.
    Also measured and removed in session 31: each down program asking the L2 for its weight tile
    (prefetch.global.L2) before its PDL wait (block_expert is visible there: the alignment ran
    two launches earlier) - level at Pro-TP8 T=1 (32.6 / 32.5 us), slower everywhere else (Pro-TP8
    T=4 63.9 / 64.8, T=8 92.2 / 93.2; Flash T=1 54.7 / 55.5, T=2 76.2 / 80.6, T=8 204.8 / 219.5;
    bitwise), as session 29's prefetch of the down's weights from the gate_up was."""
    pdl_enter(PDL)
    if N_FASTEST:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    _swap_item(pid_m, pid_n, pid_k,
               a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, sorted_ids_ptr, block_expert_ptr, N, R,
               top_k, stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_om,
               A_GATHER, OUT_SCATTER, K, BLOCK_M, BLOCK_N, NUM_STAGES, KB_PER, SPLIT, SOFTWARE_BF16,
               SELECT_SUBNORMAL, ASM, W_SWZ, W_ENC, A_BF16, DIAG, LOOP_UNROLL, FOLD_SA, FOLD_WAIT, A_PAD, ONE_CHAIN,
               PRELOAD)


@triton.jit
def _swap_kblock(acc, kb, raw_given, sb4_given, a_ptrs, a_ptr, arow, stride_am, w_ptrs, sw_ptrs, sa_ptrs, ws_ptrs,
                 row_ok, n_ok, kh, kk, k4, N, R,
                 LOADED: tl.constexpr, K_MASKED: tl.constexpr, SPLIT_HALVES: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
                 SELECT_SUBNORMAL: tl.constexpr, ASM: tl.constexpr, W_SWZ: tl.constexpr, W_ENC: tl.constexpr,
                 A_BF16: tl.constexpr, DIAG: tl.constexpr, FOLD_SA: tl.constexpr, FOLD_WAIT: tl.constexpr,
                 A_PAD: tl.constexpr, ONE_CHAIN: tl.constexpr):
    """One 128-wide K block kb of the swap item into acc (returned): the activation loads, the
    weight words (loaded here, or `raw_given` / `sb4_given` when LOADED), the dequantisation and
    the MMAs - the K loop's body, also run block by block by the PRELOAD form."""
    k0 = kb * 128
    if A_BF16 and K_MASKED:
        a_even = tl.load(a_ptrs + k0, mask=(kb < K // 128) & (kh < 64)[None, :] & (row_ok[:, None] | (A_PAD != 2)),
                         other=0.0)
        a_odd = tl.load(a_ptrs + k0 + 64, mask=(kb < K // 128) & (kh < 64)[None, :] & (row_ok[:, None] | (A_PAD != 2)),
                        other=0.0)
    elif A_BF16 and A_PAD == 2 and ONE_CHAIN and FOLD_SA and FOLD_WAIT and not SOFTWARE_BF16:
        # the pairs row of a 128-block is [64 even | 64 odd]: the one-chain operand as stored
        a_cat = tl.load(a_ptr + arow[:, None] * stride_am + (k0 + kk)[None, :], mask=row_ok[:, None], other=0.0)
        a_even = a_cat  # unused on this path (the names must exist for the branches below)
        a_odd = a_cat
    elif A_BF16 and A_PAD == 2:
        a_even = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)
        a_odd = tl.load(a_ptrs + k0 + 64, mask=row_ok[:, None], other=0.0)
    elif A_BF16:
        a_even = tl.load(a_ptrs + k0)
        a_odd = tl.load(a_ptrs + k0 + 64)
    elif K_MASKED:
        a = tl.load(a_ptrs + k0, mask=(k0 + kk)[None, :] < K, other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, 64, 2)))
    else:
        a_even, a_odd = tl.split(tl.reshape(tl.load(a_ptrs + k0), (BLOCK_M, 64, 2)))
    kmask = (k0 // 2 + kh)[None, :] < K // 2
    if W_SWZ:
        if LOADED:  # PRELOAD: the caller loaded this block's words (whole blocks, no mask)
            raw = raw_given
        elif K_MASKED:  # whole 128-blocks: only a split's tail block is masked (zero words decode to 0)
            raw = tl.load(w_ptrs + kb * 4096, mask=kb < K // 128, other=0)
        else:
            raw = tl.load(w_ptrs + kb * 4096)
        if W_ENC and not ASM:  # the PTX decodes "mma64e" words in registers; this path first
            raw = _mma64e_decode(raw, BLOCK_N)
        packed = _mma64_unswizzle(raw, BLOCK_N)
    elif K_MASKED:
        packed = tl.load(w_ptrs + k0 // 2, mask=kmask, other=0)
    else:
        packed = tl.load(w_ptrs + k0 // 2)
    if LOADED:
        sb4 = sb4_given
    elif K_MASKED:
        sb4 = tl.load(sw_ptrs + k0 // 32, mask=(k0 // 32 + k4)[None, :] < K // 32, other=127)
    else:
        sb4 = tl.load(sw_ptrs + k0 // 32)
    if DIAG == 1:  # probe: no conversion (wrong values; isolates load + MMA cost)
        w_lo = packed.to(tl.bfloat16) + tl.sum(sb4, axis=1).to(tl.bfloat16)[:, None]
        w_hi = w_lo
    elif SPLIT_HALVES:
        w_lo = _dequant_w_swz_asm_half(packed, sb4, BLOCK_N, False, W_ENC)
    elif ASM and W_SWZ:
        w_lo, w_hi = _dequant_w_swz_asm(packed, sb4, BLOCK_N, W_ENC)
    elif ASM:
        w_lo, w_hi = _dequant_w_asm(packed, sb4, BLOCK_N)
    else:
        w_lo, w_hi = _dequant_w(packed, sb4, BLOCK_N, SELECT_SUBNORMAL)
    if FOLD_SA and not A_BF16:  # q * sa in bf16 (exact); "scaled pairs" come pre-scaled
        s_b = tl.load(sa_ptrs + kb, mask=row_ok & (kb < (K + 127) // 128), other=0.0)
        a_even = (a_even.to(tl.float32) * s_b[:, None]).to(tl.bfloat16)
        a_odd = (a_odd.to(tl.float32) * s_b[:, None]).to(tl.bfloat16)
    if FOLD_SA and SOFTWARE_BF16:
        acc = tl.dot(w_lo, tl.trans(a_even.to(tl.float32)), acc, input_precision="ieee")
        acc = tl.dot(w_hi, tl.trans(a_odd.to(tl.float32)), acc, input_precision="ieee")
    elif FOLD_SA and ONE_CHAIN and FOLD_WAIT:
        # [lo | hi] along K: the 16 HGMMAs of the two dots below in their order (the same adds,
        # the same bits), with one wgmma wait per block instead of two - Triton waits after a
        # dot whose accumulator the next dot reads. sm_90a: Flash T = 1 gate_up 130 -> 119
        # registers, no hazard (scripts/sass_wgmma_hazard.py); H200 timings: routed_experts.ONE_CHAIN_MIN_ROWS
        w_cat = tl.reshape(tl.permute(tl.join(w_lo.to(tl.bfloat16), w_hi.to(tl.bfloat16)), (0, 2, 1)),
                           (BLOCK_N, 128))
        if not (A_BF16 and A_PAD == 2 and not K_MASKED):  # else a_cat was loaded as stored
            a_cat = tl.reshape(tl.permute(tl.join(a_even.to(tl.bfloat16), a_odd.to(tl.bfloat16)), (0, 2, 1)),
                               (BLOCK_M, 128))
        acc = tl.dot(w_cat, tl.trans(a_cat.to(tl.bfloat16)), acc)
        acc = _opaque_f32(acc)
    elif FOLD_SA:
        acc = tl.dot(w_lo.to(tl.bfloat16), tl.trans(a_even.to(tl.bfloat16)), acc)
        if SPLIT_HALVES:
            tl.debug_barrier()
            w_hi = _dequant_w_swz_asm_half(packed, sb4, BLOCK_N, True, W_ENC)
        acc = tl.dot(w_hi.to(tl.bfloat16), tl.trans(a_odd.to(tl.bfloat16)), acc)
        if FOLD_WAIT:
            acc = _opaque_f32(acc)
    elif DIAG == 2:  # probe: no MMA (isolates load + conversion cost)
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32) + \
            tl.sum(w_lo.to(tl.float32) + w_hi.to(tl.float32), axis=1)[:, None] + \
            tl.sum(a_even.to(tl.float32) + a_odd.to(tl.float32), axis=1)[None, :]
    elif SOFTWARE_BF16:
        part = tl.dot(w_lo, tl.trans(a_even.to(tl.float32)), input_precision="ieee")
        part = tl.dot(w_hi, tl.trans(a_odd.to(tl.float32)), part, input_precision="ieee")
    else:
        part = tl.dot(w_lo.to(tl.bfloat16), tl.trans(a_even.to(tl.bfloat16)))
        part = tl.dot(w_hi.to(tl.bfloat16), tl.trans(a_odd.to(tl.bfloat16)), part)
    if not FOLD_SA:
        s_a = tl.load(sa_ptrs + kb, mask=row_ok & (kb < (K + 127) // 128), other=0.0)
        if SPLIT:
            tl.store(ws_ptrs + kb * R * N, part * s_a[None, :],
                     mask=n_ok[:, None] & row_ok[None, :] & (kb < (K + 127) // 128))
        else:
            acc += part * s_a[None, :]
    return acc


@triton.jit
def _swap_item(pid_m, pid_n, pid_k,
               a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, sorted_ids_ptr, block_expert_ptr, N, R, top_k,
               stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_om,
               A_GATHER: tl.constexpr, OUT_SCATTER: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, KB_PER: tl.constexpr, SPLIT: tl.constexpr,
               SOFTWARE_BF16: tl.constexpr, SELECT_SUBNORMAL: tl.constexpr, ASM: tl.constexpr,
               W_SWZ: tl.constexpr, W_ENC: tl.constexpr, A_BF16: tl.constexpr, DIAG: tl.constexpr,
               LOOP_UNROLL: tl.constexpr, FOLD_SA: tl.constexpr, FOLD_WAIT: tl.constexpr,
               A_PAD: tl.constexpr, ONE_CHAIN: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    """One item of the swap kernel: rows of M-block pid_m x weight rows of N-block pid_n over
    split pid_k's K blocks (the kernel's whole body before session 30).

    PRELOAD (GemmConfig.preload; three whole "mma64" K blocks, no split): the three blocks' weight
    and scale loads are issued before the first block's MMAs, then the blocks run as the loop's
    body would (_swap_kblock). In the loop the folded "wait" body's per-block wgmma wait keeps each
    block's loads behind the previous block's MMAs (sm_90a SASS, session 42), so a short-K program
    makes one memory round trip per block; this puts all of them in flight at once. Same bits."""
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ids_ptr + rows)
    row_ok = route < R
    arow = _a_rows(sorted_ids_ptr, pid_m, rows, route, row_ok, R, top_k, A_GATHER, BLOCK_M, A_PAD)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)
    kh = tl.arange(0, 64)
    k4 = tl.arange(0, 4)
    kk = tl.arange(0, 128)
    if A_BF16:
        a_ptrs = a_ptr + arow[:, None] * stride_am + kh[None, :]
    else:
        a_ptrs = a_ptr + arow[:, None] * stride_am + kk[None, :]
    if W_SWZ:
        w_ptrs = _mma64_tile_ptrs(w_ptr + e * stride_we, pid_n, N, stride_wn, BLOCK_N)
    else:
        w_ptrs = w_ptr + e * stride_we + n_safe[:, None] * stride_wn + kh[None, :]
    sw_ptrs = sw_ptr + e * stride_swe + n_safe[:, None] * stride_swn + k4[None, :]
    sa_ptrs = sa_ptr + arow * stride_sam
    if SPLIT:
        route_safe = tl.where(row_ok, route, 0).to(tl.int64)
        ws_ptrs = ws_ptr + route_safe[None, :] * N + n[:, None]
    else:
        ws_ptrs = 0  # unused (no split workspace)
    # NOTE: with whole 128-blocks and a split that divides them evenly (or none), every
    # block index is in range: the K masks are dropped at compile time (session 6: the
    # per-element scale select of the masked load and its predicates were 44 of the 514
    # SASS instructions of the decode loop).
    K_MASKED: tl.constexpr = K % 128 != 0 or (SPLIT and (K // 128) % KB_PER != 0)
    # NOTE: folded, the block's second MMA used to stay in flight while the next block's
    # dequant ran, and ptxas before 13.3 (Triton 3.6 bundles 12.8) may put that dequant's
    # results in the registers the MMA still reads (triton-lang/triton#9433): wrong, run-to-run
    # different outputs on the H200 (session 16). Two orderings keep every such write after
    # the wgmma wait (scripts/sass_wgmma_hazard.py proves it on the SASS, tests/
    # test_sass_wgmma_hazard.py for every config routed_configs returns):
    #   FOLD_WAIT  both halves converted, both MMAs, then the accumulator through an opaque
    #              move (_opaque_f32), so each block's MMAs retire before the loop goes on;
    #   split      the odd-k half converted after the even-k MMA, behind tl.debug_barrier -
    #              which also stops Triton pipelining the loop's loads (plain LDG + STS per
    #              block, no cp.async in the SASS): 0.76-0.93x the per-block body on long K
    #              loops, but the faster one on the 16-row Pro-TP8 down (3 blocks, unrolled).
    # Bitwise the same outputs (same MMA chain); H200 timings in kernels/routed_experts.py.
    SPLIT_HALVES: tl.constexpr = FOLD_SA and ASM and W_SWZ and DIAG == 0 and not FOLD_WAIT
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PRELOAD:
        tl.static_assert(KB_PER == 3 and W_SWZ and not SPLIT and not K_MASKED,
                         "PRELOAD: three whole K blocks of 'mma64' weights, no split")
        raw0 = tl.load(w_ptrs)
        raw1 = tl.load(w_ptrs + 4096)
        raw2 = tl.load(w_ptrs + 8192)
        sb0 = tl.load(sw_ptrs)
        sb1 = tl.load(sw_ptrs + 4)
        sb2 = tl.load(sw_ptrs + 8)
        acc = _swap_kblock(acc, 0, raw0, sb0, a_ptrs, a_ptr, arow, stride_am, w_ptrs, sw_ptrs, sa_ptrs, 0,
                           row_ok, n_ok, kh, kk, k4, N, R, True, K_MASKED, SPLIT_HALVES, K, BLOCK_M, BLOCK_N, SPLIT,
                           SOFTWARE_BF16, SELECT_SUBNORMAL, ASM, W_SWZ, W_ENC, A_BF16, DIAG, FOLD_SA, FOLD_WAIT,
                           A_PAD, ONE_CHAIN)
        acc = _swap_kblock(acc, 1, raw1, sb1, a_ptrs, a_ptr, arow, stride_am, w_ptrs, sw_ptrs, sa_ptrs, 0,
                           row_ok, n_ok, kh, kk, k4, N, R, True, K_MASKED, SPLIT_HALVES, K, BLOCK_M, BLOCK_N, SPLIT,
                           SOFTWARE_BF16, SELECT_SUBNORMAL, ASM, W_SWZ, W_ENC, A_BF16, DIAG, FOLD_SA, FOLD_WAIT,
                           A_PAD, ONE_CHAIN)
        acc = _swap_kblock(acc, 2, raw2, sb2, a_ptrs, a_ptr, arow, stride_am, w_ptrs, sw_ptrs, sa_ptrs, 0,
                           row_ok, n_ok, kh, kk, k4, N, R, True, K_MASKED, SPLIT_HALVES, K, BLOCK_M, BLOCK_N, SPLIT,
                           SOFTWARE_BF16, SELECT_SUBNORMAL, ASM, W_SWZ, W_ENC, A_BF16, DIAG, FOLD_SA, FOLD_WAIT,
                           A_PAD, ONE_CHAIN)
    else:
        for j in tl.range(0, KB_PER, num_stages=NUM_STAGES, loop_unroll_factor=LOOP_UNROLL):
            acc = _swap_kblock(acc, pid_k * KB_PER + j, 0, 0, a_ptrs, a_ptr, arow, stride_am, w_ptrs, sw_ptrs,
                               sa_ptrs, ws_ptrs, row_ok, n_ok, kh, kk, k4, N, R, False, K_MASKED,
                               SPLIT_HALVES, K, BLOCK_M, BLOCK_N, SPLIT, SOFTWARE_BF16, SELECT_SUBNORMAL, ASM,
                               W_SWZ, W_ENC, A_BF16, DIAG, FOLD_SA, FOLD_WAIT, A_PAD, ONE_CHAIN)
    if FOLD_SA and SPLIT:
        tl.store(ws_ptrs + pid_k * R * N, acc, mask=n_ok[:, None] & row_ok[None, :])
    if not SPLIT:
        if OUT_SCATTER:
            orow = tl.where(row_ok, route, 0).to(tl.int64)
        else:
            orow = rows.to(tl.int64)
        if SOFTWARE_BF16:
            acc = round_to_bf16(acc, True)
        tl.store(out_ptr + orow[None, :] * stride_om + n[:, None], acc.to(tl.bfloat16),
                 mask=n_ok[:, None] & row_ok[None, :])


@triton.jit
def _mxfp4_gemv_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr,
    sorted_ids_ptr, block_expert_ptr, num_blocks_ptr,
    N, R, top_k,
    stride_am, stride_sam,
    stride_we, stride_wn,
    stride_swe, stride_swn,
    stride_om,
    A_GATHER: tl.constexpr, OUT_SCATTER: tl.constexpr, K: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, KB_PER: tl.constexpr, SPLIT: tl.constexpr,
    SOFTWARE_BF16: tl.constexpr,
    SELECT_SUBNORMAL: tl.constexpr = False,
    ASM: tl.constexpr = False,
    UNROLL: tl.constexpr = 1,   # 128-blocks per loop iteration (their loads issue together)
    PDL: tl.constexpr = 0,  # pdl_enter: programmatic dependent launch
):
    """One routed row per program (alignment with BLOCK_M = 1): a batched GEMV on the CUDA
    cores, no MMA padding. Per 128-wide block: exact fp32 products summed in any order
    (the freedom SPEC §4.3 leaves), then acc += block_sum * sa in block order."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    route = tl.load(sorted_ids_ptr + pid_m)
    if route >= R:
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if A_GATHER:
        arow = (route // top_k).to(tl.int64)
    else:
        arow = pid_m.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)
    kh = tl.arange(0, 64)
    k4 = tl.arange(0, 4)
    kk = tl.arange(0, 128)
    w_ptrs = w_ptr + e * stride_we + n_safe[:, None] * stride_wn + kh[None, :]
    sw_ptrs = sw_ptr + e * stride_swe + n_safe[:, None] * stride_swn + k4[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    kb_end = min((pid_k + 1) * KB_PER, (K + 127) // 128)   # this program's blocks: [pid_k * KB_PER, kb_end)
    for j in tl.range(0, KB_PER, UNROLL, num_stages=NUM_STAGES):
        for u in tl.static_range(UNROLL):
            kb = pid_k * KB_PER + j + u
            k0 = kb * 128
            a = tl.load(a_ptr + arow * stride_am + k0 + kk, mask=(k0 + kk < K) & (kb < kb_end), other=0.0).to(tl.float32)
            a_even, a_odd = tl.split(tl.reshape(a, (64, 2)))
            kmask = ((k0 // 2 + kh)[None, :] < K // 2) & (kb < kb_end)
            packed = tl.load(w_ptrs + k0 // 2, mask=kmask, other=0)
            sb4 = tl.load(sw_ptrs + k0 // 32, mask=((k0 // 32 + k4)[None, :] < K // 32) & (kb < kb_end), other=127)
            if ASM:
                w_lo, w_hi = _dequant_w_asm(packed, sb4, BLOCK_N)
            else:
                w_lo, w_hi = _dequant_w(packed, sb4, BLOCK_N, SELECT_SUBNORMAL)
            part = tl.sum(w_lo.to(tl.float32) * a_even[None, :] + w_hi.to(tl.float32) * a_odd[None, :], axis=1)
            s_a = tl.load(sa_ptr + arow * stride_sam + kb, mask=kb < kb_end, other=0.0)
            if SPLIT:
                tl.store(ws_ptr + kb * R * N + route * N + n, part * s_a, mask=n_ok & (kb < kb_end))
            else:
                acc += part * s_a
    if not SPLIT:
        if OUT_SCATTER:
            orow = route.to(tl.int64)
        else:
            orow = pid_m.to(tl.int64)
        if SOFTWARE_BF16:
            acc = round_to_bf16(acc, True)
        tl.store(out_ptr + orow * stride_om + n, acc.to(tl.bfloat16), mask=n_ok)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, out_ptr, route_rows_ptr, R, N, stride_om,
                           KB: tl.constexpr, OUT_SCATTER: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
                           PDL: tl.constexpr = 0):
    """out[dest(r), n] = bf16(sum over kb, in order, from +0.0, of ws[kb, r, n]) for every
    local route r (route_rows[r] >= 0); dest = r (scatter) or its GEMM row. Bitwise the
    single pass's `acc += part * s_a` loop."""
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.load(route_rows_ptr + r, mask=r < R, other=-1)
    ok = (row >= 0)[:, None] & (n < N)[None, :]
    r64 = tl.where(row >= 0, r, 0).to(tl.int64)
    ptrs = ws_ptr + r64[:, None] * N + n[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    # NOTE: unrolled (KB is a model constant, <= 56): the KB loads are independent and issue
    # together; the adds stay in block order. The rolled loop was latency-bound: 12.95 us
    # for Pro-TP8 gate_up at T=1 (56 blocks x 6 routes x 768; H200 profile, session 4).
    for kb in tl.static_range(KB):
        acc += tl.load(ptrs + kb * R * N, mask=ok, other=0.0)
    if OUT_SCATTER:
        dest = r64
    else:
        dest = tl.where(row >= 0, row, 0).to(tl.int64)
    if SOFTWARE_BF16:
        acc = round_to_bf16(acc, True)
    tl.store(out_ptr + dest[:, None] * stride_om + n[None, :], acc.to(tl.bfloat16), mask=ok)
