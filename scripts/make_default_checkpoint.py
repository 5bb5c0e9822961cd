"""Regenerate the embedded default checkpoint in weights/default/ (or --out DIR).

    python scripts/make_default_checkpoint.py            # rewrites weights/default/
    python scripts/make_default_checkpoint.py --out DIR  # writes elsewhere (tests compare bytes)

MoEConfig.tiny(), layers 0 and 1 (layer 0 is a hash layer), seed DEFAULT_SEED, one shard
per layer. The output is deterministic, so the committed files must equal a fresh run.
"""

from __future__ import annotations

import argparse
import os
import sys

from dsv4_moe.config import MoEConfig
from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR, DEFAULT_SEED
from dsv4_moe.weights.writer import write_checkpoint


def make_default_checkpoint(out_dir: str = DEFAULT_CHECKPOINT_DIR) -> str:
    config = MoEConfig.tiny()
    return write_checkpoint(out_dir, config, layers=range(config.num_hidden_layers), seed=DEFAULT_SEED,
                            overwrite=True, progress=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_CHECKPOINT_DIR)
    args = ap.parse_args(argv)
    path = make_default_checkpoint(args.out)
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if not f.endswith(".py"))
    print(f"wrote {path} ({total / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
