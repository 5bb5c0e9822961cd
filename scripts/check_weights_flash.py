"""Full-size V4-Flash check of the weights package (for the H200 box; CPU works too, slowly).

    python scripts/check_weights_flash.py [--layers 2,3] [--workdir /tmp/dsv4_flash_ckpt]

Writes a random V4-Flash checkpoint (layer 2 is a hash layer, layer 3 is not; ~3.4 GB
per layer) to --workdir (NOT under $OUT: it must not travel back), then loads layer 3
whole, as TP8 rank 7 and as EP8 rank 3, on CUDA when present, checks shapes and that
the TP/EP pieces equal slices of the whole, and that each load opened only its layer's
shard. Prints one row per step and writes $OUT/weights_flash.json (OUT defaults to ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch

from dsv4_moe.config import MoEConfig
from dsv4_moe.weights import load_layer_weights, write_checkpoint
from dsv4_moe.weights import reader as reader_mod
from dsv4_moe.weights.cli import parse_layers


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=parse_layers, default=[2, 3])
    ap.add_argument("--workdir", default="/tmp/dsv4_flash_ckpt")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = MoEConfig.flash()
    rows, result = [], {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads()}

    def row(step, seconds, extra=""):
        rows.append({"step": step, "s": round(seconds, 2), "note": extra})
        print(f"{step:<28} | {seconds:8.2f} s | {extra}", flush=True)

    t = time.perf_counter()
    ckpt = write_checkpoint(args.workdir, cfg, layers=args.layers, seed=0, overwrite=True)
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    row("write", time.perf_counter() - t, f"{len(args.layers)} layers, {size / 1e9:.2f} GB")

    opened = []
    real_init = reader_mod.CheckpointReader.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        opened.append(self.opened_files)

    reader_mod.CheckpointReader.__init__ = spy
    layer = args.layers[-1]
    t = time.perf_counter()
    _, full = load_layer_weights(ckpt, layer, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    gb = sum(x.numel() * x.element_size() for c in (full.routed, full.shared)
             for x in (c.gate_up, c.gate_up_scale, c.down, c.down_scale)) / 1e9
    dt = time.perf_counter() - t
    row(f"load layer {layer} full", dt, f"{gb:.2f} GB, {gb / dt:.2f} GB/s, opened {opened[-1]}")
    assert len(opened[-1]) == 1, opened[-1]
    assert full.routed.gate_up.shape == (256, 4096, 2048) and full.shared.gate_up.shape == (4096, 4096)

    t = time.perf_counter()
    _, tp = load_layer_weights(ckpt, layer, device=device, tp_rank=7, tp_size=8)
    row("load TP8 rank 7", time.perf_counter() - t, f"I/rank={tp.routed.intermediate}")
    i, n = 2048, 256
    assert torch.equal(tp.routed.gate_up[:, :n], full.routed.gate_up[:, 7 * n:8 * n])
    assert torch.equal(tp.routed.gate_up[:, n:], full.routed.gate_up[:, i + 7 * n:i + 8 * n])
    assert torch.equal(tp.routed.down, full.routed.down[:, :, 7 * n // 2:])
    assert torch.equal(tp.routed.down_scale.view(torch.uint8), full.routed.down_scale.view(torch.uint8)[:, :, 7 * n // 32:])
    assert torch.equal(tp.shared.down.view(torch.uint8), full.shared.down.view(torch.uint8)[:, 7 * n:])

    t = time.perf_counter()
    _, ep = load_layer_weights(ckpt, layer, device=device, ep_rank=3, ep_size=8)
    row("load EP8 rank 3", time.perf_counter() - t, f"experts {ep.routed.first_expert}..+{ep.routed.num_local}")
    assert torch.equal(ep.routed.gate_up, full.routed.gate_up[96:128])
    assert all(len(o) == 1 for o in opened), opened

    result["rows"] = rows
    with open(os.path.join(out_dir, "weights_flash.json"), "w") as f:
        json.dump(result, f, indent=2)
    if not args.keep:
        shutil.rmtree(ckpt)
    print("OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
