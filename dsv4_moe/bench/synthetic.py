"""Full-size synthetic MoE layer weights for the benchmark, drawn on the target device.

One generator serves tests and benchmarks: `dsv4_moe.testing.random_layer_weights`
(router ~ N(0, 0.02) bf16 with a small fp32 bias or a uniform tid2eid table; shared
expert N(0, SHARED_SYNTH_STD = 0.08) quantised per 128x128 block to e4m3 with UE8M0 scales; routed experts
uniform e2m1 codes with e8m0 scale bytes in E8M0_SYNTH_RANGE). Only the local experts
(EP) and the per-rank intermediate I / tp_size (TP) are made.
"""

from __future__ import annotations

from typing import Optional

from dsv4_moe.testing import E8M0_SYNTH_RANGE, random_layer_weights
from dsv4_moe.weights.tensors import MoELayerWeights

__all__ = ["synthetic_layer_weights", "E8M0_SYNTH_RANGE"]


def synthetic_layer_weights(config, *, device="cpu", tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0,
                            ep_size: int = 1, hash_layer: bool = False, seed: int = 0,
                            layer_idx: Optional[int] = None) -> MoELayerWeights:
    """Random layer weights with the checkpoint's dtypes and realistic ranges (module docstring)."""
    if layer_idx is None:  # the first hash / non-hash layer index of this config
        layer_idx = 0 if hash_layer else config.num_hash_layers
    return random_layer_weights(config, layer_idx=layer_idx, seed=seed, device=device, tp_size=tp_size,
                                tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank, hash_layer=hash_layer)
