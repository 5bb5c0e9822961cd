"""Kernels to put under Nsight Compute (H200): the decode GEMMs and the large-T SwiGLU-quant.

    ncu --clock-control none -k regex:'mxfp4|fp8|swiglu|split_k' --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        python3 scripts/gpu_ncu_kernels.py

With --layer-configs the routed GEMMs take the layer's configs (`routed_configs`); stall
reasons per issued instruction come with
`--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio`. The layer's own
weights on CUDA are "mma64e" (`--layout mma64e`; session 33's T = 1 / 16 profile:
`--layout mma64e --tokens 1 --routed-only --layer-configs --shapes flash_up,flash_down,pro_up`,
BENCHMARKS.md session 33 item 5; `--one-chain` forces one MMA chain per block, session 34's A/B).

Runs each case twice (the first launch compiles; profile either): the routed MXFP4 GEMM with
the default config at T = 1 (Flash gate_up and down, Pro-TP8 gate_up; top-6 routes), the
shared FP8 GEMM at M = 1 (Flash gate_up, the GEMV body) and SwiGLU-quant at T = 8192,
I = 2048 (fused). The ncu report says whether a kernel is issue-, latency- or memory-bound.
Session 41 added `--fp8-shapes MxNxK,...` and `--fp8-imprecise V,...` (the FP8 GEMM on choose_config's
tile with IMPRECISE overridden), for session 40's lead on the 64-row tile's serially waited QGMMAs:
    ncu --clock-control none -k regex:fp8_block --section SpeedOfLight --section WarpStateStats \
        python3 scripts/gpu_ncu_kernels.py --shapes '' --fp8-shapes 4096x4096x4096,64x4096x4096 \
        --fp8-imprecise 32,128
(`--shapes ''` skips the routed cases; `--routed-only` would skip these.)
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.fp8_block_gemm import choose_config, fp8_block_gemm_nt
from dsv4_moe.kernels.moe_align import moe_align
from dsv4_moe.kernels.mxfp4_grouped_gemm import mxfp4_grouped_gemm, select_config
from dsv4_moe.kernels.swiglu_quant import swiglu_quant
from dsv4_moe.testing import random_fp8_block_weight, random_mxfp4_weight

DEV = torch.device("cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="nk", choices=("nk", "mma64", "mma64e"),
                    help="routed weight byte order (the layer takes 'mma64e' on CUDA)")
    ap.add_argument("--tokens", default="1", help="comma-separated T for the routed GEMMs")
    ap.add_argument("--routed-only", action="store_true")
    ap.add_argument("--shapes", default="flash_up,flash_down,pro_up", help="routed GEMM cases to run "
                    "(flash_up, flash_down, pro_up, pro_down)")
    ap.add_argument("--layer-configs", action="store_true",
                    help="the configs the layer uses (routed_configs: bf16 activation pairs for gate_up, the "
                         "register cap for short-K down), not select_config's alone")
    ap.add_argument("--one-chain", action="store_true",
                    help="force GemmConfig.one_chain on every folded 'wait' swap config, split-K ones included "
                         "(session 33's lead 3: why one chain per block is slower at T = 1)")
    ap.add_argument("--fp8-shapes", default="1x4096x4096",
                    help="MxNxK,... of the shared FP8 block GEMM (choose_config's tile; session 41: e.g. "
                         "4096x4096x4096,4096x768x7168 for the 64 x 128 prefill tile)")
    ap.add_argument("--fp8-imprecise", default="",
                    help="IMPRECISE values (comma-separated, 1..128) to run each FP8 shape's MMA tile with "
                         "(default: choose_config's); session 40's lead: the 64-row tile waits on each of its "
                         "K / IMPRECISE QGMMAs in turn at 32")
    args = ap.parse_args()
    fp8_shapes = [tuple(int(v) for v in item.split("x")) for item in args.fp8_shapes.split(",") if item]
    if any(len(sh) != 3 or min(sh) < 1 for sh in fp8_shapes):
        ap.error(f"--fp8-shapes {args.fp8_shapes!r}: expected MxNxK,... with positive ints")
    fp8_imp = [int(v) for v in args.fp8_imprecise.split(",") if v]
    if any(not 0 < v <= 128 for v in fp8_imp):
        ap.error(f"--fp8-imprecise {args.fp8_imprecise!r}: expected values in 1..128")
    from dsv4_moe.kernels.routed_experts import routed_configs
    from dsv4_moe.weights.mma_layout import to_mma64, to_mma64e
    from dsv4_moe.weights.tensors import RoutedExpertWeights

    g = torch.Generator(device=DEV).manual_seed(0)
    for name, n, k, e, gather in (("flash_up", 4096, 4096, 256, True), ("flash_down", 4096, 2048, 256, False),
                                  ("pro_up", 768, 7168, 384, True), ("pro_down", 7168, 384, 384, False)):
        if name not in args.shapes.split(","):
            continue
        w, s = random_mxfp4_weight((e, n, k), generator=g)
        if args.layout in ("mma64", "mma64e"):
            w = (to_mma64 if args.layout == "mma64" else to_mma64e)(w)
        for t in [int(v) for v in args.tokens.split(",")]:
            ids = torch.stack([torch.randperm(e, device=DEV)[:6] for _ in range(t)]).sort(1).values.int()
            cfg = select_config(6 * t, e, n, k, args.layout)
            if args.layer_configs:  # shapes only: meta tensors of the layer's gate_up / down
                i, h = (n // 2, k) if gather else (k, n)
                meta = RoutedExpertWeights(torch.empty(e, 2 * i, h // 2, device="meta"), torch.empty(0, device="meta"),
                                           torch.empty(e, h, i // 2, device="meta"), torch.empty(0, device="meta"),
                                           0, e, args.layout)
                cfg = routed_configs(6 * t, meta)[0 if gather else 1]
            if args.one_chain and cfg.kind == "swap" and cfg.fold_sa and cfg.fold_order == "wait":
                cfg = dataclasses.replace(cfg, one_chain=True)
            a = moe_align(ids, e, 0, cfg.block_m)
            rows = t if gather else a.max_rows
            q, sa = act_quant(torch.randn(rows, k, device=DEV).bfloat16())
            for _ in range(2):
                mxfp4_grouped_gemm(q, sa, w, s, a, gather_a=gather, scatter_out=not gather, config=cfg,
                                   layout=args.layout)
            torch.cuda.synchronize()
            print(name, t, args.layout, cfg, flush=True)
    if args.routed_only:
        return
    for m, n, k in fp8_shapes:
        w, sw = random_fp8_block_weight(n, k, generator=g)
        q, sa = act_quant(torch.randn(m, k, device=DEV).bfloat16())
        base = choose_config(m, n, k)
        for imp in (fp8_imp if fp8_imp and not base.get("GEMV") else [None]):
            cfg = base if imp is None else {**base, "IMPRECISE": imp}
            for _ in range(2):
                fp8_block_gemm_nt(q, sa, w, sw, config=cfg)
            torch.cuda.synchronize()
            print("fp8", m, n, k, cfg, flush=True)
    gu = torch.randn(8192, 4096, device=DEV).bfloat16()
    for _ in range(2):
        swiglu_quant(gu)
    torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()
