"""Markdown tables for BENCHMARKS.md from `python -m dsv4_moe bench --json` files.

    python scripts/bench_tables.py docs/bench/2026-11-29/bench_flash.json [...]
    python scripts/bench_tables.py small_T.json+large_T.json     # one table from two runs

Prints, per argument: the whole-layer table (ours default / unfused, peers' best sum, the
floor) and the per-stage table (our stage vs the best peer for that stage), one row
per token count. Numbers are copied from the JSON, never recomputed.
"""

from __future__ import annotations

import json
import sys


def _rows(d, case):
    return {r["T"]: r for r in d["rows"] if r.get("case") == case and r.get("status") == "ok"}


def _fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def layer_table(d) -> str:
    dflt, unf, peers = _rows(d, "layer default"), _rows(d, "layer unfused"), _rows(d, "peers best sum")
    out = ["| T | ours (µs) | TB/s | TFLOP/s | % of floor | unfused (µs) | fused ÷ unfused | peers' best sum (µs) | ours vs peers |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in sorted(dflt):
        r, u, p = dflt[t], unf.get(t), peers.get(t)
        out.append(f"| {t} | {_fmt(r['us'])} | {_fmt(r['TBps'], 2)} | {_fmt(r['TFLOPs'])} | {_fmt(r['pct_floor'], 0)} | "
                   f"{_fmt(u and u['us'])} | {_fmt(u and u['us'] / r['us'], 2)}× | {_fmt(p and p['us'])} | "
                   f"{_fmt(p and p['us'] / r['us'], 2)}× |")
    return "\n".join(out)


def stage_table(d) -> str:
    st = {s: _rows(d, f"stage {s}") for s in ("router", "act_quant", "shared", "routed", "finalize")}
    peer_cases = {"router": ["peer torch_router"], "shared": ["peer scaled_mm", "peer deep_gemm"],
                  "routed": ["peer hum8t", "peer hum16", "peer grouped"]}
    peers = {c: _rows(d, c) for cs in peer_cases.values() for c in cs}
    out = ["| T | router | act_quant | shared | best shared peer | routed | hum W4A8 | hum W4A16 | `_grouped_mm` bf16 | finalize+shared |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in sorted(st["routed"]):
        def us(rows):
            r = rows.get(t)
            return _fmt(r and r["us"])
        sp = [peers[c][t]["us"] for c in peer_cases["shared"] if t in peers[c]]
        out.append(f"| {t} | {us(st['router'])} | {us(st['act_quant'])} | {us(st['shared'])} | "
                   f"{_fmt(min(sp)) if sp else 'n/a'} | {us(st['routed'])} | {us(peers['peer hum8t'])} | "
                   f"{us(peers['peer hum16'])} | {us(peers['peer grouped'])} | {us(st['finalize'])} |")
    return "\n".join(out)


def merge(runs: list[dict]) -> dict:
    """One run from several of the same layer (e.g. a budget-limited sweep and a second run
    for the large T it skipped): a later run's measured ("ok") row replaces any row with the
    same (case, T); its other rows fill gaps only. The runs must share the title."""
    titles = {r["title"] for r in runs}
    if len(titles) != 1:
        raise ValueError(f"merge: runs of different layers cannot share a table: {sorted(titles)}")
    rows: dict = {}
    for run in runs:
        for r in run["rows"]:
            key = (r.get("case"), r.get("T"))
            if r.get("status") == "ok" or key not in rows:
                rows[key] = r
    return dict(runs[0], rows=list(rows.values()), merged=runs)


def main(argv=None) -> int:
    for arg in (argv if argv is not None else sys.argv[1:]):
        runs = [json.load(open(path)) for path in arg.split("+")]
        d = merge(runs)
        print(f"### {d['title']}\n")
        for run in runs:
            hw = run["hardware"]
            print(f"`{run['command']}` — {run['env']['device_name']}, torch {run['env']['torch']}, Triton "
                  f"{run['env']['triton']}, commit {run['env'].get('git_commit') or '?'}; ceilings measured in the same "
                  f"run: copy {hw['copy_TBps']:.2f} TB/s, FP8 matmul {hw['fp8_TFLOPs']:.0f} TFLOP/s, bf16 "
                  f"{hw['bf16_TFLOPs']:.0f} TFLOP/s.\n")
        print("Whole layer (router + act quant + shared + routed + finalize):\n")
        print(layer_table(d) + "\n")
        print("Stages, µs (peers' routing sort/align precomputed, ours included):\n")
        print(stage_table(d) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
