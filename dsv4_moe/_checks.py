"""Argument checks of the layer modules (dsv4_moe/layers.py): each bad value is a ValueError
or TypeError naming the argument, its value and what was expected."""

from __future__ import annotations

import torch

from ._types import is_int
from .config import MoEConfig
from .weights.tensors import MoELayerWeights

__all__ = ["check_hidden", "capturing", "check_num_tokens", "check_types", "check_router"]


def check_hidden(name: str, x: torch.Tensor, hidden: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: expected [num_tokens, {hidden}]")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{name}.dtype={x.dtype}: expected torch.bfloat16")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the layer's weights are on {device}")


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_num_tokens(num_tokens) -> None:
    if not is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r}: expected an int >= 0")


def check_types(config, weights, weights_cls) -> None:
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected a MoEConfig, got {type(config).__name__}")
    if not isinstance(weights, weights_cls):
        raise TypeError(f"weights: expected {weights_cls.__name__}, got {type(weights).__name__}")


def check_router(config: MoEConfig, weights: MoELayerWeights) -> None:
    """The router's tensors against the config and the layer index (one pass at construction)."""
    c, r, li = config, weights.router, weights.layer_idx
    if not is_int(li) or not 0 <= li < c.num_hidden_layers:
        raise ValueError(f"weights.layer_idx={li!r}: expected an int in [0, num_hidden_layers={c.num_hidden_layers})")
    if r.is_hash != c.is_hash_layer(li):
        raise ValueError(f"layer {li}: the weights are {'hash-routed' if r.is_hash else 'top-k routed'}, but the "
                         f"config's num_hash_layers={c.num_hash_layers} makes it "
                         f"{'hash-routed' if c.is_hash_layer(li) else 'top-k routed'}")
    if r.is_hash:
        t = r.tid2eid
        if t.dtype not in (torch.int64, torch.int32) or tuple(t.shape) != (c.vocab_size, c.num_experts_per_tok):
            raise ValueError(f"router tid2eid: {t.dtype} shape {tuple(t.shape)}, expected int64 (or int32) "
                             f"[vocab_size={c.vocab_size}, num_experts_per_tok={c.num_experts_per_tok}]")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= c.n_routed_experts:
            raise ValueError(f"router tid2eid: ids in [{lo}, {hi}], expected [0, n_routed_experts={c.n_routed_experts})")
    elif r.bias is not None and (r.bias.dtype != torch.float32 or tuple(r.bias.shape) != (c.n_routed_experts,)):
        raise ValueError(f"router bias: {r.bias.dtype} shape {tuple(r.bias.shape)}, expected float32 "
                         f"[{c.n_routed_experts}]")
