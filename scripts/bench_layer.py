#!/usr/bin/env python3
"""Layer-level benchmark; the same code as `python -m dsv4_moe bench` (dsv4_moe/bench/run.py).

Without --json / --plot, results go to $OUT (default ./out) as bench_<preset>[_tpN][_epN].json
and .png, so GPU batch runs leave their numbers behind:

    python scripts/bench_layer.py --preset flash
    python scripts/bench_layer.py --preset pro --tp-size 8
    python scripts/bench_layer.py --preset tiny --device cpu --tokens 1,4
"""
import os
import sys

from dsv4_moe.bench.run import build_parser, main


def _with_default_outputs(argv):
    args, _ = build_parser().parse_known_args(argv)
    stem = "bench_" + (os.path.basename(os.path.normpath(args.checkpoint)) + f"_L{args.layer}"
                       if args.checkpoint else args.preset)
    stem += f"_tp{args.tp_size}" if args.tp_size > 1 else ""
    stem += f"_ep{args.ep_size}" if args.ep_size > 1 else ""
    stem += "_uniform" if args.routing == "uniform" else ""
    out = os.environ.get("OUT", "out")
    argv = list(argv)
    if args.json is None:
        argv += ["--json", os.path.join(out, stem + ".json")]
    if args.plot is None:
        argv += ["--plot", os.path.join(out, stem + ".png")]
    return argv


if __name__ == "__main__":
    sys.exit(main(_with_default_outputs(sys.argv[1:]), prog="python scripts/bench_layer.py"))
