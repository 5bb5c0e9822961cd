"""H200 probe (session 13): the routed SwiGLU-quant over the route list (strategy "rows",
`align.route_rows`) against the row-range strategies over the alignment's max_rows rows
(filtered by `align.row_expert`), at the layer's shapes.

    OUT=./out python3 scripts/gpu_probe_swiglu_rows.py [--ts 1,4,16,64,256,1024,4096,8192]

Per preset (Flash: I = 2048, 256 experts; Pro-TP8: I/tp = 384, 384 experts) and T: random
top-6 routes, the layer's block_m (routed_configs), gate_up = random bf16 [max_rows, 2I]
(L2-warm, as the GEMM that writes it leaves it), pairs as the layer's down config asks.
Times (CUDA graphs, us) "group", "persistent", the old automatic choice, and "rows" with
16-row tiles (4 warps) and with one row per program ("rows1", 1 warp; the layer takes it up
to ROWS_SMALL_MAX_R routes); checks that both write the same bytes as the filtered call on
every row holding a route.
Writes $OUT/probe_swiglu_rows.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_probe_swz import graph_time  # noqa: E402

import dsv4_moe.kernels._swiglu_quant as body  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.routed_experts import routed_configs  # noqa: E402
from dsv4_moe.kernels.swiglu_quant import choose_strategy, swiglu_quant  # noqa: E402

DEV = torch.device("cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,4,16,64,256,1024,4096,8192")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for preset, i, e, h in (("flash", 2048, 256, 4096), ("pro-tp8", 384, 384, 7168)):
        for t in [int(x) for x in args.ts.split(",")]:
            ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)]).sort(1).values.int().to(DEV)
            tw = torch.rand(t, 6, generator=gen).to(DEV)
            fake = types.SimpleNamespace(intermediate=i, hidden=h, num_local=e, layout="mma64")
            up, down = routed_configs(t * 6, fake)
            a = moe_align(ids, e, 0, up.block_m, tw)
            m = a.max_rows
            gu = (torch.randn(m, 2 * i, device=DEV) * 3).bfloat16()
            pairs = down.a_bf16
            old = choose_strategy(m, i, True)
            res, times = {}, {}
            saved = body.ROWS_SMALL_MAX_R
            for name in ("group", "persistent", "rows", "rows1"):
                kw = dict(route_weight=a.row_weight, pairs=pairs)
                if name.startswith("rows"):
                    kw["rows"] = a.route_rows
                    # rows: 16-row tiles, 4 warps; rows1: one row per program, 1 warp
                    body.ROWS_SMALL_MAX_R = 1 << 30 if name == "rows1" else 0
                else:
                    kw.update(expert_ids=a.row_expert, strategy=name)
                fn = lambda kw=kw: swiglu_quant(gu, **kw)  # noqa: E731
                out = fn()
                torch.cuda.synchronize()
                keep = a.row_expert >= 0
                res[name] = [o[keep].contiguous().view(torch.uint8) if o.dtype != torch.float32 else o[keep] for o in out]
                times[name] = graph_time(fn)
            body.ROWS_SMALL_MAX_R = saved
            same = all(torch.equal(x, y) and torch.equal(x, z)
                       for x, y, z in zip(res["rows"], res[old], res["rows1"]))
            row = dict(preset=preset, T=t, I=i, max_rows=m, routes=t * 6, block_m=up.block_m, pairs=pairs,
                       old=old, us={k: round(v, 2) for k, v in times.items()},
                       speedup_vs_old=times[old] / times["rows"], rows_bitwise_old=same)
            rows_out.append(row)
            print(f"{preset:8s} T={t:5d} rows {t * 6:6d}/{m:6d} bm{up.block_m:3d}  group {times['group']:8.2f}  "
                  f"persistent {times['persistent']:8.2f}  rows {times['rows']:8.2f}  rows1 {times['rows1']:8.2f} us  "
                  f"old={old}: "
                  f"x{times[old] / times['rows']:.2f}  bitwise {same}", flush=True)
    with open(os.path.join(out_dir, "probe_swiglu_rows.json"), "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), commit=os.environ.get("DSV4_MOE_GIT_COMMIT", "?"),
                       rows=rows_out), fh, indent=1)


if __name__ == "__main__":
    main()
