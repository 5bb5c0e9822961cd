"""A/B of module constants through the layer bench, the method of record (H200 tool).

    OUT=./out python3 scripts/gpu_ab_layer.py --base "--preset flash --tokens 1" \
        --case default= \
        --case split4="--set dsv4_moe.kernels.mxfp4_grouped_gemm.SHORT_K_DECODE_SPLIT=4" \
        --rounds 2 --budget-s 300 --tag flash_t1

Runs `scripts/bench_layer.py --parts layer --paths default --graph-max-tokens 8192 --graph-chain
<base> <case> --budget-s <bench-budget-s>` once per case per round, in separate processes, the cases
alternating (each round starts one case later than the one before), until `--rounds` rounds are done
or the next run would pass `--budget-s`. Every run's whole output goes to $OUT/ab_<tag>.log and its
JSON to $OUT/ab_<tag>/<case>_<round>.json; the table
(per case and T: every run's µs and their median) to stdout and $OUT/ab_<tag>.txt / .json.
Session 49 wrote it for DESIGN's leads (a) and (a2): several one-line switches, two runs each, in one
device call. Since session 50 the bench's graph holds >= 64 forwards (dsv4_moe.bench.timing.CHAIN_MIN_CALLS);
a case `--graph-chain-min-calls 1` times the old 16-forward graph beside it. A run at four decode T
takes ~20 s on a warm machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

BENCH = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_layer.py"),
         "--parts", "layer", "--paths", "default", "--graph-max-tokens", "8192", "--graph-chain"]
# "layer default | layer | 1 | 53.6 | 2.01 | ..." (the bench's table row of the default path)
_ROW = re.compile(r"^layer default\s*\|\s*layer\s*\|\s*(\d+)\s*\|\s*([0-9.]+)\s*\|")
_SKIPPED = re.compile(r"^layer default\s*\|\s*layer\s*\|\s*(\d+)\s*\|\s*skipped\s*\|.*\|\s*([^|]*)$")


def parse_rows(text: str) -> dict[int, float]:
    """{T: µs} from one bench run's stdout (the default path's layer rows)."""
    rows = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            rows[int(m.group(1))] = float(m.group(2))
    return rows


def parse_skipped(text: str) -> dict[int, str]:
    """{T: reason} of the default path's rows the bench skipped (e.g. its --budget-s spent on a
    cold compile: the first run on a fresh machine), so a missing sample is named, not silent."""
    out = {}
    for line in text.splitlines():
        m = _SKIPPED.match(line.strip())
        if m:
            out[int(m.group(1))] = m.group(2).strip()
    return out


def parse_case(spec: str) -> tuple[str, list[str]]:
    """'label=ARGS' -> (label, shlex-split ARGS); ARGS may be empty (the default)."""
    label, sep, args = spec.partition("=")
    if not sep or not label.strip() or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label.strip()):
        raise ValueError(f"--case {spec!r}: expected LABEL=ARGS with a label of letters, digits, '_.+-'")
    return label.strip(), shlex.split(args)


def order(labels: list[str], rnd: int) -> list[str]:
    """Round `rnd`'s run order: the labels rotated by rnd (so no case is always first)."""
    r = rnd % len(labels)
    return labels[r:] + labels[:r]


def run_facts(path: str) -> dict[int, dict]:
    """{T: {"MB": unique megabytes a forward moves, "graph_calls": forwards per graph}} from one bench
    run's JSON (the default path's layer rows); {} when the file is missing or has no such rows."""
    try:
        with open(path) as f:
            rows = json.load(f).get("rows", [])
    except (OSError, ValueError):
        return {}
    return {r["T"]: {"MB": r.get("MB"), "graph_calls": r.get("graph_calls")} for r in rows
            if isinstance(r, dict) and r.get("case") == "layer default" and r.get("status") == "ok"}


def table(results: dict[str, dict[int, list[float]]], facts: dict | None = None) -> list[str]:
    """Per case and T: the median µs, TB/s of the bench's unique bytes at that median (`facts[label][T]
    ["MB"]`, '-' if unknown) and every run's µs."""
    facts = facts or {}
    lines = [f"{'case':<24s} {'T':>5s} {'median us':>10s} {'TB/s':>6s}  runs"]
    for label, by_t in results.items():
        for t in sorted(by_t):
            v = by_t[t]
            med = statistics.median(v)
            mb = facts.get(label, {}).get(t, {}).get("MB")
            tbs = f"{mb / med:6.2f}" if mb else f"{'-':>6s}"
            lines.append(f"{label:<24s} {t:5d} {med:10.1f} {tbs}  " + ", ".join(f"{x:.1f}" for x in v))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="bench arguments every run shares (preset, tokens, ...)")
    ap.add_argument("--case", action="append", required=True, help="LABEL=ARGS (repeatable; ARGS may be empty)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=300.0, help="no run starts that would end past this")
    ap.add_argument("--bench-budget-s", type=float, default=60.0,
                    help="the bench's own --budget-s per run (15 until session 50; 64-forward graphs take longer)")
    ap.add_argument("--tag", default="ab")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds}: expected >= 1")
    cases = dict(parse_case(c) for c in args.case)
    if len(cases) != len(args.case):
        raise SystemExit("--case: two cases share a label")
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    os.makedirs(os.path.join(out, f"ab_{args.tag}"), exist_ok=True)
    log = open(os.path.join(out, f"ab_{args.tag}.log"), "w")
    results: dict[str, dict[int, list[float]]] = {label: {} for label in cases}
    facts: dict[str, dict[int, dict]] = {label: {} for label in cases}
    t0, longest, stopped = time.time(), 0.0, ""
    for rnd in range(args.rounds):
        for label in order(list(cases), rnd):
            if time.time() - t0 + longest > args.budget_s:
                stopped = f"stopped by --budget-s {args.budget_s:g} in round {rnd + 1} before {label}"
                break
            run_json = os.path.join(out, f"ab_{args.tag}", f"{label}_{rnd + 1}.json")
            cmd = BENCH + shlex.split(args.base) + cases[label] + [
                "--budget-s", str(args.bench_budget_s), "--json", run_json]
            s = time.time()
            p = subprocess.run(cmd, capture_output=True, text=True)
            longest = max(longest, time.time() - s)
            log.write(f"# [{label} round {rnd + 1}, {time.time() - s:.0f} s, rc {p.returncode}] "
                      f"{shlex.join(cmd[1:])}\n{p.stdout}{p.stderr}\n")
            log.flush()
            rows = parse_rows(p.stdout)
            if p.returncode or not rows:
                print(f"{label} round {rnd + 1}: rc {p.returncode}, no rows; see ab_{args.tag}.log\n"
                      f"{p.stderr[-2000:]}", flush=True)
                continue
            for t, us in rows.items():
                results[label].setdefault(t, []).append(us)
            facts[label].update(run_facts(run_json))
            skipped = "".join(f"; T={t} skipped ({why})" for t, why in sorted(parse_skipped(p.stdout).items()))
            print(f"{label} round {rnd + 1}: " + ", ".join(f"T={t} {us:.1f}" for t, us in sorted(rows.items()))
                  + skipped, flush=True)
        if stopped:
            break
    lines = [f"# gpu_ab_layer.py --base {args.base!r}"] + [f"#   {k} = {shlex.join(v)}" for k, v in cases.items()]
    calls = sorted({f.get("graph_calls") for d in facts.values() for f in d.values() if f.get("graph_calls")})
    if calls:
        lines.append(f"# forwards per graph: {', '.join(map(str, calls))}")
    lines += table(results, facts) + ([f"# {stopped}"] if stopped else [])
    print("\n".join(lines), flush=True)
    with open(os.path.join(out, f"ab_{args.tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"ab_{args.tag}.json"), "w") as f:
        json.dump({"base": args.base, "cases": {k: shlex.join(v) for k, v in cases.items()},
                   "us": {k: {str(t): v for t, v in d.items()} for k, d in results.items()},
                   "facts": {k: {str(t): v for t, v in d.items()} for k, d in facts.items()},
                   "stopped": stopped}, f, indent=1)


if __name__ == "__main__":
    main()
