"""Where the time of one DeepseekV4MoE forward goes at decode (H200 tool).

    OUT=./out python3 scripts/gpu_profile_layer.py [--tokens 1,4,16] [--presets flash,pro-tp8]

Per preset and T: the CUDA-graph replay time of the layer with the shared expert in line
and overlapped on a side stream, each with programmatic dependent launch (PDL) released
early, at exit, and off (median of 50 replays of 10 forwards, the six variants
interleaved), and a per-kernel
table (torch.profiler over 20 eager forwards: calls, mean device time) so the kernel sum
can be set against the graph time (the difference is launch gaps and serialisation).
Writes $OUT/profile_layer.txt and .json (profile_layer_<tag>.* with --tag, so several calls in one
device run keep their files).

Session 21 added: `--weight-sets N` (N layers with different weights used in turn inside each
graph, so a forward does not find its weights in the L2 - the layer bench rotates the same
way), `--no-kernels` (graph times only), the policies' own pick timed beside the six fixed
variants, and `--twins N` (the pick captured N more times). What the twins showed on the H200
(docs/bench/2026-11-30/session21/profile_layer_twins4_23d9f88.txt): separate captures of the
same forward run at one of two speeds, 4-11 % apart at some T (Pro-TP8 T=32 284.9-316.0 us,
Flash T=24 516.8-561.1) and within 1.5 % at others (Pro-TP8 T=8, 24, 48). So an A/B here needs
its variants captured several times before a difference below ~10 % means anything.
    python3 scripts/gpu_profile_layer.py --presets pro-tp8,flash --tokens 8,24,32,48 --weight-sets 4 --no-kernels --twins 4
`--ab-captures N` captures each --ab value N times (interleaved) and reports the median
(session 21's --ab rows are single captures); an --ab run also checks each value's eager
output bitwise against the default's (a module-constant A/B of the same arithmetic must keep
the bits; since session 31 a value that does not is compared with the default's output at the
layer bench's tolerance and printed "NO (rel err E)" or "WRONG (...)": session 31's token-loop
logits GEMV read "NO" here, was taken for a new summation order, and was a wrong layer). Session
22 found the main cause of the spread (mxfp4_grouped_gemm.A_PAD_ROWS); a
~3 % spread remains at Flash T = 24.
`--set MODULE.ATTR=V` (repeatable, session 27) sets module constants before anything is built,
so one switch can be A/B'd with another held (e.g. the alignment's warps with its route limit).
Session 41: at Flash T = 4-6 an --ab of dsv4_moe.dispatch.PDL_MODE=exit,early here (3 captures each,
tight) put exit ahead by 0.4-2.6 us while the layer bench (--graph-chain, two alternating runs) put
early ahead by ~3 us at each T; at Pro-TP8 T = 9-16 the two agreed. Confirm a policy change of a few
per cent with the layer bench before taking it.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig, dispatch
from dsv4_moe.testing import random_layer_weights


def capture(layer, x, ids, inner=10, pool=None):
    """A graph of `inner` forwards; `layer` may be a list of layers (weight sets), used in turn, and
    so may `x` / `ids` (input sets: forward j takes x[j % len(x)], independently of its layer);
    `pool`: a graph memory pool to capture into (another graph's `.pool()`), else a private one."""
    layers = layer if isinstance(layer, list) else [layer]
    xs = x if isinstance(x, list) else [x]
    idss = ids if isinstance(ids, list) else [ids] * len(xs)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                for j in range(max(len(layers), len(xs))):
                    layers[j % len(layers)](xs[j % len(xs)], idss[j % len(xs)])
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            for j in range(inner):
                layers[j % len(layers)](xs[j % len(xs)], idss[j % len(xs)])
    g.replay()
    torch.cuda.synchronize()
    return g


def graphs_us(graphs: dict, inner=10, reps=50) -> dict:
    """Median replay time per forward of each graph, the graphs' replays interleaved."""
    ts = {k: [] for k in graphs}
    for _ in range(reps):
        for k, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts[k].append(a.elapsed_time(b) * 1000 / inner)
    return {k: sorted(v)[len(v) // 2] for k, v in ts.items()}


def kernel_table(layer, x, ids, n=20):
    """Per-kernel device time over n eager forwards, launched without PDL: a kernel launched
    early under PDL is timed from its start, its wait for the predecessor included."""
    from torch.profiler import ProfilerActivity, profile
    saved, dispatch.PDL_MODE = dispatch.PDL_MODE, "off"
    try:
        return _kernel_table(layer, x, ids, n, ProfilerActivity, profile)
    finally:
        dispatch.PDL_MODE = saved


def _kernel_table(layer, x, ids, n, ProfilerActivity, profile):
    with torch.no_grad():
        for _ in range(3):
            layer(x, ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                layer(x, ids)
            torch.cuda.synchronize()
    acc = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = ev.name[:110]
            acc[k][0] += 1
            acc[k][1] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
    return sorted(((k, c / n, us / n) for k, (c, us) in acc.items()), key=lambda r: -r[2])


def _same_or_err(got: torch.Tensor, want: torch.Tensor):
    """True when `got` is bitwise `want` (the default forward's output), else its rel-L2 error
    against it (the layer bench's metric, dsv4_moe.bench.sweep.rel_err)."""
    if torch.equal(got.view(torch.int16), want.view(torch.int16)):
        return True
    from dsv4_moe.bench.sweep import rel_err
    return rel_err(got, want)


def _same_text(b) -> str:
    """'yes', or 'NO (rel err E)' - 'WRONG' past the layer bench's tolerance: a value whose output
    is not the default's bits must be a correct layer before its time means anything (session 31:
    a token-loop logits GEMV read 'NO' here as a new summation order and was in fact wrong)."""
    if b is True:
        return "yes"
    from dsv4_moe.bench.run import OUR_TOLERANCE
    return f"NO (rel err {b:.1e})" if b <= OUR_TOLERANCE else f"WRONG (rel err {b:.2f} > {OUR_TOLERANCE:g})"


def _set(mod, attr, value):
    """mod.attr = value, and forget the memoised routed GEMM configs (they read module constants
    such as routed_experts.FLASH_SWAP64_MIN_ROWS, which are not part of their cache key) and
    the memoised dispatch choices (predicates read switches such as router.QUANT_IN_LOGITS)."""
    from dsv4_moe.kernels import routed_experts as rx

    setattr(mod, attr, value)
    rx._routed_configs.cache_clear()
    dispatch.clear_plan_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--presets", default="flash,pro-tp8")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--ab", default="",
                    help="module.ATTR=v1,v2,...: also time the default forward (PDL auto, overlap_shared "
                         "'auto') with the module constant set to each value, interleaved with the other "
                         "graphs (e.g. dsv4_moe.kernels._swiglu_quant.FILTERED_GROUPS_PER_PROGRAM=1,4,16)")
    ap.add_argument("--ab-captures", type=int, default=1,
                    help="capture each --ab value this many times (interleaved) and report the median: "
                         "separate captures of one forward can differ by up to ~11 %% (see --twins)")
    ap.add_argument("--ab-overlap", choices=("auto", "on", "off"), default="auto",
                    help="overlap_shared of the --ab forwards ('on' / 'off' force the side stream / in line)")
    ap.add_argument("--weight-sets", type=int, default=1,
                    help="layers with different weights used in turn inside each graph (N > 1: weights "
                         "not left in the L2 by the previous forward, as the layer bench's rotation)")
    ap.add_argument("--no-kernels", action="store_true", help="graph times only (no per-kernel table)")
    ap.add_argument("--set", action="append", default=[],
                    help="MODULE.ATTR=V (repeatable): module constants set before anything is built (as "
                         "bench_layer.py's --set), e.g. to A/B one switch with another one held")
    ap.add_argument("--twins", type=int, default=0,
                    help="capture the policies' pick N more times (separate graphs, same forward): the "
                         "spread between captures of one forward, the noise floor of every A/B here")
    args = ap.parse_args()
    if args.set:
        from dsv4_moe.bench.run import _apply_set  # the layer bench's parsing; memoised configs cleared
        for item in args.set:
            print(_apply_set(item), flush=True)
    ab_ov = {"auto": "auto", "on": True, "off": False}[args.ab_overlap]
    ab_mod = ab_attr = None
    ab_vals = []
    if args.ab:
        import importlib
        target, vals = args.ab.split("=", 1)
        mod_name, ab_attr = target.rsplit(".", 1)
        ab_mod = importlib.import_module(mod_name)
        kind = type(getattr(ab_mod, ab_attr))
        ab_vals = [v.strip().lower() not in ("0", "", "false", "off") if kind is bool else kind(v)
                   for v in vals.split(",")]  # bool("0") would be True
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    lines, rows = [], []
    cfgs = {"flash": MoEConfig.flash(),
            "pro-tp8": MoEConfig.pro().replace(moe_intermediate_size=384, name="pro-tp8-rank")}
    for name in args.presets.split(","):
        cfg = cfgs[name]
        w = random_layer_weights(cfg, layer_idx=5, seed=0, device="cuda")
        layer = DeepseekV4MoE(cfg, w)
        del w
        sets = [layer] + [DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=5, seed=s, device="cuda"))
                          for s in range(1, args.weight_sets)]
        inner = 10 if len(sets) == 1 else 3 * len(sets)

        def each(attr, value):
            for lay in sets:
                setattr(lay, attr, value)
        for t in [int(v) for v in args.tokens.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, device="cuda", generator=g).bfloat16()
            ids = torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=g)
            graphs = {}
            saved = dispatch.PDL_MODE
            for ov in (False, True):
                for mode in dispatch.PDL_MODES:
                    each("overlap_shared", ov)
                    dispatch.PDL_MODE = mode
                    graphs[(ov, mode)] = capture(sets, x, ids, inner)
            dispatch.PDL_MODE = saved
            each("overlap_shared", "auto")
            graphs[("auto", "auto")] = capture(sets, x, ids, inner)  # what the policies pick
            for j in range(args.twins):
                graphs[("twin", j)] = capture(sets, x, ids, inner)
            ab_same = []
            if ab_vals:
                each("overlap_shared", ab_ov)
                base = getattr(ab_mod, ab_attr)
                with torch.no_grad():
                    want = sets[0](x, ids)
                    for v in ab_vals:  # an A/B of the same arithmetic must give the same bits
                        _set(ab_mod, ab_attr, v)
                        got = sets[0](x, ids)
                        ab_same.append(_same_or_err(got, want))
                    _set(ab_mod, ab_attr, base)
                for j in range(args.ab_captures):  # the values interleaved, each captured ab_captures times
                    for i, v in enumerate(ab_vals):
                        _set(ab_mod, ab_attr, v)
                        graphs[("ab", i, j)] = capture(sets, x, ids, inner)
                _set(ab_mod, ab_attr, base)
            res = graphs_us(graphs, inner)
            del graphs
            layer.overlap_shared = False
            table = [] if args.no_kernels else kernel_table(layer, x, ids)
            each("overlap_shared", "auto")
            ov_auto = layer.shared_overlap(t)[0]
            pick = (ov_auto, dispatch.pdl_policy(t, ov_auto, layer.config.local_intermediate(layer.tp_size))[0])
            ksum = sum(r[2] for r in table)
            def trio(ov):
                return " / ".join(f"{res[(ov, m)]:.1f}" for m in dispatch.PDL_MODES)
            ab_caps = [[res[("ab", i, j)] for j in range(args.ab_captures)] for i in range(len(ab_vals))]
            ab_med = [sorted(c)[len(c) // 2] for c in ab_caps]
            ab = (f"; default forward with {ab_attr} = {', '.join(str(v) for v in ab_vals)}: "
                  + " / ".join(f"{m:.1f}" for m in ab_med)
                  + f" (output bitwise the default's: {' / '.join(_same_text(b) for b in ab_same)})"
                  + (f" (median of {args.ab_captures} captures each: "
                     + "; ".join(" / ".join(f"{u:.1f}" for u in c) for c in ab_caps) + ")"
                     if args.ab_captures > 1 else "")) if ab_vals else ""
            best = min((k for k in res if k[0] in (False, True)), key=lambda k: res[k])
            caps = [res[("auto", "auto")]] + [res[("twin", j)] for j in range(args.twins)]
            twins = (f"; {len(caps)} captures of the pick: {' / '.join(f'{v:.1f}' for v in caps)} "
                     f"(max / min x{max(caps) / min(caps):.3f})") if args.twins else ""
            lines.append(f"== {name} T={t}: graph us, PDL {' / '.join(dispatch.PDL_MODES)}: in line {trio(False)}, "
                         f"overlapped {trio(True)}; policies pick {'overlapped' if pick[0] else 'in line'} "
                         f"{pick[1]}: {res[('auto', 'auto')]:.1f} (best {'overlapped' if best[0] else 'in line'} "
                         f"{best[1]} {res[best]:.1f}, x{res[('auto', 'auto')] / res[best]:.3f}); "
                         f"{len(sets)} weight set(s); kernel sum (in line, eager, PDL off) {ksum:.1f} us over "
                         f"{sum(r[1] for r in table):.0f} launches{twins}{ab}")
            for k, c, us in table:
                lines.append(f"   {us:8.2f} us  x{c:4.1f}  {k}")
            rows.append(dict(preset=name, T=t, pdl=dispatch.has_pdl(layer.device)[1], kernel_sum_us=ksum, kernels=table,
                             weight_sets=len(sets), graph_auto_us=res[("auto", "auto")], graph_auto_captures_us=caps,
                             auto_pick=dict(overlap=pick[0], pdl=pick[1]),
                             **{f"graph_{'overlap' if k[0] else 'inline'}_{k[1]}_us": v for k, v in res.items()
                                if k[0] in (False, True)},  # ("ab", i, j) keys have three members
                             **{f"graph_default_{ab_attr}_{v}_us": m for v, m in zip(ab_vals, ab_med)},
                             **{f"default_{ab_attr}_{v}_same_bits": b is True for v, b in zip(ab_vals, ab_same)},
                             **{f"default_{ab_attr}_{v}_rel_err_vs_default": 0.0 if b is True else b
                                for v, b in zip(ab_vals, ab_same)},
                             **{f"graph_default_{ab_attr}_{v}_captures_us": c for v, c in zip(ab_vals, ab_caps)}))
            print("\n".join(lines[-len(table) - 1:]), flush=True)
    with open(os.path.join(out, f"profile_layer{'_' + args.tag if args.tag else ''}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"profile_layer{'_' + args.tag if args.tag else ''}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
