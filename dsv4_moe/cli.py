"""Command line: `python -m dsv4_moe {run,explain,bench,make-checkpoint}`.

    run              standalone forward pass of every MoE layer of a checkpoint (default:
                     the embedded tiny checkpoint, no download), with the plan and stats
    explain          the dispatch plan for one layer and token count
    bench            the layer-level benchmark (dsv4_moe.bench)
    make-checkpoint  write a synthetic checkpoint in the official format
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

import torch

__all__ = ["main"]


def _default_checkpoint() -> str:
    from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR

    return str(DEFAULT_CHECKPOINT_DIR)


def _layers_arg(s: Optional[str], num_layers: int) -> list[int]:
    if s is None or s == "all":
        return list(range(num_layers))
    try:
        layers = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--layer={s!r}: expected an int, a comma-separated list, or 'all'")
    if not layers:
        raise SystemExit(f"--layer={s!r}: names no layer; expected an int, a comma-separated list, or 'all'")
    dup = next((li for i, li in enumerate(layers) if li in layers[:i]), None)
    if dup is not None:
        raise SystemExit(f"--layer={s!r}: layer {dup} is named twice; expected distinct layers")
    for li in layers:
        if not 0 <= li < num_layers:
            raise SystemExit(f"--layer={li}: the checkpoint has layers 0..{num_layers - 1}")
    return layers


def _device(name: str) -> torch.device:
    from dsv4_moe.weights import check_device

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return check_device(name, name="--device")
    except ValueError as e:
        raise SystemExit(str(e))


# --tokens' upper bound: a forward over more tokens is an engine's prefill split into chunks; the
# bound keeps a typo (an extra digit or three) from reaching torch as an allocation of terabytes.
MAX_TOKENS = 1 << 20


def _loading(ckpt: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) (reading the config or a layer of checkpoint `ckpt`); a bad checkpoint
    (CheckpointError, a ValueError naming the tensor and shard; a malformed config.json; an
    unreadable file) ends the command with that message, not a traceback."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError, OSError) as e:
        raise SystemExit(f"--checkpoint={ckpt!r}: {type(e).__name__}: {e}") from None


def _inputs(config, tokens: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=g).to(device)
    return x, ids


def cmd_run(args) -> int:
    from dsv4_moe import MoEConfig, load_moe_layer
    from dsv4_moe.reference import moe_forward

    ckpt = args.checkpoint or _default_checkpoint()
    config = _loading(ckpt, MoEConfig.from_pretrained, ckpt)
    device = _device(args.device)
    print(f"checkpoint: {ckpt}{'  (embedded default)' if args.checkpoint is None else ''}")
    print(f"config: {config!r}")
    print(f"device: {device}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}")
    for li in _layers_arg(args.layer, config.num_hidden_layers):
        t0 = time.perf_counter()
        layer = _loading(ckpt, load_moe_layer, ckpt, li, device=device)
        load_s = time.perf_counter() - t0
        x, ids = _inputs(config, args.tokens, device, args.seed + li)
        print()
        print(layer.explain(args.tokens))
        with torch.no_grad():
            layer(x, ids)  # warm-up (kernel compilation)
            out, fwd_s = _timed(lambda: layer(x, ids), device)
        o = out.float()
        finite = bool(torch.isfinite(o).all())
        print(f"layer {li}: load {load_s * 1e3:.1f} ms, forward T={args.tokens} {fwd_s * 1e3:.3f} ms"
              f"{' eager' if device.type == 'cuda' else ''}; "
              f"out {tuple(out.shape)} {out.dtype} mean {o.mean():+.4e} std {o.std():.4e} "
              f"absmax {o.abs().max():.4e} finite={finite}")
        if device.type == "cuda" and args.tokens > 0:
            print(f"layer {li}: {_graph_line(layer, x, ids, out, device)}")
        if args.check:
            with torch.no_grad():
                ref = moe_forward(x.cpu(), ids.cpu(), layer.weights.to("cpu"), config)
            from dsv4_moe.testing import bf16_diff_stats

            st = bf16_diff_stats(out.cpu(), ref)
            print(f"layer {li}: vs CPU reference: {st['mismatch_frac'] * 100:.3f}% elements differ, "
                  f"max {st['max_ulp']:.0f} ulp, rel L2 {st['rel_l2']:.2e}")
        if not finite:
            print(f"layer {li}: output has non-finite values", file=sys.stderr)
            return 1
    return 0


def _timed(fn, device, reps: int = 5):
    """(output, median seconds of `reps` calls, each synchronised on CUDA)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return out, sorted(times)[len(times) // 2]


def _graph_line(layer, x, ids, eager_out, device) -> str:
    """The same forward replayed from a CUDA graph (GraphedMoE): its time, and whether its
    output equals the eager one bit for bit. An eager forward's time on CUDA is mostly the
    host launching kernels; the graph shows the GPU's."""
    from dsv4_moe import GraphedMoE

    try:
        graphed = GraphedMoE(layer, token_counts=(x.shape[0],))
        with torch.no_grad():
            graphed(x, ids)  # capture
            out, s = _timed(lambda: graphed(x, ids), device)
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the eager result above stands
        return f"CUDA graph not timed ({type(e).__name__}: {e})"
    same = torch.equal(out.view(torch.int16), eager_out.view(torch.int16))
    return (f"forward T={x.shape[0]} {s * 1e3:.3f} ms replayed from a CUDA graph (GraphedMoE, input copy "
            f"and output clone included); graph output == eager bitwise: {same}")


def cmd_explain(args) -> int:
    from dsv4_moe import MoEConfig, load_moe_layer

    ckpt = args.checkpoint or _default_checkpoint()
    config = _loading(ckpt, MoEConfig.from_pretrained, ckpt)
    device = _device(args.device)
    for li in _layers_arg(args.layer, config.num_hidden_layers):
        layer = _loading(ckpt, load_moe_layer, ckpt, li, device=device)
        print(layer.explain(args.tokens))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from dsv4_moe.bench.run import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "make-checkpoint":
        from dsv4_moe.weights.cli import make_checkpoint_main

        return make_checkpoint_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m dsv4_moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("run", "standalone forward pass"), ("explain", "print the dispatch plan")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the embedded one)")
        s.add_argument("--layer", default=None, help="layer index, comma list, or 'all' (default: all)")
        s.add_argument("--tokens", type=int, default=16, help="number of tokens T (default 16)")
        s.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default)")
        if name == "run":
            s.add_argument("--seed", type=int, default=0)
            s.add_argument("--check", action="store_true", help="also compare with the CPU reference")
    sub.add_parser("bench", help="layer-level benchmark (see `bench --help`)")
    sub.add_parser("make-checkpoint", help="write a synthetic checkpoint (see `make-checkpoint --help`)")
    args = p.parse_args(argv)
    if not 1 <= args.tokens <= MAX_TOKENS:
        p.error(f"--tokens={args.tokens}: expected an int in [1, {MAX_TOKENS}]")
    if args.cmd == "run" and not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed={args.seed}: expected an int in [0, 2^63)")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint={args.checkpoint!r}: no such directory (a checkpoint directory is expected)")
    if args.checkpoint is not None and not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        p.error(f"--checkpoint={args.checkpoint!r}: no config.json there (a checkpoint directory is expected)")
    return {"run": cmd_run, "explain": cmd_explain}[args.cmd](args)
