"""H200 check (session 24): the one-launch decode front's outputs against the separate
launches it merges, output by output, with and without bf16 pairs.

    OUT=./out python3 scripts/gpu_check_front_pairs.py [--tokens 1,2,3,4] [--set MODULE.ATTR=V ...]

(session 31: --tokens and --set, e.g. `--set dsv4_moe.kernels.router.GEMV_PREWAIT=0`. Both sides
run the same logits tile code, so an error they share passes here: session 31's token-loop GEMV
was bitwise here at T = 1-8 and wrong in the layer bench - check a new form there too.)

Session 24's gpu_check_layer found the whole layer with the fused front (force_paths(
front="fused")) differing from the separate front at T = 2 only, once the decode gate_up took
bf16 pairs there; T = 2 is the one T whose logits GEMV runs 8 warps (router.gemv_blocks).
This compares, for Flash (E 256, H 4096) and Pro (E 384, H 7168) gate shapes and T = 1..4,
route_front's (weights, ids, q, sa, q_pairs) with route_topk + act_quant, bitwise, at the
GEMV's warps and at 4 warps (route_front's `_warps`). Writes $OUT/front_pairs.json.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels.route_front import route_front
from dsv4_moe.kernels.router import gemv_blocks, route_topk


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _tokens(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    if not out or min(out) < 1:
        raise ValueError(f"--tokens: expected token counts >= 1 such as '1,2,3' or '1-8', got {spec!r}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,3,4", help="token counts, e.g. 1,2,3,4 or 1-8")
    ap.add_argument("--set", action="append", default=[], help="MODULE.ATTR=V (repeatable), as bench_layer.py")
    args = ap.parse_args()
    from dsv4_moe.bench.run import _apply_set  # the layer bench's --set (same parsing, memo cleared)
    for item in args.set:
        print(_apply_set(item), flush=True)
    dev = torch.device("cuda")
    rows = []
    g = torch.Generator(device=dev).manual_seed(24)
    for name, e, h in (("flash", 256, 4096), ("pro", 384, 7168)):
        w = (torch.randn(e, h, device=dev, generator=g) * 0.02).bfloat16()
        bias = torch.randn(e, device=dev, generator=g) * 0.01
        for t in _tokens(args.tokens):
            x = torch.randn(t, h, device=dev, generator=g).bfloat16()
            rw, rids = route_topk(x, w, bias, None, None, 6, 1.5)
            for pairs in (False, True, "scaled"):
                want = act_quant(x, pairs=pairs)
                q, sa, qp = want[0], want[1], (want[2] if pairs else None)
                for warps in (None, 4):
                    o = route_front(x, w, bias, None, None, 6, 1.5, num_local=e, first_expert=0, block_m=16,
                                    pairs=pairs, _warps=warps)
                    torch.cuda.synchronize()
                    row = dict(shape=name, T=t, pairs=str(pairs), warps=warps or gemv_blocks(t, h)[3],
                               weights=_same(o[0], rw), ids=_same(o[1], rids), q=_same(o[2], q),
                               sa=_same(o[3], sa), q_pairs=_same(o[4], qp))
                    if pairs and not row["q_pairs"]:
                        d = (o[4].float() != qp.float())
                        row["pairs_differ"] = int(d.sum())
                        row["first_differ"] = int(torch.nonzero(d.reshape(-1))[0])
                    rows.append(row)
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    json.dump(rows, open(os.path.join(out, "front_pairs.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
