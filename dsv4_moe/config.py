"""MoEConfig: the facts of one DeepSeek-V4 MoE FFN (SPEC §2), as a frozen dataclass.

Everything the layers, loaders, kernels and benchmarks need to know about the model
comes from here; no other module hard-codes a model number. `repr(config)` is
paste-able: `MoEConfig(hidden_size=4096, ...)` rebuilds the same config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ._types import is_int, is_real

__all__ = ["MoEConfig", "FP8_BLOCK", "MXFP4_GROUP", "ACT_BLOCK"]

# Quantisation granularities fixed by the checkpoint format (SPEC §3, §4.2).
FP8_BLOCK = 128  # FP8 weight blocks are FP8_BLOCK x FP8_BLOCK (V4, V4-Pro)
MXFP4_GROUP = 32  # one e8m0 scale per 32 e2m1 values along K
ACT_BLOCK = 128  # act_quant: one UE8M0 scale per 128 columns of a row

_REQUIRED = object()  # MoEConfig.from_dict: a key with no default

_SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
_SUPPORTED_SCORING = ("sqrtsoftplus",)
_SUPPORTED_TOPK_METHOD = ("noaux_tc",)
_SUPPORTED_EXPERT_DTYPE = ("fp4",)


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing facts of a DeepSeek-V4 MoE layer.

    Field names follow the official `config.json` keys, except `fp8_block_size` (read from and
    written to `quantization_config.weight_block_size`) and `name` (a label: the preset's name,
    stored as `_dsv4_moe_name`). The defaults are V4-Flash's (`MoEConfig.preset("flash")` differs
    only in its name); `from_pretrained(dir)` reads a checkpoint's config.json.
    """

    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hidden_layers: int = 43
    num_hash_layers: int = 3
    vocab_size: int = 129280
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    expert_dtype: str = "fp4"
    fp8_block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    model_type: str = "deepseek_v4"
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        def _pos_int(key: str) -> None:
            v = getattr(self, key)
            if not is_int(v) or v <= 0:
                raise ValueError(f"MoEConfig.{key}={v!r}: expected a positive int")

        for key in ("hidden_size", "moe_intermediate_size", "n_routed_experts",
                    "num_experts_per_tok", "num_hidden_layers", "vocab_size"):
            _pos_int(key)
        if self.model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"MoEConfig.model_type={self.model_type!r}: expected one of {_SUPPORTED_MODEL_TYPES}")
        if self.scoring_func not in _SUPPORTED_SCORING:
            raise ValueError(
                f"MoEConfig.scoring_func={self.scoring_func!r}: expected one of {_SUPPORTED_SCORING}")
        if self.topk_method not in _SUPPORTED_TOPK_METHOD:
            raise ValueError(
                f"MoEConfig.topk_method={self.topk_method!r}: expected one of {_SUPPORTED_TOPK_METHOD}")
        if self.expert_dtype not in _SUPPORTED_EXPERT_DTYPE:
            raise ValueError(
                f"MoEConfig.expert_dtype={self.expert_dtype!r}: expected one of {_SUPPORTED_EXPERT_DTYPE} "
                "(FP8 routed experts of V4-Flash-Base are not supported yet)")
        if isinstance(self.n_shared_experts, bool) or self.n_shared_experts != 1 or not isinstance(
                self.n_shared_experts, int):
            raise ValueError(f"MoEConfig.n_shared_experts={self.n_shared_experts!r}: expected 1")
        if self.norm_topk_prob is not True:
            raise ValueError(f"MoEConfig.norm_topk_prob={self.norm_topk_prob!r}: DeepSeek-V4 always renormalises; "
                             "expected True")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"MoEConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"n_routed_experts={self.n_routed_experts}")
        if not (is_int(self.num_hash_layers)
                and 0 <= self.num_hash_layers <= self.num_hidden_layers):
            raise ValueError(
                f"MoEConfig.num_hash_layers={self.num_hash_layers!r}: expected an int in "
                f"[0, num_hidden_layers={self.num_hidden_layers}]")
        blk = self.fp8_block_size
        if (not isinstance(blk, (tuple, list)) or len(blk) != 2
                or any(not is_int(b) for b in blk)):
            raise ValueError(f"MoEConfig.fp8_block_size={blk!r}: expected two ints, ({FP8_BLOCK}, {FP8_BLOCK})")
        if tuple(self.fp8_block_size) != (FP8_BLOCK, FP8_BLOCK):
            raise ValueError(
                f"MoEConfig.fp8_block_size={self.fp8_block_size!r}: only [{FP8_BLOCK}, {FP8_BLOCK}] is supported "
                "(V4.1's [32, 32] blocks are not supported yet)")
        object.__setattr__(self, "fp8_block_size", tuple(self.fp8_block_size))
        for key in ("routed_scaling_factor", "swiglu_limit"):
            v = getattr(self, key)
            if not is_real(v) or not (0 < v < math.inf):
                raise ValueError(f"MoEConfig.{key}={v!r}: expected a finite number > 0")
        for key, div in (("hidden_size", 2 * MXFP4_GROUP), ("moe_intermediate_size", MXFP4_GROUP)):
            v = getattr(self, key)
            if v % div:
                raise ValueError(f"MoEConfig.{key}={v}: must be a multiple of {div} (MXFP4 groups of {MXFP4_GROUP})")

    # ------------------------------------------------------------------ presets
    @classmethod
    def flash(cls) -> MoEConfig:
        """DeepSeek-V4-Flash (hidden 4096, intermediate 2048, 256 experts)."""
        return cls(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=256,
                   routed_scaling_factor=1.5, num_hidden_layers=43, num_hash_layers=3, name="flash")

    @classmethod
    def pro(cls) -> MoEConfig:
        """DeepSeek-V4-Pro (hidden 7168, intermediate 3072, 384 experts)."""
        return cls(hidden_size=7168, moe_intermediate_size=3072, n_routed_experts=384,
                   routed_scaling_factor=2.5, num_hidden_layers=61, num_hash_layers=3, name="pro")

    @classmethod
    def tiny(cls) -> MoEConfig:
        """The embedded default checkpoint's shape: small, CPU-friendly, I=384 like Pro at TP8."""
        return cls(hidden_size=256, moe_intermediate_size=384, n_routed_experts=16,
                   routed_scaling_factor=1.5, num_hidden_layers=2, num_hash_layers=1,
                   vocab_size=1024, name="tiny")

    @classmethod
    def preset(cls, name: str) -> MoEConfig:
        presets = {"flash": cls.flash, "pro": cls.pro, "tiny": cls.tiny}
        if not isinstance(name, str) or name not in presets:
            raise ValueError(f"preset={name!r}: expected one of {sorted(presets)}")
        return presets[name]()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "<dict>") -> MoEConfig:
        """A config from official `config.json` keys. The keys that set the numerics or the
        layer count (hidden_size, moe_intermediate_size, n_routed_experts, num_experts_per_tok,
        routed_scaling_factor, swiglu_limit, num_hidden_layers, num_hash_layers) are required;
        every value must have its JSON type (no coercion); errors name `source` and the key."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object of config keys, got {type(d).__name__}")
        if "text_config" in d and d.get("model_type") != "deepseek_v4":
            raise ValueError(
                f"{source}: model_type={d.get('model_type')!r} with a text_config (DeepSeek-V4.1) is not "
                "supported yet: its 32x32 FP8 blocks, gate_temp and bias_vl are unimplemented")
        mt = d.get("model_type", "deepseek_v4")
        if mt != "deepseek_v4":
            raise ValueError(f"{source}: model_type={mt!r}: expected 'deepseek_v4'")
        # V4.1's extras change the routing (SPEC §2); nothing here implements them, so a config that sets
        # them is refused rather than loaded and run with V4's routing
        if "text_config" in d:
            raise ValueError(f"{source}: text_config is set (DeepSeek-V4.1's layout): not supported yet")
        if d.get("gate_temp") not in (None, 1, 1.0) or isinstance(d.get("gate_temp"), bool):
            raise ValueError(f"{source}: gate_temp={d['gate_temp']!r}: the router would divide its logits by it "
                             f"(DeepSeek-V4.1); only 1.0 (or no key) is supported")
        if d.get("bias_vl") not in (None, False):
            raise ValueError(f"{source}: bias_vl={d['bias_vl']!r}: a second selection bias (DeepSeek-V4.1, image "
                             f"tokens) is not supported")
        if d.get("hidden_act") not in (None, "silu"):
            raise ValueError(f"{source}: hidden_act={d['hidden_act']!r}: expected 'silu' (the clamped SwiGLU of V4)")

        def typed(key: str, kinds: tuple, what: str, default: Any = _REQUIRED) -> Any:
            # NOTE: no coercion: int("256"), int(2.5) or bool("false") would load a config other
            # than the file's without a word (bool is an int to Python, so it is refused apart)
            if key not in d:
                if default is _REQUIRED:
                    raise ValueError(f"{source}: missing required key {key!r} ({what})")
                return default
            v = d[key]
            if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
                raise ValueError(f"{source}: {key}={v!r}: expected {what}")
            return v

        qc = d.get("quantization_config", {})
        if qc is None:
            qc = {}
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: quantization_config={qc!r}: expected a JSON object")
        # the numerics SPEC §4 fixes: keys that are present must say so (absent keys mean V4's)
        for key, want in (("quant_method", ("fp8",)), ("fmt", ("e4m3",)), ("scale_fmt", ("ue8m0",)),
                          ("activation_scheme", ("dynamic",))):
            if key in qc and qc[key] not in want:
                raise ValueError(f"{source}: quantization_config.{key}={qc[key]!r}: expected {want[0]!r} (the "
                                 f"numerics this package implements: FP8 e4m3 with UE8M0 power-of-two scales, "
                                 f"activations quantised per 128 columns at run time)")
        block = qc.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or any(not is_int(b) for b in block)):
            raise ValueError(f"{source}: quantization_config.weight_block_size={block!r}: expected a list of two ints")
        expert_dtype = d.get("expert_dtype", qc.get("expert_dtype", "fp4"))
        if not isinstance(expert_dtype, str):
            raise ValueError(f"{source}: expert_dtype={expert_dtype!r}: expected a string")
        for key in ("n_group", "topk_group"):
            if d.get(key) not in (None, 1):
                raise ValueError(f"{source}: {key}={d[key]!r}: group-limited top-k is not part of DeepSeek-V4")
        num = (int, float)
        return cls(
            hidden_size=typed("hidden_size", (int,), "an int"),
            moe_intermediate_size=typed("moe_intermediate_size", (int,), "an int"),
            n_routed_experts=typed("n_routed_experts", (int,), "an int"),
            n_shared_experts=typed("n_shared_experts", (int,), "an int", 1),
            num_experts_per_tok=typed("num_experts_per_tok", (int,), "an int"),
            routed_scaling_factor=float(typed("routed_scaling_factor", num, "a number (1.5 Flash, 2.5 Pro)")),
            swiglu_limit=float(typed("swiglu_limit", num, "a number (10.0 in V4)")),
            num_hidden_layers=typed("num_hidden_layers", (int,), "an int"),
            num_hash_layers=typed("num_hash_layers", (int,), "an int (3 in V4)"),
            vocab_size=typed("vocab_size", (int,), "an int", 129280),
            scoring_func=typed("scoring_func", (str,), "a string", "sqrtsoftplus"),
            topk_method=typed("topk_method", (str,), "a string", "noaux_tc"),
            norm_topk_prob=typed("norm_topk_prob", (bool,), "true or false", True),
            expert_dtype=expert_dtype,
            fp8_block_size=tuple(block),
            model_type=mt,
            name=typed("_dsv4_moe_name", (str,), "a string (this package's preset name)", "custom"),
        )

    @classmethod
    def from_pretrained(cls, source: Any) -> MoEConfig:
        """Read a config from a checkpoint directory, a `config.json` path, or a
        transformers `DeepseekV4Config`."""
        if hasattr(source, "to_dict") and not isinstance(source, (str, os.PathLike)):
            d = source.to_dict()
            if "hidden_act" in d or getattr(source, "model_type", None) == "deepseek_v4":
                # transformers' mlp_layer_types encodes the hash layers explicitly.
                types = d.get("mlp_layer_types")
                if types is not None:
                    d = dict(d, num_hash_layers=sum(t == "hash_moe" for t in types))
            return cls.from_dict(d, source=type(source).__name__)
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"from_pretrained: source={source!r}: expected a checkpoint directory, a config.json "
                            f"path or a transformers DeepseekV4Config")
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"from_pretrained: no config.json at {path!r}")
        with open(path, "rb") as f:
            try:
                d = json.loads(f.read().decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not valid UTF-8 JSON ({e})") from e
        return cls.from_dict(d, source=path)

    def to_dict(self) -> dict[str, Any]:
        """The official `config.json` keys this package reads (plus the quantization_config)."""
        return {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "num_hidden_layers": self.num_hidden_layers,
            "num_hash_layers": self.num_hash_layers,
            "vocab_size": self.vocab_size,
            "scoring_func": self.scoring_func,
            "topk_method": self.topk_method,
            "norm_topk_prob": self.norm_topk_prob,
            "expert_dtype": self.expert_dtype,
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "scale_fmt": "ue8m0",
                "weight_block_size": list(self.fp8_block_size),
            },
            "_dsv4_moe_name": self.name,
        }

    # ------------------------------------------------------------------ facts
    def is_hash_layer(self, layer_idx: int) -> bool:
        if (not is_int(layer_idx) or layer_idx < 0
                or layer_idx >= self.num_hidden_layers):
            raise ValueError(
                f"layer_idx={layer_idx!r}: expected an int in [0, num_hidden_layers={self.num_hidden_layers})")
        return layer_idx < self.num_hash_layers

    def check_parallel(self, *, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> None:
        """Raise ValueError if this config cannot be split this way (SPEC §6)."""
        for key, rank, size in (("tp", tp_rank, tp_size), ("ep", ep_rank, ep_size)):
            if not is_int(size) or size < 1:
                raise ValueError(f"{key}_size={size!r}: expected an int >= 1")
            if not is_int(rank) or not 0 <= rank < size:
                raise ValueError(f"{key}_rank={rank!r}: expected an int in [0, {key}_size={size})")
        if tp_size > 1 and ep_size > 1:
            raise ValueError(f"tp_size={tp_size} with ep_size={ep_size}: combine one of them, not both")
        i = self.moe_intermediate_size
        if i % (MXFP4_GROUP * tp_size):
            raise ValueError(
                f"tp_size={tp_size}: moe_intermediate_size={i} must be divisible by {MXFP4_GROUP}*tp_size "
                f"so each rank holds whole MXFP4 groups")
        if tp_size > 1 and (i // tp_size) % FP8_BLOCK:
            raise ValueError(
                f"tp_size={tp_size}: per-rank intermediate {i // tp_size} must be a multiple of the FP8 block "
                f"{FP8_BLOCK} so the shared expert's block scales split cleanly")
        if self.n_routed_experts % ep_size:
            raise ValueError(
                f"ep_size={ep_size}: n_routed_experts={self.n_routed_experts} must be divisible by ep_size")

    def local_intermediate(self, tp_size: int = 1) -> int:
        return self.moe_intermediate_size // tp_size

    def local_experts(self, ep_rank: int = 0, ep_size: int = 1) -> range:
        n = self.n_routed_experts // ep_size
        return range(ep_rank * n, (ep_rank + 1) * n)

    def replace(self, **changes: Any) -> MoEConfig:
        return dataclasses.replace(self, **changes)
