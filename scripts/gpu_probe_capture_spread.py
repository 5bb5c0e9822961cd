"""Why two CUDA-graph captures of one forward run at different speeds (H200 tool).

    OUT=./out python3 scripts/gpu_probe_capture_spread.py [--presets flash,pro-tp8] [--tokens 24,32]
        [--captures 6] [--weight-sets 4] [--overlap auto|on|off]

Session 21 found that separate captures of the identical DeepseekV4MoE forward replay at one of
two speeds, 4-11 % apart at some T (Flash T = 24 ~518 or ~560 us; Pro-TP8 T = 32), while one
graph replays within ~1 % (`gpu_profile_layer.py --twins`). Per preset and T this probe:

1. captures the forward `--captures` times into private memory pools (as every earlier tool
   did) and `--captures` times into one shared pool (`torch.cuda.graph(g, pool=first.pool())`:
   each capture finds the previous one's freed intermediates, so the graphs use the same
   intermediate addresses), the two kinds alternating;
2. times every graph (median of --reps replays, all graphs interleaved);
3. prints each graph's memory-pool segments (base address, size): the graphs differ in
   nothing else, so if the speed follows an address pattern this shows it;
4. profiles the fastest and the slowest graph (torch.profiler over --profile-replays replays
   each) and prints the kernels whose time differs most - which kernel is slow in the slow
   capture.

`--redirect I,J --offsets-mb ...` instead moves allocation I (then J) of every forward (the
index in the allocation list) into an arena at each offset, the rest captured into one shared
pool: which buffer's placement sets the speed.

What it found on the H200 (session 22, docs/bench/2026-11-30/session22/): at Flash T = 24 the
captures sharing a pool share a speed, the whole difference is the routed gate_up GEMM (270 vs
317 us), and only the placement of its [T, K] activation operand moves it - every padding row of
every program loaded token 0's row (fixed: mxfp4_grouped_gemm.A_PAD_ROWS).

Writes $OUT/probe_capture_spread[_TAG].txt and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_profile_layer import capture, graphs_us  # noqa: E402

from dsv4_moe import DeepseekV4MoE, MoEConfig  # noqa: E402
from dsv4_moe.testing import random_layer_weights  # noqa: E402


def pool_segments(g) -> list[tuple[int, int]]:
    """(address, size) of the memory segments of graph g's pool, sorted by address."""
    pid = tuple(g.pool())
    return sorted((s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
                  if tuple(s.get("segment_pool_id", ())) == pid)


class AllocLog:
    """Records (shape, dtype, data_ptr) of every torch.empty / zeros / empty_like the forward
    makes during a capture while active (the package's kernels allocate through these three)."""

    def __init__(self):
        self.log = []

    def __enter__(self):
        self.saved = {n: getattr(torch, n) for n in ("empty", "zeros", "empty_like")}
        for n, f in self.saved.items():
            setattr(torch, n, self._wrap(f))
        return self

    def _wrap(self, f):
        def inner(*a, **kw):
            t = f(*a, **kw)
            if t.is_cuda and torch.cuda.is_current_stream_capturing():  # not the warm-up forwards
                self.log.append((tuple(t.shape), str(t.dtype).replace("torch.", ""), t.data_ptr()))
            return t
        return inner

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch, n, f)


class Redirect(AllocLog):
    """Like AllocLog, and the `nth` allocation of every forward (period = allocations per
    forward) is served as a view of `arena` at byte offset `offset` instead of the pool."""

    def __init__(self, arena, offset, nth, period):
        super().__init__()
        self.arena, self.offset, self.nth, self.period = arena, offset, nth, period
        self.count = 0

    def _wrap(self, f):
        def inner(*a, **kw):
            t = f(*a, **kw)
            if t.is_cuda and torch.cuda.is_current_stream_capturing():
                if self.count % self.period == self.nth:
                    nbytes = t.numel() * t.element_size()
                    t = self.arena[self.offset:self.offset + nbytes].view(t.dtype).view(t.shape)
                self.count += 1
                self.log.append((tuple(t.shape), str(t.dtype).replace("torch.", ""), t.data_ptr()))
            return t
        return inner


def redirect_sweep(sets, x, ids, inner, nths, offsets_mb, reps, say):
    """Captures into one shared pool, each with one allocation of every forward moved into an
    arena at a given offset; the graphs' times against the unmoved capture."""
    with AllocLog() as log:
        base = capture(sets, x, ids, inner)
    period = len(log.log) // inner
    pool = base.pool()
    arena = torch.empty(int((max(offsets_mb) + 64) * 2**20), dtype=torch.uint8, device="cuda")
    graphs = {("base", 0): base}
    for nth in nths:
        shape, dt, _ = log.log[nth]
        for o in offsets_mb:
            with Redirect(arena, int(o * 2**20), nth, period):
                graphs[(nth, o)] = capture(sets, x, ids, inner, pool=pool)
    res = graphs_us(graphs, inner, reps)
    res2 = graphs_us(graphs, inner, reps)
    say(f"   redirect sweep ({period} allocations per forward; arena at {arena.data_ptr():#x}): base "
        f"{res[('base', 0)]:.1f}/{res2[('base', 0)]:.1f} us")
    for nth in nths:
        shape, dt, addr = log.log[nth]
        say(f"     allocation {nth} {list(shape)} {dt} (base at {addr:#x}), arena offset MiB: us")
        say("       " + "  ".join(f"{o:g}:{res[(nth, o)]:.1f}/{res2[(nth, o)]:.1f}" for o in offsets_mb))
    return {f"{k[0]}@{k[1]}": [res[k], res2[k]] for k in graphs}


def kernel_times(g, inner: int, replays: int) -> tuple[dict, float, list]:
    """Per-kernel device time per forward inside graph g (torch.profiler over `replays`
    replays), the mean span from the first kernel's start to the last one's end per replay, and
    the mean duration of the i-th kernel of a replay (name, us) in launch order."""
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()
    acc = defaultdict(float)
    evs = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            acc[ev.name[:100]] += us
            evs.append((ev.time_range.start, ev.time_range.end, ev.name[:60], us))
    evs.sort()
    span = (evs[-1][1] - evs[0][0]) / replays / inner if evs else float("nan")  # includes host gaps between replays
    per = len(evs) // replays
    seq = [(evs[i][2], sum(evs[r * per + i][3] for r in range(replays)) / replays) for i in range(per)]
    return {k: v / replays / inner for k, v in acc.items()}, span, seq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="flash,pro-tp8")
    ap.add_argument("--tokens", default="24,32")
    ap.add_argument("--captures", type=int, default=6, help="captures of each kind (private pools, one shared pool)")
    ap.add_argument("--weight-sets", type=int, default=4)
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile-replays", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-shared", action="store_true", help="private-pool captures only")
    ap.add_argument("--redirect", default="",
                    help="comma-separated allocation indices (within a forward, see the allocation list): "
                         "instead of the spread captures, capture with each moved to --offsets-mb in an arena")
    ap.add_argument("--offsets-mb", default="0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30")
    ap.add_argument("--show-allocs", type=int, default=60, help="allocations listed in the text output")
    args = ap.parse_args()
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    ov = {"auto": "auto", "on": True, "off": False}[args.overlap]
    cfgs = {"flash": MoEConfig.flash(),
            "pro-tp8": MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank")}
    lines, rows = [], []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    for name in args.presets.split(","):
        cfg = cfgs[name]
        sets = [DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=5, seed=s, device="cuda"))
                for s in range(args.weight_sets)]
        for lay in sets:
            lay.overlap_shared = ov
        inner = 10 if len(sets) == 1 else 3 * len(sets)
        for t in [int(v) for v in args.tokens.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
            ids = torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=gen)
            if args.redirect:
                say(f"== {name} T={t} overlap={args.overlap}, {len(sets)} weight sets, {inner} forwards per graph")
                rows.append(dict(preset=name, T=t, redirect=redirect_sweep(
                    sets, x, ids, inner, [int(v) for v in args.redirect.split(",")],
                    [float(v) for v in args.offsets_mb.split(",")], args.reps, say)))
                continue
            graphs, shared_pool = {}, None
            allocs = {}
            for j in range(args.captures):
                with AllocLog() as log:
                    graphs[("private", j)] = capture(sets, x, ids, inner)
                allocs[("private", j)] = log.log
                if args.no_shared:
                    continue
                with AllocLog() as log:
                    g = capture(sets, x, ids, inner, pool=shared_pool)
                allocs[("shared", j)] = log.log
                shared_pool = shared_pool or g.pool()
                graphs[("shared", j)] = g
            segs = {k: pool_segments(g) for k, g in graphs.items()}
            res = graphs_us(graphs, inner, args.reps)
            res2 = graphs_us(graphs, inner, args.reps)  # a second pass: is a graph's speed its own?
            say(f"== {name} T={t} overlap={args.overlap}, {len(sets)} weight sets, {inner} forwards per graph: "
                f"us per forward (pass 1 / pass 2)")
            for kind in ("private",) + (() if args.no_shared else ("shared",)):
                vals = [res[(kind, j)] for j in range(args.captures)]
                say(f"   {kind:8s}: " + "  ".join(f"{res[(kind, j)]:.1f}/{res2[(kind, j)]:.1f}"
                                                for j in range(args.captures))
                    + f"   max/min x{max(vals) / min(vals):.3f}")
            for k in graphs:
                sg = segs[k]
                say(f"   {k[0]:8s} {k[1]}: {res[k]:7.1f} us  segments "
                    + " ".join(f"{a:#x}+{s >> 10}K" for a, s in sg[:6]) + (" ..." if len(sg) > 6 else ""))
            fast = min(graphs, key=lambda k: res[k] + res2[k])
            slow = max(graphs, key=lambda k: res[k] + res2[k])
            kt_f, span_f, seq_f = kernel_times(graphs[fast], inner, args.profile_replays)
            kt_s, span_s, seq_s = kernel_times(graphs[slow], inner, args.profile_replays)
            say(f"   profiled: fastest {fast} ({res[fast]:.1f} us), slowest {slow} ({res[slow]:.1f} us); "
                f"kernel sums {sum(kt_f.values()):.1f} / {sum(kt_s.values()):.1f} us per forward, "
                f"spans {span_f:.1f} / {span_s:.1f}")
            names = sorted(set(kt_f) | set(kt_s), key=lambda n: -abs(kt_s.get(n, 0) - kt_f.get(n, 0)))
            for n in names[:12]:
                say(f"     {kt_f.get(n, 0):8.2f} {kt_s.get(n, 0):8.2f}  {kt_s.get(n, 0) - kt_f.get(n, 0):+7.2f}  {n}")
            if len(seq_f) == len(seq_s):
                say("   the kernels of one replay in launch order whose time differs most (fast / slow us):")
                order = sorted(range(len(seq_f)), key=lambda i: -abs(seq_s[i][1] - seq_f[i][1]))[:16]
                for i in sorted(order):
                    say(f"     #{i:4d} {seq_f[i][1]:8.2f} {seq_s[i][1]:8.2f}  {seq_f[i][0]}")
            # the forward's allocations (first capture pass): index, shape, and each graph's address
            n_al = min(len(v) for v in allocs.values())
            say(f"   allocations during capture: {n_al} (first {min(n_al, args.show_allocs)} listed; address per graph, "
                f"graphs ordered fastest first)")
            ordered = sorted(graphs, key=lambda k: res[k] + res2[k])
            say("     " + " ".join(f"{k[0][0]}{k[1]}:{res[k]:.0f}" for k in ordered))
            for i in range(min(n_al, args.show_allocs)):
                shape, dt, _ = allocs[ordered[0]][i]
                say(f"     [{i:3d}] {str(list(shape)):>14s} {dt:>8s} "
                    + " ".join(f"{allocs[k][i][2]:x}" for k in ordered))
            rows.append(dict(preset=name, T=t, overlap=args.overlap, weight_sets=len(sets),
                             allocs={f"{k[0]}{k[1]}": allocs[k] for k in graphs},
                             seq_fast=seq_f, seq_slow=seq_s,
                             us={f"{k[0]}{k[1]}": [res[k], res2[k]] for k in graphs},
                             segments={f"{k[0]}{k[1]}": segs[k] for k in graphs},
                             fastest=f"{fast[0]}{fast[1]}", slowest=f"{slow[0]}{slow[1]}",
                             kernels_fast=kt_f, kernels_slow=kt_s))
            del graphs
            torch.cuda.empty_cache()
    tag = "_" + args.tag if args.tag else ""
    with open(os.path.join(out, f"probe_capture_spread{tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"probe_capture_spread{tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
