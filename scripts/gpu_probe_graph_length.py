"""How the layer's time per forward depends on the length of the CUDA graph it is timed in (H200 tool).

    OUT=./out python3 scripts/gpu_probe_graph_length.py [--presets pro-tp8,flash] [--tokens 1,4]
        [--lengths 1,2,3,4,6] [--modes stream,inline] [--rounds 2] [--set MODULE.ATTR=V] [--tag TAG]

Session 50 found that the layer bench's figure moves with the number of forwards its chained graph
holds: the same layers read up to 3.5 µs per forward apart at T = 1 between 16 and 48 forwards, in
either direction depending on the variant (BENCHMARKS.md session 50; DESIGN.md, leads left by session
50, (c)). This probe maps it. Per preset and T it builds the layer bench's rotation
(`gpu_timeline_layer.build_sets(..., "bench")`: `--weight-sets` router + shared copies over one set of
routed experts, `--input-sets` inputs in turn) and times, with the bench's own harness
(`dsv4_moe.bench.timing.time_sets`, exactly the calls given: `chain_min_calls=1`), one chained graph
of the rotation repeated k times for every k in `--lengths`, the lengths alternating over `--rounds`.

Modes: "stream" builds the layers as the policy does (the shared expert on its side stream where the
policy puts it); "inline" builds them with `overlap_shared=False`, one stream. If the length
dependence goes away in line, the graph's multi-stream structure is what moves it.

Writes $OUT/probe_graph_length[_TAG].txt and .json: µs per forward by graph length (forwards per graph).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timeline_layer import _apply_sets, build_sets, preset_config  # noqa: E402

MODES = {"stream": "auto", "inline": False}


def parse_ints(text: str, flag: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: positive, distinct, in the order given; anything else is a SystemExit naming the flag."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag}={text!r}: expected comma-separated positive ints") from None
    if not vals or min(vals) < 1 or len(set(vals)) != len(vals):
        raise SystemExit(f"{flag}={text!r}: expected comma-separated distinct positive ints")
    return vals


def rotation_calls(layers: list, xs: list, ids: list, repeats: int) -> list:
    """The rotation's forwards (forward j: layer j % len(layers), input j % len(xs)) `repeats` times over,
    as zero-argument callables in graph order."""
    n = max(len(layers), len(xs))
    return [(lambda L=layers[j % len(layers)], x=xs[j % len(xs)], i=ids[j % len(xs)]: L(x, i))
            for _ in range(repeats) for j in range(n)]


def order(items: list, r: int) -> list:
    """Round r's order: the items rotated by r (each round starts one later)."""
    k = r % len(items)
    return items[k:] + items[:k]


def table(results: dict, n: int, lengths: list[int]) -> list[str]:
    """results[(preset, T, mode)][k] = [us, ...] -> text lines: one row per case, one column per graph length."""
    head = f"{'case':<24}" + "".join(f"{k * n:>10}" for k in lengths)
    lines = [f"us per forward by forwards per graph (the rotation of {n} forwards repeated)", head]
    for (preset, t, mode), by_k in results.items():
        cells = "".join(f"{statistics.median(by_k[k]):>10.1f}" if by_k.get(k) else f"{'-':>10}" for k in lengths)
        lines.append(f"{f'{preset} T={t} {mode}':<24}" + cells)
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="pro-tp8,flash")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--lengths", default="1,2,3,4,6", help="repeats of the rotation per graph")
    ap.add_argument("--modes", default="stream,inline", help=f"any of {','.join(MODES)}")
    ap.add_argument("--weight-sets", type=int, default=16)
    ap.add_argument("--input-sets", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="MODULE.ATTR=V, applied before the layers are built")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    lengths = parse_ints(args.lengths, "--lengths")
    tokens = parse_ints(args.tokens, "--tokens")
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes={args.modes!r}: expected any of {','.join(MODES)}")
    for flag, v in (("--weight-sets", args.weight_sets), ("--input-sets", args.input_sets), ("--rounds", args.rounds)):
        if v < 1:
            raise SystemExit(f"{flag}={v}: expected >= 1")
    cfgs = {name: preset_config(name) for name in args.presets.split(",")}
    _apply_sets(args.set)
    from dsv4_moe.bench.timing import time_sets

    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    results = {}
    n = max(args.weight_sets, args.input_sets)
    for name, cfg in cfgs.items():
        for mode in modes:
            layers = build_sets(cfg, "bench", args.weight_sets, overlap_shared=MODES[mode])
            for t in tokens:
                gen = torch.Generator(device="cuda").manual_seed(t)
                xs = [torch.randn(t, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
                      for _ in range(args.input_sets)]
                ids = [torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=gen)
                       for _ in range(args.input_sets)]
                by_k = results.setdefault((name, t, mode), {})
                for r in range(args.rounds):
                    for k in order(lengths, r):
                        us = time_sets(rotation_calls(layers, xs, ids, k), device="cuda", graphs=True, chain=True,
                                       chain_min_calls=1).median_us
                        by_k.setdefault(k, []).append(us)
                        print(f"{name} T={t} {mode} round {r + 1}: {k * n} forwards per graph {us:.1f} us",
                              flush=True)
            del layers
            torch.cuda.empty_cache()
    lines = table(results, n, lengths)
    print("\n".join(lines), flush=True)
    tag = f"_{args.tag}" if args.tag else ""
    with open(os.path.join(out, f"probe_graph_length{tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"probe_graph_length{tag}.json"), "w") as f:
        json.dump([dict(preset=p, T=t, mode=m, forwards_per_graph={k * n: v for k, v in by_k.items()}, sets=args.set)
                   for (p, t, m), by_k in results.items()], f, indent=1)


if __name__ == "__main__":
    main()
