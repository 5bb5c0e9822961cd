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
"""
from __future__ import annotations

import argparse
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


def timeline(sets, x, ids, inner: int, replays: int):
    from torch.profiler import ProfilerActivity, profile
    from gpu_profile_layer import capture  # scripts/ is on sys.path when this script runs
    g = capture(sets, x, ids, inner)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    evs = [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
           if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
           and not e.name().startswith(("Memcpy", "Memset"))]
    return forward_table(evs, inner, replays)


def forward_table(evs, inner: int, replays: int):
    """Kernel events [(name, start_ns, end_ns)] of `replays` replays of a graph of `inner`
    forwards -> ((table, summary), "") or (None, why). Kernels whose count is not a whole
    number per forward (e.g. one launch per replay) are set aside first (session 27: Pro-TP8
    T = 16 had 2900 events for 240 forwards). The rest, sorted by start, is cut into forwards
    of equal kernel counts; table: [((short name, occurrence in the forward), {start, end,
    dur} medians in us from the forward's first start)] in the order of the median ends;
    summary: kernels per forward, the median span, the median period (first start to the next
    forward's first start, inside one replay) and the set-aside kernels with their counts."""
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
    summary = dict(kernels_per_forward=per, span_us=med(spans), period_us=med(periods) if periods else None,
                   set_aside=aside)
    return (table, summary), ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="pro-tp8")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--weight-sets", type=int, default=4)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], help="MODULE.ATTR=V, applied before the layers are built")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    _apply_sets(args.set)
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    cfgs = {"flash": MoEConfig.flash(),
            "pro-tp8": MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank")}
    lines, js = [], []
    for name in args.presets.split(","):
        cfg = cfgs[name]
        sets = [DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=5, seed=s, device="cuda"))
                for s in range(args.weight_sets)]
        inner = 3 * len(sets)
        for t in [int(v) for v in args.tokens.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
            ids = torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=gen)
            res, why = timeline(sets, x, ids, inner, args.replays)
            if res is None:
                lines.append(f"== {name} T={t}: {why}")
                print(lines[-1], flush=True)
                continue
            table, s = res
            head = (f"== {name} T={t} ({args.weight_sets} weight sets, {args.set or 'defaults'}): span "
                    f"{s['span_us']:.1f} us, period {s['period_us']:.1f} us, {s['kernels_per_forward']} kernels"
                    + (f"; set aside (not once per forward): {s['set_aside']}" if s["set_aside"] else ""))
            lines.append(head)
            lines.append(f"   {'start':>7} {'end':>7} {'dur':>6} {'+end':>6}  kernel (in order of their end)")
            prev = 0.0
            for (kname, occ), r in table:
                lines.append(f"   {r['start']:7.2f} {r['end']:7.2f} {r['dur']:6.2f} {r['end'] - prev:6.2f}  "
                             f"{kname}{f' #{occ + 1}' if occ else ''}")
                prev = r["end"]
            print("\n".join(lines[-len(table) - 2:]), flush=True)
            js.append(dict(preset=name, T=t, sets=args.set, **s,
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
