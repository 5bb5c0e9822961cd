"""What the first forwards of a layer cost on a GPU: Triton's JIT compiles (H200 probe, session 36).

Every Triton kernel is compiled on its first launch for each set of constexpr arguments (block
sizes, configs per token count, dtypes), then cached in memory and on disk (TRITON_CACHE_DIR,
default ~/.triton/cache). An engine that starts a fresh process pays that once per new shape
unless the disk cache is warm. This times, per preset and token count T, in eager mode:
`first` (the first forward at that T in this process), `second` (the next one) and what the first
cost beyond it. Run it twice with the same TRITON_CACHE_DIR: the first run compiles (cold cache),
the second loads the compiled kernels from disk (warm cache).

    D=$(mktemp -d); for run in cold warm; do TRITON_CACHE_DIR=$D OUT=./out \\
        python3 scripts/gpu_probe_compile_time.py --tag $run; done

Writes $OUT/compile_time_TAG.json and prints one line per (preset, T).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig
from dsv4_moe.testing import random_layer_weights

PRESETS = {"flash": MoEConfig.flash,
           "pro-tp8": lambda: MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank")}


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="flash,pro-tp8")
    ap.add_argument("--tokens", default="1,2,4,16,64,256,1024,4096")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this long")
    args = ap.parse_args()
    start = time.perf_counter()
    rows = []
    cache = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache (default)")
    print(f"== {args.tag}: TRITON_CACHE_DIR={cache}", flush=True)
    for name in args.presets.split(","):
        cfg = PRESETS[name]()
        t0 = time.perf_counter()
        layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=min(5, cfg.num_hidden_layers - 1), seed=0,
                                                        device="cuda"))
        torch.cuda.synchronize()
        build_s = time.perf_counter() - t0
        print(f"{name}: layer built in {build_s:.1f} s (random weights on the GPU, weight layouts)", flush=True)
        for t in [int(v) for v in args.tokens.split(",")]:
            if time.perf_counter() - start > args.budget_s:
                print(f"{name} T={t}: skipped (budget {args.budget_s:.0f} s spent)", flush=True)
                continue
            x = torch.randn(t, cfg.hidden_size, device="cuda").bfloat16()
            with torch.no_grad():
                first = _timed(lambda: layer(x))
                second = _timed(lambda: layer(x))
            row = dict(tag=args.tag, preset=name, T=t, first_s=first, second_s=second, extra_s=first - second)
            rows.append(row)
            print(f"{name} T={t}: first {first * 1e3:.1f} ms, second {second * 1e3:.2f} ms", flush=True)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"compile_time_{args.tag}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), commit=os.environ.get("DSV4_MOE_GIT_COMMIT"),
                       cache_dir=cache, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
