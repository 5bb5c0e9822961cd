"""In-memory containers for one MoE layer's native (still quantised) tensors.

The loader fills them from checkpoint bytes; layers and kernels consume them. Layout
choices (the only ones made at load time, by pure functions in `weights.prepare`):

* gate and up (w1, w3) are merged along the output dim into one `gate_up` tensor, rows
  [0, I) = w1 (gate), rows [I, 2I) = w3 (up), so both projections are one GEMM launch.
  For the FP8 shared expert the block-scale rows are merged the same way (I is a
  multiple of 128, so the 128-row blocks never straddle the seam).
* routed experts are stacked along a leading expert dim holding the *local* experts
  `first_expert .. first_expert + E_local - 1` in ascending id.
* e8m0 scales keep dtype torch.float8_e8m0fnu (view as uint8 for kernels); MXFP4 codes
  are torch.uint8, two e2m1 per byte, low nibble = even k. Nothing is dequantised or
  padded: I=384 stays 384.
* `RoutedExpertWeights.layout` names the byte order of the packed codes: "nk" (the
  checkpoint's, row-major) or "mma64" (the same bytes permuted per 64 x 128 tile for the
  Hopper kernels, weights/mma_layout.py). Shapes and dtypes are the same in both;
  `with_layout` converts (a pure permutation), and everything that reads values
  (the reference, the writer) asks for "nk".

Shapes (H hidden, I the per-rank intermediate, E_local the experts this rank holds):

    RouterWeights.weight          [E, H]            bfloat16
    RouterWeights.bias            [E]               float32       (None on hash layers)
    RouterWeights.tid2eid         [vocab, top_k]    int64         (None on non-hash layers)
    SharedExpertWeights.gate_up   [2I, H]           float8_e4m3fn
    SharedExpertWeights.gate_up_scale [2I/128, ceil(H/128)] float8_e8m0fnu
    SharedExpertWeights.down      [H, I]            float8_e4m3fn
    SharedExpertWeights.down_scale [ceil(H/128), I/128] float8_e8m0fnu
    RoutedExpertWeights.gate_up   [E_local, 2I, H/2] uint8 (packed e2m1)
    RoutedExpertWeights.gate_up_scale [E_local, 2I, H/32] float8_e8m0fnu
    RoutedExpertWeights.down      [E_local, H, I/2]  uint8 (packed e2m1)
    RoutedExpertWeights.down_scale [E_local, H, I/32] float8_e8m0fnu
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

__all__ = ["RouterWeights", "SharedExpertWeights", "RoutedExpertWeights", "MoELayerWeights"]


def _to(obj, device):
    kw = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        kw[f.name] = v.to(device) if isinstance(v, torch.Tensor) else v
    return type(obj)(**kw)


@dataclass
class RouterWeights:
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    tid2eid: Optional[torch.Tensor] = None

    @property
    def is_hash(self) -> bool:
        return self.tid2eid is not None

    def to(self, device) -> "RouterWeights":
        return _to(self, device)


@dataclass
class SharedExpertWeights:
    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor

    @property
    def intermediate(self) -> int:
        return self.down.shape[1]

    @property
    def hidden(self) -> int:
        return self.down.shape[0]

    def to(self, device) -> "SharedExpertWeights":
        return _to(self, device)


@dataclass
class RoutedExpertWeights:
    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    first_expert: int = 0
    num_experts: int = 0  # global expert count E (routes index 0..E-1)
    layout: str = "nk"    # byte order of gate_up / down: "nk", "mma64" or "mma64e" (weights/mma_layout.py)

    def __post_init__(self) -> None:
        from .mma_layout import LAYOUTS  # noqa: PLC0415

        if self.layout not in LAYOUTS:
            raise ValueError(f"RoutedExpertWeights.layout={self.layout!r}: expected one of {LAYOUTS}")

    def with_layout(self, layout: str) -> "RoutedExpertWeights":
        """The same experts with gate_up and down in byte order `layout` (self when it
        already is; otherwise new tensors, scales shared)."""
        from .mma_layout import convert_layout  # noqa: PLC0415

        if layout == self.layout:
            return self
        return RoutedExpertWeights(convert_layout(self.gate_up, self.layout, layout), self.gate_up_scale,
                                   convert_layout(self.down, self.layout, layout), self.down_scale,
                                   self.first_expert, self.num_experts, layout)

    @property
    def num_local(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.down.shape[1]

    def to(self, device) -> "RoutedExpertWeights":
        return _to(self, device)


@dataclass
class MoELayerWeights:
    router: RouterWeights
    shared: SharedExpertWeights
    routed: RoutedExpertWeights
    layer_idx: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def to(self, device) -> "MoELayerWeights":
        return MoELayerWeights(self.router.to(device), self.shared.to(device), self.routed.to(device),
                               self.layer_idx, self.tp_rank, self.tp_size, self.ep_rank, self.ep_size)
