"""Probe (session 40): the shared expert's FP8 GEMM at mid M (16 < M <= 128) on mma.sync row
blocks of 16 or 32 (kernels.fp8_block_gemm.MID_M_BLOCK_M), split over K or not
(SPLIT_K_WIDE_PROGRAMS_PER_SM), against the default 64-row wgmma tiles: the time of each alone
(L2-warm weights: a ranking, not a layer figure), the share of bf16 outputs off the fp64-summed
result, and split == unsplit bitwise for the same row block.

    python3 scripts/gpu_probe_mid_m.py [--variants 64:0,16:0,32:0,16:2,32:2]
    python3 scripts/gpu_probe_mid_m.py --shapes 64x4096x4096 --forced 64x64x4x4,16x64x4x6  # BMxBNxWARPSxSTAGES
"""
from __future__ import annotations

import argparse

import torch

from dsv4_moe.kernels import fp8_block_gemm as F

SHAPES = [  # (M, N, K): Pro-TP8 shared gate_up and down, Flash shared gate_up
    (32, 768, 7168), (64, 768, 7168), (128, 768, 7168), (64, 7168, 384), (64, 4096, 4096)]


def _inputs(m, n, k, g):
    q = (torch.randn(m, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-12, -4, (m, -(-k // 128)), generator=g).float())
    sw = torch.randint(110, 125, (-(-n // 128), -(-k // 128)), generator=g).to(torch.uint8)
    return [t.cuda() for t in (q, sa, w, sw)]


def _exact(q, sa, w, sw):
    """bf16 of the fp64 sum over K of q * sa * w * sw (no in-block rounding at all)."""
    k = q.shape[1]
    sa64 = sa.double().repeat_interleave(128, 1)[:, :k]
    swf = torch.exp2(sw.double() - 127).repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :k]
    return ((q.double() * sa64) @ (w.double() * swf).T).to(torch.bfloat16)


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
    p.add_argument("--variants", default="64:0,16:0,32:0,16:2,32:2,16:4",
                   help="BLOCK_M:split-K programs per SM, comma-separated")
    p.add_argument("--shapes", default="", help="MxNxK,... (default: the built-in list)")
    p.add_argument("--forced", default="", help="forced tile configs BMxBNxWARPSxSTAGES,... (each after the variants)")
    args = p.parse_args()
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",") if v]
    forced = [tuple(int(x) for x in v.split("x")) for v in args.forced.split(",") if v]
    shapes = [tuple(int(x) for x in v.split("x")) for v in args.shapes.split(",") if v] or SHAPES
    g = torch.Generator().manual_seed(0)
    bad = 0
    print(f"{'M':>4} {'N':>5} {'K':>5} | {'BM:pps':>6} | split | {'us':>6} | % off fp64 | == unsplit")
    for m, n, k in shapes:
        q, sa, w, sw = _inputs(m, n, k, g)
        exact = _exact(q, sa, w, sw)
        unsplit = {}
        for bm, pps in variants:
            F.MID_M_BLOCK_M, F.SPLIT_K_WIDE_PROGRAMS_PER_SM = bm, pps
            try:
                split = F.choose_config(m, n, k)["SPLIT_K"]
                out = F.fp8_block_gemm_nt(q, sa, w, sw)
                t = _time_us(lambda: F.fp8_block_gemm_nt(q, sa, w, sw))
            finally:
                F.MID_M_BLOCK_M, F.SPLIT_K_WIDE_PROGRAMS_PER_SM = 64, 0
            off = (out.view(torch.int16) != exact.view(torch.int16)).double().mean().item() * 100
            same = ""
            if split == 1:
                unsplit[bm] = out
            elif bm in unsplit:
                eq = torch.equal(out.view(torch.int16), unsplit[bm].view(torch.int16))
                bad += not eq
                same = str(eq)
            print(f"{m:>4} {n:>5} {k:>5} | {bm:>3}:{pps:<2} | {split:>5} | {t:>6.1f} | {off:>10.3f} | {same}",
                  flush=True)
        for bm, bn, nw, ns in forced:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=nw, num_stages=ns, IMPRECISE=32, SPLIT_K=1)
            try:
                out = F.fp8_block_gemm_nt(q, sa, w, sw, config=cfg)
                t = _time_us(lambda: F.fp8_block_gemm_nt(q, sa, w, sw, config=cfg))
            except Exception as e:  # e.g. out of shared memory: say so and go on
                print(f"{m:>4} {n:>5} {k:>5} | {bm}x{bn}x{nw}x{ns} | failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            off = (out.view(torch.int16) != exact.view(torch.int16)).double().mean().item() * 100
            print(f"{m:>4} {n:>5} {k:>5} | {bm}x{bn}x{nw}x{ns} | {1:>5} | {t:>6.1f} | {off:>10.3f} |", flush=True)
    print("every split bitwise its unsplit twin" if not bad else f"{bad} splits differ from their unsplit twin")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
