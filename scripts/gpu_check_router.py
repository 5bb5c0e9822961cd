"""H200 check + probe of the decode front end: the router (kernels/router.py: in-kernel
scores, the logits GEMV) and moe_align's one-launch decode kernel.

    OUT=./out python3 scripts/gpu_check_router.py [--parts scores,renorm,ids,align,time,topk,align_warps,align_sorted] [--budget-s 200]

scores  every fp32 bit pattern (2^32, in chunks): `_sqrt_softplus` (libdevice log1p/exp,
        IEEE sqrt) against torch.sqrt(F.softplus(x)) on the same GPU; must be bitwise
        (NaN payloads compared as "both NaN"). Then route_topk with scores in the kernel
        vs scores by torch, on the same logits: ids and weights bitwise.
renorm  (session 36) one-hot gate rows (exact logits): the weights bitwise ref.route's on this GPU
        wherever the ids agree, Flash / Pro shapes, biased and hash routing, T = 1-1024.
ids     route_topk (auto: GEMV logits for T <= GEMV_MAX_T, tensor-core logits to MMA_MAX_T,
        in-kernel scores) against the reference on the CPU, Flash and Pro gate shapes, biased
        and hash routing: share of tokens whose ids differ, and whether each differing token
        is a near-tie; the logits' largest error over sum_k |x_k w_k| (GEMV, tensor-core
        kernel and cuBLAS), bounded by K * 2^-24.
align   moe_align impl="small" (one launch in its compare forms: pairwise and, to 64 routes,
        one-hot) == impl="chunked" (three) on the GPU, every output, T = 1..10 at Flash /
        Pro-TP8 / EP shapes; and their CUDA-graph times.
time    CUDA-graph replay, gate weights rotated over 32 copies (so the 60 MB L2 does not
        hold them): the session-4 router (cuBLAS + torch softplus/sqrt + top-k) against
        cuBLAS / GEMV / tensor-core logits + in-kernel scores, and GEMV and tensor-core
        block variants.
topk    (not in the default parts) the top-k kernel's launch switches (router.TOPK_PACKED /
        TOPK_WARPS): route_topk bitwise the default and its graph time per variant.
align_warps (not in the default parts; session 27) the one-launch alignment at 4 / 8 / 16 warps
        with a 128-route limit, T = 4-21: bitwise the three launches, and graph times.
align_sorted (session 27; in the default parts since session 28, when it became moe_align's
        default) the one-launch alignment's sorted form, T = 1-42: bitwise the three launches,
        and graph times beside them and the compare form.
Writes $OUT/router.json and prints one line per row.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from dsv4_moe import reference as ref
from dsv4_moe.kernels._router import _sqrt_softplus
from dsv4_moe.kernels.router import (GEMV_MAX_T, MMA_MAX_T, gemv_blocks, mma_blocks, route_topk, router_logits,
                                     router_logits_gemv, router_logits_mma)

DEV = torch.device("cuda")
ROWS: list[dict] = []


def emit(**row):
    ROWS.append(row)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


@triton.jit
def _scores_elementwise(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, _sqrt_softplus(x), mask=i < n)


def check_scores():
    chunk = 1 << 28
    bad = nan_mismatch = 0
    first_bad = None
    t0 = time.time()
    for c in range(1 << 32 >> 28):
        bits = torch.arange(c * chunk, (c + 1) * chunk, dtype=torch.int64, device=DEV)
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        x = bits.view(torch.float32)
        want = torch.sqrt(torch.nn.functional.softplus(x))
        got = torch.empty_like(x)
        # the launch option route_topk uses (libdevice without flush-to-zero)
        _scores_elementwise[(triton.cdiv(chunk, 1024),)](x, got, chunk, BLOCK=1024, enable_reflect_ftz=False)
        wn, gn = torch.isnan(want), torch.isnan(got)
        nan_mismatch += int((wn != gn).sum())
        diff = (want.view(torch.int32) != got.view(torch.int32)) & ~(wn & gn)
        nb = int(diff.sum())
        if nb and first_bad is None:
            j = int(torch.nonzero(diff)[0])
            first_bad = dict(x=float(x[j]), bits=hex(int(bits[j]) & 0xFFFFFFFF), torch=float(want[j]), kernel=float(got[j]))
        bad += nb
    emit(check="scores_exhaustive", patterns=1 << 32, mismatches=bad, nan_mismatch=nan_mismatch,
         first_bad=str(first_bad), ok=bad == 0 and nan_mismatch == 0, seconds=time.time() - t0)
    # the top-k kernel on the same logits: scores in-kernel vs by torch
    g = torch.Generator(device=DEV).manual_seed(1)
    for e, h in ((256, 4096), (384, 7168)):
        w = (torch.randn(e, h, device=DEV, generator=g) * 0.02).bfloat16()
        bias = torch.randn(e, device=DEV, generator=g) * 0.01
        for t in (1, 37, 4096):
            x = torch.randn(t, h, device=DEV, generator=g).bfloat16()
            a = route_topk(x, w, bias, None, None, 6, 1.5, logits_impl="mm", scores_impl="kernel")
            b = route_topk(x, w, bias, None, None, 6, 1.5, logits_impl="mm", scores_impl="torch")
            ok = torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
            emit(check="topk_scores_kernel_vs_torch", E=e, T=t, ok=ok)


def check_ids():
    g = torch.Generator(device=DEV).manual_seed(2)
    for name, e, h in (("flash", 256, 4096), ("pro", 384, 7168)):
        w = (torch.randn(e, h, device=DEV, generator=g) * 0.02).bfloat16()
        bias = torch.randn(e, device=DEV, generator=g) * 0.01
        tab = torch.stack([torch.randperm(e)[:6] for _ in range(1000)]).to(DEV)
        for t in (1, 4, 8, 16, 32, 64, 1024):
            x = torch.randn(t, h, device=DEV, generator=g).bfloat16()
            lg = router_logits_gemv(x, w)
            lm = router_logits(x, w)
            lt = router_logits_mma(x, w)
            exact = x.double() @ w.double().T
            # error against the dot product's own bound sum_k |x_k w_k| (the max relative error
            # of session <= 23 divided by |logit|, which near zero reads large for a few-ulp
            # difference): fp32 sums in any order stay within about K * 2^-24 of it
            mag = (x.double().abs() @ w.double().abs().T).clamp_min(1e-300)
            bound = h * 2.0 ** -24
            err_g = float(((lg.double() - exact).abs() / mag).max())
            err_m = float(((lm.double() - exact).abs() / mag).max())
            err_t = float(((lt.double() - exact).abs() / mag).max())
            tw, ids = route_topk(x, w, bias, None, None, 6, 1.5)
            rw, rids = ref.route(x.cpu(), w.cpu(), bias.cpu(), None, None, 6, 1.5)
            mism = (ids.cpu().long() != rids).any(1)
            biased = ref.router_scores(x.cpu(), w.cpu()) + bias.cpu()
            top = biased.topk(7, dim=1).values
            near_tie = (top[:, 5] - top[:, 6]).abs() <= 1e-5 * top[:, 5].abs()
            okr = ~mism
            wrel = float(((tw.cpu()[okr] - rw[okr]).abs() / rw[okr]).max()) if okr.any() else 0.0
            emit(check="ids_vs_reference", shape=name, T=t,
                 logits="gemv" if t <= GEMV_MAX_T else "mma" if t <= MMA_MAX_T else "mm",
                 gemv_logit_err=err_g, mm_logit_err=err_m, mma_logit_err=err_t, err_bound=bound,
                 id_mismatch_tokens=int(mism.sum()), off_tie=int((mism & ~near_tie).sum()), w_rel=wrel,
                 ok=int((mism & ~near_tie).sum()) == 0 and wrel < 1e-5 and max(err_g, err_m, err_t) <= bound)
            ids_in = torch.randint(0, 1000, (t,), device=DEV)
            hw, hids = route_topk(x, w, None, tab, ids_in, 6, 1.5)
            rhw, rhids = ref.route(x.cpu(), w.cpu(), None, tab.cpu(), ids_in.cpu(), 6, 1.5)
            emit(check="hash_vs_reference", shape=name, T=t, ids_equal=torch.equal(hids.cpu().long(), rhids),
                 w_rel=float(((hw.cpu() - rhw).abs() / rhw).max()))


def check_renorm():
    """Session 36: the weights given the same scores. One-hot gate rows make every logit an exact
    bf16 value (x[t, j]), so the kernel's fp32 logits, scores and the reference's are the same;
    where the ids agree (bf16 values tie often, and torch.topk need not take the lowest index)
    the renormalised weights must be bitwise the reference's run on this GPU (IEEE division,
    sum in ascending id order). Before session 36 the kernel divided with Triton's default fp32
    `/` (div.full.f32)."""
    g = torch.Generator(device=DEV).manual_seed(3)
    for name, e, h in (("flash", 256, 4096), ("pro", 384, 7168)):
        w = torch.zeros(e, h, device=DEV)
        w[torch.arange(e), torch.arange(e)] = 1.0
        w = w.bfloat16()
        bias = torch.randn(e, device=DEV, generator=g) * 0.01
        tab = torch.stack([torch.randperm(e)[:6] for _ in range(1000)]).to(DEV)
        for t in (1, 3, 4, 8, 16, 64, 1024):
            x = torch.randn(t, h, device=DEV, generator=g).bfloat16()
            ids_in = torch.randint(0, 1000, (t,), device=DEV)
            for kind, args in (("biased", (bias, None, None)), ("hash", (None, tab, ids_in))):
                tw, ids = route_topk(x, w, *args, 6, 1.5)
                rw, rids = ref.route(x, w, *args, 6, 1.5)
                same = (ids.long() == rids).all(1)
                w_diff = int((tw[same].view(torch.int32) != rw[same].view(torch.int32)).sum())
                emit(check="renorm_bitwise", shape=name, kind=kind, T=t,
                     logits="gemv" if t <= GEMV_MAX_T else "mma" if t <= MMA_MAX_T else "mm",
                     tokens_ids_equal=int(same.sum()), of=t, weights_differing=w_diff, ok=w_diff == 0)


def check_align():
    import dsv4_moe.kernels.moe_align as ma
    from dsv4_moe.kernels.moe_align import moe_align
    fields = ("sorted_route_ids", "block_expert", "num_valid_blocks", "expert_offsets", "expert_counts",
              "route_rows", "row_expert", "row_weight")
    g = torch.Generator().manual_seed(4)
    for e, first, num_local, bm in ((256, 0, 256, 16), (384, 0, 384, 16), (384, 96, 48, 16), (256, 0, 256, 1),
                                    (256, 0, 256, 64)):
        for t in (1, 2, 4, 7, 8, 10):
            ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).sort(1).values.int().to(DEV)
            tw = torch.rand(t, 6, generator=g).to(DEV)
            if t * 6 > ma.SMALL_MAX_ROUTES or ma.align_sizes(t * 6, num_local, bm)[1] > ma.SMALL_MAX_ROWS:
                continue  # past the one-launch path's limits
            a = moe_align(ids, num_local, first, bm, tw, impl="small")
            b = moe_align(ids, num_local, first, bm, tw, impl="chunked")
            ok = all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)
            if t * 6 <= 64:  # the one-hot form (session <= 25) too
                ma.SMALL_PAIRWISE = False
                c = moe_align(ids, num_local, first, bm, tw, impl="small")
                ok = ok and all(torch.equal(getattr(c, f), getattr(b, f)) for f in fields)
                ma.SMALL_PAIRWISE = True
            row = dict(check="align_small_vs_chunked", E=e, first=first, local=num_local, bm=bm, T=t, ok=ok)
            if t in (1, 4, 8, 10) and bm == 16 and first == 0:
                row["small_us"] = graph_us(lambda: moe_align(ids, num_local, first, bm, tw, impl="small"))
                row["chunked_us"] = graph_us(lambda: moe_align(ids, num_local, first, bm, tw, impl="chunked"))
                if t * 6 <= 64:
                    ma.SMALL_PAIRWISE = False
                    row["small_onehot_us"] = graph_us(lambda: moe_align(ids, num_local, first, bm, tw, impl="small"))
                    ma.SMALL_PAIRWISE = True
            emit(**row)


def graph_us(fn, reps=15, inner=20):
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(inner):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gr.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / inner)
    return sorted(ts)[len(ts) // 2]


def time_router(budget_s, tokens=(1, 2, 4, 8, 16, 32, 64, 256, 1024)):
    g = torch.Generator(device=DEV).manual_seed(3)
    t0 = time.time()
    for name, e, h in (("flash", 256, 4096), ("pro", 384, 7168)):
        copies = 32
        ws = [(torch.randn(e, h, device=DEV, generator=g) * 0.02).bfloat16() for _ in range(copies)]
        bias = torch.randn(e, device=DEV, generator=g) * 0.01
        for t in tokens:
            if time.time() - t0 > budget_s:
                print("budget reached", flush=True)
                return
            xs = [torch.randn(t, h, device=DEV, generator=g).bfloat16() for _ in range(copies)]
            variants = {
                "s4 mm+torch": dict(logits_impl="mm", scores_impl="torch"),
                "mm+kernel": dict(logits_impl="mm", scores_impl="kernel"),
                "gemv+kernel": dict(logits_impl="gemv", scores_impl="kernel"),
                "mma+kernel": dict(logits_impl="mma", scores_impl="kernel"),
                "auto": {},
            }
            res = {}
            for label, kw in variants.items():
                def fn(kw=kw):
                    for c in range(copies):
                        route_topk(xs[c], ws[c], bias, None, None, 6, 1.5, **kw)
                res[label] = graph_us(fn, inner=1) / copies
            if t <= 64:
                bt, be, bh, nw = gemv_blocks(t)
                # whole gate rows per program (session 10): every load of a program in flight at once
                whole = [(bt, 1, triton.next_power_of_2(h), w) for w in (4, 8)
                         if bt * triton.next_power_of_2(h) <= 64 * 32 * w]
                for blk in [(bt, 1, min(1024, bh * 2), 4), (bt, 4, max(64, bh // 2), 4), (bt, 2, bh, 8),
                            (min(bt, 4), 2, bh, 4)] + whole:
                    def fn2(blk=blk):
                        for c in range(copies):
                            router_logits_gemv(xs[c], ws[c], blocks=blk)
                    res[f"gemv_only {blk}"] = graph_us(fn2, inner=1) / copies

                def fn3():
                    for c in range(copies):
                        router_logits_gemv(xs[c], ws[c])
                res[f"gemv_only default {gemv_blocks(t, h)}"] = graph_us(fn3, inner=1) / copies

                def fn4():
                    for c in range(copies):
                        router_logits(xs[c], ws[c])
                res["mm_only"] = graph_us(fn4, inner=1) / copies
                dflt = mma_blocks(t, e, h)
                be0, bt, bk, k_per, splits = dflt
                exact = xs[0].double() @ ws[0].double().T
                mag = (xs[0].double().abs() @ ws[0].double().abs().T).clamp_min(1e-300)
                # session 26: the K chunk; session 27: gate rows per program (more programs in
                # flight: 32 rows x 14 chunks = 168 at Pro) and warps
                for be, kp, nw in ((64, 256, 4), (64, 512, 4), (64, 1024, 4), (32, 256, 4), (32, 512, 4),
                                   (32, 1024, 4), (16, 512, 4), (64, 512, 8), (32, 512, 2)):
                    blk = (be, bt, bk, kp, -(-h // kp))
                    err = float(((router_logits_mma(xs[0], ws[0], blocks=blk, num_warps=nw).double() - exact).abs()
                                 / mag).max())

                    def fn5(blk=blk, nw=nw):
                        for c in range(copies):
                            router_logits_mma(xs[c], ws[c], blocks=blk, num_warps=nw)
                    tag = " default" if (blk == dflt and nw == 4) else ""
                    res[f"mma_only {blk} w{nw}{tag}"] = graph_us(fn5, inner=1) / copies
                    emit(check="mma_variant_err", shape=name, T=t, blocks=blk, num_warps=nw, err=err,
                         err_bound=h * 2.0 ** -24, ok=err <= h * 2.0 ** -24)
            for label, us in res.items():
                emit(check="time", shape=name, T=t, variant=label, us=us, TBps=e * h * 2 / us / 1e6)


def topk_variants(tokens, rounds=3):
    """route_topk (auto) under the top-k kernel's launch switches (router.TOPK_PACKED /
    TOPK_WARPS, session 25): ids and weights bitwise the default on every shape, and the
    CUDA-graph time of 32 calls on rotated gate weights, rounds interleaved (min)."""
    import dsv4_moe.kernels.router as router

    variants = {"default (4/2 warps)": (False, 0), "packed": (True, 0), "packed 1 warp": (True, 1),
                "packed 2 warps": (True, 2), "1 warp": (False, 1)}
    g = torch.Generator(device=DEV).manual_seed(5)
    saved = (router.TOPK_PACKED, router.TOPK_WARPS)
    try:
        for name, e, h in (("flash", 256, 4096), ("pro", 384, 7168)):
            copies = 32
            ws = [(torch.randn(e, h, device=DEV, generator=g) * 0.02).bfloat16() for _ in range(copies)]
            bias = torch.randn(e, device=DEV, generator=g) * 0.01
            for t in tokens:
                xs = [torch.randn(t, h, device=DEV, generator=g).bfloat16() for _ in range(copies)]
                outs, res = {}, {}
                for label, (packed, warps) in variants.items():
                    router.TOPK_PACKED, router.TOPK_WARPS = packed, warps
                    outs[label] = [route_topk(xs[c], ws[c], bias, None, None, 6, 1.5) for c in range(4)]
                for _ in range(rounds):
                    for label, (packed, warps) in variants.items():
                        router.TOPK_PACKED, router.TOPK_WARPS = packed, warps

                        def fn():
                            for c in range(copies):
                                route_topk(xs[c], ws[c], bias, None, None, 6, 1.5)
                        res.setdefault(label, []).append(graph_us(fn, inner=1) / copies)
                base = next(iter(variants))
                for label in variants:
                    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                               for a, b in zip(outs[label], outs[base]))
                    emit(check="topk_variant", shape=name, T=t, variant=label, us=min(res[label]),
                         ids_equal=same, ok=same)
    finally:
        router.TOPK_PACKED, router.TOPK_WARPS = saved


def align_warps(tokens=(4, 8, 10, 11, 12, 16, 20, 21)):
    """The one-launch alignment (pairwise) at 4 / 8 / 16 warps and a 128-route limit (session
    27, DESIGN lead 2 of session 26): bitwise the three launches, and graph-timed against them."""
    import dsv4_moe.kernels.moe_align as ma
    from dsv4_moe.kernels.moe_align import moe_align
    fields = ("sorted_route_ids", "block_expert", "num_valid_blocks", "expert_offsets", "expert_counts",
              "route_rows", "row_expert", "row_weight")
    g = torch.Generator().manual_seed(5)
    saved = (ma.SMALL_MAX_ROUTES, ma.SMALL_NUM_WARPS, ma.SMALL_NUM_WARPS_64)
    ma.SMALL_MAX_ROUTES = 128
    try:
        for e, bm in ((256, 16), (384, 16)):
            for t in tokens:
                ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).sort(1).values.int().to(DEV)
                tw = torch.rand(t, 6, generator=g).to(DEV)
                b = moe_align(ids, e, 0, bm, tw, impl="chunked")
                row = dict(check="align_warps", E=e, T=t, routes=6 * t,
                           chunked_us=graph_us(lambda: moe_align(ids, e, 0, bm, tw, impl="chunked")))
                ok = True
                for nw in (4, 8, 16):
                    ma.SMALL_NUM_WARPS = ma.SMALL_NUM_WARPS_64 = nw  # below / from 64-route tiles
                    a = moe_align(ids, e, 0, bm, tw, impl="small")
                    ok = ok and all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)
                    row[f"small_w{nw}_us"] = graph_us(lambda: moe_align(ids, e, 0, bm, tw, impl="small"))
                row["ok"] = ok
                emit(**row)
    finally:
        ma.SMALL_MAX_ROUTES, ma.SMALL_NUM_WARPS, ma.SMALL_NUM_WARPS_64 = saved


def align_sorted(tokens=(1, 2, 4, 8, 10, 11, 12, 16, 21, 32, 42)):
    """The one-program alignment's sorted form (session 27, untimed when built): bitwise the
    three launches at Flash / Pro-TP8 shapes, and graph-timed against them and, to 64 routes,
    against the default one-program form."""
    import dsv4_moe.kernels.moe_align as ma
    from dsv4_moe.kernels.moe_align import moe_align
    fields = ("sorted_route_ids", "block_expert", "num_valid_blocks", "expert_offsets", "expert_counts",
              "route_rows", "row_expert", "row_weight")
    g = torch.Generator().manual_seed(7)
    for e in (256, 384):
        for t in tokens:
            ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).sort(1).values.int().to(DEV)
            tw = torch.rand(t, 6, generator=g).to(DEV)
            b = moe_align(ids, e, 0, 16, tw, impl="chunked")
            a = moe_align(ids, e, 0, 16, tw, impl="sorted")
            row = dict(check="align_sorted", E=e, T=t, routes=6 * t,
                       ok=all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields),
                       sorted_us=graph_us(lambda: moe_align(ids, e, 0, 16, tw, impl="sorted")),
                       chunked_us=graph_us(lambda: moe_align(ids, e, 0, 16, tw, impl="chunked")))
            if 6 * t <= ma.SMALL_MAX_ROUTES:
                row["small_us"] = graph_us(lambda: moe_align(ids, e, 0, 16, tw, impl="small"))
            emit(**row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="scores,renorm,ids,align,align_sorted,time")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,256,1024", help="T of the timing part")
    args = ap.parse_args()
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    parts = args.parts.split(",")
    emit(check="env", device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         commit=os.environ.get("DSV4_MOE_GIT_COMMIT", "?"))
    if "scores" in parts:
        check_scores()
    if "renorm" in parts:
        check_renorm()
    if "ids" in parts:
        check_ids()
    if "align" in parts:
        check_align()
    if "align_warps" in parts:
        align_warps()
    if "align_sorted" in parts:
        align_sorted()
    if "time" in parts:
        time_router(args.budget_s, tuple(int(v) for v in args.tokens.split(",")))
    if "topk" in parts:
        topk_variants(tuple(int(v) for v in args.tokens.split(",")))
    with open(os.path.join(out, "router.json"), "w") as f:
        json.dump(ROWS, f, indent=1, default=str)
    bad = [r for r in ROWS if r.get("ok") is False or r.get("ids_equal") is False]
    print(f"{len(bad)} failed checks" if bad else "all router checks ok", flush=True)


if __name__ == "__main__":
    main()
