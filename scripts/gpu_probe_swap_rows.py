"""Probe (H200): bigger folded swap blocks for the mid and prefill sizes.

Session 17's "wait" ordering of the folded swap body (GemmConfig.fold_order) needs far
fewer registers than the per-block body (sm_90a, offline, scripts/sass_wgmma_hazard.py's
compile): 32 rows 151 instead of 216; 64 rows 194-212 with no spill instead of 255 with 25
spilled words; 64 rows on 8 warps 113-128; 128 rows on 8 warps 166-168. The 64-row swap was
never competitive per-block (spills), so the tile body (weights through shared memory, its
MMA waited on at once: `HGMMA ...; WARPGROUP.DEPBAR.LE gsb0, 0x0` twice per 128-k block)
took T >= ~1700 (Flash) / ~6100 (Pro-TP8). This probe times, per GEMM of the layer, the
layer's own config against folded swap candidates, each with its own alignment (block_m),
on the same routes and activations, and checks that every candidate gives the layer
config's bits on every route (all folded bodies run the same MMA chain; session 17 measured
them bitwise equal).

    OUT=./out python3 scripts/gpu_probe_swap_rows.py [--ts 1024,2048,4096,8192] [--presets flash,pro-tp8]
    TRITON_INTERPRET=1 python3 scripts/gpu_probe_swap_rows.py --presets tiny --ts 8 --device cpu --reps 1
                                                              (a dry run of the script on CPU)

First run: session 18 (docs/bench/2026-11-30/session18/probe_swap_rows_*.txt). Session 19
(docs/bench/2026-11-30/session19/) timed the n_fastest launch order (now the layer's default for
32/64-row swap blocks) and the 256-weight-row blocks on two warpgroups (slower), and moved the
64-row bands. `--layer-twins` adds the layer config timed twice (the noise floor: up to 8 % at
T = 8192) and with n_fastest flipped; `--rounds N` interleaves N timing rounds (min and median).
    python3 scripts/gpu_probe_swap_rows.py --presets flash --ts 1536,2048,8192 --only 'swap 64 4w s4 r168 nf' --layer-twins --rounds 3
Session 20 (docs/bench/2026-11-30/session20/) ran session 19's "mma64e" weights: `--enc` times
the layer config on them next to the plain "mma64" ones (the layer is then built on "mma64"),
`--enc-variants 'TAG:field=value,...;...'` the layer config with GemmConfig fields replaced, on
the re-encoded weights (how the Pro-TP8 register cap and "wait" ordering of
routed_experts._mma64e_configs were found). Without either, the layer and every candidate run
on "mma64e", the layer's CUDA default.
    python3 scripts/gpu_probe_swap_rows.py --presets pro-tp8 --ts 16,1024 --enc-variants 'r128:maxnreg=128;wait:fold_order=wait' --rounds 3
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
from dsv4_moe.kernels.routed_experts import fold_config, routed_configs
from dsv4_moe.testing import random_layer_weights

SWAP = dict(kind="swap", asm=True, a_bf16=True, fold_sa=True)
CANDIDATES = {
    "swap 32 4w s3": GemmConfig(32, 128, 4, 3, **SWAP),
    "swap 64 4w s2": GemmConfig(64, 128, 4, 2, **SWAP),
    "swap 64 4w s3": GemmConfig(64, 128, 4, 3, **SWAP),
    "swap 64 8w s3": GemmConfig(64, 128, 8, 3, **SWAP),
    "swap 64 8w s4": GemmConfig(64, 128, 8, 4, **SWAP),
    "swap 128 8w s2": GemmConfig(128, 128, 8, 2, **SWAP),
    "swap 128 8w s3": GemmConfig(128, 128, 8, 3, **SWAP),
    "swap 256 8w s2": GemmConfig(256, 128, 8, 2, **SWAP),
    "swap 64 4w s4": GemmConfig(64, 128, 4, 4, **SWAP),
    "swap 64 4w s3 u2": GemmConfig(64, 128, 4, 3, unroll=2, **SWAP),
    "swap 64 4w s3 r168": GemmConfig(64, 128, 4, 3, maxnreg=168, **SWAP),
    "swap 64 4w s3 r128": GemmConfig(64, 128, 4, 3, maxnreg=128, **SWAP),
    "swap 64 4w s3 n64": GemmConfig(64, 64, 4, 3, **SWAP),
    "swap 32 4w s4": GemmConfig(32, 128, 4, 4, **SWAP),
    "swap 32 4w s3 u2": GemmConfig(32, 128, 4, 3, unroll=2, **SWAP),
    # 128 rows on one warpgroup (sm_90a offline: 64 weight rows 135-143 registers, 128 of them 255; no spill)
    "swap 128x64 4w s2": GemmConfig(128, 64, 4, 2, **SWAP),
    "swap 128x64 4w s3": GemmConfig(128, 64, 4, 3, **SWAP),
    "swap 128x64 4w s3 u2": GemmConfig(128, 64, 4, 3, unroll=2, **SWAP),
    "swap 128x128 4w s2": GemmConfig(128, 128, 4, 2, **SWAP),
    "swap 256x64 8w s2": GemmConfig(256, 64, 8, 2, **SWAP),
    # 256 weight rows per program on two warpgroups: each m-block's activation rows are read by
    # half as many programs (the 64 x 128 block reads 14.6 GB of bf16 activation rows from L2 at
    # Flash T = 8192 gate_up); sm_90a offline 209-213 registers (one program per SM), 32 rows 158
    "swap 64x256 8w s2": GemmConfig(64, 256, 8, 2, **SWAP),
    "swap 64x256 8w s3": GemmConfig(64, 256, 8, 3, **SWAP),
    "swap 64x256 8w s4": GemmConfig(64, 256, 8, 4, **SWAP),
    "swap 32x256 8w s3": GemmConfig(32, 256, 8, 3, **SWAP),
    # the layer's prefill block launched with the weight blocks fastest (GemmConfig.n_fastest)
    "swap 64 4w s3 r168 nf": GemmConfig(64, 128, 4, 3, maxnreg=168, n_fastest=True, **SWAP),
    "swap 64 4w s3 nf": GemmConfig(64, 128, 4, 3, n_fastest=True, **SWAP),
    "swap 64 4w s3 u2 nf": GemmConfig(64, 128, 4, 3, unroll=2, n_fastest=True, **SWAP),
    "swap 32 4w s3 nf": GemmConfig(32, 128, 4, 3, n_fastest=True, **SWAP),
    # session 19: n_fastest is the layer's default for 32/64-row swap blocks (layer bench A/B:
    # Flash T=8192 1.10x, T=2048 1.08x); the other shapes again, launched that way
    "swap 64 4w s4 r168 nf": GemmConfig(64, 128, 4, 4, maxnreg=168, n_fastest=True, **SWAP),
    "swap 64 4w s2 r168 nf": GemmConfig(64, 128, 4, 2, maxnreg=168, n_fastest=True, **SWAP),
    "swap 128x128 4w s2 nf": GemmConfig(128, 128, 4, 2, n_fastest=True, **SWAP),
    "swap 64x256 8w s3 nf": GemmConfig(64, 256, 8, 3, n_fastest=True, **SWAP),
    "swap 32 4w s3 u2 nf": GemmConfig(32, 128, 4, 3, unroll=2, n_fastest=True, **SWAP),
    "swap 128x64 4w s3 u2 nf": GemmConfig(128, 64, 4, 3, unroll=2, n_fastest=True, **SWAP),
    "swap 64 4w s3 u2 r168 nf": GemmConfig(64, 128, 4, 3, unroll=2, maxnreg=168, n_fastest=True, **SWAP),
    # session 36: ncu (Flash T=8192 gate_up) put "128x64 4w s3 u2 nf" at 213 KB of shared memory per
    # program (1 per SM, 6 % occupancy) and "128x128 4w s2 nf" at 255 registers (2 per SM) - 39 % fewer
    # instructions than the layer's 64-row body; 128 rows on 64 weight rows without the unroll fit 3
    "swap 128x64 4w s2 nf": GemmConfig(128, 64, 4, 2, n_fastest=True, **SWAP),
    "swap 128x64 4w s3 nf": GemmConfig(128, 64, 4, 3, n_fastest=True, **SWAP),
}


def graph_us(fn, device, reps):
    """CUDA-graph replay time of fn (the package's bench timer: median of batches)."""
    return time_sets([fn], device=device, reps=reps).median_us


def _parse_variant(spec: str) -> tuple[str, dict]:
    """'TAG:field=value,field=value' -> (TAG, {field: value}) for dataclasses.replace(GemmConfig)."""
    tag, _, body = spec.strip().partition(":")
    known = {f.name for f in dataclasses.fields(GemmConfig)}
    fields = {}
    for item in body.split(","):
        key, eq, val = item.strip().partition("=")
        if not eq or key not in known:
            raise SystemExit(f"--enc-variants: bad item {item!r} in {spec!r}; expected field=value with a "
                             f"GemmConfig field ({sorted(known)})")
        consts = {"None": None, "True": True, "False": False}
        fields[key] = consts[val] if val in consts else int(val) if val.lstrip("-").isdigit() else val
    if not tag or not fields:
        raise SystemExit(f"--enc-variants: bad variant {spec!r}; expected TAG:field=value[,field=value]")
    return tag, fields


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1024,2048,4096,8192")
    ap.add_argument("--presets", default="flash,pro-tp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all; 'none': no "
                                                "candidate, only the layer config and --enc / --enc-variants)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (min and median reported)")
    ap.add_argument("--enc", action="store_true",
                    help="add 'layer mma64e': the layer config on the re-encoded weights (weights/mma_layout.py "
                         "'mma64e'; the layer config is routed_configs' for the plain 'mma64' weights): must be bitwise the "
                         "layer config")
    ap.add_argument("--enc-variants", default="",
                    help="';'-separated TAG:field=value[,field=value] - the layer config with these GemmConfig "
                         "fields replaced, run on the 'mma64e' weights as 'e TAG' (e.g. 'r128:maxnreg=128;"
                         "u1:unroll=1'); values: int, None, True, False or a string")
    ap.add_argument("--layer-twins", action="store_true",
                    help="add 'layer again' (the layer config timed twice: the noise floor) and 'layer nf' "
                         "(the layer config with GemmConfig.n_fastest flipped, swap configs only)")
    ap.add_argument("--gemms", default="gate_up,down", help="which GEMMs to time (comma-separated)")
    args = ap.parse_args()
    dev = args.device
    out = os.environ.get("OUT", "./out")
    lines = []

    def say(text):
        lines.append(text)
        print(text, flush=True)

    enc_variants = [_parse_variant(v) for v in args.enc_variants.split(";") if v.strip()]
    cfgs = {"flash": MoEConfig.flash(), "pro-tp8": MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank"),
            "pro-tp1": MoEConfig.pro(), "tiny": MoEConfig.tiny()}
    for name in args.presets.split(","):
        cfg = cfgs[name]
        # with --enc / --enc-variants the layer (its configs, its weights) is the plain "mma64" twin
        layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=min(5, cfg.num_hidden_layers - 1), seed=0, device=dev),
                              routed_layout="mma64" if args.enc or enc_variants else "auto")
        r = layer.routed
        h, i = r.hidden, r.intermediate
        enc_w = {}
        if args.enc or enc_variants:
            from dsv4_moe.weights.mma_layout import convert_layout
            enc_w = {"gate_up": convert_layout(r.gate_up, r.layout, "mma64e"),
                     "down": convert_layout(r.down, r.layout, "mma64e")}
        for t in [int(v) for v in args.ts.split(",")]:
            g = torch.Generator(device=dev).manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, device=dev, generator=g).bfloat16()
            with torch.no_grad():
                w, ids = route_topk(x, layer.router.weight, layer.router.bias, None, None,
                                    cfg.num_experts_per_tok, cfg.routed_scaling_factor)
            q, sa, qps = act_quant(x, pairs="scaled")
            routes = ids.numel()
            hq_r, hs_r = act_quant((torch.randn(routes, i, device=dev, generator=g) * 2).bfloat16())
            up, down = routed_configs(routes, r)
            for gemm, layer_cfg, k in (("gate_up", up, h), ("down", down, i)):
                if gemm not in args.gemms.split(","):
                    continue
                if layer_cfg.kind == "gemv":
                    say(f"{name} T={t} {gemm}: the layer runs the GEMV here, skipped")
                    continue
                variants = {f"layer ({layer_cfg.kind} {layer_cfg.block_m}{' nf' if layer_cfg.n_fastest else ''})":
                            fold_config(layer_cfg, k)}
                only = [v.strip() for v in args.only.split(",") if v.strip()]
                if only == ["none"]:
                    only = [None]
                unknown = [v for v in only if v is not None and v not in CANDIDATES]
                if unknown:
                    raise SystemExit(f"--only: unknown candidates {unknown}; known: {list(CANDIDATES)}")
                variants.update({c_name: fold_config(c, k) for c_name, c in CANDIDATES.items()
                                 if not only or c_name in only})
                if args.layer_twins:
                    variants["layer again"] = variants[next(iter(variants))]
                    if layer_cfg.kind == "swap" and layer_cfg.split_k == 1:
                        flipped = dataclasses.replace(layer_cfg, n_fastest=not layer_cfg.n_fastest)
                        variants["layer nf" if flipped.n_fastest else "layer mf"] = fold_config(flipped, k)
                if args.enc or args.enc_variants:
                    variants["layer mma64e"] = variants[next(iter(variants))]
                for tag, fields in enc_variants:
                    try:
                        v_cfg = dataclasses.replace(variants[next(iter(variants))], **fields)
                    except ValueError as exc:  # e.g. unroll on a tile config: not this GEMM's variant
                        say(f"{name} T={t} {gemm}: variant {tag} skipped ({exc})")
                        continue
                    variants[f"e {tag}"] = v_cfg
                calls, per_route = {}, {}
                for v_name, c in variants.items():
                    align = moe_align(ids, r.num_local, r.first_expert, c.block_m, w)
                    rows = align.route_rows.long()
                    enc = v_name == "layer mma64e" or v_name.startswith("e ")
                    lay = "mma64e" if enc else r.layout
                    if gemm == "gate_up":
                        wt = enc_w["gate_up"] if enc else r.gate_up

                        def call(c=c, align=align, wt=wt, lay=lay):
                            return mxfp4_grouped_gemm(q, sa, wt, r.gate_up_scale, align, gather_a=True,
                                                      scatter_out=False, config=c, layout=lay,
                                                      **({"a_pairs": qps, "a_pairs_scaled": True} if c.a_bf16 else {}))
                        calls[v_name] = call
                        per_route[v_name] = lambda call=call, rows=rows: call()[rows]
                    else:
                        hq = torch.zeros(align.max_rows, i, dtype=hq_r.dtype, device=dev)
                        hs = torch.ones(align.max_rows, hs_r.shape[1], dtype=hs_r.dtype, device=dev)
                        hq[rows], hs[rows] = hq_r, hs_r
                        hps = bf16_pairs(hq, hs)

                        wt = enc_w["down"] if enc else r.down

                        def call(c=c, align=align, hq=hq, hs=hs, hps=hps, wt=wt, lay=lay):
                            return mxfp4_grouped_gemm(hq, hs, wt, r.down_scale, align, gather_a=False,
                                                      scatter_out=True, config=c, layout=lay,
                                                      **({"a_pairs": hps, "a_pairs_scaled": True} if c.a_bf16 else {}))
                        calls[v_name] = call
                        per_route[v_name] = call
                res = {}
                for _ in range(args.rounds):  # interleaved
                    for v_name, call in calls.items():
                        res.setdefault(v_name, []).append(graph_us(call, dev, args.reps))
                names = list(variants)
                ref = per_route[names[0]]()
                base = min(res[names[0]])
                med = {v: sorted(res[v])[len(res[v]) // 2] for v in names}
                parts = []
                for v_name in names[1:]:
                    same = all(torch.equal(per_route[v_name](), ref) for _ in range(3))
                    us = min(res[v_name])
                    spread = (f" (median {med[v_name]:.1f} x{med[names[0]] / med[v_name]:.3f})"
                              if args.rounds > 2 else "")
                    parts.append(f"{v_name} {us:.1f} us x{base / us:.3f}{spread}"
                                 f"{'' if same else ' NOT BITWISE the layer config'}")
                say(f"{name} T={t} {gemm}: {names[0]} {base:.1f} us"
                    + (f" (median {med[names[0]]:.1f})" if args.rounds > 2 else "") + "; " + "; ".join(parts))
        del layer
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "probe_swap_rows.txt"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
