"""DeepseekV4MLP, the shared expert: an FP8 (e4m3, 128x128 UE8M0 block scales) clamped-SwiGLU
MLP holding the checkpoint's native tensors as non-persistent buffers (`.to(device)` moves them,
nothing is dequantised). Each forward asks dispatch for the act_quant, fp8_gemm and swiglu_quant
paths; DeepseekV4MoE (dsv4_moe/layers.py) runs it on the rows it has already quantised.
"""

from __future__ import annotations

import torch
from torch import nn

from . import dispatch
from ._checks import check_hidden, check_num_tokens, check_types
from .config import MoEConfig
from .dispatch import DispatchContext
from .weights.tensors import SharedExpertWeights

__all__ = ["DeepseekV4MLP"]


class _NativeBuffers(nn.Module):
    """Registers a weights dataclass's tensors as non-persistent buffers."""

    def _register(self, prefix: str, obj) -> None:
        for name, v in vars(obj).items():
            if isinstance(v, torch.Tensor):
                self.register_buffer(f"{prefix}{name}", v, persistent=False)

    def _apply(self, fn, recurse=True):
        """Module.to / .cuda / .cpu / .half / .float / .bfloat16 all come here. A device move is
        what these modules support; a dtype change would cast the checkpoint's native tensors
        (FP8 codes, e8m0 scales, the fp32 router) into other values, so it is refused - before
        any buffer is touched (each buffer's dtype is probed on an empty tensor first)."""
        for name, b in self.named_buffers():
            to = fn(torch.empty(0, dtype=b.dtype, device=b.device)).dtype
            if to != b.dtype:
                raise TypeError(f"{type(self).__name__}: a dtype change (here buffer {name!r} {b.dtype} -> {to}) "
                                f"is not supported: the layer holds the checkpoint's tensors in their native "
                                f"dtypes (FP8 codes, e8m0 scales, packed e2m1, the fp32 router); move it with "
                                f".to(device) only (its outputs are bf16 whatever the input)")
        return super()._apply(fn, recurse)

    def _rebuild(self, cls, prefix: str, **extra):
        kw = {}
        for name in cls.__dataclass_fields__:
            if name in extra:
                kw[name] = extra[name]
            else:
                kw[name] = getattr(self, f"{prefix}{name}", None)
        return cls(**kw)


class DeepseekV4MLP(_NativeBuffers):
    """The shared expert: FP8 (e4m3, 128x128 UE8M0 block scales) clamped-SwiGLU MLP.

    forward(x [T, H] bf16) -> [T, H] bf16. With tp_size > 1 the weights hold this rank's
    I/tp slice and the output is this rank's partial sum (DeepseekV4MoE reduces it).
    """

    def __init__(self, config: MoEConfig, weights: SharedExpertWeights, *, tp_size: int = 1):
        super().__init__()
        check_types(config, weights, SharedExpertWeights)
        config.check_parallel(tp_size=tp_size)
        if weights.hidden != config.hidden_size:
            raise ValueError(f"shared expert hidden {weights.hidden} != config.hidden_size {config.hidden_size}")
        want_i = config.local_intermediate(tp_size)
        if weights.intermediate != want_i:
            raise ValueError(f"shared expert intermediate {weights.intermediate} != moe_intermediate_size/tp_size "
                             f"= {want_i}")
        self.config = config
        self.tp_size = tp_size
        self._register("w_", weights)

    @property
    def weights(self) -> SharedExpertWeights:
        return self._rebuild(SharedExpertWeights, "w_")

    @property
    def device(self) -> torch.device:
        return self.w_gate_up.device

    def context(self, num_tokens: int) -> DispatchContext:
        c = self.config
        return DispatchContext(device=self.device, num_tokens=num_tokens, hidden=c.hidden_size,
                               intermediate=c.local_intermediate(self.tp_size), num_experts=c.n_routed_experts,
                               num_local_experts=0, top_k=c.num_experts_per_tok, tp_size=self.tp_size)

    @torch.no_grad()  # inference only: the FP8 / MXFP4 paths have no backward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_hidden("x", x, self.config.hidden_size, self.device)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        ctx = self.context(x.shape[0])
        q, sa = dispatch.select("act_quant", ctx).impl(x)
        return self.forward_quantised(q, sa, ctx)

    def forward_quantised(self, q: torch.Tensor, sa: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """The expert on already-quantised rows (q, sa = act_quant(x)), so the MoE layer
        quantises x once for the shared and the routed GEMMs."""
        gemm = dispatch.select("fp8_gemm", ctx).impl
        gu = gemm(q, sa, self.w_gate_up, self.w_gate_up_scale)
        hq, hs = dispatch.select("swiglu_quant", ctx).impl(gu, self.config.swiglu_limit)
        return gemm(hq, hs, self.w_down, self.w_down_scale)

    def prefetch_tensors(self) -> list:
        """The expert's weight tensors in the order its forward reads them (for an L2 prefetch)."""
        return [self.w_gate_up, self.w_gate_up_scale, self.w_down, self.w_down_scale]

    def explain(self, num_tokens: int) -> str:
        check_num_tokens(num_tokens)
        return dispatch.explain(self.context(num_tokens), ["act_quant", "fp8_gemm", "swiglu_quant"])
