"""Probe (H200): the routed swap body with the activation scale folded into the bf16
activation operand (the K loop accumulates in the MMA chain: no per-block wait, FFMA or
scale loads) against the default body, on the layer's own configs. Timing only (the
folded run is fed unscaled pairs: its values are not checked here).

    OUT=./out python3 scripts/gpu_probe_foldsa.py [--ts 1,4,16,64]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mx_foldsa_exp as EXP  # noqa: E402

from dsv4_moe import DeepseekV4MoE, MoEConfig  # noqa: E402
from dsv4_moe.kernels import _mxfp4_grouped_gemm as BODY  # noqa: E402
from dsv4_moe.kernels.act_quant import act_quant  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.mxfp4_grouped_gemm import bf16_pairs, mxfp4_grouped_gemm  # noqa: E402
from dsv4_moe.kernels.routed_experts import routed_configs  # noqa: E402
from dsv4_moe.kernels.router import route_topk  # noqa: E402
from dsv4_moe.testing import random_layer_weights  # noqa: E402


class _Shim:
    def __init__(self, fold):
        self.fold = fold

    def __getitem__(self, grid):
        def launch(*a, **k):
            return EXP._mxfp4_grouped_gemm_swap_kernel[grid](*a, SA_IN_B=self.fold, **k)
        return launch


def graph_us(fn, inner=20, reps=15):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / inner)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,4,16,64")
    args = ap.parse_args()
    out = os.environ.get("OUT", "./out")
    lines = []
    cfgs = {"flash": MoEConfig.flash(), "pro-tp8": MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank")}
    for name, cfg in cfgs.items():
        layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=5, seed=0, device="cuda"))
        r = layer.routed
        for t in [int(v) for v in args.ts.split(",")]:
            x = torch.randn(t, cfg.hidden_size, device="cuda").bfloat16()
            with torch.no_grad():
                w, ids = route_topk(x, layer.router.weight, layer.router.bias, None, None,
                                    cfg.num_experts_per_tok, cfg.routed_scaling_factor)
            up, down = routed_configs(t * cfg.num_experts_per_tok, r)
            align = moe_align(ids, r.num_local, r.first_expert, up.block_m, w)
            q, sa, qp = act_quant(x, pairs=True)
            i = r.intermediate
            hq = (torch.randn(align.max_rows, i, device="cuda") * 2).to(torch.float8_e4m3fn)
            hs = torch.ones(align.max_rows, i // 128, device="cuda")
            hp = bf16_pairs(hq)
            for gemm, cfg_g, call in (
                ("gate_up", up, lambda c: mxfp4_grouped_gemm(q, sa, r.gate_up, r.gate_up_scale, align, gather_a=True,
                                                             scatter_out=False, config=c, layout=r.layout,
                                                             a_pairs=qp if c.a_bf16 else None)),
                ("down", down, lambda c: mxfp4_grouped_gemm(hq, hs, r.down, r.down_scale, align, gather_a=False,
                                                           scatter_out=True, config=c, layout=r.layout,
                                                           a_pairs=hp if c.a_bf16 else None))):
                if cfg_g.kind != "swap":
                    lines.append(f"{name} T={t} {gemm}: kind {cfg_g.kind}, skipped")
                    continue
                res = {}
                for fold in (False, True, False, True):
                    BODY._mxfp4_grouped_gemm_swap_kernel = _Shim(fold)
                    res.setdefault(fold, []).append(graph_us(lambda: call(cfg_g)))
                lines.append(f"{name} T={t} {gemm} ({cfg_g.block_m}x{cfg_g.block_n}, split {cfg_g.split_k}, "
                             f"pairs {cfg_g.a_bf16}, cap {cfg_g.maxnreg}, unroll {cfg_g.unroll}): default "
                             f"{min(res[False]):.2f} us, folded {min(res[True]):.2f} us, "
                             f"x{min(res[False]) / min(res[True]):.3f}")
                print(lines[-1], flush=True)
        del layer
        torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "probe_foldsa.txt"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
