"""The checkpoint name table (SPEC §3): checkpoint name <-> logical name, dtype, shape.

Every tensor the package reads or writes is named here and nowhere else. Names carry
no `model.` prefix. For MoE layer L, expert e (H hidden, I = moe_intermediate_size,
E = n_routed_experts, k = num_experts_per_tok; shapes are the *unsliced* checkpoint
shapes):

    checkpoint name                              logical name          dtype     shape
    layers.L.ffn.gate.weight                     router.weight         BF16      [E, H]
    layers.L.ffn.gate.bias        (non-hash)     router.bias           F32       [E]
    layers.L.ffn.gate.tid2eid     (hash layers)  router.tid2eid        I64       [vocab, k]
    layers.L.ffn.experts.e.w1.weight  (gate)     experts.e.w1.weight   I8        [I, H/2]   packed e2m1
    layers.L.ffn.experts.e.w1.scale              experts.e.w1.scale    F8_E8M0   [I, H/32]
    layers.L.ffn.experts.e.w3.weight  (up)       experts.e.w3.weight   I8        [I, H/2]
    layers.L.ffn.experts.e.w3.scale              experts.e.w3.scale    F8_E8M0   [I, H/32]
    layers.L.ffn.experts.e.w2.weight  (down)     experts.e.w2.weight   I8        [H, I/2]
    layers.L.ffn.experts.e.w2.scale              experts.e.w2.scale    F8_E8M0   [H, I/32]
    layers.L.ffn.shared_experts.w1.weight        shared.w1.weight      F8_E4M3   [I, H]
    layers.L.ffn.shared_experts.w1.scale         shared.w1.scale       F8_E8M0   [ceil(I/128), ceil(H/128)]
    layers.L.ffn.shared_experts.w3.weight        shared.w3.weight      F8_E4M3   [I, H]
    layers.L.ffn.shared_experts.w3.scale         shared.w3.scale       F8_E8M0   [ceil(I/128), ceil(H/128)]
    layers.L.ffn.shared_experts.w2.weight        shared.w2.weight      F8_E4M3   [H, I]
    layers.L.ffn.shared_experts.w2.scale         shared.w2.scale       F8_E8M0   [ceil(H/128), ceil(I/128)]

Names are built from this table and parsed back by exact, field-by-field matching
(`parse_name`); nothing here or in the reader matches tensors by substring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from dsv4_moe._types import is_int
from dsv4_moe.config import FP8_BLOCK, MXFP4_GROUP, MoEConfig

__all__ = [
    "TensorSpec", "ParsedName", "SAFETENSORS_DTYPES", "PROJECTIONS",
    "layer_prefix", "router_tensor_names", "shared_expert_tensor_names", "expert_tensor_names",
    "layer_tensor_names", "parse_name",
]

# safetensors header dtype string -> the torch dtype `safe_open(framework="pt")` returns.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F8_E4M3": torch.float8_e4m3fn,
}

# w1 = gate, w3 = up (both [I, H]); w2 = down ([H, I]).
PROJECTIONS = ("w1", "w3", "w2")
_ROUTER_PARTS = ("weight", "bias", "tid2eid")
_PARAM_PARTS = ("weight", "scale")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name in the file, the logical name the package uses,
    the safetensors dtype string and the full (unsliced) shape."""

    name: str
    logical: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.torch_dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ParsedName:
    """A checkpoint name taken apart: `layers.{layer}.ffn.{logical}`; `expert` is set for
    routed-expert tensors."""

    layer: int
    logical: str
    expert: Optional[int] = None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def layer_prefix(layer_idx: int) -> str:
    """The common prefix of every FFN tensor of decoder layer `layer_idx`."""
    if not is_int(layer_idx) or layer_idx < 0:
        raise ValueError(f"layer_idx={layer_idx!r}: expected a non-negative int")
    return f"layers.{layer_idx}.ffn."


def router_tensor_names(config: MoEConfig, layer_idx: int) -> list[TensorSpec]:
    """gate.weight, plus gate.tid2eid on hash layers or gate.bias on the others."""
    p = layer_prefix(layer_idx)
    e, h = config.n_routed_experts, config.hidden_size
    specs = [TensorSpec(p + "gate.weight", "router.weight", "BF16", (e, h))]
    if config.is_hash_layer(layer_idx):
        specs.append(TensorSpec(p + "gate.tid2eid", "router.tid2eid", "I64",
                                (config.vocab_size, config.num_experts_per_tok)))
    else:
        specs.append(TensorSpec(p + "gate.bias", "router.bias", "F32", (e,)))
    return specs


def shared_expert_tensor_names(config: MoEConfig, layer_idx: int) -> list[TensorSpec]:
    """The FP8 shared expert: w1, w3, w2 weights (e4m3) and 128x128 block scales (e8m0)."""
    p = layer_prefix(layer_idx) + "shared_experts."
    h, i, b = config.hidden_size, config.moe_intermediate_size, FP8_BLOCK
    shapes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}
    specs = []
    for proj in PROJECTIONS:
        n, k = shapes[proj]
        specs.append(TensorSpec(f"{p}{proj}.weight", f"shared.{proj}.weight", "F8_E4M3", (n, k)))
        specs.append(TensorSpec(f"{p}{proj}.scale", f"shared.{proj}.scale", "F8_E8M0",
                                (_ceil_div(n, b), _ceil_div(k, b))))
    return specs


def expert_tensor_names(config: MoEConfig, layer_idx: int, expert: int) -> list[TensorSpec]:
    """Routed expert `expert`: packed-e2m1 weights (I8) and per-32 e8m0 scales, in the
    order w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale."""
    if not is_int(expert) or not 0 <= expert < config.n_routed_experts:
        raise ValueError(f"expert={expert!r}: expected an int in [0, n_routed_experts={config.n_routed_experts})")
    p = f"{layer_prefix(layer_idx)}experts.{expert}."
    h, i, g = config.hidden_size, config.moe_intermediate_size, MXFP4_GROUP
    shapes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}
    specs = []
    for proj in PROJECTIONS:
        n, k = shapes[proj]
        specs.append(TensorSpec(f"{p}{proj}.weight", f"experts.{expert}.{proj}.weight", "I8", (n, k // 2)))
        specs.append(TensorSpec(f"{p}{proj}.scale", f"experts.{expert}.{proj}.scale", "F8_E8M0", (n, k // g)))
    return specs


def layer_tensor_names(config: MoEConfig, layer_idx: int,
                       experts: Optional[Iterable[int]] = None) -> list[TensorSpec]:
    """Every tensor layer `layer_idx` needs: router, shared expert, then the routed
    experts `experts` (default: all) in the given order."""
    config.is_hash_layer(layer_idx)  # validates layer_idx against the config
    ids: Sequence[int] = range(config.n_routed_experts) if experts is None else list(experts)
    specs = router_tensor_names(config, layer_idx) + shared_expert_tensor_names(config, layer_idx)
    for e in ids:
        specs.extend(expert_tensor_names(config, layer_idx, e))
    return specs


def _parse_int(s: str) -> Optional[int]:
    # Decimal without sign or leading zeros, as the checkpoint writes indices.
    if not s.isdigit() or not s.isascii() or (len(s) > 1 and s[0] == "0"):
        return None
    return int(s)


def parse_name(name: str) -> Optional[ParsedName]:
    """`layers.L.ffn.<part>` -> ParsedName, or None for any name that is not an FFN
    tensor of this table (attention, norms, embeddings, unknown FFN parts).

    Matching is exact, field by field: `layers.3.ffn.experts.7.w2.scale` parses,
    `layers.3.ffn.experts.7.w2.scale_inv` and `model.layers.3...` do not.
    """
    parts = name.split(".")
    if len(parts) < 5 or parts[0] != "layers" or parts[2] != "ffn":
        return None
    layer = _parse_int(parts[1])
    if layer is None:
        return None
    rest = parts[3:]
    if rest[0] == "gate" and len(rest) == 2 and rest[1] in _ROUTER_PARTS:
        return ParsedName(layer, f"router.{rest[1]}")
    if (rest[0] == "shared_experts" and len(rest) == 3 and rest[1] in PROJECTIONS
            and rest[2] in _PARAM_PARTS):
        return ParsedName(layer, f"shared.{rest[1]}.{rest[2]}")
    if rest[0] == "experts" and len(rest) == 4 and rest[2] in PROJECTIONS and rest[3] in _PARAM_PARTS:
        expert = _parse_int(rest[1])
        if expert is None:
            return None
        return ParsedName(layer, f"experts.{expert}.{rest[2]}.{rest[3]}", expert)
    return None
