"""Decode FP8 block GEMM: the MMA body (16-row mma.sync tiles) vs the CUDA-core GEMV body.

    OUT=./out python scripts/gpu_probe_fp8_gemv.py

Shapes of the shared expert (Flash, Pro-TP8, Pro-TP1 gate_up and down) at M in
{1, 2, 4, 8, 16}; GEMV tiles x split-K; CUDA-graph timing; each row compared with the
float64-summed reference (share of bf16 outputs that differ, max ulp) and split-K with
its single pass (bitwise). Writes $OUT/probe_fp8_gemv.json.
"""

from __future__ import annotations

import json
import os

import torch

from dsv4_moe import reference as ref
from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.fp8_block_gemm import choose_config, fp8_block_gemm_nt

DEV = torch.device("cuda")


def graph_time(fn, reps=15, inner=10):
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


def ulp(a, b):
    def key(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    d = (key(a) - key(b)).abs()
    return float((d > 0).float().mean()), int(d.max())


def main():
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    shapes = (("flash_up", 4096, 4096), ("flash_down", 4096, 2048), ("pro8_up", 768, 7168),
              ("pro8_down", 7168, 384), ("pro1_up", 6144, 7168), ("pro1_down", 7168, 3072))
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=g, device=DEV) * 0.7).to(torch.float8_e4m3fn)
        sw = torch.randint(118, 126, (-(-n // 128), -(-k // 128)), generator=g, device=DEV,
                           dtype=torch.uint8).view(torch.float8_e8m0fnu)
        for m in (1, 2, 4, 8, 16):
            q, sa = act_quant(torch.randn(m, k, generator=g, device=DEV).bfloat16())
            want = ref.fp8_gemm(q.cpu(), sa.cpu(), w.cpu(), sw.cpu())
            base_cfg = choose_config(m, n, k)
            cands = [("base", base_cfg)]
            kb = -(-k // 128)
            for bn in (16, 32, 64):
                for nw in (2, 4):
                    for sk in (1, 2, 4, 8, 16):
                        if sk <= kb and (sk == 1 or m <= 4):
                            cands.append((f"gemv bn{bn} w{nw} sk{sk}",
                                          dict(BLOCK_M=1, BLOCK_N=bn, GROUP_M=1, num_warps=nw, num_stages=4,
                                               GEMV=True, SPLIT_K=sk)))
            singles = {}
            for tag, cfg in cands:
                out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
                fn = lambda: fp8_block_gemm_nt(q, sa, w, sw, out=out, config=cfg)  # noqa: E731
                try:
                    fn()
                    torch.cuda.synchronize()
                    us = graph_time(fn)
                except Exception as ex:  # noqa: BLE001
                    print(f"{name} M={m} {tag}: {type(ex).__name__}: {str(ex)[:150]}", flush=True)
                    rows.append(dict(shape=name, M=m, tag=tag, error=str(ex)[:300]))
                    continue
                frac, mx = ulp(out.cpu(), want)
                key = tag.rsplit(" sk", 1)[0]
                bitwise = None
                if cfg.get("SPLIT_K", 1) == 1:
                    singles[key] = out.clone()
                elif key in singles:
                    bitwise = bool(torch.equal(out.view(torch.int16), singles[key].view(torch.int16)))
                tbps = n * k / us / 1e6
                rows.append(dict(shape=name, M=m, tag=tag, cfg=cfg, us=us, TBps=tbps, differ=frac, max_ulp=mx,
                                 split_bitwise=bitwise))
                print(f"{name:10s} M={m:2d} {tag:24s} {us:7.2f} us {tbps:5.2f} TB/s differ {frac:.4%} "
                      f"max {mx} split_bitwise={bitwise}", flush=True)
    with open(os.path.join(out_dir, "probe_fp8_gemv.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
