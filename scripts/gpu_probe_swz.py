"""H200 probe: the "mma64" MXFP4 weight layout (weights/mma_layout.py) against "nk".

    OUT=./out python3 scripts/gpu_probe_swz.py [--ts 1,4,16,64,256,1024,4096] [--budget-s 300]

For Flash / Pro-TP8 gate_up (gathered rows) and down (permuted rows, scattered), top-6
routes of random tokens: times under CUDA-graph replay the "nk" default
(select_config(..., "nk")), the "mma64" default and mma64 variants; checks bitwise:
  * mma64 swap/tile == nk swap/tile with the same config (same MMA, same k order),
  * the mma64 dequantisation PTX == the plain fp32 construction (asm off),
  * a_bf16 (bf16 activations handed to the swap body, conversion timed) == fp8 ones,
and reports the share of outputs that differ from the nk default (other bodies sum a
128-block in another order). Writes $OUT/probe_swz.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.moe_align import moe_align
from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig, bf16_pairs, mxfp4_grouped_gemm, select_config
from dsv4_moe.testing import random_mxfp4_weight
from dsv4_moe.weights.mma_layout import to_mma64

DEV = torch.device("cuda")


def graph_time(fn, reps=15, inner=5):
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return sorted(times)[len(times) // 2]


def ulp_stats(a, b):
    d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return float((d != 0).float().mean()), int(d.max()) if d.numel() else 0


def label(cfg, layout):
    return (f"{layout:5s} {cfg.kind}{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            f" sk{cfg.split_k} asm{int(cfg.asm)}{' bf16A' if cfg.a_bf16 else ''}{f' DIAG{cfg.diag}' if cfg.diag else ''}"
            f"{f' r{cfg.maxnreg}' if cfg.maxnreg else ''}{f' u{cfg.unroll}' if cfg.unroll > 1 else ''}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--ts", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--shapes", default="flash_up,flash_down,pro_up,pro_down")
    ap.add_argument("--fixup", action="store_true",
                    help="the shared FP8 GEMMs at M = 1 and 4: split-K summed in the tile's last program "
                         "vs the separate phase-2 launch (the routed MXFP4 variant measured slower in "
                         "session 6 and was removed)")
    ap.add_argument("--gemv", action="store_true",
                    help="only the shared expert's M=1 FP8 GEMV: split-K x KB_VEC variants, weights rotated")
    ap.add_argument("--regs", action="store_true",
                    help="only the mma64 default and register / stage variants of it")
    ap.add_argument("--unroll", action="store_true",
                    help="only the layer's config (a_bf16 / register cap as routed_configs) and its K loop "
                         "unrolled 2 and 4 times (GemmConfig.unroll: fewer pipeline barriers per block)")
    ap.add_argument("--diag", action="store_true",
                    help="only the mma64 default and its DIAG twins (1: no dequantisation, 2: no MMA; "
                         "wrong values) to split its time into load, conversion and MMA")
    ap.add_argument("--cfgs", default="",
                    help="only the nk / mma64 defaults and these configs: comma-separated "
                         "kind:block_m:block_n:warps:stages[:bf16A][:pre][:sk<split>][:r<maxnreg>][:u<unroll>][:nk], "
                         "e.g. swap:128:128:8:3:bf16A; pre: the bf16 pairs made outside the timed call "
                         "(as if the kernel writing q wrote them too)")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.time()
    shapes = (("flash_up", 4096, 4096, 256, True), ("flash_down", 4096, 2048, 256, False),
              ("pro_up", 768, 7168, 384, True), ("pro_down", 7168, 384, 384, False))
    gcuda = torch.Generator(device=DEV).manual_seed(0)
    weights = {}
    for name, n, k, e, _ in shapes:
        w, s = random_mxfp4_weight((e, n, k), generator=gcuda)
        weights[name] = {"nk": w, "mma64": to_mma64(w), "scale": s}
    for t in [int(x) for x in args.ts.split(",")]:
        for name, n, k, e, gather in shapes:
            if name not in args.shapes.split(","):
                continue
            if time.time() - t0 > args.budget_s:
                print("budget reached", flush=True)
                break
            ws = weights[name]
            ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)]).sort(1).values.int().to(DEV)
            hit = torch.unique(ids).numel()
            wbytes = hit * n * k * 17 // 32
            torch.manual_seed(t * 7 + n)
            xs = torch.randn(t if gather else t * 6, k, device=DEV).bfloat16()
            qx, sx = act_quant(xs)

            pre_keys = set()

            def run(cfg, layout):
                a = moe_align(ids, e, 0, cfg.block_m)
                if gather:
                    q, sa = qx, sx
                else:
                    rid = a.sorted_route_ids.long().clamp(max=t * 6 - 1)
                    q, sa = qx[rid].contiguous(), sx[rid].contiguous()
                o = torch.zeros(a.max_rows if gather else t * 6, n, dtype=torch.bfloat16, device=DEV)
                pairs = bf16_pairs(q) if (cfg, layout) in pre_keys else None
                fn = lambda: mxfp4_grouped_gemm(q, sa, ws[layout], ws["scale"], a, gather_a=gather,  # noqa: E731
                                                scatter_out=not gather, out=o, config=cfg, layout=layout,
                                                a_pairs=pairs)
                fn()
                torch.cuda.synchronize()
                res = (o[a.route_rows.long()] if gather else o).clone()
                return res, graph_time(fn)

            rows_per = t * 6 / e
            base_cfg = select_config(t * 6, e, n, k, "nk")
            new_cfg = select_config(t * 6, e, n, k, "mma64")
            cands = [(base_cfg, "nk"), (new_cfg, "mma64")]
            if rows_per < 8:
                cands += [(GemmConfig(16, 128, 4, 4, kind="swap", asm=True), "nk"),
                          (GemmConfig(16, 128, 4, 4, kind="swap"), "mma64"),
                          (GemmConfig(16, 128, 4, 3, kind="swap", asm=True), "mma64"),
                          (GemmConfig(16, 64, 4, 4, kind="swap", asm=True), "mma64"),
                          (GemmConfig(16, 128, 4, 3, asm=True), "mma64")]
                cands.append((GemmConfig(16, 128, 4, 4, kind="swap", asm=True, a_bf16=True), "mma64"))
                if rows_per >= 1:  # session 5: wider weight tiles at T = 64..256
                    cands += [(GemmConfig(16, 256, 8, 4, kind="swap", asm=True, a_bf16=True), "mma64"),
                              (GemmConfig(32, 128, 4, 3, kind="swap", asm=True, a_bf16=True), "mma64")]
                if rows_per < 0.2:
                    for sk in (2, 4, 8):
                        cands.append((GemmConfig(16, 128, 4, 4, kind="swap", asm=True, split_k=sk), "mma64"))
            elif rows_per < 64:
                cands += [(GemmConfig(32, 128, 4, 3, kind="swap", asm=True, a_bf16=True), "mma64"),
                          (GemmConfig(32, 256, 8, 3, kind="swap", asm=True, a_bf16=True), "mma64"),
                          (GemmConfig(32, 128, 4, 3, kind="swap", asm=True), "nk"),
                          (GemmConfig(32, 128, 4, 4, kind="swap", asm=True), "mma64")]
            else:
                # session 5: smaller weight tiles for the tile body (ncu: 250 registers, 2
                # programs per SM at 64 x 128) and the swap body with bf16 activations
                cands += [(GemmConfig(64, 128, 4, 3, asm=True), "nk"),
                          (GemmConfig(64, 64, 4, 3, asm=True), "nk"),
                          (GemmConfig(64, 64, 4, 3, asm=True), "mma64"),
                          (GemmConfig(64, 64, 4, 4, asm=True), "mma64"),
                          (GemmConfig(128, 64, 4, 3, asm=True), "mma64"),
                          (GemmConfig(128, 64, 8, 3, asm=True), "mma64"),
                          (GemmConfig(32, 128, 4, 3, asm=True), "mma64"),
                          (GemmConfig(64, 128, 4, 4, asm=True), "nk"),
                          (GemmConfig(32, 128, 4, 3, kind="swap", asm=True, a_bf16=True), "mma64")]
            if args.regs:  # session 6: more programs per SM for the decode swap body (147 regs -> 3/SM)
                c = {**new_cfg.__dict__, "a_bf16": gather and new_cfg.kind == "swap" and rows_per >= 0.2}
                base = GemmConfig(**c)
                cands = [(base, "mma64")] + [(GemmConfig(**{**c, **kw}), "mma64") for kw in (
                    dict(maxnreg=128), dict(num_stages=2), dict(num_stages=3, maxnreg=128), dict(num_warps=8),
                    dict(num_stages=2, maxnreg=120))]
            if args.unroll:  # session 10: ncu put 9-11 % of the decode body's cycles in the loop barrier
                c = {**new_cfg.__dict__, "a_bf16": gather and new_cfg.kind == "swap" and new_cfg.split_k == 1
                     and rows_per >= 0.2}
                if not gather and k <= 1024 and rows_per >= 0.05 and new_cfg.kind == "swap":
                    c["maxnreg"] = 128
                base = GemmConfig(**c)
                cands = [(base, "mma64")]
                if base.kind == "swap":
                    cands += [(GemmConfig(**{**c, "unroll": u}), "mma64") for u in (2, 4)]
                    if base.maxnreg:
                        cands += [(GemmConfig(**{**c, "unroll": u, "maxnreg": None}), "mma64") for u in (1, 2, 3)]
            if args.cfgs:
                cands = [(base_cfg, "nk"), (new_cfg, "mma64")]
                for spec in args.cfgs.split(","):
                    f = spec.split(":")
                    extra = f[5:]
                    cfg = GemmConfig(int(f[1]), int(f[2]), int(f[3]), int(f[4]), kind=f[0], asm=True,
                                     a_bf16="bf16A" in extra,
                                     maxnreg=next((int(x[1:]) for x in extra if x.startswith("r")), None),
                                     unroll=next((int(x[1:]) for x in extra if x.startswith("u")), 1),
                                     split_k=next((int(x[2:]) for x in extra if x.startswith("sk")), 1))
                    cands.append((cfg, "nk" if "nk" in extra else "mma64"))
                    if "pre" in extra:  # session 11: bf16 pairs made outside the timed call
                        pre_keys.add(cands[-1])
            if args.fixup or args.gemv:  # only the FP8 GEMMs below
                continue
            if args.diag:
                cands = [(new_cfg, "mma64")] + [(GemmConfig(**{**new_cfg.__dict__, "diag": d}), "mma64") for d in (1, 2)]
            results = {}
            base_res = base_us = None
            for cfg, layout in cands:
                key = (cfg, layout)
                if key in results:
                    continue
                try:
                    res, us = run(cfg, layout)
                except Exception as ex:  # noqa: BLE001
                    msg = f"{type(ex).__name__}: {ex}"[:300]
                    rows.append(dict(shape=name, T=t, cfg=repr(cfg), layout=layout, error=msg))
                    print(f"{name:10s} T={t:5d} {label(cfg, layout)} ERROR {msg[:200]}", flush=True)
                    continue
                results[key] = res
                if base_res is None:
                    base_res, base_us = res, us
                fb, mb = ulp_stats(res, base_res)
                # bitwise twins: the same config in the other layout, and asm on/off
                twin = None
                other = (cfg, "nk") if layout == "mma64" else None
                plain = (GemmConfig(**{**cfg.__dict__, "asm": not cfg.asm}), layout)
                checks = {}
                bf16_twin = (GemmConfig(**{**cfg.__dict__, "a_bf16": False}), layout) if cfg.a_bf16 else None
                for tag, k2 in (("vs_nk_same_cfg", other), ("asm_vs_plain", plain), ("a_bf16_vs_fp8", bf16_twin)):
                    if k2 is not None and k2 in results and k2 != key:
                        checks[tag] = bool(torch.equal(res.view(torch.int16), results[k2].view(torch.int16)))
                rows.append(dict(shape=name, T=t, cfg=repr(cfg), layout=layout, pre=key in pre_keys, us=us, TBps=wbytes / us / 1e6,
                                 speedup_vs_nk_default=base_us / us, differ_vs_nk_default=fb, max_ulp=mb,
                                 default=key in ((base_cfg, "nk"), (new_cfg, "mma64")), **checks))
                print(f"{name:10s} T={t:5d} {label(cfg, layout) + (' pre' if key in pre_keys else ''):38s} {us:8.1f} us {wbytes / us / 1e6:5.2f} TB/s "
                      f"x{base_us / us:4.2f} differ {fb:.4%} max {mb} {checks}"
                      f"{' <- default' if key in ((base_cfg, 'nk'), (new_cfg, 'mma64')) else ''}", flush=True)
    if args.fixup:
        _probe_fp8_fixup(rows)
    if args.gemv:
        _probe_fp8_gemv_vec(rows)
    with open(os.path.join(out_dir, "probe_swz.json"), "w") as f:
        json.dump(rows, f, indent=1)


def _probe_fp8_fixup(rows):
    """The shared expert's FP8 GEMMs at M = 1..4 (split-K GEMV / tile bodies): the in-kernel
    last-program sum vs the separate phase-2 launch, bitwise and timed (weights rotated over
    8 copies so 4 of the 8 MB..17 MB matrices do not sit in L2)."""
    from dsv4_moe.kernels.fp8_block_gemm import choose_config, fp8_block_gemm_nt
    from dsv4_moe.testing import random_fp8_block_weight
    g = torch.Generator(device=DEV).manual_seed(1)
    for name, n, k in (("flash_shared_up", 4096, 4096), ("flash_shared_down", 4096, 2048),
                       ("pro_shared_up", 768, 7168), ("pro_tp1_shared_up", 6144, 7168)):
        ws = [random_fp8_block_weight(n, k, generator=g) for _ in range(8)]
        for m in (1, 4):
            q, sa = act_quant(torch.randn(m, k, device=DEV).bfloat16())
            cfg = choose_config(m, n, k)
            if cfg.get("SPLIT_K", 1) == 1:
                print(f"{name:18s} M={m} not split", flush=True)
                continue
            res = {}
            for fx in (True, False):
                c = {**cfg, "SPLIT_FIXUP": fx}
                outs = [torch.empty(m, n, dtype=torch.bfloat16, device=DEV) for _ in ws]

                def fn(c=c, outs=outs):
                    for (w, sw), o in zip(ws, outs):
                        fp8_block_gemm_nt(q, sa, w, sw, out=o, config=c)
                us = graph_time(fn) / len(ws)
                res[fx] = (outs[0].clone(), us)
            same = bool(torch.equal(res[True][0].view(torch.int16), res[False][0].view(torch.int16)))
            rows.append(dict(shape=name, T=m, cfg=repr(cfg), fixup_us=res[True][1], two_launch_us=res[False][1],
                             bitwise=same))
            print(f"{name:18s} M={m} split {cfg['SPLIT_K']:3d} {'GEMV' if cfg.get('GEMV') else 'tile'} "
                  f"fixup {res[True][1]:6.1f} us  two launches {res[False][1]:6.1f} us  bitwise {same}", flush=True)


def _probe_fp8_gemv_vec(rows):
    """Session 7: the M = 1 FP8 GEMV (split-K, in-kernel fixup) with each program's K blocks
    loaded in one tile (KB_VEC) against the per-block loop, over splits; weights rotated
    over 8 copies; each variant compared bitwise with the default config's output."""
    from dsv4_moe.kernels.fp8_block_gemm import choose_config, fp8_block_gemm_nt
    from dsv4_moe.testing import random_fp8_block_weight
    g = torch.Generator(device=DEV).manual_seed(2)
    for name, n, k in (("flash_up", 4096, 4096), ("flash_down", 4096, 2048), ("pro8_up", 768, 7168),
                       ("pro8_down", 7168, 384), ("pro1_up", 6144, 7168), ("pro1_down", 7168, 3072)):
        ws = [random_fp8_block_weight(n, k, generator=g) for _ in range(8)]
        q, sa = act_quant(torch.randn(1, k, device=DEV).bfloat16())
        base = choose_config(1, n, k)
        kb = -(-k // 128)
        cands = [("default", base, None), ("default+vec", {**base, "KB_VEC": True}, None)]
        for per in (1, 2, 4):
            sk = -(-kb // per)
            if sk > 1:
                cands.append((f"per{per}+vec", {**base, "KB_VEC": True}, sk))
                cands.append((f"per{per}+vec bn32", {**base, "KB_VEC": True, "BLOCK_N": 32}, sk))
                cands.append((f"per{per}+vec w4", {**base, "KB_VEC": True, "num_warps": 4}, sk))
        ref_out = None
        for tag, cfg, sk in cands:
            outs = [torch.empty(1, n, dtype=torch.bfloat16, device=DEV) for _ in ws]

            def fn(cfg=cfg, outs=outs, sk=sk):
                for (w, sw), o in zip(ws, outs):
                    fp8_block_gemm_nt(q, sa, w, sw, out=o, config=cfg, split_k=sk)
            try:
                us = graph_time(fn) / len(ws)
            except Exception as ex:  # noqa: BLE001
                print(f"{name:10s} {tag:18s} ERROR {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                rows.append(dict(shape=name, tag=tag, error=str(ex)[:300]))
                continue
            if ref_out is None:
                ref_out = outs[0].clone()
            same = bool(torch.equal(outs[0].view(torch.int16), ref_out.view(torch.int16)))
            split = sk or base.get("SPLIT_K", 1)
            rows.append(dict(shape=name, T=1, tag=tag, split=split, us=us, TBps=n * k / us / 1e6, bitwise_default=same))
            print(f"{name:10s} {tag:18s} split {split:3d} {us:6.2f} us {n * k / us / 1e6:5.2f} TB/s "
                  f"bitwise vs default {same}", flush=True)


if __name__ == "__main__":
    main()
