"""Write a checkpoint in the official DeepSeek-V4 format (SPEC §3) from random weights.

Real V4 weights cannot be downloaded here, so loaders are tested on checkpoints written
by this module: the same names (no `model.` prefix), dtypes (BF16 / F32 / I64 / I8 /
F8_E8M0 / F8_E4M3), shapes, index file and shard naming as the release, with
realistic statistics:

    router weight        ~N(0, 0.02)                      bf16
    router bias          ~N(0, 0.01)                      f32   (non-hash layers)
    tid2eid              k distinct random expert ids per token, int64 (hash layers)
    expert / shared      ~N(0, 0.02) in fp32, quantised by weights.quantize
                         (MXFP4 per-32 scales / FP8 128x128 block scales chosen from the data)

Determinism: every tensor group (a layer's router, its shared expert, one routed
expert) draws from its own CPU generator seeded by sha256(seed, group name), so the
bytes of a layer do not depend on which other layers are written, on the shard count,
or on the machine's thread count; safetensors orders each header deterministically
(by dtype alignment, then name), so equal inputs give byte-identical files.

Layout: `model-000NN-of-000MM.safetensors`; by default one shard per layer (a layer's
FFN is ~3.4 GB on V4-Flash, about what the release puts in one shard). With
`num_shards` the tensor groups are cut into that many contiguous, byte-balanced shards,
so a layer may straddle two shards as in the release.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from safetensors.torch import save_file

from dsv4_moe._types import is_int
from dsv4_moe.config import FP8_BLOCK, MoEConfig

from .names import TensorSpec, expert_tensor_names, router_tensor_names, shared_expert_tensor_names
from .quantize import quantize_fp8_block, quantize_mxfp4
from .reader import INDEX_FILE

__all__ = ["write_checkpoint", "shard_file_name", "WEIGHT_STD", "BIAS_STD"]

WEIGHT_STD = 0.02
BIAS_STD = 0.01
# Progress bar by default only for layers big enough to take a while (V4 presets have 256+).
_PROGRESS_MIN_EXPERTS = 32


def shard_file_name(i: int, n: int) -> str:
    """The release's shard naming, 1-based: model-00001-of-00048.safetensors."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class _Group:
    """Tensors generated together from one seed: a layer's router, shared expert, or one expert."""

    layer: int
    kind: str  # "router" | "shared" | "expert"
    expert: int
    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def key(self) -> str:
        return f"layers.{self.layer}.ffn.{self.kind}" + (f".{self.expert}" if self.kind == "expert" else "")


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"dsv4_moe/{seed}/{key}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return g


def _randn(shape: Sequence[int], std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).mul_(std)


def _generate(group: _Group, config: MoEConfig, seed: int) -> dict[str, torch.Tensor]:
    g = _generator(seed, group.key)
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
    out: dict[str, torch.Tensor] = {}
    if group.kind == "router":
        weight_spec, extra_spec = group.specs
        out[weight_spec.name] = _randn((e, h), WEIGHT_STD, g).to(torch.bfloat16)
        if extra_spec.logical == "router.bias":
            out[extra_spec.name] = _randn((e,), BIAS_STD, g)
        else:
            # k distinct ids per token: the k largest of E uniform draws.
            vocab, k = extra_spec.shape
            out[extra_spec.name] = torch.rand(vocab, e, generator=g).topk(k, dim=-1).indices.to(torch.int64)
        return out
    shapes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}
    # "shared.w1.weight" / "experts.7.w1.weight" -> "w1.weight"
    by_logical = {".".join(s.logical.split(".")[-2:]): s for s in group.specs}
    for proj in ("w1", "w3", "w2"):
        w = _randn(shapes[proj], WEIGHT_STD, g)
        if group.kind == "shared":
            q, s = quantize_fp8_block(w)
        else:
            q, s = quantize_mxfp4(w)
            q = q.view(torch.int8)  # the release stores packed e2m1 as I8
        out[by_logical[f"{proj}.weight"].name] = q
        out[by_logical[f"{proj}.scale"].name] = s
    return out


def _groups(config: MoEConfig, layers: Sequence[int]) -> list[_Group]:
    groups = []
    for layer in layers:
        groups.append(_Group(layer, "router", -1, tuple(router_tensor_names(config, layer))))
        groups.append(_Group(layer, "shared", -1, tuple(shared_expert_tensor_names(config, layer))))
        for e in range(config.n_routed_experts):
            groups.append(_Group(layer, "expert", e, tuple(expert_tensor_names(config, layer, e))))
    return groups


def _split(groups: list[_Group], layers: Sequence[int], num_shards: Optional[int]) -> list[list[_Group]]:
    if num_shards is None:
        return [[g for g in groups if g.layer == layer] for layer in layers]
    if not is_int(num_shards) or not 1 <= num_shards <= len(groups):
        raise ValueError(f"num_shards={num_shards!r}: expected an int in [1, {len(groups)}] (tensor groups)")
    # Contiguous and byte-balanced: cut j falls after the first group whose running byte
    # total reaches j/n of the whole, kept so that every shard gets at least one group.
    cum = list(itertools.accumulate(g.nbytes for g in groups))
    bounds = [0]
    for j in range(1, num_shards):
        c = bisect.bisect_left(cum, cum[-1] * j / num_shards) + 1
        c = min(max(c, bounds[-1] + 1), len(groups) - (num_shards - j))
        bounds.append(c)
    bounds.append(len(groups))
    return [groups[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _show_progress(progress: Optional[bool], config: MoEConfig) -> bool:
    if progress is not None:
        return bool(progress)
    return sys.stderr.isatty() and config.n_routed_experts > _PROGRESS_MIN_EXPERTS


def _existing_outputs(out_dir: str) -> list[str]:
    return sorted(f for f in os.listdir(out_dir)
                  if f in (INDEX_FILE, "config.json", "model.safetensors")
                  or (f.startswith("model-") and f.endswith(".safetensors")))


def write_checkpoint(checkpoint_dir: str | os.PathLike, config: MoEConfig, *, layers: Iterable[int],
                     seed: int = 0, num_shards: Optional[int] = None, overwrite: bool = False,
                     progress: Optional[bool] = None) -> str:
    """Write `config.json`, `model.safetensors.index.json` and the shards holding the
    FFN tensors of `layers` to `checkpoint_dir`; return the directory path.

    layers      decoder layer indices (each in [0, config.num_hidden_layers)); hash
                layers (index < num_hash_layers) get tid2eid, the others a bias
    seed        int; the output bytes are a function of (config, layers, seed, num_shards)
    num_shards  None: one shard per layer; else that many byte-balanced shards
    overwrite   False: refuse a directory already holding checkpoint files; True: replace them
    progress    tqdm bar over tensor groups; None: on when stderr is a tty and E > 32
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected a MoEConfig, got {type(config).__name__}")
    if not is_int(seed):
        raise TypeError(f"seed={seed!r}: expected an int")
    for key, v in (("overwrite", overwrite), ("progress", progress)):
        if not isinstance(v, bool) and not (key == "progress" and v is None):
            raise TypeError(f"{key}={v!r}: expected True or False" + (" (or None)" if key == "progress" else ""))
    if config.moe_intermediate_size % FP8_BLOCK:
        raise ValueError(f"config.moe_intermediate_size={config.moe_intermediate_size}: the loader needs a multiple of "
                         f"{FP8_BLOCK} (the shared expert's FP8 block; its gate and up scales are merged per block), "
                         f"so this checkpoint could not be read back")
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers={layers!r}: expected an iterable of layer indices, e.g. [3, 4]")
    layers = list(layers)
    if not layers:
        raise ValueError("layers=[]: expected at least one layer index")
    for layer in layers:
        config.is_hash_layer(layer)  # raises naming a bad index
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers={layers}: duplicate layer indices")
    layers = sorted(layers)
    out_dir = os.fspath(checkpoint_dir)
    # every argument is checked before anything on disk is touched (a refused call leaves the
    # directory as it was: no empty directory made, no old checkpoint removed)
    groups = _groups(config, layers)
    shards = _split(groups, layers, num_shards)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"checkpoint_dir={out_dir!r} exists and is not a directory")
    existing = _existing_outputs(out_dir) if os.path.isdir(out_dir) else []
    if existing and not overwrite:
        raise FileExistsError(f"checkpoint_dir={out_dir!r} already holds {existing}; overwrite=True (make-checkpoint --overwrite) replaces them")
    os.makedirs(out_dir, exist_ok=True)
    for f in existing:
        os.remove(os.path.join(out_dir, f))
    n = len(shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    from tqdm.auto import tqdm

    with tqdm(total=len(groups), desc=f"writing layers {layers}", unit="group",
              disable=not _show_progress(progress, config)) as bar:
        for j, shard_groups in enumerate(shards):
            fname = shard_file_name(j, n)
            tensors: dict[str, torch.Tensor] = {}
            for g in shard_groups:
                tensors.update(_generate(g, config, seed))
                bar.update(1)
            for name, t in tensors.items():
                weight_map[name] = fname
                total_size += t.numel() * t.element_size()
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
            del tensors

    index = {"metadata": {"total_size": total_size},
             "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    # safetensors' save_file creates its files 0600 whatever the umask; give the shards the mode
    # the process gives its other new files (the index's), so a shared directory is readable
    mode = os.stat(os.path.join(out_dir, INDEX_FILE)).st_mode & 0o777
    for fname in sorted(set(weight_map.values())):
        os.chmod(os.path.join(out_dir, fname), mode)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
        f.write("\n")
    return out_dir
