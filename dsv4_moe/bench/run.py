"""`python -m dsv4_moe bench` — one MoE layer timed whole, by stage, and against peers.

For each token count T of the sweep:
  1. rotated input sets: x ~ N(0, 1) bf16 (and input_ids on hash layers); the routing of
     each set is the reference router's (dsv4_moe.reference.route) on that x, used by the
     stage/peer rows and by the byte model. `--routing router` (default) runs the layer's
     real router on random x; `--routing uniform` builds the synthetic layer as a hash
     layer whose tid2eid table gives k distinct uniform experts per token id, so selection
     is uniform random while the weights still come from the router scores.
  2. rows: layer paths (default / unfused / reference), stages (router, act_quant,
     shared, routed, finalize) and peers (peers.py). Every output is checked against
     dsv4_moe.reference on the first `--check-rows` tokens before it is timed (tokens are
     independent); a failing output is reported "wrong (rel err X)" and not timed.
  3. timing (timing.py): warm-up, CUDA-graph replay for T <= --graph-max-tokens, rotation
     over the sets, CUDA events, median of batches.
  4. derived units (model.py): effective TB/s over the unique bytes of the row's scope,
     TFLOP/s, % of the floor max(bytes / copy rate, flops / FP8 matmul rate), the rates
     measured at the start of the same run.

One GPU runs one rank: with --tp-size/--ep-size the rank's share is benchmarked and the
all-reduce is left out (ours.single_rank_view).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Optional

import torch

from dsv4_moe.config import MoEConfig

from . import ours
from . import report
from .model import LayerDims
from .peers import DEFAULT_PEERS, PEER_TOLERANCE, PEERS
from .synthetic import synthetic_layer_weights
from .timing import CHAIN_MAX_MS, CHAIN_MIN_CALLS, measure_hardware, time_sets

__all__ = ["main", "build_parser", "DEFAULT_TOKENS", "OUR_TOLERANCE"]

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
# rel-L2 vs the reference allowed for this package's paths and stages. The contract allows
# only in-block accumulation order to differ (a last-bit flip of an fp32 partial, which can
# move a bf16 or e4m3 rounding downstream): measured ~1e-3; 2e-2 still fails a missing clamp
# or a wrong scale exponent (>= 30%).
OUR_TOLERANCE = 2e-2
_DEFAULT_BUDGET_S = 250.0  # two presets (Flash, Pro-TP8) in under 10 minutes on the H200


def build_parser(prog: str = "python -m dsv4_moe bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("layer")
    src.add_argument("--preset", choices=("flash", "pro", "tiny"), default="flash",
                     help="synthetic full-size weights of this config (ignored with --checkpoint)")
    src.add_argument("--checkpoint", metavar="DIR", help="load --layer from an official-format checkpoint")
    src.add_argument("--layer", type=int, default=None,
                     help="layer index (checkpoint); synthetic default: the first non-hash layer")
    src.add_argument("--tp-size", type=int, default=1)
    src.add_argument("--tp-rank", type=int, default=0)
    src.add_argument("--ep-size", type=int, default=1)
    src.add_argument("--ep-rank", type=int, default=0)
    src.add_argument("--routing", choices=("router", "uniform"), default="router",
                     help="router: the layer's router on random x; uniform: synthetic hash layer with "
                          "uniform distinct experts per token")
    src.add_argument("--seed", type=int, default=0)
    run = p.add_argument_group("run")
    run.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated token counts")
    run.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    run.add_argument("--parts", default="layer,stages,peers", help="any of layer,stages,peers")
    run.add_argument("--paths", default=",".join(ours.DEFAULT_LAYER_PATHS),
                     help=f"layer paths to time, any of {','.join(ours.LAYER_PATHS)}")
    run.add_argument("--stages", default=",".join(ours.STAGES), help="stages to time")
    run.add_argument("--peers", default=",".join(DEFAULT_PEERS), help=f"any of {','.join(PEERS)}")
    run.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                     help="CUDA-graph replay for T <= --graph-max-tokens")
    run.add_argument("--graph-max-tokens", type=int, default=256)
    run.add_argument("--graph-chain", action="store_true",
                     help="capture the rotated sets' calls one after the other into one graph (mode "
                          "'graph-chain'), as a model's graph holds its layers: no graph launch between "
                          "two calls; the time is still per call. Default: one graph per call")
    run.add_argument("--graph-chain-min-calls", type=int, default=CHAIN_MIN_CALLS,
                     help="with --graph-chain: repeat the rotation in the graph until it holds this many calls "
                          f"(while one replay stays under {CHAIN_MAX_MS:g} ms), about a model's number of MoE layers: "
                          "the time per call depends on the graph's length (session 50); 1: the rotation once "
                          "(sessions <= 49)")
    run.add_argument("--routed-layout", choices=("auto", "nk", "mma64", "mma64e"), default="auto",
                     help="byte order of this package's routed weights (DeepseekV4MoE routed_layout; 'auto' "
                          "takes 'mma64e' on CUDA, 'mma64' is its same-bits A/B twin)")
    run.add_argument("--overlap-shared", choices=("auto", "on", "off"), default="auto",
                     help="DeepseekV4MoE overlap_shared of this package's layers: 'auto' (the layer's policy), "
                          "'on' / 'off' force the shared expert onto its side stream / in line (an A/B switch)")
    run.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                     help="set a module constant before the layers are built (repeatable; an A/B switch, "
                          "e.g. dsv4_moe.kernels.mxfp4_grouped_gemm.A_PAD_ROWS=0); VALUE takes the constant's type")
    run.add_argument("--ref-max-tokens", type=int, default=4,
                     help="on CUDA the reference path (fp64 loops) is timed only up to this T")
    run.add_argument("--sets", type=int, default=0, help="rotated input sets (0: sized from the L2)")
    run.add_argument("--weight-sets", type=int, default=0,
                     help="copies of router+shared weights rotated with the inputs (0: auto)")
    run.add_argument("--reps", type=int, default=0, help="timed batches per row (0: 15 on CUDA, 5 on CPU)")
    run.add_argument("--check-rows", type=int, default=8, help="tokens checked against the reference")
    run.add_argument("--budget-s", type=float, default=_DEFAULT_BUDGET_S,
                     help="wall-clock budget; rows past it are reported skipped")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE")
    out.add_argument("--plot", metavar="FILE.png")
    return p


def _csv(s: str, allowed, what: str) -> list[str]:
    items = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {bad}; expected any of {','.join(allowed)}")
    return items


def _tokens(s: str) -> list[int]:
    try:
        ts = [int(x) for x in s.split(",")]   # an empty item ("1,,2", "4,") is refused too
    except ValueError:
        raise SystemExit(f"--tokens={s!r}: expected comma-separated positive ints") from None
    if not ts or min(ts) < 1:
        raise SystemExit(f"--tokens={s!r}: expected comma-separated positive ints")
    return ts


def _out_path(flag: str, path: Optional[str]) -> None:
    """Refuse an output path that cannot be written before anything is timed (the run can take
    minutes): an existing directory, a parent that is a file, or an unwritable parent. Missing
    parent directories are made when the file is written."""
    if path is None:
        return
    if os.path.isdir(path):
        raise SystemExit(f"{flag}={path!r}: is a directory; expected a file path")
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise SystemExit(f"{flag}={path!r}: {d!r} is a file, not a directory")
    if not os.access(d, os.W_OK):
        raise SystemExit(f"{flag}={path!r}: {d!r} is not writable")


def _git_commit() -> str:
    # NOTE: a copy of the tree without .git (the GPU machine) gets it from the environment.
    if os.environ.get("DSV4_MOE_GIT_COMMIT"):
        return os.environ["DSV4_MOE_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "unknown"
    except Exception:  # noqa: BLE001 - no git binary / not a checkout
        return "unknown"


def _env(device: str) -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception as e:  # noqa: BLE001
        tv = f"not importable ({type(e).__name__})"
    dev = torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or "cpu")
    return {"device": device, "device_name": dev, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": tv, "python": sys.version.split()[0], "git_commit": _git_commit(),
            "hostname": platform.node()}


class _Bench:
    def __init__(self, args, device: str):
        self.args, self.device = args, device
        self.t0 = time.time()
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.last_plan: dict[str, str] = {}  # layer path -> dispatch plan last noted

    def left(self) -> float:
        return self.args.budget_s - (time.time() - self.t0)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        return row

    def case(self, base: dict, make_fns, check, *, work, context=None, graphs=True, tol=OUR_TOLERANCE,
             reps=None, max_sets=None, max_inner=200) -> dict:
        """Build -> check -> time one row. make_fns() -> list of callables; check(out0) -> rel err."""
        row = dict(base)
        if self.left() < 5:
            return self.add(dict(row, status="skipped", reason=f"time budget (--budget-s {self.args.budget_s:g})"))
        context = context or contextlib.nullcontext
        try:
            fns = make_fns()
            if max_sets:
                fns = fns[:max_sets]
            with context():
                out = fns[0]()
            # --check-rows 0 (e.g. a probe whose output is not the layer's): no check, no rel_err figure
            err = check(out) if self.args.check_rows > 0 else None
        except Exception as e:  # noqa: BLE001 - one failing case must not end the sweep
            self._drain()
            return self.add(dict(row, status="error", reason=f"{type(e).__name__}: {str(e)[:300]}"))
        row["rel_err"], row["tol"] = err, tol
        if err is not None and not (err <= tol):
            return self.add(dict(row, status="wrong"))
        use_graphs = graphs and self.args.graphs and row["T"] <= self.args.graph_max_tokens
        try:
            t = time_sets(fns, device=self.device, graphs=use_graphs, reps=reps or self.reps, context=context,
                          max_inner=max_inner, chain=self.args.graph_chain,
                          chain_min_calls=getattr(self.args, "graph_chain_min_calls", CHAIN_MIN_CALLS))
        except Exception as e:  # noqa: BLE001
            self._drain()
            return self.add(dict(row, status="error", reason=f"timing: {type(e).__name__}: {str(e)[:300]}"))
        row.update(t.as_dict())
        row.update(self.derived(t.median_us, work))
        row["status"] = "ok"
        return self.add(row)

    def _drain(self) -> None:
        """Finish pending GPU work after a failed case (a sticky CUDA error re-raises here:
        nothing after it could be trusted, so the sweep stops with that error)."""
        if self.device == "cuda":
            torch.cuda.synchronize()

    def derived(self, us: float, work) -> dict:
        floor = work.floor_us(self.hw.copy_bytes_per_s, self.hw.mm_flops_per_s)
        return {"TBps": work.bytes / us / 1e6, "TFLOPs": work.flops / us / 1e6, "floor_us": floor,
                "pct_floor": 100.0 * floor / us, "MB": work.bytes / 1e6, "GFLOP": work.flops / 1e9}


def _load(args, device: str):
    """(full config, weights) from --checkpoint or a synthetic preset."""
    if args.checkpoint:
        if args.routing == "uniform":
            raise SystemExit("--routing uniform needs a synthetic --preset (a checkpoint layer routes itself)")
        import importlib

        wmod = importlib.import_module("dsv4_moe.weights")
        loader = getattr(wmod, "load_layer_weights", None)
        if loader is None:
            loader = importlib.import_module("dsv4_moe.weights.loader").load_layer_weights
        layer = 0 if args.layer is None else args.layer
        return loader(args.checkpoint, layer, device=device, tp_rank=args.tp_rank, tp_size=args.tp_size,
                      ep_rank=args.ep_rank, ep_size=args.ep_size)
    cfg = MoEConfig.preset(args.preset)
    hash_layer = args.routing == "uniform"
    if args.layer is not None and cfg.is_hash_layer(args.layer) != hash_layer:
        raise SystemExit(f"--layer {args.layer} is {'a hash' if cfg.is_hash_layer(args.layer) else 'a non-hash'} "
                         f"layer of {args.preset}; synthetic routing={args.routing} makes "
                         f"{'hash' if hash_layer else 'non-hash'} layers")
    w = synthetic_layer_weights(cfg, device=device, tp_rank=args.tp_rank, tp_size=args.tp_size,
                                ep_rank=args.ep_rank, ep_size=args.ep_size, hash_layer=hash_layer, seed=args.seed,
                                layer_idx=args.layer)
    return cfg, w


def _apply_set(item: str) -> str:
    """MODULE.ATTR=VALUE: set an existing module constant, VALUE parsed as its current type;
    returns the note the report carries."""
    import importlib

    target, sep, value = item.partition("=")
    mod_name, _, attr = target.rpartition(".")
    if not sep or not mod_name or not attr:
        raise ValueError("expected MODULE.ATTR=VALUE")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"module {mod_name!r} does not import ({e})") from None
    if not hasattr(mod, attr):
        raise ValueError(f"module {mod_name} has no attribute {attr!r}")
    old = getattr(mod, attr)
    if isinstance(old, bool):
        if value.lower() not in ("0", "1", "true", "false", "on", "off"):
            raise ValueError(f"{attr} is a bool: expected 0/1/true/false/on/off, got {value!r}")
        new = value.lower() in ("1", "true", "on")
    elif isinstance(old, (int, float, str)):
        try:
            new = type(old)(value)
        except ValueError:
            raise ValueError(f"{attr} is of type {type(old).__name__}: cannot parse {value!r}") from None
    else:
        raise ValueError(f"{attr} is of type {type(old).__name__}, not a bool / int / float / str constant")
    setattr(mod, attr, new)
    from dsv4_moe import dispatch
    from dsv4_moe.kernels import routed_experts  # its memoised configs read module constants

    routed_experts._routed_configs.cache_clear()
    dispatch.clear_plan_cache()  # the dispatch predicates read switches too (router.QUANT_IN_LOGITS)
    return f"--set: {mod_name}.{attr} = {new!r} (default {old!r})"


def main(argv: Optional[list[str]] = None, prog: str = "python -m dsv4_moe bench") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for flag, v, lo in (("--sets", args.sets, 0), ("--reps", args.reps, 0), ("--check-rows", args.check_rows, 0),
                        ("--graph-chain-min-calls", args.graph_chain_min_calls, 1)):
        if v < lo:
            parser.error(f"{flag}={v}: expected >= {lo}")
    if not (args.budget_s >= 0 and math.isfinite(args.budget_s)):   # 0: every row skipped, with the reason
        parser.error(f"--budget-s={args.budget_s}: expected a finite number of seconds >= 0")
    argv = list(sys.argv[1:] if argv is None else argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    parts = _csv(args.parts, ("layer", "stages", "peers"), "parts")
    paths = _csv(args.paths, ours.LAYER_PATHS, "paths")
    stage_list = _csv(args.stages, ours.STAGES, "stages")
    peer_names = _csv(args.peers, tuple(PEERS), "peers")
    tokens = _tokens(args.tokens)
    _out_path("--json", args.json)
    _out_path("--plot", args.plot)
    plot_why = report.plot_unavailable() if args.plot else None
    if plot_why:   # said now and again at the end: the run goes on, the plot will not be drawn
        print(f"# --plot {args.plot}: will be skipped: {plot_why}", flush=True)
    set_notes = []
    for item in args.set:
        try:
            set_notes.append(_apply_set(item))
        except ValueError as e:
            raise SystemExit(f"{prog}: --set {item!r}: {e}") from None
    torch.manual_seed(args.seed)
    from . import sweep

    b = _Bench(args, device)
    b.reps = args.reps or (15 if device == "cuda" else 5)
    b.notes.extend(set_notes)
    if args.check_rows == 0:
        b.notes.append("--check-rows 0: no row was checked against the reference (rel_err '-'): these times are "
                       "of unchecked outputs")
    if device != "cuda" and args.graphs:
        b.notes.append(f"device {device}: timed eagerly (CUDA graphs need a CUDA device; --graphs has no effect)")
    try:
        full_cfg, full_w = _load(args, device)
    except (ValueError, OSError) as e:  # bad split / layer / checkpoint: a usage error, not a crash
        raise SystemExit(f"{prog}: {type(e).__name__}: {e}") from None
    cfg, w = ours.single_rank_view(full_cfg, full_w)
    command = f"{prog} {shlex.join(argv)}".strip()
    print(f"# {command}", flush=True)
    b.hw = measure_hardware(device)
    hw = b.hw.as_dict()
    rates = ", ".join(f"{k.split('_')[0]} {hw[k]:.4g} TFLOP/s" for k in ("fp8_TFLOPs", "bf16_TFLOPs", "fp32_TFLOPs")
                      if hw[k] is not None)
    print(f"# {hw['device_name']}: copy {hw['copy_TBps']:.3g} TB/s, {rates} (floor uses {hw['floor_matmul']})",
          flush=True)
    with torch.no_grad():
        sweep.run(b, cfg, w, full_w.ep_size, tokens, parts, paths, stage_list, peer_names)
    report.add_speedups(b.rows)
    dims = LayerDims.from_config(cfg, hash_layer=w.router.is_hash)
    title = (f"{full_cfg.name} layer {full_w.layer_idx} tp {args.tp_rank}/{args.tp_size} ep {args.ep_rank}/"
             f"{args.ep_size} (H={dims.hidden}, I/rank={dims.intermediate}, E={dims.num_experts}, k={dims.top_k}), "
             f"routing={args.routing}, device {hw['device_name']}")
    print(title)
    print(report.format_table(b.rows, hardware=hw))
    for n in b.notes:
        print(f"# {n}")
    print(f"# reproduce: {command}", flush=True)
    if args.json:
        doc = {"command": command, "argv": argv, "title": title, "env": _env(device), "hardware": hw,
               "config": repr(full_cfg), "rank_config": repr(cfg),
               "layer": {"layer_idx": full_w.layer_idx, "tp_rank": args.tp_rank, "tp_size": args.tp_size,
                         "ep_rank": args.ep_rank, "ep_size": args.ep_size, "hash_layer": w.router.is_hash,
                         "routing": args.routing, "source": args.checkpoint or f"synthetic preset {args.preset}"},
               "tolerances": {"ours": OUR_TOLERANCE, "peers": PEER_TOLERANCE}, "notes": b.notes,
               "budget_s": args.budget_s, "elapsed_s": time.time() - b.t0, "rows": b.rows}
        report.write_json(args.json, doc)
        print(f"# json: {args.json}")
    if args.plot:
        why = report.write_plot(args.plot, b.rows, hw, title)
        print(f"# plot: {args.plot}" if why is None else f"# plot skipped: {why}")
    return 0
