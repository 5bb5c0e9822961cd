"""Where does the MXFP4 grouped GEMM spend its time? Layout variants and probes on the H200.

    OUT=./out python scripts/gpu_probe_mxfp4.py

Times mxfp4_grouped_gemm (gate_up, gathered rows) at Flash (N 4096, K 4096, 256 experts)
and Pro-TP8 (N 768, K 7168, 384 experts) for T in {1, 16, 256, 4096}, over the kernel's
layout flags (a_split, w_kn, scale_bcast) and two probes (diag=1: no dequantisation,
diag=2: no MMA; both give wrong values and only bound the costs). Non-probe variants are
checked bitwise against the default layout. Writes $OUT/probe_mxfp4.json and prints a table.
"""

from __future__ import annotations

import json
import os
import time

import torch

from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.moe_align import moe_align
from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig, mxfp4_grouped_gemm
from dsv4_moe.testing import random_mxfp4_weight

DEV = torch.device("cuda")


def graph_time(fn, reps=20):
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(5):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / 5)
    return sorted(times)[len(times) // 2]


# The layouts of the first probe (2026-11-29, probe_mxfp4.txt) were
#   ({a_split: F, scale_bcast: F}, {a_split}, {w_kn}, {scale_bcast}, {a_split, w_kn},
#    {a_split, scale_bcast}, {diag: 1}, {diag: 2}); the default is now a_split + scale_bcast.
# The second (probe_mxfp4_dot_scaled.txt) also timed tl.dot_scaled, since removed (slower).
# NOTE: the probes (diag) act on the per-element-scale layout only, hence scale_bcast=False.
_PLAIN = {"a_split": False, "scale_bcast": False}
VARIANTS = ({}, _PLAIN, {"w_kn": True, "scale_bcast": False}, {**_PLAIN, "diag": 1}, {**_PLAIN, "diag": 2})


def main():
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    t_start = time.time()
    for name, n, k, e in (("flash", 4096, 4096, 256), ("pro_tp8", 768, 7168, 384)):
        w, s = random_mxfp4_weight((e, n, k), generator=gen, device=DEV)
        for t in (1, 16, 256, 4096):
            x = torch.randn(t, k, device=DEV).bfloat16()
            q, sa = act_quant(x)
            ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)]).sort(1).values.int().to(DEV)
            hit = torch.unique(ids).numel()
            wbytes = hit * n * k * 17 // 32
            bms = [(16, 128, 4, 3)] if t <= 256 else [(64, 128, 4, 3), (128, 128, 8, 3)]
            for bm, bn, nw, st in bms:
                a = moe_align(ids, e, 0, bm)
                base = None
                for flags in VARIANTS:
                    cfg = GemmConfig(bm, bn, nw, st, **flags)
                    def fn():
                        return mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=True, scatter_out=False, config=cfg)
                    try:
                        out = fn()
                        us = graph_time(fn)
                    except Exception as ex:
                        rows.append({"shape": name, "T": t, "cfg": cfg.__dict__, "error": f"{type(ex).__name__}: {ex}"[:300]})
                        print(f"{name} T={t} {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                        continue
                    valid = a.route_rows.long()
                    if not flags:
                        base = out[valid]
                    same = None if flags.get("diag") or base is None else bool(torch.equal(out[valid], base))
                    rows.append({"shape": name, "T": t, "cfg": cfg.__dict__, "us": us,
                                 "TBps": wbytes / us / 1e6, "bitwise_vs_default_layout": same})
                    tag = ",".join(f"{k_}={v}" for k_, v in flags.items()) or "default"
                    print(f"{name:8s} T={t:5d} bm={bm:3d} bn={bn:3d} w={nw} st={st} {tag:28s} {us:9.1f} us "
                          f"{wbytes / us / 1e6:6.2f} TB/s same={same}", flush=True)
            if time.time() - t_start > 110:
                print("time budget reached", flush=True)
                break
        del w, s
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "probe_mxfp4.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
