"""Probe (H200): the routed swap body with the activation scale folded into the bf16
activation operand (GemmConfig.fold_sa: the K loop accumulates in the MMA chain, no
per-block wait, FFMA or scale loads) against the per-block body, on the layer's own
configs (CUDA graphs, weights not rotated), interleaved; plus the share of outputs that
differ between the two (both are checked against the reference by gpu_check_layer).

    OUT=./out python3 scripts/gpu_probe_foldsa.py [--ts 1,4,16,64]        (decode: swap bodies)
    OUT=./out python3 scripts/gpu_probe_foldsa.py --ts 256,1024,4096,8192 (32-row swap and tile bodies)
    OUT=./out python3 scripts/gpu_probe_foldsa.py --orders wait,split   (the folded swap body in
                                         each GemmConfig.fold_order; each checked bitwise against the
                                         first over 5 reruns)

Each GEMM: its config with fold_sa off against routed_experts.fold_config of it (the folded
twin), and with --orders the folded swap body in each ordering. Session 15/16 timings of the
swap bodies were of the earlier folded body, which ptxas < 13.3 made unsafe
(scripts/sass_wgmma_hazard.py); session 17's (probe_foldsa_syncs_a1037d2.txt) of "split"
(then FOLD_SYNC 0) and "wait" (FOLD_SYNC 2).

(Session 15 first measured an experimental copy of the kernel fed unscaled pairs, commit
955a6d2 + scripts/_mx_foldsa_exp.py, docs/bench/2026-11-29/session15/probe_foldsa_exp.txt.)
"""
import argparse
import os
import dataclasses

import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig  # noqa: E402
from dsv4_moe.bench.timing import time_sets  # noqa: E402
from dsv4_moe.kernels.act_quant import act_quant  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.mxfp4_grouped_gemm import bf16_pairs, mxfp4_grouped_gemm  # noqa: E402
from dsv4_moe.kernels.routed_experts import fold_config, routed_configs  # noqa: E402
from dsv4_moe.kernels.router import route_topk  # noqa: E402
from dsv4_moe.testing import random_layer_weights  # noqa: E402


def graph_us(fn):
    """CUDA-graph replay time of fn (the package's bench timer: median of batches)."""
    return time_sets([fn], device="cuda").median_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,4,16,64")
    ap.add_argument("--orders", default="", help="fold_order values to time (default: fold_config's)")
    args = ap.parse_args()
    orders = [v for v in args.orders.split(",") if v]
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
            qps = act_quant(x, pairs="scaled")[2]
            i = r.intermediate
            hq, hs = act_quant((torch.randn(align.max_rows, i, device="cuda") * 2).bfloat16())
            hp, hps = bf16_pairs(hq), bf16_pairs(hq, hs)

            def pairs_kw(c, plain, scaled):
                if not c.a_bf16:
                    return {}
                return dict(a_pairs=scaled, a_pairs_scaled=True) if c.fold_sa else dict(a_pairs=plain)
            for gemm, cfg_g, call in (
                ("gate_up", up, lambda c: mxfp4_grouped_gemm(q, sa, r.gate_up, r.gate_up_scale, align, gather_a=True,
                                                             scatter_out=False, config=c, layout=r.layout,
                                                             **pairs_kw(c, qp, qps))),
                ("down", down, lambda c: mxfp4_grouped_gemm(hq, hs, r.down, r.down_scale, align, gather_a=False,
                                                           scatter_out=True, config=c, layout=r.layout,
                                                           **pairs_kw(c, hp, hps)))):
                if cfg_g.kind == "gemv":
                    lines.append(f"{name} T={t} {gemm}: kind gemv, skipped")
                    continue
                res = {}
                twin = fold_config(cfg_g, r.hidden if gemm == "gate_up" else r.intermediate)
                variants = {"per-block": dataclasses.replace(cfg_g, fold_sa=False)}
                for o in (orders if cfg_g.kind == "swap" and orders else [twin.fold_order]):
                    variants[f"folded ({o})"] = dataclasses.replace(twin, fold_order=o)
                for _ in range(2):
                    for v, c in variants.items():
                        res.setdefault(v, []).append(graph_us(lambda: call(c)))
                rows = align.route_rows.long() if gemm == "gate_up" else slice(None)
                outs = {v: call(c).float()[rows] for v, c in variants.items()}
                names = list(variants)
                same = {v: all(torch.equal(call(variants[v]).float()[rows], outs[names[1]]) for _ in range(5))
                        for v in names[1:]}
                differ = (outs[names[0]] != outs[names[1]]).float().mean().item()
                base = min(res[names[0]])
                folded = ", ".join(f"{v} {min(res[v]):.2f} us x{base / min(res[v]):.3f}"
                                   f"{'' if same[v] else ' NOT BITWISE ' + names[1] + ' / its reruns'}"
                                   for v in names[1:])
                lines.append(f"{name} T={t} {gemm} ({cfg_g.kind} {cfg_g.block_m}x{cfg_g.block_n}, split {cfg_g.split_k}, "
                             f"pairs {cfg_g.a_bf16}, cap {cfg_g.maxnreg}, unroll {cfg_g.unroll}, default fold "
                             f"{cfg_g.fold_sa}): per-block {base:.2f} us, {folded}; {differ:.3%} of outputs "
                             f"differ per-block vs folded")
                print(lines[-1], flush=True)
        del layer
        torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "probe_foldsa.txt"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
