"""H200 probe (session 14): where the one-launch decode front's time goes.

    OUT=./out python3 scripts/gpu_probe_front.py [--ts 1,2,3,4]

For Flash (H 4096, E 256) and Pro (H 7168, E 384) router shapes, per T: CUDA-graph time of
route_front (default, DIAG 1 = no routing / alignment, DIAG 2 = no act_quant share) and of
the separate launches it replaces (logits GEMV, GEMV + top-k, act_quant, moe_align small,
all four in a row). Gate weights rotated over 16 copies (from DRAM, as in a model).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_probe_swz import graph_time  # noqa: E402

from dsv4_moe.kernels.act_quant import act_quant  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.route_front import route_front  # noqa: E402
from dsv4_moe.kernels.router import route_topk, router_logits_gemv  # noqa: E402

DEV = torch.device("cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,2,3,4")
    args = ap.parse_args()
    rows = []
    for name, h, e in (("flash", 4096, 256), ("pro", 7168, 384)):
        ws = [(torch.randn(e, h, device=DEV) * 0.02).bfloat16() for _ in range(16)]
        bias = torch.randn(e, device=DEV) * 0.1
        for t in [int(v) for v in args.ts.split(",")]:
            x = torch.randn(t, h, device=DEV).bfloat16()
            it = [0]

            def nxt():
                it[0] = (it[0] + 1) % len(ws)
                return ws[it[0]]

            def sep():
                w = nxt()
                tw, ids = route_topk(x, w, bias, None, None, 6, 2.5)
                act_quant(x)
                moe_align(ids, e, 0, 16, tw)

            cases = {
                "front": lambda: route_front(x, nxt(), bias, None, None, 6, 2.5, num_local=e, first_expert=0,
                                             block_m=16),
                "front diag1 (no route/align)": lambda: route_front(x, nxt(), bias, None, None, 6, 2.5,
                                                                    num_local=e, first_expert=0, block_m=16, _diag=1),
                "front diag2 (no quant)": lambda: route_front(x, nxt(), bias, None, None, 6, 2.5, num_local=e,
                                                              first_expert=0, block_m=16, _diag=2),
                "gemv": lambda: router_logits_gemv(x, nxt()),
                "gemv+topk": lambda: route_topk(x, nxt(), bias, None, None, 6, 2.5),
                "separate 4": sep,
            }
            for cname, fn in cases.items():
                us = graph_time(fn, reps=20, inner=16)
                print(f"{name:6s} T={t} {cname:30s} {us:7.2f} us", flush=True)
                rows.append(dict(shape=name, T=t, case=cname, us=us))
    with open(os.path.join(os.environ.get("OUT", "./out"), "probe_front.json"), "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), commit=os.environ.get("DSV4_MOE_GIT_COMMIT", "?"),
                       rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
