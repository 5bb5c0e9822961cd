"""Rows -> aligned table, JSON document and plot for the layer benchmark.

A row is a dict with at least: case, kind ("path" | "stage" | "peer" | "sum"), scope, T,
status ("ok" | "skipped" | "wrong" | "error"), and when timed: us, TBps, TFLOPs, pct_floor,
floor_us, mode, rel_err. `add_speedups` fills `vs` = {baseline case: baseline_us / us}
for this package's rows against every timed baseline of the same scope and T.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

__all__ = ["add_speedups", "format_table", "write_json", "write_plot", "BASELINE_KINDS"]

BASELINE_KINDS = ("peer", "sum")


def add_speedups(rows: list[dict]) -> None:
    """Ours = kind path/stage; baselines = peers, peer sums, and our own non-default paths."""
    for r in rows:
        if r.get("status") != "ok" or r["kind"] not in ("path", "stage"):
            continue
        if r["kind"] == "path" and r.get("path") != "default":
            continue
        vs = {}
        for b in rows:
            if b is r or b.get("status") != "ok" or b["T"] != r["T"] or b["scope"] != r["scope"]:
                continue
            if b["kind"] in BASELINE_KINDS or (b["kind"] == "path" and b.get("path") != "default"):
                vs[b["case"]] = b["us"] / r["us"]
        r["vs"] = vs


def _fmt(v, spec: str, missing: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return missing
    return format(v, spec)


def _t(t) -> str:
    return "all" if t is None else str(t)


def format_table(rows: list[dict], *, hardware: Optional[dict] = None) -> str:
    """One aligned line per row; skipped / wrong / error rows carry their reason."""
    head = ["case", "scope", "T", "us", "TB/s", "TFLOP/s", "%floor", "rel_err", "mode", "x vs baselines"]
    lines = []
    for r in rows:
        st = r.get("status")
        if st == "ok":
            vs = ", ".join(f"{v:.2f}x {k}" for k, v in sorted((r.get("vs") or {}).items()))
            lines.append([r["case"], r["scope"], _t(r["T"]), _fmt(r.get("us"), ".1f"), _fmt(r.get("TBps"), ".3g"),
                          _fmt(r.get("TFLOPs"), ".3g"), _fmt(r.get("pct_floor"), ".0f"), _fmt(r.get("rel_err"), ".1e"),
                          r.get("mode", "-"), vs])
        else:
            why = r.get("reason", "")
            if st == "wrong":
                why = f"wrong (rel err {r.get('rel_err', float('nan')):.3g} > tol {r.get('tol')})" + (
                    f": {why}" if why else "")
            lines.append([r["case"], r["scope"], _t(r["T"]), st or "?", "", "", "", "", "", why])
    widths = [max(len(head[i]), *(len(ln[i]) for ln in lines)) if lines else len(head[i]) for i in range(len(head))]
    widths[-1] = len(head[-1])  # the last column is free text, not padded
    right = {2, 3, 4, 5, 6, 7}

    def fmt_line(cells):
        out = []
        for i, c in enumerate(cells):
            out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return " | ".join(out).rstrip()

    text = [fmt_line(head), "-+-".join("-" * w for w in widths)]
    text += [fmt_line(ln) for ln in lines]
    if hardware:
        text.append(f"floor = max(bytes / {hardware['copy_TBps']:.3g} TB/s copy, flops / "
                    f"{hardware['floor_TFLOPs']:.4g} TFLOP/s "
                    f"{hardware.get('floor_matmul')} matmul), measured in this run on {hardware['device_name']}")
    return "\n".join(text)


def _clean(o):
    """NaN / inf -> None so the file is strict JSON; tuples -> lists; other objects -> str."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if o is None or isinstance(o, (str, int, bool)):
        return o
    return str(o)


def write_json(path: str, doc: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(doc), f, indent=1, allow_nan=False)
        f.write("\n")


def plot_unavailable() -> Optional[str]:
    """None when matplotlib imports, else why write_plot will skip (said before a run starts)."""
    try:
        import matplotlib  # noqa: F401
    except Exception as e:  # noqa: BLE001 - plotting is optional (pip install matplotlib)
        return f"matplotlib not importable ({type(e).__name__}); pip install dsv4_moe[bench]"
    return None


def write_plot(path: str, rows: list[dict], hardware: dict, title: str) -> Optional[str]:
    """Time and effective bandwidth vs tokens per case, layer floor and copy rate drawn in.
    Returns None on success or the reason it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - plotting is optional (pip install matplotlib)
        return f"matplotlib not importable ({type(e).__name__}); pip install dsv4_moe[bench]"
    # Layer rows, peers and the stages peers are compared with; the other stages would bury them.
    ok = [r for r in rows if r.get("status") == "ok"
          and (r["kind"] != "stage" or r["scope"] in ("routed", "shared"))]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    cases = []
    for r in ok:
        if r["case"] not in cases:
            cases.append(r["case"])
    for case in cases:
        pts = sorted((r["T"], r["us"], r.get("TBps")) for r in ok if r["case"] == case)
        ls = "-" if pts and any(r["scope"] == "layer" for r in ok if r["case"] == case) else "--"
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", ms=3, label=case)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], ls, marker="o", ms=3, label=case)
    floors = sorted({(r["T"], r["layer_floor_us"]) for r in rows if r.get("layer_floor_us")})
    if floors:
        axes[0].plot([f[0] for f in floors], [f[1] for f in floors], "k:", lw=2, label="layer floor")
    axes[1].axhline(hardware["copy_TBps"], color="k", ls=":", lw=2, label="measured copy rate")
    for ax, yl in ((axes[0], "us per forward"), (axes[1], "effective TB/s (unique bytes / time)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
