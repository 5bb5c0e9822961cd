"""The embedded default checkpoint: MoEConfig.tiny() (hidden 256, intermediate 384,
16 experts, top-6, 2 layers, layer 0 a hash layer, vocab 1024), 2 shards, seed 0.

Regenerate with `python scripts/make_default_checkpoint.py`; tests check the files here
are byte-identical to what that script writes.
"""

import os

__all__ = ["DEFAULT_CHECKPOINT_DIR", "DEFAULT_SEED"]

DEFAULT_CHECKPOINT_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SEED = 0
