"""Which MXFP4 grouped-GEMM body is fastest per shape and T? (H200 probe)

    OUT=./out python scripts/gpu_probe_mxfp4_bodies.py [--budget-s 240]

For gate_up (gathered rows) and down (permuted rows, scattered) at Flash (H 4096,
I 2048, 256 experts) and Pro-TP8 (H 7168, I 384, 384 experts), top-6 routes of random
tokens, T in {1, 4, 16, 64, 256, 1024, 4096}: times the "tile" body (the current
default), the "swap" body (weights as the MMA's first operand) and the "gemv" body
(CUDA cores, one row per program), with and without the exact split-K, under CUDA-graph
replay. Each variant is compared with the tile body's output (share of bf16 outputs
that differ, largest difference in ulp; only in-block order may differ) and split-K
with its own single pass (must be bitwise). Writes $OUT/probe_mxfp4_bodies.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.moe_align import moe_align
from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig, mxfp4_grouped_gemm, select_config
from dsv4_moe.testing import random_mxfp4_weight

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


def variants(t, n, k, which):
    """Candidate configs; which="bodies" (first probe: the three bodies, split-K) or "asm"
    (second probe: the inline-PTX dequantisation in every body, against the plain one)."""
    kb = -(-k // 128)
    v = []
    if which == "unroll":  # third probe: several 128-blocks per GEMV loop iteration
        for bn, nw in ((16, 2), (64, 4)):
            for un in (1, 2, 4):
                for sk in (1, 4):
                    v.append(GemmConfig(1, bn, nw, 4, kind="gemv", asm=True, unroll=un, split_k=sk))
        return v
    if which == "asm":
        if t <= 16:
            for bn, nw in ((16, 2), (64, 4)):
                v += [GemmConfig(1, bn, nw, 4, kind="gemv"), GemmConfig(1, bn, nw, 4, kind="gemv", asm=True)]
        if t <= 256:
            v += [GemmConfig(16, 128, 4, 3, asm=True), GemmConfig(16, 128, 4, 3, kind="swap"),
                  GemmConfig(16, 128, 4, 3, kind="swap", asm=True), GemmConfig(16, 64, 4, 3, kind="swap", asm=True),
                  GemmConfig(16, 128, 4, 4, kind="swap", asm=True), GemmConfig(16, 128, 8, 3, kind="swap", asm=True)]
        if t >= 256:
            v += [GemmConfig(32, 128, 4, 3, kind="swap"), GemmConfig(32, 128, 4, 3, kind="swap", asm=True),
                  GemmConfig(16, 128, 4, 3, kind="swap", asm=True)]
        if t >= 1024:
            v += [GemmConfig(64, 128, 4, 3, asm=True), GemmConfig(64, 128, 4, 3, kind="swap", asm=True),
                  GemmConfig(128, 128, 8, 3, asm=True), GemmConfig(64, 256, 8, 3, asm=True)]
        return v
    if t <= 64:
        for bn, nw in ((16, 2), (32, 4), (64, 4)):
            for sk in (1, 4, 8):
                if sk <= kb and (sk == 1 or t <= 16):
                    v.append(GemmConfig(1, bn, nw, 4, kind="gemv", split_k=sk))
    if t <= 256:
        for bn in (64, 128):
            for sk in (1, 2, 4, 8):
                if sk <= kb and (sk == 1 or t <= 16):
                    v.append(GemmConfig(16, bn, 4, 3, kind="swap", split_k=sk))
    if t >= 64:
        v += [GemmConfig(32, 128, 4, 3, kind="swap"), GemmConfig(64, 128, 4, 3, kind="swap"),
              GemmConfig(64, 128, 8, 3, kind="swap")]
    if t >= 1024:
        v += [GemmConfig(128, 128, 8, 3, kind="swap"), GemmConfig(64, 256, 8, 3, kind="swap"),
              GemmConfig(128, 128, 4, 3, kind="swap"), GemmConfig(64, 128, 4, 4, kind="swap")]
    return v


def ulp_stats(a, b):
    d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return float((d != 0).float().mean()), int(d.max()) if d.numel() else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--ts", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--set", default="asm", choices=("bodies", "asm", "unroll"))
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.time()
    shapes = (("flash_up", 4096, 4096, 256, True), ("flash_down", 4096, 2048, 256, False),
              ("pro_up", 768, 7168, 384, True), ("pro_down", 7168, 384, 384, False))
    ts = [int(x) for x in args.ts.split(",")]
    gcuda = torch.Generator(device=DEV).manual_seed(0)
    weights = {name: random_mxfp4_weight((e, n, k), generator=gcuda) for name, n, k, e, _ in shapes}
    for t in ts:
        for name, n, k, e, gather in shapes:
            if time.time() - t0 > args.budget_s:
                print("budget reached", flush=True)
                break
            w, s = weights[name]
            ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)]).sort(1).values.int().to(DEV)
            hit = torch.unique(ids).numel()
            wbytes = hit * n * k * 17 // 32
            base_cfg = select_config(t * 6, e, n, k)
            # the same x for every block_m: draw once per (shape, T) for the gathered case;
            # for down the rows are permuted per alignment, so compare per route
            torch.manual_seed(t * 7 + n)
            xs = torch.randn(t if gather else t * 6, k, device=DEV).bfloat16()
            qx, sx = act_quant(xs)

            def run2(cfg):
                bm = cfg.block_m
                a = moe_align(ids, e, 0, bm)
                if gather:
                    q, sa = qx, sx
                else:  # permuted rows: row i holds route sorted_route_ids[i]
                    rid = a.sorted_route_ids.long().clamp(max=t * 6 - 1)
                    q, sa = qx[rid].contiguous(), sx[rid].contiguous()
                out_rows = a.max_rows if gather else t * 6
                o = torch.zeros(out_rows, n, dtype=torch.bfloat16, device=DEV)
                fn = lambda: mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=gather, scatter_out=not gather,  # noqa: E731
                                                out=o, config=cfg)
                return fn, a, o

            def per_route(a, o):
                rr = a.route_rows.long()
                return o[rr] if gather else o

            fn, a, o = run2(base_cfg)
            fn()
            base = per_route(a, o).clone()
            us = graph_time(fn)
            rows.append(dict(shape=name, T=t, cfg=base_cfg.__dict__, us=us, TBps=wbytes / us / 1e6, base=True))
            print(f"{name:10s} T={t:5d} BASE {base_cfg.kind}{base_cfg.block_m}x{base_cfg.block_n} "
                  f"w{base_cfg.num_warps} s{base_cfg.num_stages}: {us:9.1f} us {wbytes / us / 1e6:5.2f} TB/s", flush=True)
            singles = {(base_cfg.kind, base_cfg.block_m, base_cfg.block_n, base_cfg.num_warps,
                        base_cfg.num_stages, False): base}
            for cfg in variants(t, n, k, args.set):
                try:
                    fn, a, o = run2(cfg)
                    fn()
                    torch.cuda.synchronize()
                    res = per_route(a, o).clone()
                    us = graph_time(fn)
                except Exception as ex:  # noqa: BLE001
                    msg = f"{type(ex).__name__}: {ex}"[:300]
                    rows.append(dict(shape=name, T=t, cfg=cfg.__dict__, error=msg))
                    print(f"{name:10s} T={t:5d} {cfg.kind} {cfg}: {msg[:150]}", flush=True)
                    continue
                frac, mx = ulp_stats(res, base)
                key = (cfg.kind, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) + \
                    ((cfg.unroll,) if cfg.unroll > 1 else ())
                bitwise_split = None
                if cfg.asm:  # the PTX dequantisation builds the same bf16 values: bitwise
                    key_plain = key + (False,)
                    if key_plain in singles:
                        bitwise_split = bool(torch.equal(res.view(torch.int16), singles[key_plain].view(torch.int16)))
                elif cfg.split_k == 1:
                    singles[key + (False,)] = res
                    singles[key] = res
                elif key in singles:
                    bitwise_split = bool(torch.equal(res.view(torch.int16), singles[key].view(torch.int16)))
                rows.append(dict(shape=name, T=t, cfg=cfg.__dict__, us=us, TBps=wbytes / us / 1e6,
                                 differ_vs_tile=frac, max_ulp_vs_tile=mx, split_bitwise=bitwise_split))
                print(f"{name:10s} T={t:5d} {cfg.kind:4s} {cfg.block_m:3d}x{cfg.block_n:3d} w{cfg.num_warps} "
                      f"s{cfg.num_stages} sk{cfg.split_k} asm{int(cfg.asm)} u{cfg.unroll}: {us:9.1f} us {wbytes / us / 1e6:5.2f} TB/s "
                      f"differ {frac:.4%} max {mx} ulp split_bitwise={bitwise_split}", flush=True)
    with open(os.path.join(out_dir, "probe_mxfp4_bodies.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
