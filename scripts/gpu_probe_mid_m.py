"""Probe (session 40): the shared expert's FP8 GEMM at mid M on choose_config's tiles with the row
block forced (a variant BM:pps sets kernels.fp8_block_gemm.MID_M_BLOCK_M and _LARGE to BM and lifts
the mid-M rule's M / N / K limits, so every shape given takes BM-row blocks: 16 and 32 on mma.sync, 64
the wgmma tiles; pps > 0 splits over K at ~pps programs per SM, SPLIT_K_WIDE_PROGRAMS_PER_SM), or a
forced tile config: the time of each alone (L2-warm weights: a ranking, not a layer figure), the share
of bf16 outputs off the fp64-summed result, and split == unsplit bitwise for the same row block.

    python3 scripts/gpu_probe_mid_m.py [--variants 64:0,16:0,32:0,16:2,32:2]
    python3 scripts/gpu_probe_mid_m.py --shapes 64x4096x4096 --forced 64x64x4x4,16x64x4x6  # BMxBNxWARPSxSTAGES
    python3 scripts/gpu_probe_mid_m.py --prefetch   # the same with fp8_block_gemm.SCALE_PREFETCH on
    python3 scripts/gpu_probe_mid_m.py --variants 64:0 --shapes 1x768x7168 \
        --set dsv4_moe.kernels.fp8_block_gemm.OVERLAPPED_GEMV_SPLIT=0   # any module constant (as bench_layer.py)
Since session 41 SCALE_PREFETCH is on by default: `--prefetch` forces it on, `--no-prefetch` off.
"""
from __future__ import annotations

import argparse

import torch

from dsv4_moe.kernels import fp8_block_gemm as F
from gpu_probe_wide_split import _inputs, _time_us  # scripts/ is on sys.path when this script runs

# the mid-M rule's limits lifted for the variants (restored after each)
FORCE = dict(MID_M_BLOCK_M=None, MID_M_BLOCK_M_LARGE=None, MID_M_MAX=1 << 30, MID_M_MAX_N=1 << 30,
             MID_M_MIN_KB=0, SPLIT_K_WIDE_PROGRAMS_PER_SM=0)
SHAPES = [  # (M, N, K): Pro-TP8 shared gate_up and down, Flash shared gate_up
    (32, 768, 7168), (64, 768, 7168), (128, 768, 7168), (64, 7168, 384), (64, 4096, 4096)]


def _exact(q, sa, w, sw):
    """bf16 of the fp64 sum over K of q * sa * w * sw (no in-block rounding at all)."""
    k = q.shape[1]
    sa64 = sa.double().repeat_interleave(128, 1)[:, :k]
    swf = torch.exp2(sw.double() - 127).repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :k]
    return ((q.double() * sa64) @ (w.double() * swf).T).to(torch.bfloat16)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="64:0,16:0,32:0,16:2,32:2,16:4",
                   help="BLOCK_M:split-K programs per SM, comma-separated")
    p.add_argument("--shapes", default="", help="MxNxK,... (default: the built-in list)")
    p.add_argument("--forced", default="", help="forced tile configs BMxBNxWARPSxSTAGES,... (each after the variants)")
    p.add_argument("--prefetch", action="store_true", help="every run with fp8_block_gemm.SCALE_PREFETCH on")
    p.add_argument("--no-prefetch", action="store_true", help="every run with fp8_block_gemm.SCALE_PREFETCH off")
    p.add_argument("--set", action="append", default=[], help="MODULE.ATTR=V (repeatable), as bench_layer.py")
    args = p.parse_args()
    if args.prefetch and args.no_prefetch:
        p.error("--prefetch and --no-prefetch exclude each other")
    if args.prefetch or args.no_prefetch:
        F.SCALE_PREFETCH = args.prefetch
    from dsv4_moe.bench.run import _apply_set  # the layer bench's parsing
    for item in args.set:
        print(_apply_set(item), flush=True)
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
            saved = {a: getattr(F, a) for a in FORCE}
            for a, v in FORCE.items():
                setattr(F, a, v)
            F.MID_M_BLOCK_M = F.MID_M_BLOCK_M_LARGE = bm
            F.SPLIT_K_WIDE_PROGRAMS_PER_SM = pps
            try:
                split = F.choose_config(m, n, k)["SPLIT_K"]
                out = F.fp8_block_gemm_nt(q, sa, w, sw)
                t = _time_us(lambda: F.fp8_block_gemm_nt(q, sa, w, sw))
            finally:
                for a, v in saved.items():
                    setattr(F, a, v)
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
