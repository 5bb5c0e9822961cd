"""H200 probe: act_quant's program shape (rows per program x warps) at prefill sizes.

    OUT=./out python3 scripts/gpu_probe_act_quant.py [--ms 256,1024,4096,8192] [--ks 4096,7168]

For each (M, K), with and without the bf16 pairs output: the tuned launch
(kernels/_act_quant.launch_act_quant's default) and BLOCK_M x warps variants, timed under
CUDA-graph replay over 4 rotated inputs (so M >= 1024 is not served from L2); every
variant's q / scales / pairs are checked bitwise against the default's. GB/s counts the
bytes moved (x read, q + scales (+ pairs) written). Writes $OUT/probe_act_quant.json.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from dsv4_moe.kernels._act_quant import launch_act_quant
from dsv4_moe.kernels._triton_utils import SCALE_FMTS

FP32 = SCALE_FMTS["fp32"]

DEV = torch.device("cuda")


def graph_time(fn, reps=15, inner=8):
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="256,1024,4096,8192")
    ap.add_argument("--ks", default="4096,7168")
    ap.add_argument("--variants", default="4:2,8:4,16:4,16:8,32:4,32:8,64:8",
                    help="block_m:num_warps pairs besides the default")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    variants = [None] + [tuple(int(v) for v in x.split(":")) for x in args.variants.split(",")]
    for k in [int(v) for v in args.ks.split(",")]:
        for m in [int(v) for v in args.ms.split(",")]:
            g = k // 128
            xs = [torch.randn(m, k, device=DEV).bfloat16() * (1 + i) for i in range(4)]
            for pairs in (False, True):
                q = torch.empty(m, k, dtype=torch.uint8, device=DEV)
                s = torch.empty(m, g, dtype=torch.float32, device=DEV)
                p = torch.empty(m, k, dtype=torch.bfloat16, device=DEV) if pairs else None
                nbytes = m * k * 2 + m * k + m * g * 4 + (m * k * 2 if pairs else 0)
                base = None
                for var in variants:
                    kw = {} if var is None else {"block_m": var[0], "num_warps": var[1]}
                    state = {"i": 0}

                    def fn():
                        launch_act_quant(xs[state["i"] % 4], q, s, m, FP32, p, **kw)
                        state["i"] += 1
                    launch_act_quant(xs[0], q, s, m, FP32, p, **kw)
                    torch.cuda.synchronize()
                    res = (q.clone(), s.clone(), p.clone() if pairs else None)
                    if base is None:
                        base = res
                    same = torch.equal(res[0], base[0]) and torch.equal(res[1], base[1]) and \
                        (not pairs or torch.equal(res[2].view(torch.int16), base[2].view(torch.int16)))
                    us = graph_time(fn)
                    name = "default" if var is None else f"bm{var[0]} w{var[1]}"
                    rows.append(dict(M=m, K=k, pairs=pairs, variant=name, us=us, gbps=nbytes / us / 1e3, same=same))
                    print(f"M={m:5d} K={k:5d} pairs={int(pairs)} {name:10s} {us:8.2f} us "
                          f"{nbytes / us / 1e3:7.1f} GB/s same={same}", flush=True)
    with open(os.path.join(out_dir, "probe_act_quant.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
