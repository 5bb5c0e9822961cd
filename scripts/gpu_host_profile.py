"""Host-side cost of an eager DeepseekV4MoE forward (H200 tool).

    OUT=./out python3 scripts/gpu_host_profile.py [--tokens 1,4,16,256] [--presets flash,pro-tp8]

Per preset and T: the wall time of an eager forward (mean over `--reps` forwards, one
synchronize at the end), the host time to enqueue one forward (the GPU kept busy by a long
sleep kernel first, so the host never waits on it), and the CUDA-graph replay time for
comparison; with `--cprofile` a cProfile of `--reps` forwards at the first T (top functions
by own time and by cumulative time). Writes $OUT/host_profile.txt.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import triton
import triton.language as tl

from dsv4_moe import DeepseekV4MoE, MoEConfig
from dsv4_moe.bench.timing import time_sets

try:  # older trees (A/B runs against an earlier commit) have no GraphedMoE
    from dsv4_moe import GraphedMoE
except ImportError:
    GraphedMoE = None
from dsv4_moe.testing import random_layer_weights


@triton.jit
def _bare_kernel(a, b, c, d, e, f, g, h, n1, n2, n3, n4, B1: tl.constexpr, B2: tl.constexpr):
    pass


def _median_batches(fn, reps, batches=5):
    """Median over `batches` batches of reps // batches calls of (wall us, this thread's CPU
    us) per call; the CPU time ignores preemption by other processes on a shared host."""
    n = max(1, reps // batches)
    walls, cpus = [], []
    for _ in range(batches):
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            fn()
        walls.append((time.perf_counter() - w0) / n * 1e6)
        cpus.append((time.thread_time() - c0) / n * 1e6)
    return sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]


def eager_us(layer, x, ids, reps):
    """Wall us per eager forward, synchronised per batch (median of 5 batches)."""
    with torch.no_grad():
        for _ in range(3):
            layer(x, ids)
        torch.cuda.synchronize()
        n = max(1, reps // 5)
        walls = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                layer(x, ids)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / n * 1e6)
        return sorted(walls)[2]


def enqueue_us(layer, x, ids, reps):
    """(wall, thread CPU) us per forward while the GPU is busy (a sleep kernel queued first,
    so the host never waits on it); medians of 5 batches."""
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))  # cycles: ~0.3 s at H200 clocks
        res = _median_batches(lambda: layer(x, ids), reps)
        torch.cuda.synchronize()
        return res


def graphed_us(graphed, x, ids, reps):
    """Wall time per GraphedMoE call (copy in, replay, clone out), one synchronize at the end."""
    with torch.no_grad():
        graphed(x, ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            graphed(x, ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e6


def graph_us(layer, x, ids):
    """CUDA-graph replay time of one forward (the package's bench timer: median of batches)."""
    with torch.no_grad():
        return time_sets([lambda: layer(x, ids)], device="cuda").median_us


def calibrate():
    """Host cost of the building blocks: a bare Triton launch, torch.empty, a stream query."""
    _k = _bare_kernel
    x = torch.empty(16, device="cuda")
    args = (x, x, x, x, x, x, x, x, 1, 2, 3, 4)
    _k[(1,)](*args, B1=16, B2=32)
    torch.cuda.synchronize()
    out = []
    for what, fn in (("bare Triton launch, 12 args + 2 constexpr", lambda: _k[(1,)](*args, B1=16, B2=32)),
                     ("torch.empty([16, 4096], bf16, cuda)",
                      lambda: torch.empty((16, 4096), dtype=torch.bfloat16, device="cuda")),
                     ("torch.cuda.current_stream()", torch.cuda.current_stream),
                     ("os.environ.get", lambda: os.environ.get("DSV4_MOE_FORCE", ""))):
        for _ in range(100):
            fn()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        out.append(f"calibrate: {what}: {(time.perf_counter() - t0) / 2000 * 1e6:.2f} us")
        print(out[-1], flush=True)
    torch.cuda.synchronize()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,256")
    ap.add_argument("--presets", default="flash,pro-tp8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--calibrate", action="store_true",
                    help="also time a bare Triton launch (14 arguments) and torch.empty on this host")
    args = ap.parse_args()
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    cfgs = {"flash": MoEConfig.flash(),
            "pro-tp8": MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank")}
    lines = []
    if args.calibrate:
        lines += calibrate()
    tokens = [int(v) for v in args.tokens.split(",")]
    for name in args.presets.split(","):
        cfg = cfgs[name]
        w = random_layer_weights(cfg, layer_idx=5, seed=0, device="cuda")
        layer = DeepseekV4MoE(cfg, w)
        del w
        for t in tokens:
            g = torch.Generator(device="cuda").manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, device="cuda", generator=g).bfloat16()
            ids = torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=g)
            e = eager_us(layer, x, ids, args.reps)
            q, qc = enqueue_us(layer, x, ids, args.reps)
            gr = graph_us(layer, x, ids)
            gm = graphed_us(GraphedMoE(layer, token_counts=(t,)), x, ids, args.reps) if GraphedMoE else float("nan")
            lines.append(f"{name} T={t}: eager {e:.1f} us/forward, host enqueue {q:.1f} us/forward "
                         f"({qc:.1f} us of thread CPU), "
                         f"graph replay {gr:.1f} us/forward, GraphedMoE call {gm:.1f} us")
            print(lines[-1], flush=True)
        if args.cprofile:
            t = tokens[0]
            x = torch.randn(t, cfg.hidden_size, device="cuda").bfloat16()
            ids = torch.randint(0, cfg.vocab_size, (t,), device="cuda")
            with torch.no_grad():
                layer(x, ids)
                torch.cuda.synchronize()
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(args.reps):
                    layer(x, ids)
                pr.disable()
                torch.cuda.synchronize()
            pr.dump_stats(os.path.join(out, f"host_{name}_T{t}.prof"))
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats(key).print_stats(args.top)
                lines.append(f"--- cProfile {name} T={t}, {args.reps} forwards, by {key}\n{s.getvalue()}")
                print(lines[-1], flush=True)
        del layer
        torch.cuda.empty_cache()
    with open(os.path.join(out, "host_profile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
