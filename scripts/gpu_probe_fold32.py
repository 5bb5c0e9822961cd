"""Probe (H200): the 32-row swap body with the activation scale folded (GemmConfig.fold_sa)
against an fp64 reference, the per-block body and the folded 16-row body, on the same
quantised inputs. Session 16 found the folded 32-row gate_up differing from the per-block
body in 0.47-0.55 % of its outputs (16-row and tile bodies: <= 0.012 %) and the layer's
relative error at 5.9e-3 instead of 9e-5 (docs/bench/2026-11-29/session16/); this script
says where: which rows, columns and experts, how far from the exact value (bf16 ulps),
whether a rerun gives the same bytes, and whether other pipeline depths / unrolls change it.

    OUT=./out python3 scripts/gpu_probe_fold32.py [--gemm gate_up|down] [--seeds 1,2] [--reruns 10] [--time]

Runs 8d08a02 / 2368def / 50c338f (docs/bench/2026-11-29/session16/probe_fold32_*.txt): the
folded 32-row body at 3 and 4 pipeline stages was wrong and non-deterministic (up to 2.4e6
ulps, 0.05-0.5 % of outputs > 1 ulp); at 2 stages, unrolled twice or on the fp8 operand it
equalled the folded 16-row body and the folded tile bit for bit. The cause was ptxas < 13.3
reusing the in-flight wgmma's A registers (scripts/sass_wgmma_hazard.py). Since 933a6cc the
folded swap body converts the odd-k half after the even-k MMA (GemmConfig.fold_order
"split"); run d97206c (docs/bench/2026-11-29/session17/): exact and deterministic at 2-4
stages. Since session 17 the "fold" variants run the default ordering "wait" (each block's
MMAs waited on through the accumulator), the "split" ones the barrier ordering.
"""
import argparse
import dataclasses
import os

import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig
from dsv4_moe.bench.timing import time_sets
from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.moe_align import moe_align
from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig, bf16_pairs, mxfp4_grouped_gemm
from dsv4_moe.kernels.router import route_topk
from dsv4_moe.testing import random_layer_weights
from dsv4_moe.weights.formats import e2m1_codes_to_float, e8m0_to_float32, unpack_e2m1


def _exact(xd, route_rows, ids, routed, which):
    """fp64 [R, N]: route r's row xd[route_rows[r]] times its expert's `which` ("gate_up" or
    "down") weight, both dequantised exactly (rows of non-local routes 0)."""
    nk = routed.with_layout("nk")
    w4, sw = getattr(nk, which), getattr(nk, which + "_scale")
    flat = ids.reshape(-1)
    out = torch.zeros(flat.numel(), w4.shape[1], dtype=torch.float64, device=xd.device)
    for e in torch.unique(flat).tolist():
        el = e - routed.first_expert
        if not 0 <= el < routed.num_local:
            continue
        r = torch.nonzero(flat == e).squeeze(1)
        w = e2m1_codes_to_float(unpack_e2m1(w4[el])).double()
        w = w * e8m0_to_float32(sw[el]).double().repeat_interleave(32, dim=1)
        out[r] = xd[route_rows[r]] @ w.T
    return out


def _dequant_rows(q, s):
    return q.double() * s.double().repeat_interleave(128, dim=1)[:, :q.shape[1]]


def exact_gate_up(x_q, x_sa, ids, routed, k):
    """fp64 value of every route's gate_up row (route r = token r // k, slot r % k): [R, 2I]."""
    return _exact(_dequant_rows(x_q, x_sa), torch.arange(ids.numel(), device=ids.device) // k, ids, routed,
                  "gate_up")


def exact_down(h_q, h_s, ids, routed):
    """fp64 value of every route's down row from its quantised SwiGLU output (h_q, h_s) [R, I]:
    [R, H]."""
    return _exact(_dequant_rows(h_q, h_s), torch.arange(ids.numel(), device=ids.device), ids, routed, "down")


def aligned_rows(x_route, align):
    """Per-route rows [R, ...] -> the alignment's row order [max_rows, ...] (padding rows 0)."""
    sid = align.sorted_route_ids.long()
    ok = sid < align.num_routes
    res = torch.zeros(sid.shape[0], *x_route.shape[1:], dtype=x_route.dtype, device=x_route.device)
    res[ok] = x_route[sid[ok]]
    return res


def by_route(out, align):
    """Aligned gate_up rows -> [R, N] in route order."""
    sid = align.sorted_route_ids.long()
    ok = sid < align.num_routes
    res = torch.empty(align.num_routes, out.shape[1], dtype=out.dtype, device=out.device)
    res[sid[ok]] = out[:sid.shape[0]][ok]
    return res


def ulps(v, ref):
    """|v - ref| in units of the bf16 spacing at ref."""
    spacing = torch.ldexp(torch.ones_like(ref), torch.frexp(ref.abs().clamp_min(1e-30))[1] - 8)
    return (v.double() - ref).abs() / spacing


def variants(gemm="gate_up"):
    base32 = GemmConfig(32, 128, 4, 3, kind="swap", asm=True, a_bf16=True)
    b16 = GemmConfig(16, 128, 4, 4, kind="swap", asm=True, a_bf16=True)
    if gemm == "down":
        u2 = dataclasses.replace(base32, unroll=2)
        return {
            "per-block 32 unroll 2": u2,
            "fold 32 unroll 2": dataclasses.replace(u2, fold_sa=True),
            "fold 32 unroll 2 split": dataclasses.replace(u2, fold_sa=True, fold_order="split"),
            "fold 32 stages 2": dataclasses.replace(base32, fold_sa=True, num_stages=2),
            "fold 32": dataclasses.replace(base32, fold_sa=True),
            "per-block 16": b16,
            "fold 16": dataclasses.replace(b16, fold_sa=True),
            "fold 16 split": dataclasses.replace(b16, fold_sa=True, fold_order="split"),
        }
    return {
        "per-block 32": base32,
        "fold 32": dataclasses.replace(base32, fold_sa=True),
        "fold 32 split": dataclasses.replace(base32, fold_sa=True, fold_order="split"),
        "fold 32 stages 2": dataclasses.replace(base32, fold_sa=True, num_stages=2),
        "fold 32 stages 4": dataclasses.replace(base32, fold_sa=True, num_stages=4),
        "fold 32 unroll 2": dataclasses.replace(base32, fold_sa=True, unroll=2),
        "fold 32 fp8 operand": dataclasses.replace(base32, fold_sa=True, a_bf16=False),
        "per-block 16": b16,
        "fold 16": dataclasses.replace(b16, fold_sa=True),
        "fold 16 split": dataclasses.replace(b16, fold_sa=True, fold_order="split"),
        "fold 64 tile": GemmConfig(64, 128, 4, 3, asm=True, a_bf16=True, fold_sa=True),
        "per-block 64 tile": GemmConfig(64, 128, 4, 3, asm=True, a_bf16=True),
    }


def cases():
    return [("flash", MoEConfig.flash(), 1024),
            ("pro-tp8", MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank"), 4096)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemm", choices=("gate_up", "down"), default="gate_up")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--reruns", type=int, default=10)
    ap.add_argument("--time", action="store_true", help="also time each variant (CUDA graphs)")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "./out")
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    for name, cfg, t in cases():
        layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=5, seed=0, device="cuda"))
        r = layer.routed
        k = cfg.num_experts_per_tok
        for seed in [int(v) for v in args.seeds.split(",")]:
            torch.manual_seed(seed)
            x = torch.randn(t, cfg.hidden_size, device="cuda").bfloat16()
            w, ids = route_topk(x, layer.router.weight, layer.router.bias, None, None, k, cfg.routed_scaling_factor)
            q, sa, qp = act_quant(x, pairs=True)
            qps = act_quant(x, pairs="scaled")[2]
            if args.gemm == "down":  # one quantised SwiGLU output per route, placed per alignment
                h_q, h_s = act_quant((torch.randn(t * k, r.intermediate, device="cuda") * 2).bfloat16())
                ref = exact_down(h_q, h_s, ids, r)
            else:
                ref = exact_gate_up(q, sa, ids, r, k)
            outs = {}
            for label, c in variants(args.gemm).items():
                align = moe_align(ids, r.num_local, r.first_expert, c.block_m, w)
                if args.gemm == "down":
                    aq, asa = aligned_rows(h_q, align), aligned_rows(h_s, align)
                    ap_ = bf16_pairs(aq, asa if c.fold_sa else None)
                    kw = dict(a_pairs=ap_, a_pairs_scaled=c.fold_sa) if c.a_bf16 else {}

                    def call():
                        return mxfp4_grouped_gemm(aq, asa, r.down, r.down_scale, align, gather_a=False,
                                                  scatter_out=True, config=c, layout=r.layout, **kw)
                    ob_fn = lambda o: o  # noqa: E731  (scattered: already in route order)
                else:
                    kw = {}
                    if c.a_bf16:
                        kw = dict(a_pairs=qps, a_pairs_scaled=True) if c.fold_sa else dict(a_pairs=qp)

                    def call():
                        return mxfp4_grouped_gemm(q, sa, r.gate_up, r.gate_up_scale, align, gather_a=True,
                                                  scatter_out=False, config=c, layout=r.layout, **kw)
                    ob_fn = lambda o, a=align: by_route(o, a)  # noqa: E731
                ob = ob_fn(call())
                same = sum(torch.equal(ob_fn(call()), ob) for _ in range(args.reruns))
                outs[label] = ob
                u = ulps(ob, ref)
                flat_u = u.reshape(-1)
                bad = u > 1.0
                timing = ""
                if args.time and seed == int(args.seeds.split(",")[0]):
                    timing = f"; {time_sets([call], device='cuda').median_us:.1f} us"
                say(f"{name} T={t} seed {seed} {args.gemm} {label}: reruns bitwise {same}/{args.reruns}; ulps vs "
                    f"fp64: max {flat_u.max().item():.2f}, > 1 ulp {bad.double().mean().item():.4%}, > 0.5 ulp "
                    f"{(u > 0.5).double().mean().item():.4%}{timing}")
                if bad.double().mean().item() > 1e-4:
                    rr, nn = torch.nonzero(bad, as_tuple=True)
                    sid = align.sorted_route_ids.long()
                    pos = torch.empty(align.num_routes, dtype=torch.long, device="cuda")
                    okm = sid < align.num_routes
                    pos[sid[okm]] = torch.nonzero(okm).squeeze(1)
                    in_block = (pos[rr] % c.block_m).bincount(minlength=c.block_m).tolist()
                    say(f"    bad elements {rr.numel()}: rows {rr.unique().numel()} of {align.num_routes}, experts "
                        f"{ids.reshape(-1)[rr].unique().numel()}; row-in-block histogram {in_block}")
            for a in outs:
                if a != "fold 16":
                    d = (outs[a] != outs["fold 16"]).double().mean().item()
                    say(f"{name} T={t} seed {seed}: {a} vs fold 16: {d:.4%} of outputs differ")
        del layer
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    open(os.path.join(out_dir, f"probe_fold32_{args.gemm}.txt"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
