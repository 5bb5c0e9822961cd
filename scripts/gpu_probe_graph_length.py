"""How the layer's time per forward depends on the length of the CUDA graph it is timed in (H200 tool).

    OUT=./out python3 scripts/gpu_probe_graph_length.py [--presets pro-tp8,flash] [--tokens 1,4]
        [--lengths 1,2,3,4,6] [--modes stream,inline] [--rounds 2] [--between-bytes N] [--set MODULE.ATTR=V]
        [--tag TAG]

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
dependence goes away in line, the graph's multi-stream structure is what moves it. Session 51 ran it:
flat within 0.3 µs in line, 2.8-7.1 µs from 16 to 96 forwards with the side stream (BENCHMARKS.md
session 51 item 2).

`--between-bytes N` (session 51's lead (a)): a model's graph has attention between its MoE layers, on
one stream. With N > 0 every forward is followed, on the main stream, by a device copy of N bytes (a
stand-in for that work), and the same number of copies alone is timed in a graph of the same length;
the table gives the forward's time net of the copy (with - alone), the JSON both.

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


def rotation_calls(layers: list, xs: list, ids: list, repeats: int, between=None) -> list:
    """The rotation's forwards (forward j: layer j % len(layers), input j % len(xs)) `repeats` times over,
    as zero-argument callables in graph order; with `between`, each call runs between() after its forward."""
    n = max(len(layers), len(xs))

    def call(L, x, i):
        out = L(x, i)
        if between is not None:
            between()
        return out

    return [(lambda L=layers[j % len(layers)], x=xs[j % len(xs)], i=ids[j % len(xs)]: call(L, x, i))
            for _ in range(repeats) for j in range(n)]


def copy_stand_in(nbytes: int, device: str = "cuda"):
    """(between, label): a device copy of `nbytes` bytes on the current stream (None, "" when 0)."""
    if nbytes < 0:
        raise SystemExit(f"--between-bytes={nbytes}: expected >= 0")
    if nbytes == 0:
        return None, ""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), f"net of a {nbytes / 1e6:g} MB copy after every forward"


def order(items: list, r: int) -> list:
    """Round r's order: the items rotated by r (each round starts one later)."""
    k = r % len(items)
    return items[k:] + items[:k]


def table(results: dict, n: int, lengths: list[int], note: str = "") -> list[str]:
    """results[(preset, T, mode)][k] = [us, ...] -> text lines: one row per case, one column per graph length."""
    head = f"{'case':<24}" + "".join(f"{k * n:>10}" for k in lengths)
    lines = [f"us per forward by forwards per graph (the rotation of {n} forwards repeated{note})", head]
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
    ap.add_argument("--between-bytes", type=int, default=0,
                    help="a device copy of N bytes on the main stream after every forward (0: none)")
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
    results, alone = {}, {}
    n = max(args.weight_sets, args.input_sets)
    between, note = copy_stand_in(args.between_bytes)
    if note:
        note = ", " + note
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
                        us = time_sets(rotation_calls(layers, xs, ids, k, between), device="cuda", graphs=True,
                                       chain=True, chain_min_calls=1).median_us
                        if between is not None:
                            cp = time_sets([between] * (k * n), device="cuda", graphs=True, chain=True,
                                           chain_min_calls=1).median_us
                            alone.setdefault(k * n, []).append(cp)
                            print(f"{name} T={t} {mode} round {r + 1}: {k * n} forwards + copies per graph {us:.1f} "
                                  f"us, copies alone {cp:.1f} us", flush=True)
                            us -= cp
                        by_k.setdefault(k, []).append(us)
                        print(f"{name} T={t} {mode} round {r + 1}: {k * n} forwards per graph {us:.1f} us",
                              flush=True)
            del layers
            torch.cuda.empty_cache()
    lines = table(results, n, lengths, note)
    if alone:
        lines.append("copy alone, us per call: " + ", ".join(f"{c} per graph {statistics.median(v):.1f}"
                                                             for c, v in sorted(alone.items())))
    print("\n".join(lines), flush=True)
    tag = f"_{args.tag}" if args.tag else ""
    with open(os.path.join(out, f"probe_graph_length{tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"probe_graph_length{tag}.json"), "w") as f:
        json.dump([dict(preset=p, T=t, mode=m, forwards_per_graph={k * n: v for k, v in by_k.items()}, sets=args.set,
                        between_bytes=args.between_bytes, copy_alone_us={c: v for c, v in alone.items()})
                   for (p, t, m), by_k in results.items()], f, indent=1)


if __name__ == "__main__":
    main()
