"""The device timeline of one DeepseekV4MoE forward inside a CUDA graph (H200 tool).

    OUT=./out python3 scripts/gpu_timeline_layer.py [--presets pro-tp8] [--tokens 1,16] [--weight-sets 4]

`gpu_profile_layer.py` times the graph as a whole and the kernels one by one in eager mode;
neither shows where a replayed forward waits. This captures what the layer bench times
(the policies' own picks: overlap, PDL; `--weight-sets` layers used in turn so the weights
are not in the L2), replays it under torch.profiler (CUPTI records every kernel node of a
graph with its stream and device start / end), cuts the kernel stream into forwards and
prints, per kernel of the forward (medians over the replayed forwards, in the order of their
ends): its start and end relative to the forward's first kernel, its duration and how much
later than the previous kernel it ends. Under programmatic dependent launch a kernel starts
early and waits for its predecessor, so its duration includes that wait: read the ends. The
head line per case: the forward's span (first start to last end) and the period (start to
the next forward's start inside one replay: what a forward costs in a model's graph).

`--set MODULE.ATTR=V` (repeatable) sets module constants first (as bench_layer.py does).
Writes $OUT/timeline_layer[_TAG].txt and .json.

Session 49 added two things, because this tool and the layer bench had disagreed five times on the sign
of a 1-3 µs change (BENCHMARKS.md session 49 item 3):
- `events` in the head line: the same graph's time per forward from CUDA events around 20 replays,
  without the profiler. If it differs from `period`, the profiler (CUPTI) changes what it measures.
- `--rotation bench`: the layer bench's rotation instead of `--weight-sets` whole layers. That is one
  set of routed experts shared by `--weight-sets` router + shared copies (dsv4_moe.bench.sweep.weight_copies),
  with `--input-sets` different x taken in turn, so consecutive forwards route differently.
  The default, `layers`, gives every forward of a layer the same x. If one rotation agrees with the
  bench and the other does not, the rotation is the cause.
Session 50 found neither was (BENCHMARKS.md session 50), so the head line now also times the same
layers and inputs with the layer bench's own harness (`dsv4_moe.bench.timing.time_sets`, one chained
graph): if that agrees with `events`, the two tools differ in what they build, not in how they time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from collections import defaultdict

import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig
from dsv4_moe.testing import random_layer_weights


def _short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:48]


def _apply_sets(sets: list[str]) -> None:
    from dsv4_moe.bench.run import _apply_set  # the layer bench's --set (same parsing, memo cleared)
    for item in sets:
        print(_apply_set(item), flush=True)


def events_period_us(g, inner: int, replays: int, repeats: int = 3) -> float:
    """The graph's time per forward from CUDA events around `replays` replays (no profiler):
    the median over `repeats`."""
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / (replays * inner))
    return statistics.median(ts)


def bench_timing_us(sets, x, ids, repeats=(1, 4)) -> dict:
    """The same forwards timed by the layer bench's own harness (dsv4_moe.bench.timing.time_sets,
    one chained graph, as `bench_layer.py --graph-chain` does), with the rotation's forwards once
    (the bench's graph before session 50) and `repeats` times over in one graph (4 x 16: the bench's
    graph since): {repeat: us per forward}. If the time
    per forward moves with the graph's length, the bench's figure depends on it (session 50: in either
    direction, by up to 3.5 us at T = 1)."""
    from dsv4_moe.bench.timing import time_sets
    layers = sets if isinstance(sets, list) else [sets]
    xs = x if isinstance(x, list) else [x]
    idss = ids if isinstance(ids, list) else [ids] * len(xs)
    n = max(len(layers), len(xs))
    out = {}
    for rep in repeats:
        fns = [(lambda L=layers[j % len(layers)], xx=xs[j % len(xs)], ii=idss[j % len(xs)]: L(xx, ii))
               for j in range(n * rep)]
        # chain_min_calls=1: exactly these calls in the graph (the bench itself now repeats to >= 64)
        out[rep] = time_sets(fns, device="cuda", graphs=True, chain=True, max_inner=200, chain_min_calls=1).median_us
    return out


def timeline(sets, x, ids, inner: int, replays: int):
    """((table, summary), "") or (None, why) for a graph of `inner` forwards over `sets` (x / ids
    may be lists: input sets taken in turn); summary["events_us"] is the same graph timed by events."""
    from torch.profiler import ProfilerActivity, profile
    from gpu_profile_layer import capture  # scripts/ is on sys.path when this script runs
    g = capture(sets, x, ids, inner)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    events_us = events_period_us(g, inner, replays)
    bench_us = bench_timing_us(sets, x, ids)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    evs = [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
           if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
           and not e.name().startswith(("Memcpy", "Memset"))]
    res, why = forward_table(evs, inner, replays)
    if res is not None:
        res[1]["events_us"] = events_us
        res[1]["bench_us"] = bench_us
    return res, why


def forward_table(evs, inner: int, replays: int):
    """Kernel events [(name, start_ns, end_ns)] of `replays` replays of a graph of `inner`
    forwards -> ((table, summary), "") or (None, why). Kernels whose count is not a whole
    number per forward (e.g. one launch per replay) are set aside first (session 27: Pro-TP8
    T = 16 had 2900 events for 240 forwards). The rest, sorted by start, is cut into forwards
    of equal kernel counts; table: [((short name, occurrence in the forward), {start, end,
    dur} medians in us from the forward's first start)] in the order of the median ends;
    summary: kernels per forward, the median span, the median period (first start to the next
    forward's first start, inside one replay), the median idle gap between replays (the last end of
    one replay to the first start of the next) and the set-aside kernels with their counts."""
    forwards = replays * inner
    counts = defaultdict(int)
    for e in evs:
        counts[_short(e[0])] += 1
    aside = {k: c for k, c in sorted(counts.items()) if c % forwards}
    evs = sorted((e for e in evs if _short(e[0]) not in aside), key=lambda e: e[1])
    n = len(evs)
    per = n // forwards if n else 0
    if per == 0 or n != per * forwards:
        return None, (f"{n} kernel events for {replays} x {inner} forwards: not a whole number per forward"
                      f" (set aside: {aside or 'none'})")
    rows = defaultdict(lambda: defaultdict(list))
    spans, fwd_starts = [], []
    for f in range(replays * inner):
        chunk = evs[f * per:(f + 1) * per]
        t0 = chunk[0][1]
        fwd_starts.append(t0)
        seen = defaultdict(int)
        for name, start, end in chunk:
            name = _short(name)
            r = rows[(name, seen[name])]
            seen[name] += 1
            r["start"].append((start - t0) / 1e3)
            r["end"].append((end - t0) / 1e3)
            r["dur"].append((end - start) / 1e3)
        spans.append((max(e[2] for e in chunk) - t0) / 1e3)
    periods = [(fwd_starts[f + 1] - fwd_starts[f]) / 1e3 for f in range(len(fwd_starts) - 1)
               if (f + 1) % inner]  # within one replay only
    med = statistics.median
    table = sorted(((k, {m: med(v) for m, v in r.items()}) for k, r in rows.items()), key=lambda kv: kv[1]["end"])
    # the idle time between one replay's last kernel end and the next replay's first start (what
    # `events` and the bench pay per replay, not per forward; session 50)
    gaps = [(fwd_starts[r * inner] - max(e[2] for e in evs[(r * inner - 1) * per:r * inner * per])) / 1e3
            for r in range(1, replays)]
    summary = dict(kernels_per_forward=per, span_us=med(spans), period_us=med(periods) if periods else None,
                   replay_gap_us=med(gaps) if gaps else None, set_aside=aside)
    return (table, summary), ""


PRESETS = ("flash", "pro-tp8")


def preset_config(name: str) -> MoEConfig:
    """The configs these tools time: "flash", or "pro-tp8" (V4-Pro with its per-rank width at TP8, 384)."""
    if name == "flash":
        return MoEConfig.flash()
    if name == "pro-tp8":
        return MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank")
    raise SystemExit(f"--presets: unknown preset {name!r}; expected any of {','.join(PRESETS)}")


def build_sets(cfg, rotation: str, n: int, device: str = "cuda", overlap_shared="auto") -> list:
    """The layers a graph's forwards take in turn: n whole layers (rotation "layers", seeds 0..n-1), or
    the layer bench's n layers over one set of routed experts in the layout the layer picks, each with
    its own router and shared tensors (rotation "bench"); `overlap_shared` as DeepseekV4MoE's."""
    if rotation == "layers":
        return [DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=5, seed=s, device=device),
                              overlap_shared=overlap_shared) for s in range(n)]
    from dsv4_moe.bench.sweep import weight_copies
    from dsv4_moe.layers import choose_routed_layout
    w = random_layer_weights(cfg, layer_idx=5, seed=0, device=device)
    layout, _ = choose_routed_layout(w.routed, "auto")
    w = dataclasses.replace(w, routed=w.routed.with_layout(layout))
    return [DeepseekV4MoE(cfg, wc, overlap_shared=overlap_shared) for wc in weight_copies(w, n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="pro-tp8")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--weight-sets", type=int, default=4)
    ap.add_argument("--rotation", choices=("layers", "bench"), default="layers",
                    help="layers: --weight-sets whole layers, one x; bench: the layer bench's rotation (one routed "
                         "set, --weight-sets router + shared copies, --input-sets x in turn)")
    ap.add_argument("--input-sets", type=int, default=4, help="x sets taken in turn (--rotation bench)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], help="MODULE.ATTR=V, applied before the layers are built")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.weight_sets < 1 or args.input_sets < 1:
        raise SystemExit(f"--weight-sets={args.weight_sets}, --input-sets={args.input_sets}: expected >= 1")
    _apply_sets(args.set)
    cfgs = {name: preset_config(name) for name in args.presets.split(",")}
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    lines, js = [], []
    for name, cfg in cfgs.items():
        sets = build_sets(cfg, args.rotation, args.weight_sets)
        inner = 3 * len(sets)
        n_x = args.input_sets if args.rotation == "bench" else 1
        for t in [int(v) for v in args.tokens.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(t)
            xs = [torch.randn(t, cfg.hidden_size, device="cuda", generator=gen).bfloat16() for _ in range(n_x)]
            ids = [torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=gen) for _ in range(n_x)]
            res, why = timeline(sets, xs, ids, inner, args.replays)
            if res is None:
                lines.append(f"== {name} T={t}: {why}")
                print(lines[-1], flush=True)
                continue
            table, s = res
            rot = (f"{args.weight_sets} weight sets" if args.rotation == "layers" else
                   f"bench rotation: {args.weight_sets} router + shared copies, {n_x} x sets")
            head = (f"== {name} T={t} ({rot}, {args.set or 'defaults'}): span {s['span_us']:.1f} us, "
                    f"period {s['period_us']:.1f} us, gap between replays {s['replay_gap_us']:.1f} us (events, no "
                    f"profiler: {s['events_us']:.1f} us per forward over {inner}-forward replays; the bench's "
                    f"harness on the same layers, per forward: "
                    + ", ".join(f"{v:.1f} in {k * len(sets)}-forward graphs" for k, v in s["bench_us"].items())
                    + "), "
                    f"{s['kernels_per_forward']} kernels"
                    + (f"; set aside (not once per forward): {s['set_aside']}" if s["set_aside"] else ""))
            lines.append(head)
            lines.append(f"   {'start':>7} {'end':>7} {'dur':>6} {'+end':>6}  kernel (in order of their end)")
            prev = 0.0
            for (kname, occ), r in table:
                lines.append(f"   {r['start']:7.2f} {r['end']:7.2f} {r['dur']:6.2f} {r['end'] - prev:6.2f}  "
                             f"{kname}{f' #{occ + 1}' if occ else ''}")
                prev = r["end"]
            print("\n".join(lines[-len(table) - 2:]), flush=True)
            js.append(dict(preset=name, T=t, sets=args.set, rotation=args.rotation, weight_sets=args.weight_sets,
                           input_sets=n_x, **s,
                           kernels=[dict(name=k[0], occurrence=k[1], **r) for k, r in table]))
        del sets
        torch.cuda.empty_cache()
    tag = f"_{args.tag}" if args.tag else ""
    with open(os.path.join(out, f"timeline_layer{tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"timeline_layer{tag}.json"), "w") as f:
        json.dump(js, f, indent=1)


if __name__ == "__main__":
    main()
