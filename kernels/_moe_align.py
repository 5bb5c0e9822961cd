"""Triton bodies of `moe_align`: a deterministic counting sort of routes by local expert.

Three launches, no host sync, sizes fixed by shapes only (CUDA-graph capturable):

1. `_align_count_kernel`   grid (C,)   C = cdiv(R, BLOCK) chunks of routes.
   Per chunk: the local expert key of each route (-1 if not local), its rank among the
   chunk's earlier routes with the same key (a BLOCK x BLOCK compare), and the chunk's
   per-expert histogram chunk_counts[c, :].
2. `_align_scan_kernel`    grid (E_PAD / E_TILE,).
   Per expert tile (one program each): exclusive prefix over chunks (chunk_base[c, e])
   with one 2-D cumsum, and the expert totals.
3. `_align_scatter_kernel` grid (max(C, cdiv(max_blocks, BB)),).
   Every program: padded sizes cdiv(count, BLOCK_M) * BLOCK_M and their exclusive prefix
   over experts (expert_offsets, in registers; program 0 stores it and the number of
   valid M-blocks, total padded rows / BLOCK_M).
   Routes: row = expert_offsets[e] + chunk_base[c, e] + rank, so rows of one expert
   keep route order (token-major) — the permutation is deterministic; per row also the
   local expert and (optionally) the route weight, for the filtered SwiGLU. Blocks: the
   expert of each M-block (-1 past the valid ones) and, in every row that holds no route
   (expert padding and whole unused blocks), the sentinel R, expert -1 and weight 0.

Decode (R <= 256 routes, max_rows <= SMALL_MAX_ROWS): `_align_small_kernel` does all three
steps in one program and one launch: every row first gets the sentinel R / -1 / 0
(`_align_fill`), then (after a barrier, which orders the program's global writes) the routes
overwrite their rows (`_align_place`); each valid M-block's expert is written by the routes it
holds (every valid block holds at least one), the others get -1. Its default form sorts the
routes' packed keys once (`_align_sorted_body`); the older forms (`_align_small_body`, R <= 64:
[routes x routes] or [routes x experts] compares) remain for `impl="small"` and the one-launch
front (`_route_front.py`). Same outputs, bit for bit.
"""

import triton
import triton.language as tl

from ._triton_utils import pdl_enter


@triton.jit
def _local_key(ids_ptr, r, in_r, first_expert, num_local):
    e = tl.load(ids_ptr + r, mask=in_r, other=-1).to(tl.int32) - first_expert
    local = in_r & (e >= 0) & (e < num_local)
    return tl.where(local, e, -1), local


@triton.jit
def _align_count_kernel(ids_ptr, rank_ptr, chunk_counts_ptr, R, first_expert, num_local,
                        BLOCK: tl.constexpr, E_PAD: tl.constexpr, E_TILE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    _align_count_body(ids_ptr, rank_ptr, chunk_counts_ptr, tl.program_id(0), R, first_expert, num_local,
                      BLOCK, E_PAD, E_TILE)


@triton.jit
def _align_count_body(ids_ptr, rank_ptr, chunk_counts_ptr, c, R, first_expert, num_local,
                      BLOCK: tl.constexpr, E_PAD: tl.constexpr, E_TILE: tl.constexpr):
    i = tl.arange(0, BLOCK)
    r = c * BLOCK + i
    in_r = r < R
    key, local = _local_key(ids_ptr, r, in_r, first_expert, num_local)
    same = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None]) & local[None, :]
    tl.store(rank_ptr + r, tl.sum(same.to(tl.int32), axis=1), mask=in_r)
    for e0 in tl.static_range(0, E_PAD, E_TILE):
        ecol = e0 + tl.arange(0, E_TILE)
        cnt = tl.sum((key[:, None] == ecol[None, :]).to(tl.int32), axis=0)
        tl.store(chunk_counts_ptr + c * E_PAD + ecol, cnt)


@triton.jit
def _align_scan_kernel(chunk_counts_ptr, chunk_base_ptr, expert_counts_ptr, C, num_local,
                       C_PAD: tl.constexpr, E_TILE: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr = 0):
    """Program p: experts p*E_TILE .. : the exclusive prefix over chunks and the totals."""
    pdl_enter(PDL)
    cc = tl.arange(0, C_PAD)
    ecol = tl.program_id(0) * E_TILE + tl.arange(0, E_TILE)
    m = cc[:, None] < C
    idx = cc[:, None] * E_PAD + ecol[None, :]
    cnt = tl.load(chunk_counts_ptr + idx, mask=m, other=0)
    tl.store(chunk_base_ptr + idx, tl.cumsum(cnt, axis=0) - cnt, mask=m)
    tl.store(expert_counts_ptr + ecol, tl.sum(cnt, axis=0), mask=ecol < num_local)


@triton.jit
def _align_scatter_kernel(ids_ptr, route_rows_ptr, chunk_base_ptr, expert_counts_ptr,
                          expert_offsets_ptr, num_blocks_ptr, sorted_ids_ptr, block_expert_ptr,
                          row_expert_ptr, topk_w_ptr, row_weight_ptr,
                          R, first_expert, num_local, C, max_blocks,
                          HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BB: tl.constexpr,
                          E_PAD: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    # ---- every program: the padded prefix over experts, from the totals (<= 512 of them;
    # program 0 stores it and the valid block count for the GEMMs)
    ecol = tl.arange(0, E_PAD)
    is_e = ecol < num_local
    tot = tl.load(expert_counts_ptr + ecol, mask=is_e, other=0)
    offs, nvb = _align_offsets(tot, ecol, is_e, expert_offsets_ptr, num_blocks_ptr, num_local, pid == 0, BLOCK_M)
    _align_scatter_routes(ids_ptr, route_rows_ptr, chunk_base_ptr, sorted_ids_ptr, row_expert_ptr, topk_w_ptr,
                          row_weight_ptr, offs, pid, (pid < C), R, first_expert, num_local,
                          HAS_WEIGHTS, BLOCK, E_PAD)
    _align_scatter_blocks(sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr, tot, offs, is_e, nvb,
                          pid, R, max_blocks, HAS_WEIGHTS, BLOCK_M, BB)


@triton.jit
def _align_offsets(tot, ecol, is_e, expert_offsets_ptr, num_blocks_ptr, num_local, store, BLOCK_M: tl.constexpr):
    """Padded sizes cdiv(count, BLOCK_M) * BLOCK_M of the experts' totals `tot` and their
    exclusive prefix (-> offs, number of valid blocks); `store`: also write expert_offsets
    (with the used rows at [num_local]) and the valid block count."""
    padded = (tot + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    offs = tl.cumsum(padded, axis=0) - padded
    total = tl.sum(padded, axis=0)
    nvb = total // BLOCK_M
    tl.store(expert_offsets_ptr + ecol, offs, mask=is_e & store)
    one = tl.arange(0, 1)
    tl.store(expert_offsets_ptr + num_local + one, tl.zeros([1], tl.int32) + total, mask=store)
    tl.store(num_blocks_ptr + one, tl.zeros([1], tl.int32) + nvb, mask=store)
    return offs, nvb


@triton.jit
def _align_scatter_routes(ids_ptr, route_rows_ptr, chunk_base_ptr, sorted_ids_ptr, row_expert_ptr, topk_w_ptr,
                          row_weight_ptr, offs, c, chunk_ok, R, first_expert, num_local,
                          HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """Routes of chunk c -> their rows: row = offs[e] + chunk_base[c, e] + rank (the rank the
    count step left in route_rows); route_rows then holds the row (-1 if not local)."""
    r = c * BLOCK + tl.arange(0, BLOCK)
    in_r = (r < R) & chunk_ok
    key, local = _local_key(ids_ptr, r, in_r, first_expert, num_local)
    rank = tl.load(route_rows_ptr + r, mask=local, other=0)
    base = tl.load(chunk_base_ptr + c * E_PAD + key, mask=local, other=0)
    dest = tl.gather(offs, tl.where(local, key, 0), 0) + base + rank
    tl.store(sorted_ids_ptr + dest, r, mask=local)
    tl.store(row_expert_ptr + dest, key, mask=local)
    if HAS_WEIGHTS:
        tl.store(row_weight_ptr + dest, tl.load(topk_w_ptr + r, mask=local, other=0.0), mask=local)
    tl.store(route_rows_ptr + r, tl.where(local, dest, -1), mask=in_r)


@triton.jit
def _align_scatter_blocks(sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr, tot, offs, is_e, nvb,
                          g, R, max_blocks, HAS_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BB: tl.constexpr):
    """M-blocks g*BB .. : their expert id (-1 past the valid ones) and the sentinel rows."""
    b = g * BB + tl.arange(0, BB)
    in_b = b < max_blocks
    # expert holding row b*BLOCK_M = last expert whose start <= that row (empty experts
    # share their start with the next one, so "last" skips them)
    row0 = b * BLOCK_M
    ex = tl.sum(((offs[None, :] <= row0[:, None]) & is_e[None, :]).to(tl.int32), axis=1) - 1
    valid_b = in_b & (b < nvb)
    ex = tl.where(valid_b, ex, -1)
    tl.store(block_expert_ptr + b, ex, mask=in_b)
    ex_safe = tl.where(valid_b, ex, 0)  # invalid blocks are all padding whatever these read
    cnt = tl.gather(tot, ex_safe, 0)
    start = tl.gather(offs, ex_safe, 0)
    rows = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad = (rows >= (start + cnt)[:, None]) | (~valid_b)[:, None]
    pad = pad & in_b[:, None]
    tl.store(sorted_ids_ptr + rows, tl.full([BB, BLOCK_M], 0, tl.int32) + R, mask=pad)
    tl.store(row_expert_ptr + rows, tl.full([BB, BLOCK_M], -1, tl.int32), mask=pad)
    if HAS_WEIGHTS:
        tl.store(row_weight_ptr + rows, tl.zeros([BB, BLOCK_M], tl.float32), mask=pad)


@triton.jit
def _align_fill(expert_offsets_ptr, num_blocks_ptr, sorted_ids_ptr, row_expert_ptr, row_weight_ptr,
                block_expert_ptr, num_local, total, nvb, R, max_blocks, HAS_WEIGHTS: tl.constexpr,
                BLOCK_M: tl.constexpr, ROWS_PAD: tl.constexpr, MB_PAD: tl.constexpr):
    """The one-program forms' first stores: the used rows and the valid block count, every row
    the sentinel (rows holding a route are overwritten after the caller's barrier) and every
    block past the valid ones -1."""
    one = tl.arange(0, 1)
    rows = tl.arange(0, ROWS_PAD)
    in_rows = rows < max_blocks * BLOCK_M
    b = tl.arange(0, MB_PAD)
    tl.store(expert_offsets_ptr + num_local + one, tl.zeros([1], tl.int32) + total)
    tl.store(num_blocks_ptr + one, tl.zeros([1], tl.int32) + nvb)
    tl.store(sorted_ids_ptr + rows, tl.zeros([ROWS_PAD], tl.int32) + R, mask=in_rows)
    tl.store(row_expert_ptr + rows, tl.full([ROWS_PAD], -1, tl.int32), mask=in_rows)
    if HAS_WEIGHTS:
        tl.store(row_weight_ptr + rows, tl.zeros([ROWS_PAD], tl.float32), mask=in_rows)
    tl.store(block_expert_ptr + b, tl.full([MB_PAD], -1, tl.int32), mask=(b < max_blocks) & (b >= nvb))


@triton.jit
def _align_place(sorted_ids_ptr, row_expert_ptr, row_weight_ptr, route_rows_ptr, block_expert_ptr, topk_w_ptr,
                 dest, route, key, local, route_ok, HAS_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each local route into its row `dest` (route id, expert, weight), its row into route_rows
    (-1 if not local) and its expert into its M-block."""
    tl.store(sorted_ids_ptr + dest, route, mask=local)
    tl.store(row_expert_ptr + dest, key, mask=local)
    if HAS_WEIGHTS:
        tl.store(row_weight_ptr + dest, tl.load(topk_w_ptr + route, mask=local, other=0.0), mask=local)
    tl.store(route_rows_ptr + route, tl.where(local, dest, -1), mask=route_ok)
    tl.store(block_expert_ptr + dest // BLOCK_M, key, mask=local)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _align_sorted_body(ids_ptr, topk_w_ptr, route_rows_ptr, expert_counts_ptr, expert_offsets_ptr,
                       num_blocks_ptr, sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                       R, first_expert, num_local, max_blocks,
                       HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       E_PAD: tl.constexpr, ROWS_PAD: tl.constexpr, MB_PAD: tl.constexpr):
    """The one-program alignment by sorting (session 27; the default since session 28): the BLOCK routes' keys
    (local expert, E_PAD for a route that is not local or past R) packed with their index,
    key * BLOCK + i, sorted ascending - so by expert and, within an expert, by route (the
    counting sort's order). In sorted order a route's rank is its distance from its expert's
    first position (a max-scan of the segment starts), its expert's count is known at the
    segment's last position (rank + 1), and its expert's start is the sum of the padded counts
    of the segments before it (a cumsum over the last positions). Every step is a [BLOCK]
    vector: no [routes x routes] or [routes x experts] tile. Same outputs as the other forms."""
    i = tl.arange(0, BLOCK)
    in_r = i < R
    key, local = _local_key(ids_ptr, i, in_r, first_expert, num_local)
    packed = tl.where(local, key, E_PAD) * BLOCK + i
    srt = tl.sort(packed)
    sk = srt // BLOCK                      # key in sorted order (E_PAD: not local)
    si = srt % BLOCK                       # route index in sorted order
    s_local = sk < E_PAD
    prev = tl.gather(sk, tl.maximum(i - 1, 0), 0)
    nxt = tl.gather(sk, tl.minimum(i + 1, BLOCK - 1), 0)
    start = (i == 0) | (sk != prev)
    last = (i == BLOCK - 1) | (sk != nxt)
    rank = i - tl.associative_scan(tl.where(start, i, 0), 0, _max_combine)
    pf = tl.where(last & s_local, (rank + BLOCK_M) // BLOCK_M * BLOCK_M, 0)   # padded count of rank + 1 rows
    off = tl.cumsum(pf, axis=0) - pf
    total = tl.sum(pf, axis=0)
    nvb = total // BLOCK_M
    ecol = tl.arange(0, E_PAD)
    is_e = ecol < num_local
    tl.store(expert_counts_ptr + ecol, tl.zeros([E_PAD], tl.int32), mask=is_e)
    _align_fill(expert_offsets_ptr, num_blocks_ptr, sorted_ids_ptr, row_expert_ptr, row_weight_ptr,
                block_expert_ptr, num_local, total, nvb, R, max_blocks, HAS_WEIGHTS, BLOCK_M, ROWS_PAD, MB_PAD)
    # the barrier orders the fills above (any thread) before the writes below
    tl.debug_barrier()
    # `off` at any position of a segment: the padded counts of the segments before it (its own
    # last position's pf is subtracted there; its other positions have pf 0)
    _align_place(sorted_ids_ptr, row_expert_ptr, row_weight_ptr, route_rows_ptr, block_expert_ptr, topk_w_ptr,
                 off + rank, si, sk, s_local, si < R, HAS_WEIGHTS, BLOCK_M)
    tl.store(expert_counts_ptr + sk, rank + 1, mask=last & s_local)
    tl.debug_barrier()
    cnt = tl.load(expert_counts_ptr + ecol, mask=is_e, other=0, volatile=True)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(expert_offsets_ptr + ecol, tl.cumsum(padded, axis=0) - padded, mask=is_e)


@triton.jit
def _align_small_kernel(ids_ptr, topk_w_ptr, route_rows_ptr, expert_counts_ptr, expert_offsets_ptr,
                        num_blocks_ptr, sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                        R, first_expert, num_local, max_blocks,
                        HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                        E_PAD: tl.constexpr, ROWS_PAD: tl.constexpr, MB_PAD: tl.constexpr,
                        PAIRWISE: tl.constexpr = True, PDL: tl.constexpr = 0, SORTED: tl.constexpr = False):
    pdl_enter(PDL)
    if SORTED:
        _align_sorted_body(ids_ptr, topk_w_ptr, route_rows_ptr, expert_counts_ptr, expert_offsets_ptr,
                           num_blocks_ptr, sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                           R, first_expert, num_local, max_blocks,
                           HAS_WEIGHTS, BLOCK, BLOCK_M, E_PAD, ROWS_PAD, MB_PAD)
    else:  # NOTE: if / else, not an early return (Triton compiles the code after a return too)
        _align_small_body(ids_ptr, topk_w_ptr, route_rows_ptr, expert_counts_ptr, expert_offsets_ptr,
                          num_blocks_ptr, sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                          R, first_expert, num_local, max_blocks,
                          HAS_WEIGHTS, BLOCK, BLOCK_M, E_PAD, ROWS_PAD, MB_PAD, PAIRWISE)


@triton.jit
def _align_small_body(ids_ptr, topk_w_ptr, route_rows_ptr, expert_counts_ptr, expert_offsets_ptr,
                      num_blocks_ptr, sorted_ids_ptr, block_expert_ptr, row_expert_ptr, row_weight_ptr,
                      R, first_expert, num_local, max_blocks,
                      HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                      E_PAD: tl.constexpr, ROWS_PAD: tl.constexpr, MB_PAD: tl.constexpr,
                      PAIRWISE: tl.constexpr = True):
    """The one-program alignment (also run by the last program of `_route_front_kernel`,
    after a CTA barrier, on the ids and weights its top-k just wrote).

    PAIRWISE (session 26): everything a route needs from the [routes x routes] compare -
    its rank among earlier routes of its expert, its expert's count, and its expert's start
    (the padded counts of the smaller experts, each taken once from that expert's first
    route); the per-expert outputs (counts, offsets) from one [E] pass over counts scattered
    to memory and read back after a barrier. Without it, [routes x E] one-hot sums (E = 384
    experts: 8-64 x 512 cells against 8-64 x 8-64)."""
    i = tl.arange(0, BLOCK)
    in_r = i < R
    key, local = _local_key(ids_ptr, i, in_r, first_expert, num_local)
    same = (key[:, None] == key[None, :]) & local[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    ecol = tl.arange(0, E_PAD)
    is_e = ecol < num_local
    if PAIRWISE:
        cnt_r = tl.sum(same.to(tl.int32), axis=1)                       # routes of route i's expert
        first = local & (rank == 0)
        pf = tl.where(first, (cnt_r + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        off = tl.sum(tl.where(key[None, :] < key[:, None], pf[None, :], 0), axis=1)
        total = tl.sum(pf, axis=0)
        nvb = total // BLOCK_M
        # every row the sentinel, every expert count 0 (the routes' rows and their experts'
        # counts are overwritten after the barrier, which orders the program's global writes)
        tl.store(expert_counts_ptr + ecol, tl.zeros([E_PAD], tl.int32), mask=is_e)
    else:
        cnt = tl.sum((key[:, None] == ecol[None, :]).to(tl.int32), axis=0)
        padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        offs = tl.cumsum(padded, axis=0) - padded
        total = tl.sum(padded, axis=0)
        tl.store(expert_counts_ptr + ecol, cnt, mask=is_e)
        tl.store(expert_offsets_ptr + ecol, offs, mask=is_e)
        nvb = total // BLOCK_M
        # each route's expert offset gathered in registers (a one-hot sum over the experts), not
        # re-read from global memory after the barrier (session 7: one L2 round trip fewer on
        # the decode critical path)
        off = tl.sum(tl.where(key[:, None] == ecol[None, :], offs[None, :], 0), axis=1)
    _align_fill(expert_offsets_ptr, num_blocks_ptr, sorted_ids_ptr, row_expert_ptr, row_weight_ptr,
                block_expert_ptr, num_local, total, nvb, R, max_blocks, HAS_WEIGHTS, BLOCK_M, ROWS_PAD, MB_PAD)
    # the barrier orders the fills above (any thread) before the writes below (the route's thread)
    tl.debug_barrier()
    _align_place(sorted_ids_ptr, row_expert_ptr, row_weight_ptr, route_rows_ptr, block_expert_ptr, topk_w_ptr,
                 off + rank, i, key, local, in_r, HAS_WEIGHTS, BLOCK_M)
    if PAIRWISE:
        tl.store(expert_counts_ptr + key, cnt_r, mask=first)                # one first route per expert
        tl.debug_barrier()
        cnt = tl.load(expert_counts_ptr + ecol, mask=is_e, other=0, volatile=True)
        padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(expert_offsets_ptr + ecol, tl.cumsum(padded, axis=0) - padded, mask=is_e)
