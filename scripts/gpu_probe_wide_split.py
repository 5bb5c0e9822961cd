"""Probe (session 39): the shared expert's FP8 GEMM at M > 16 split over K
(kernels.fp8_block_gemm.SPLIT_K_WIDE_PROGRAMS_PER_SM) against its single pass: bitwise equality
and the time of each alone (L2-warm weights: a ranking, not a layer figure).

    python3 scripts/gpu_probe_wide_split.py [--pps 4]
"""
from __future__ import annotations

import argparse

import torch

from dsv4_moe.kernels import fp8_block_gemm as F

SHAPES = [  # (M, N, K): Pro-TP8 shared gate_up / down, Flash shared gate_up, at mid and prefill M
    (32, 768, 7168), (64, 768, 7168), (128, 768, 7168), (256, 768, 7168), (64, 7168, 384),
    (64, 4096, 4096), (256, 4096, 4096)]


def _inputs(m, n, k, g):
    q = (torch.randn(m, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-12, -4, (m, -(-k // 128)), generator=g).float())
    sw = torch.randint(110, 125, (-(-n // 128), -(-k // 128)), generator=g).to(torch.uint8)
    return [t.cuda() for t in (q, sa, w, sw)]


def _time_us(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps // 10):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / reps


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pps", type=int, default=4, help="SPLIT_K_WIDE_PROGRAMS_PER_SM to compare")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    bad = 0
    print(f"{'M':>5} {'N':>5} {'K':>5} | split | single us | split us | equal")
    for m, n, k in SHAPES:
        q, sa, w, sw = _inputs(m, n, k, g)
        F.SPLIT_K_WIDE_PROGRAMS_PER_SM = 0
        one = F.fp8_block_gemm_nt(q, sa, w, sw)
        t1 = _time_us(lambda: F.fp8_block_gemm_nt(q, sa, w, sw))
        F.SPLIT_K_WIDE_PROGRAMS_PER_SM = args.pps
        split = F.choose_config(m, n, k)["SPLIT_K"]
        two = F.fp8_block_gemm_nt(q, sa, w, sw)
        t2 = _time_us(lambda: F.fp8_block_gemm_nt(q, sa, w, sw))
        F.SPLIT_K_WIDE_PROGRAMS_PER_SM = 0
        eq = torch.equal(one.view(torch.int16), two.view(torch.int16))
        bad += not eq
        print(f"{m:>5} {n:>5} {k:>5} | {split:>5} | {t1:>9.1f} | {t2:>8.1f} | {eq}")
    print("all bitwise equal" if not bad else f"{bad} shapes differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
