"""Fused finalize + shared add (SPEC §5.2) against its two-kernel twin, timed properly.

    OUT=./out python scripts/gpu_probe_finalize.py [--ts 1,4,16,64,256,1024,4096,8192]

For H in {4096, 7168} (Flash, Pro) and top-6 with one route in eight non-local: the fused
kernel (`finalize_shared_add`) and its twin (`finalize_unfused`: fp32 partial written,
then add + round), each with the default BLOCK_H rule and with BLOCK_H forced to the small-T
block (`finalize.SMALL_T_BLOCK_H`: 256 until session 32, 128 since; the JSON key says which) and
to 1024 (the `_SMALL_T` crossover of kernels/finalize.py). CUDA-graph replay, inputs
rotated over enough sets to exceed 2x the 60 MB L2; every variant checked bitwise against
the default fused output before it is timed. Writes $OUT/probe_finalize.json and prints one
line per row.

--calls-per-graph N (default 1): each graph holds N consecutive calls (over the rotated
sets) and the time is per call. With 1, a call costs a graph launch (~4.4 µs for an empty
kernel on the H200), which hides the kernels at small T; with N > 1 it costs what it costs
inside a layer's graph, where finalize is one kernel among ~10 (the method of
`triton.testing.do_bench_cudagraph`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

from dsv4_moe.kernels import finalize as fin

DEV = torch.device("cuda")
L2 = 60e6


def bench(fns, reps=15, target_ms=2.0, per_graph=1):
    """CUDA-graph replays, each of `per_graph` consecutive calls (rotating over the sets
    from a different start per graph); median us per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graphs = []
    for j in range(len(fns)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in range(per_graph):
                fns[(j + c) % len(fns)]()
        graphs.append(g)
    n = len(graphs)
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for g in graphs:
        g.replay()
    st.record()
    for g in graphs:
        g.replay()
    en.record()
    en.synchronize()
    one = st.elapsed_time(en) / n
    inner = n * max(1, min(100, math.ceil(target_ms / max(one * n, 1e-3))))
    times = []
    for _ in range(reps):
        st.record()
        for i in range(inner):
            graphs[i % n].replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) / inner / per_graph * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ts", default="1,4,16,64,256,1024,4096,8192")
    p.add_argument("--calls-per-graph", type=int, default=1,
                   help="consecutive calls captured in one graph (the time is per call)")
    p.add_argument("--hs", default="4096,7168")
    args = p.parse_args()
    if args.calls_per_graph < 1:
        p.error(f"--calls-per-graph={args.calls_per_graph}: expected >= 1")
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator(device=DEV).manual_seed(3)
    k, e, first, local = 6, 256, 0, 224   # experts 224..255 are not local: ~1 route in 8 skipped
    rows = []
    for h in [int(x) for x in args.hs.split(",")]:
        for t in [int(x) for x in args.ts.split(",")]:
            per_set = t * k * h * 2 + t * h * 2
            sets = max(2, min(64, math.ceil(2 * L2 / per_set)))
            data = []
            for _ in range(sets):
                y = torch.randn(t, k, h, device=DEV, generator=g).bfloat16()
                ids = torch.rand(t, e, device=DEV, generator=g).argsort(dim=1)[:, :k]
                ids = torch.sort(ids, dim=1).values.to(torch.int32)
                sh = torch.randn(t, h, device=DEV, generator=g).bfloat16()
                data.append((y, ids, sh))
            want = [fin.finalize_shared_add(y, ids, first, local, sh) for y, ids, sh in data[:2]]
            row = dict(H=h, T=t, sets=sets, calls_per_graph=args.calls_per_graph, bytes_fused=t * k * h * 2 + 4 * t * h,
                       bytes_unfused=t * k * h * 2 + 12 * t * h)
            saved = fin._SMALL_T
            small = f"bh{fin.SMALL_T_BLOCK_H}"
            for tag, small_t in (("default", saved), (small, 1 << 30), ("bh1024", 0)):
                fin._SMALL_T = small_t
                try:
                    for name, fn in (("fused", fin.finalize_shared_add), ("unfused", fin.finalize_unfused)):
                        same = all(torch.equal(fn(y, ids, first, local, sh).view(torch.int16), w.view(torch.int16))
                                   for (y, ids, sh), w in zip(data[:2], want))
                        us = bench([lambda y=y, ids=ids, sh=sh, fn=fn: fn(y, ids, first, local, sh)
                                    for y, ids, sh in data], per_graph=args.calls_per_graph)
                        row[f"{name}_{tag}_us"] = us
                        row[f"{name}_{tag}_bitwise"] = same
                finally:
                    fin._SMALL_T = saved
            row["ratio_default"] = row["unfused_default_us"] / row["fused_default_us"]
            best_f = min(row[f"fused_{small}_us"], row["fused_bh1024_us"])
            best_u = min(row[f"unfused_{small}_us"], row["unfused_bh1024_us"])
            row["ratio_best"] = best_u / best_f
            row["TBps_fused"] = row["bytes_fused"] / row["fused_default_us"] / 1e6
            rows.append(row)
            ok = all(v for key, v in row.items() if key.endswith("_bitwise"))
            print(f"H={h} T={t:5d} fused {row['fused_default_us']:8.2f} us ({row['TBps_fused']:.2f} TB/s) "
                  f"unfused {row['unfused_default_us']:8.2f} -> {row['ratio_default']:.2f}x | BLOCK_H {small[2:]} / 1024: "
                  f"fused {row[f'fused_{small}_us']:.2f} / {row['fused_bh1024_us']:.2f}, unfused "
                  f"{row[f'unfused_{small}_us']:.2f} / {row['unfused_bh1024_us']:.2f} | bitwise {ok}", flush=True)
            del data, want
    with open(os.path.join(out_dir, f"probe_finalize_x{args.calls_per_graph}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
