"""Why `gpu_check_routed.py --quick` timed the fused finalize at Pro-TP8 T = 4096 at 190.5 µs eager when
the layer bench's stage timing gave 113.0 µs (session 47's lead): one launch timed alone between two
events, the device idle before it, against the same launch timed back to back and from a CUDA graph.

    OUT=./out python scripts/gpu_probe_eager_timing.py [--tokens 1024,4096,8192]

For each T: the host time of one `finalize_shared_add` call (no synchronisation, mean of 200), and its
device time four ways: (1) gpu_check_routed.py's old `bench` (event, call, event, synchronise: median of
20); (2) 20 calls back to back between one pair of events (median over 5 repeats of the mean); (3) one
call captured in a CUDA graph, replayed as (1); (4) 20 replays back to back as (2). Prints a table and
writes $OUT/probe_eager_timing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from dsv4_moe.kernels.finalize import finalize_shared_add


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def one_by_one(run, iters: int = 20) -> float:
    """gpu_check_routed.py's old bench: each call between its own events, synchronised after each."""
    ts = []
    for _ in range(iters):
        a, b = _events()
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def back_to_back(run, n: int = 20, repeats: int = 5) -> float:
    """n calls between one pair of events; the median over `repeats` of the mean per call."""
    ts = []
    for _ in range(repeats):
        a, b = _events()
        a.record()
        for _ in range(n):
            run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(ts)


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,4096,8192")
    p.add_argument("--h", type=int, default=7168)
    p.add_argument("--experts", type=int, default=384)
    args = p.parse_args()
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    k, e, h = 6, args.experts, args.h
    rows = []
    print(f"{'T':>6s} {'host us':>8s} {'1-by-1':>8s} {'b2b':>8s} {'graph 1-by-1':>12s} {'graph b2b':>10s} {'TB/s b2b':>9s}")
    for t in (int(v) for v in args.tokens.split(",")):
        y = torch.randn(t, k, h, device="cuda", generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)]).sort(1).values.int()
        sh = torch.randn(t, h, device="cuda", generator=g).bfloat16()

        def fn():
            finalize_shared_add(y, ids, 0, e, sh)

        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - h0) / 200 * 1e6
        torch.cuda.synchronize()
        gr = graphed(fn)
        row = {"T": t, "host_us": host, "one_by_one_us": one_by_one(fn), "back_to_back_us": back_to_back(fn),
               "graph_one_by_one_us": one_by_one(gr), "graph_back_to_back_us": back_to_back(gr),
               "bytes": t * k * h * 2 + 2 * t * h * 2}
        rows.append(row)
        print(f"{t:6d} {host:8.1f} {row['one_by_one_us']:8.1f} {row['back_to_back_us']:8.1f} "
              f"{row['graph_one_by_one_us']:12.1f} {row['graph_back_to_back_us']:10.1f} "
              f"{row['bytes'] / row['back_to_back_us'] / 1e6:9.2f}", flush=True)
    with open(os.path.join(out, "probe_eager_timing.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
