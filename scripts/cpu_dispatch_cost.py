"""Host-side cost of the dispatch planning a layer forward does (no GPU needed).

    python scripts/cpu_dispatch_cost.py [--tokens 4]

Plans every stage for a CUDA context (Pro-TP8 shapes; the capability is faked to sm_90, so
this runs on a CPU-only machine) and prints the mean time of `dispatch.select` per stage.
Every eager forward pays it (a CUDA-graph replay does not).
"""
from __future__ import annotations

import argparse
import time

import torch

from dsv4_moe import dispatch
from dsv4_moe.dispatch import DispatchContext


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    dispatch._capability = lambda index: (9, 0)
    ctx = DispatchContext(device=torch.device("cuda", 0), num_tokens=args.tokens, hidden=7168, intermediate=384,
                          num_experts=384, num_local_experts=384)
    for st in dispatch.STAGES:
        dispatch.select(st, ctx)
    total = 0.0
    for st in dispatch.STAGES:
        t0 = time.perf_counter()
        for _ in range(args.reps):
            dispatch.select(st, ctx)
        us = (time.perf_counter() - t0) / args.reps * 1e6
        total += us
        print(f"{st:<15} {us:7.1f} us  -> {dispatch.select(st, ctx).name}")
    print(f"{'all stages':<15} {total:7.1f} us")


if __name__ == "__main__":
    main()
