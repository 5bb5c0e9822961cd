"""How far apart a checkpoint's MXFP4 scales lie inside each 128-wide K block (CPU, no GPU needed).

    python scripts/scale_spread.py CHECKPOINT_DIR [--layer 3] [--ep-size 8 --ep-rank 0]

DESIGN.md's session-48 lead (c) prices an exact W4A8 route through the integer tensor cores whose
fast form folds each 32-group's e8m0 scale into integer weights relative to the smallest scale of
its row's 128-block: exact while 12 * 2^spread fits the weight type - a spread of at most 3 binades
for s8 (96), 4 for u8 (192). This script says how often a real layer allows it, before any GPU time.

For every routed expert of the layer (this EP rank's, read by the package's loader, so only that
layer's tensors), every output row of gate_up (w1 | w3) and down, and every 128-wide K block: the
spread = largest - smallest scale byte over the block's groups that hold a nonzero code (a group of
zeros contributes nothing at any scale). Prints, per GEMM, the share of row-blocks at each spread
and the shares the s8 / u8 folds would cover; `--json PATH` writes the counts.
A V4-Pro layer is ~13 GB of routed bytes on the CPU: `--ep-size 8` reads a 48-expert slice.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dsv4_moe.weights.loader import load_layer_weights

MAX_BIN = 8   # spreads of 8 binades or more share the last bin


def block_spreads(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [E, N, K/2] uint8 ("nk" order), scales [E, N, K/32] e8m0 -> the spread of every
    (expert, row, 128-block) as int64 [E, N, ceil(K/128)]; -1 where the block holds no nonzero code."""
    e, n, g = scales.shape
    s = scales.view(torch.uint8).to(torch.int16)
    nonzero = (codes.view(e, n, g, 16) & 0x77).ne(0).any(-1)        # the group holds a nonzero magnitude
    pad = -g % 4
    if pad:  # K not whole 128-blocks: the last block has fewer groups
        s = torch.nn.functional.pad(s, (0, pad))
        nonzero = torch.nn.functional.pad(nonzero, (0, pad))
    s = s.view(e, n, -1, 4)
    nonzero = nonzero.view(e, n, -1, 4)
    hi = torch.where(nonzero, s, torch.full_like(s, -1)).amax(-1)
    lo = torch.where(nonzero, s, torch.full_like(s, 256)).amin(-1)
    return torch.where(nonzero.any(-1), hi - lo, torch.full_like(hi, -1)).long()


def spread_counts(spreads: torch.Tensor) -> dict:
    """{"blocks", "empty", "by_spread": [count of spread 0, 1, ..., >= MAX_BIN]} of block_spreads' output."""
    valid = spreads[spreads >= 0]
    by = torch.bincount(valid.clamp(max=MAX_BIN), minlength=MAX_BIN + 1)
    return {"blocks": int(spreads.numel()), "empty": int((spreads < 0).sum()), "by_spread": by.tolist()}


def _report(name: str, c: dict) -> str:
    n = sum(c["by_spread"])
    share = [v / n if n else 0.0 for v in c["by_spread"]]
    bins = " ".join(f"{i}{'+' if i == MAX_BIN else ''}:{100 * v:.2f}%" for i, v in enumerate(share))
    return (f"{name:8s} {c['blocks']} row-blocks ({c['empty']} all zero); spread {bins}; "
            f"s8 fold (<= 3) {100 * sum(share[:4]):.2f}%, u8 fold (<= 4) {100 * sum(share[:5]):.2f}%")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--layer", type=int, default=None, help="decoder layer (default: the first non-hash layer)")
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--ep-rank", type=int, default=0)
    p.add_argument("--json", default=None, help="write the counts here")
    a = p.parse_args(argv)
    from dsv4_moe import MoEConfig

    layer = a.layer if a.layer is not None else MoEConfig.from_pretrained(a.checkpoint).num_hash_layers
    cfg, w = load_layer_weights(a.checkpoint, layer, ep_rank=a.ep_rank, ep_size=a.ep_size, progress=None)
    r = w.routed.with_layout("nk")
    out = {"checkpoint": str(a.checkpoint), "layer": layer, "experts": r.num_local,
           "gate_up": spread_counts(block_spreads(r.gate_up, r.gate_up_scale)),
           "down": spread_counts(block_spreads(r.down, r.down_scale))}
    print(f"layer {layer}: {r.num_local} routed experts (EP rank {a.ep_rank} of {a.ep_size}), H {cfg.hidden_size}, "
          f"I {cfg.moe_intermediate_size}")
    for name in ("gate_up", "down"):
        print(_report(name, out[name]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
