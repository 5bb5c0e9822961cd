"""`python -m dsv4_moe make-checkpoint`: write a random checkpoint in the official format.

    python -m dsv4_moe make-checkpoint --preset flash --layers 3,4 --out DIR [--seed S] [--num-shards N]

The top-level CLI (dsv4_moe.cli) forwards the arguments after `make-checkpoint` to
`make_checkpoint_main`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from dsv4_moe.config import MoEConfig

from .writer import write_checkpoint

__all__ = ["make_checkpoint_main", "parse_layers"]


def parse_layers(text: str) -> list[int]:
    """"3,4" -> [3, 4]; "0-2,5" -> [0, 1, 2, 5]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(part)])
        except ValueError:
            raise argparse.ArgumentTypeError(f"--layers {text!r}: expected ints or ranges like 3,4 or 0-2") from None
    return out


def make_checkpoint_main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_moe make-checkpoint",
                                 description="Write a random DeepSeek-V4 MoE checkpoint in the official format.")
    ap.add_argument("--preset", default="tiny", choices=("flash", "pro", "tiny"), help="model shape (default tiny)")
    ap.add_argument("--layers", type=parse_layers, default=None,
                    help="decoder layers to write, e.g. 3,4 or 0-2 (default: every layer of the preset)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=None, help="default: one shard per layer")
    ap.add_argument("--overwrite", action="store_true", help="replace checkpoint files already in --out")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    config = MoEConfig.preset(args.preset)
    layers = args.layers if args.layers is not None else list(range(config.num_hidden_layers))
    try:
        path = write_checkpoint(args.out, config, layers=layers, seed=args.seed, num_shards=args.num_shards,
                                overwrite=args.overwrite, progress=False if args.no_progress else None)
    except (ValueError, OSError) as e:   # FileExistsError (an OSError) names --overwrite itself
        where = f"--out={args.out!r}: " if isinstance(e, OSError) and not isinstance(e, FileExistsError) else ""
        print(f"make-checkpoint: {where}{e}", file=sys.stderr)
        return 2
    print(path)
    return 0
