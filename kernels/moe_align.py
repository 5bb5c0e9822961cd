"""Token permutation for the grouped expert GEMMs: routes grouped by local expert.

    topk_ids          [T, k]  int32 / int64   global expert id of each route (route r = t*k + slot)
    ->  MoeAlignment
    sorted_route_ids  [max_rows]        int32  route id held by each GEMM row; R = T*k marks a
                                               row that holds no route (padding / unused block)
    block_expert      [max_blocks]      int32  local expert of each BLOCK_M-row block, -1 past
                                               the valid blocks
    num_valid_blocks  [1]               int32  device scalar: blocks to run
    expert_offsets    [E_local + 1]     int32  first row of each local expert (prefix sums of
                                               the padded histogram); [E_local] = rows used
    expert_counts     [E_local]         int32  routes per local expert (the histogram)
    route_rows        [R]               int32  inverse: row of each route, -1 if not local
    row_expert        [max_rows]        int32  local expert of each row, -1 for rows without a route
    row_weight        [max_rows]        f32    topk_weights of each row's route (0 on padding);
                                               only when `topk_weights` [T, k] f32 is passed

Routes to experts outside [first_expert, first_expert + num_local) (other EP ranks) are
left out. Rows of one expert are contiguous, in route order, padded to a multiple of
BLOCK_M; experts are in ascending id. Everything is sized from shapes alone:
max_blocks = min(R, cdiv(R, BLOCK_M) + min(E_local, R)) (each non-empty expert wastes
less than one block, and every valid block holds at least one route), max_rows =
max_blocks * BLOCK_M, so the call never syncs and can be captured in a CUDA graph.
Decode-sized inputs (R <= SORTED_MAX_ROUTES = 256 routes, the sorted one-program form) take
one launch, larger ones three (kernels/_moe_align.py; `impl` forces any form, and all give the
same outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_moe._types import is_int

__all__ = ["MoeAlignment", "moe_align", "align_sizes", "check_align_args", "new_alignment"]

_BLOCK = 64    # routes per chunk: the rank compare is BLOCK x BLOCK registers
_BB = 16       # M-blocks per program in the scatter kernel
_E_TILE = 64   # experts per one-hot tile in the count kernel
_SCAN_TILE = 4      # fewest experts per scan program
_SCAN_CELLS = 4096  # counts per scan program (C_PAD x E_TILE)
SMALL_MAX_ROWS = 4096  # decode path (one launch) when R <= SMALL_MAX_ROUTES and max_rows <= this
# NOTE (session 26, H200, gpu_check_router.py --parts align, graphs, us, one-hot -> pairwise,
# docs/bench/2026-11-30/session26/): the one-launch path on its [routes x routes] form
# (SMALL_PAIRWISE, see _align_small_body) instead of [routes x experts] one-hot sums: Flash T=1
# 2.03 -> 1.60, T=4 3.48 -> 1.86, T=8 5.36 -> 3.92; Pro T=1 2.13 -> 1.68, T=4 4.12 -> 1.92, T=8
# 6.16 -> 3.90 (three launches: 4.9-5.7). At 96 routes (T = 16, a 128-route tile) it took 10.2
# against 5.0-5.4 for the three launches, so the one-launch path keeps its 64-route limit.
# In the layer (gpu_profile_layer.py --ab, 12 forwards per graph, 3 captures each, median, us,
# pairwise / one-hot): Pro-TP8 (E_pad 512) T=2 49.3 / 51.5, T=4 71.6 / 73.9, T=8 100.1 / 106.2;
# Flash (E_pad 256) T=8 208.9 / 213.5 but T=2 95.6 / 92.8 and T=4 142.0 / 133.8 - slower, though
# the kernel alone is faster there (not understood; docs/DESIGN.md, session 26). So pairwise
# where the one-hot tile is widest (E_pad > 256) and, on narrower ones, from
# SMALL_PAIRWISE_MIN_ROUTES routes. A/B switches.
SMALL_PAIRWISE = True
SMALL_PAIRWISE_MIN_ROUTES = 48
SMALL_MAX_ROUTES = 64
# Warps of the one-launch kernel: SMALL_NUM_WARPS for route tiles below 64, SMALL_NUM_WARPS_64
# from 64 (R = 33-64). NOTE (session 26, offline sm_90a compile): the pairwise form at a
# 64-route tile takes 163 registers and ~1600 SASS instructions per thread in 4 warps, 102 /
# ~850 in 8, 57 / ~580 in 16; at a 128-route tile 4 warps spill (255 registers, 352 bytes of
# stack), 8 do not (255, ~2850).
# NOTE (session 27, H200, gpu_check_router.py --parts align_warps, graphs, us, one launch at 4 /
# 8 / 16 warps vs the three launches; docs/bench/2026-11-30/session27/): E 384 T=8 3.90 / 3.62 /
# 3.73 vs 5.38, T=10 4.74 / 3.82 / 3.83 vs 6.01; E 256 T=8 3.94 / 3.57 / 3.59, T=10 4.73 / 3.83 /
# 3.69; at 24 routes level (E 384 T=4 2.01 / 2.01 / 2.19). In the layer (gpu_profile_layer.py
# --ab, 12 forwards per graph, 3 captures, us, 4 / 8 warps): Pro-TP8 T=8 99.1 / 98.2, T=10 116.3 /
# 114.6; Flash T=8 208.9 / 208.3, T=10 247.3 / 246.0. A 128-route tile (SMALL_MAX_ROUTES = 128)
# is 9.0-10.6 us at any of the three warp counts against 5.0-6.2 for the three launches, and
# the layer was slower with it (Pro-TP8 T=12 132.2 -> 135.6, T=16 158.8 -> 160.4, T=20 200.7 ->
# 203.6 at 8 warps), so the 64-route limit stays.
SMALL_NUM_WARPS = 4
SMALL_NUM_WARPS_64 = 8
# The one-program kernel in its sorted form (`_align_sorted_body`: one sort of BLOCK packed
# keys and [BLOCK]-vector scans, no [routes x routes] or [routes x experts] tile), taken for
# R <= SORTED_MAX_ROUTES when SMALL_SORTED is on (the default; off: the forms above, R <= 64).
# NOTE (session 28, H200, docs/bench/2026-11-30/session28/): alone (gpu_check_router.py --parts
# align_sorted, graphs, us, sorted / one-program pairwise or one-hot / three launches, bitwise
# equal at every size): E 384 T=1 1.71 / 1.69 / 5.66, T=4 2.05 / 1.95 / 5.70, T=8 2.60 / 3.60 /
# 5.30, T=16 3.11 / - / 5.31, T=42 4.18 / - / 6.15; E 256 T=1 1.65 / 2.02 / 4.84, T=4 2.15 / 3.57
# / 5.27, T=16 3.13 / - / 4.85, T=42 4.40 / - / 5.95. In the layer (gpu_profile_layer.py --ab
# ...SMALL_SORTED=0,1, 12 forwards per graph, 3 captures, us, off / on): Pro-TP8 T=1-4 level,
# T=6 86.1 / 85.7, T=12 131.0 / 124.6, T=16 156.1 / 151.0, T=21 204.0 / 194.9, T=32 274.9 /
# 272.9, T=42 311.2 / 306.3; Flash T=2 80.0 / 79.3, T=3 109.7 / 107.4, T=4 128.5 / 126.7, T=6
# 166.8 / 162.5, T=8 206.3 / 205.4, T=16 351.9 / 347.4, T=42 712.9 / 710.6 (Flash T=2-6 with
# the unsplit shared GEMMs of dispatch.shared_split_policy; beside the old split-K grid the
# sorted form was slower at Flash T=3-4, 114.7 / 119.5 and 132.8 / 141.3). A/B switch.
SMALL_SORTED = True
SORTED_MAX_ROUTES = 256
# NOTE (session 27, H200, not kept): the three launches in one for 65-1024 routes (each program
# counting its chunk, the last to arrive - split_k_arrive - scanning and scattering everything)
# was bitwise the three launches but slower: alone 7.8-8.4 us at E 256 and 10.3-11.2 at E 384
# for 66-126 routes against 5.1-6.0 (gpu_check_router.py --parts align_arrive), and the layer
# 15-20 us slower (Pro-TP8 T=12 131.1 -> 151.6, T=16 157.0 -> 174.6, T=21 206.0 -> 226.3;
# docs/bench/2026-11-30/session27/). Its serial tail (scan + every chunk's scatter in one
# program) costs more than the two launches it saves.


@dataclass
class MoeAlignment:
    sorted_route_ids: torch.Tensor
    block_expert: torch.Tensor
    num_valid_blocks: torch.Tensor
    expert_offsets: torch.Tensor
    expert_counts: torch.Tensor
    route_rows: torch.Tensor
    row_expert: torch.Tensor
    row_weight: torch.Tensor | None
    block_m: int
    top_k: int
    num_routes: int   # R = T * k; also the padding sentinel in sorted_route_ids
    max_blocks: int

    @property
    def max_rows(self) -> int:
        return self.max_blocks * self.block_m

    @property
    def num_tokens(self) -> int:
        return self.num_routes // self.top_k if self.top_k else 0


def align_sizes(num_routes: int, num_local: int, block_m: int) -> tuple[int, int]:
    """(max_blocks, max_rows) for R routes over E_local experts: shapes only."""
    if num_routes == 0:
        return 0, 0
    max_blocks = min(num_routes, -(-num_routes // block_m) + min(num_local, num_routes))
    return max_blocks, max_blocks * block_m


def check_align_args(num_local, first_expert, block_m) -> None:
    """ValueError naming the argument unless num_local >= 1, first_expert >= 0 and block_m is
    a power of two (moe_align's and route_front's alignment parameters)."""
    if not is_int(num_local) or num_local < 1:
        raise ValueError(f"num_local={num_local!r}: expected an int >= 1")
    if not is_int(first_expert) or first_expert < 0:
        raise ValueError(f"first_expert={first_expert!r}: expected an int >= 0")
    if not is_int(block_m) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m!r}: expected a power of two >= 1")


def new_alignment(num_routes: int, top_k: int, num_local: int, block_m: int, device,
                  with_weights: bool = True) -> MoeAlignment:
    """An unfilled MoeAlignment of the right sizes (the kernels write every entry)."""
    max_blocks, max_rows = align_sizes(num_routes, num_local, block_m)
    i32 = dict(dtype=torch.int32, device=device)
    return MoeAlignment(
        sorted_route_ids=torch.empty(max_rows, **i32),
        block_expert=torch.empty(max_blocks, **i32),
        # NOTE: empty, not zeros: the scan kernel writes every entry (3 fill launches
        # fewer per forward; each was ~1 us of a ~110 us Flash decode layer on the H200)
        num_valid_blocks=torch.empty(1, **i32),
        expert_offsets=torch.empty(num_local + 1, **i32),
        expert_counts=torch.empty(num_local, **i32),
        route_rows=torch.empty(num_routes, **i32),
        row_expert=torch.empty(max_rows, **i32),
        row_weight=torch.empty(max_rows, dtype=torch.float32, device=device) if with_weights else None,
        block_m=block_m, top_k=top_k, num_routes=num_routes, max_blocks=max_blocks,
    )


def moe_align(topk_ids: torch.Tensor, num_local: int, first_expert: int, block_m: int,
              topk_weights: torch.Tensor | None = None, *, impl: str = "auto") -> MoeAlignment:
    """Group the (token, slot) routes of `topk_ids` by local expert; see the module doc.

    impl: "auto" (one launch for decode-sized inputs: R <= SORTED_MAX_ROUTES routes in the sorted
    form while SMALL_SORTED is on (the default), else R <= SMALL_MAX_ROUTES; max_rows <=
    SMALL_MAX_ROWS either way; else three), "small" (force the one-launch kernel; raises past those limits), "sorted" (force
    its sorted form; raises past R <= SORTED_MAX_ROUTES) or "chunked" (force the three
    launches). All give the same outputs."""
    if impl not in ("auto", "small", "sorted", "chunked"):
        raise ValueError(f"impl={impl!r}: expected 'auto', 'small', 'sorted' or 'chunked'")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 \
            or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected a [T, k] int32/int64 tensor, got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids))} shape {tuple(getattr(topk_ids, 'shape', ()))}")
    check_align_args(num_local, first_expert, block_m)
    t, k = topk_ids.shape
    r = t * k
    if topk_weights is not None and not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"topk_weights: expected a torch.Tensor or None, got {type(topk_weights).__name__}")
    if topk_weights is not None and (topk_weights.dtype != torch.float32 or topk_weights.shape != (t, k)
                                     or topk_weights.device != topk_ids.device):
        raise ValueError(f"topk_weights: expected [{t}, {k}] float32 on {topk_ids.device}, got "
                         f"{topk_weights.dtype} shape {tuple(topk_weights.shape)} on {topk_weights.device}")
    if r >= 2 ** 31 - 1:
        raise ValueError(f"topk_ids: T*k={r} routes overflow int32 row ids")
    dev = topk_ids.device
    out = new_alignment(r, k, num_local, block_m, dev, with_weights=topk_weights is not None)
    max_blocks, max_rows = out.max_blocks, out.max_rows
    i32 = dict(dtype=torch.int32, device=dev)
    if r == 0:
        out.num_valid_blocks.zero_()
        out.expert_offsets.zero_()
        out.expert_counts.zero_()
        return out
    import triton  # noqa: PLC0415

    from ._moe_align import _align_count_kernel, _align_scan_kernel, _align_scatter_kernel, _align_small_kernel
    from ._triton_utils import pdl_options
    pdl = pdl_options(dev)
    ids = topk_ids.contiguous().view(-1)
    c = triton.cdiv(r, _BLOCK)
    e_pad = max(triton.next_power_of_2(num_local), _E_TILE)
    small_ok = r <= SMALL_MAX_ROUTES and max_rows <= SMALL_MAX_ROWS
    sorted_ok = r <= SORTED_MAX_ROUTES and max_rows <= SMALL_MAX_ROWS
    if impl == "small" and not small_ok:
        raise ValueError(f"impl='small': needs R <= {SMALL_MAX_ROUTES} routes and max_rows <= {SMALL_MAX_ROWS}, "
                         f"got R={r}, max_rows={max_rows}")
    if impl == "sorted" and not sorted_ok:
        raise ValueError(f"impl='sorted': needs R <= {SORTED_MAX_ROUTES} routes and max_rows <= {SMALL_MAX_ROWS}, "
                         f"got R={r}, max_rows={max_rows}")
    use_sorted = impl == "sorted" or (impl == "auto" and SMALL_SORTED and sorted_ok)
    if use_sorted or impl == "small" or (impl == "auto" and small_ok):
        # NOTE: one launch instead of three at decode (count 2.5 + scan 1.2 + scatter 2.3 us
        # at Flash T=1 in the session-4 H200 profile)
        tw = None if topk_weights is None else topk_weights.contiguous().view(-1)
        # NOTE: the route tile is R rounded up to a power of two (8 at T = 1, top-6), not
        # _BLOCK: the [routes x experts] one-hot count is 8 x 256 instead of 64 x 256
        block = max(2, triton.next_power_of_2(r))
        _align_small_kernel[(1,)](ids, tw if tw is not None else ids, out.route_rows, out.expert_counts,
                                  out.expert_offsets, out.num_valid_blocks, out.sorted_route_ids,
                                  out.block_expert, out.row_expert,
                                  out.row_weight if tw is not None else out.row_expert,
                                  r, first_expert, num_local, max_blocks,
                                  HAS_WEIGHTS=tw is not None, BLOCK=block,
                                  BLOCK_M=block_m, E_PAD=e_pad,
                                  ROWS_PAD=triton.next_power_of_2(max_rows),
                                  MB_PAD=triton.next_power_of_2(max_blocks),
                                  PAIRWISE=SMALL_PAIRWISE and (e_pad > 256 or r >= SMALL_PAIRWISE_MIN_ROUTES),
                                  SORTED=use_sorted,
                                  num_warps=SMALL_NUM_WARPS if block < 64 else SMALL_NUM_WARPS_64, **pdl)
        return out
    chunk_counts = torch.empty((c, e_pad), **i32)
    chunk_base = torch.empty((c, e_pad), **i32)
    _align_count_kernel[(c,)](ids, out.route_rows, chunk_counts, r, first_expert, num_local,
                              BLOCK=_BLOCK, E_PAD=e_pad, E_TILE=_E_TILE, num_warps=4, **pdl)
    c_pad = triton.next_power_of_2(c)
    # NOTE: one program per [C_PAD, E_TILE] tile of ~4096 counts (one program for all experts
    # while C_PAD <= 16: T <= 170 at top-6). Until session 18 a single program walked the
    # tiles in turn: 157 us at Flash T=8192 (16 steps of [1024, 16]), 264 us at Pro-TP8
    # (32 steps) in the H200 profile (docs/bench/2026-11-30/session18/profile_layer_*.txt).
    e_tile = min(e_pad, max(_SCAN_TILE, triton.next_power_of_2(max(1, _SCAN_CELLS // c_pad))))
    _align_scan_kernel[(e_pad // e_tile,)](chunk_counts, chunk_base, out.expert_counts, c, num_local,
                                           C_PAD=c_pad, E_TILE=e_tile, E_PAD=e_pad, num_warps=4, **pdl)
    tw = None if topk_weights is None else topk_weights.contiguous().view(-1)
    grid = max(c, triton.cdiv(max_blocks, _BB))
    _align_scatter_kernel[(grid,)](ids, out.route_rows, chunk_base, out.expert_counts, out.expert_offsets,
                                   out.num_valid_blocks, out.sorted_route_ids, out.block_expert,
                                   out.row_expert, tw, out.row_weight if tw is not None else out.row_expert,
                                   r, first_expert, num_local, c, max_blocks,
                                   HAS_WEIGHTS=tw is not None, BLOCK=_BLOCK, BLOCK_M=block_m, BB=_BB, E_PAD=e_pad,
                                   num_warps=4, **pdl)
    return out
