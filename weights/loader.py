"""Load one MoE layer's native tensors from an official checkpoint directory.

    config, weights = load_layer_weights(dir, layer_idx, tp_rank=r, tp_size=8)

Steps: read `config.json` (MoEConfig.from_pretrained); check the parallel split; compare
the index's names for this layer with what the config implies (expert count, hash vs
bias); build the exact name list (weights.names) with each rank's slice
(weights.slicing); check every tensor's dtype, shape and shard before reading any;
read only this rank's bytes, only from the shards that hold them, checking the values a
header cannot vouch for (NaN scales and FP8 codes, tid2eid ids); assemble the
containers (weights.prepare) directly on `device`, one expert at a time.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from dsv4_moe.config import MoEConfig

from . import prepare
from .names import (expert_tensor_names, layer_prefix, layer_tensor_names, parse_name, router_tensor_names,
                    shared_expert_tensor_names)
from .reader import CheckpointError, CheckpointReader, TensorRequest
from .slicing import ep_experts, tp_index
from .tensors import MoELayerWeights

__all__ = ["load_layer_weights", "check_device"]

# Loads of more experts than this show a progress bar by default (when stderr is a tty):
# a V4-Flash layer (256 experts, ~3.4 GB) takes seconds to tens of seconds from disk.
_PROGRESS_MIN_EXPERTS = 32


def _check_layer_names(reader: CheckpointReader, config: MoEConfig, layer_idx: int) -> None:
    """Fail when the index's FFN names for this layer contradict the config: experts
    beyond n_routed_experts, a bias on a hash layer, a tid2eid on a non-hash layer, names
    the config implies but the index lacks. (Dtypes and shapes are checked against the
    shard headers afterwards, by CheckpointReader.check.)"""
    is_hash = config.is_hash_layer(layer_idx)
    for name in reader.names():
        p = parse_name(name)
        if p is None or p.layer != layer_idx:
            continue
        shard = reader.shard_of(name)
        if p.expert is not None and p.expert >= config.n_routed_experts:
            raise CheckpointError(
                f"tensor {name!r} in shard {shard!r}: expert {p.expert} does not exist under config.json's "
                f"n_routed_experts={config.n_routed_experts} (the checkpoint and config.json disagree)")
        if p.logical == "router.bias" and is_hash:
            raise CheckpointError(
                f"tensor {name!r} in shard {shard!r}: a selection bias on layer {layer_idx}, which config.json's "
                f"num_hash_layers={config.num_hash_layers} makes a hash layer (the checkpoint and config disagree)")
        if p.logical == "router.tid2eid" and not is_hash:
            raise CheckpointError(
                f"tensor {name!r} in shard {shard!r}: a hash table on layer {layer_idx}, which config.json's "
                f"num_hash_layers={config.num_hash_layers} makes a biased top-k layer (the checkpoint and config "
                "disagree)")
    expected = [s.name for s in layer_tensor_names(config, layer_idx)]
    missing = [n for n in expected if n not in reader.weight_map]
    if missing:
        present = sorted({reader.shard_of(n) for n in reader.names()
                          if (p := parse_name(n)) is not None and p.layer == layer_idx})
        where = f"its other FFN tensors are in {present}" if present else "the index lists no FFN tensor of this layer"
        raise CheckpointError(
            f"tensor {missing[0]!r} is missing ({len(missing)} of the {len(expected)} tensors config.json implies "
            f"for layer {layer_idx} are absent from {reader.index_path or 'model.safetensors'}; {where}). "
            f"config.json: n_routed_experts={config.n_routed_experts}, num_hash_layers={config.num_hash_layers}")


def _show_progress(progress: Optional[bool], num_experts: int) -> bool:
    if progress is not None:
        return bool(progress)
    return sys.stderr.isatty() and num_experts > _PROGRESS_MIN_EXPERTS


def check_device(device, *, name: str = "device") -> torch.device:
    """torch.device(device), or a ValueError naming it (as `name`, e.g. a CLI flag): a string
    torch cannot parse, a type other than cpu / cuda, or a CUDA device this process lacks."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise ValueError(f"{name}={device!r}: expected 'cpu', 'cuda', 'cuda:N' or a torch.device")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}={device!r}: not a device torch knows ({e})") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={device!r}: expected a cpu or cuda device, got type {dev.type!r}")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise ValueError(f"{name}={device!r}: the CPU has no index {dev.index}")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"{name}={device!r}: no CUDA device in this process (torch {torch.__version__})")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"{name}={device!r}: this process has {n} CUDA device(s)")
    return dev


def _check_values(reader: CheckpointReader, tensors: dict[str, torch.Tensor], num_experts: int) -> None:
    """The values a well-formed header can still hide, checked as each group of tensors is
    read: NaN e8m0 scales (0xFF) and FP8 e4m3 weights (S.1111.111), non-finite router weights
    or bias, tid2eid ids outside [0, E) or repeated in a row. CheckpointError naming the tensor
    and shard. The MXFP4 e2m1 codes have no invalid values."""
    for name, t in tensors.items():
        def bad(what: str, mask: torch.Tensor) -> None:
            first = tuple(int(i) for i in torch.nonzero(mask)[0])
            where = os.path.join(reader.checkpoint_dir, reader.shard_of(name))
            raise CheckpointError(f"tensor {name!r} in shard {where!r}: {int(mask.sum())} {what}, first at {first}")

        if t.dtype == torch.float8_e8m0fnu:
            mask = t.view(torch.uint8) == 0xFF
            if mask.any():
                bad("NaN e8m0 scales (byte 0xFF)", mask)
        elif t.dtype == torch.float8_e4m3fn:
            mask = (t.view(torch.uint8) & 0x7F) == 0x7F
            if mask.any():
                bad("NaN FP8 e4m3 values (byte 0x7F / 0xFF)", mask)
        elif t.is_floating_point():
            mask = ~torch.isfinite(t)
            if mask.any():
                bad("non-finite values", mask)
        elif (parsed := parse_name(name)) is not None and parsed.logical == "router.tid2eid":
            mask = (t < 0) | (t >= num_experts)
            if mask.any():
                bad(f"expert ids outside [0, {num_experts})", mask)
            srt = t.sort(dim=1).values
            mask = srt[:, 1:] == srt[:, :-1]
            if mask.any():
                bad("repeated expert ids within a token's row (a token's k experts must be distinct)", mask)


def load_layer_weights(checkpoint_dir: str | os.PathLike, layer_idx: int, *, device: torch.device | str = "cpu",
                       tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
                       progress: Optional[bool] = None) -> tuple[MoEConfig, MoELayerWeights]:
    """Read the FFN of decoder layer `layer_idx` for one rank.

    Returns (config, weights) with weights laid out as `weights.tensors` documents:
    router replicated; shared expert with I/tp_size rows; routed experts
    `config.local_experts(ep_rank, ep_size)` with I/tp_size rows each.
    `progress`: tqdm bar over experts; None shows it when stderr is a tty and the rank
    loads more than 32 experts. Raises CheckpointError (a ValueError) naming the
    tensor and shard for anything missing or inconsistent; nothing is returned then.
    """
    device = check_device(device)
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"progress={progress!r}: expected True, False or None (a bar when stderr is a terminal)")
    config = MoEConfig.from_pretrained(checkpoint_dir)
    config.check_parallel(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)
    is_hash = config.is_hash_layer(layer_idx)
    local = ep_experts(config, ep_rank, ep_size)

    def requests(specs):
        return [TensorRequest(s, tp_index(s.logical, config, tp_rank, tp_size)) for s in specs]

    router_req = requests(router_tensor_names(config, layer_idx))
    shared_req = requests(shared_expert_tensor_names(config, layer_idx))
    expert_req = [requests(expert_tensor_names(config, layer_idx, e)) for e in local]

    with CheckpointReader(checkpoint_dir) as reader:
        _check_layer_names(reader, config, layer_idx)
        # Everything is checked before the first byte is read, so a bad checkpoint fails
        # fast and no partially filled layer is ever returned.
        reader.check(router_req + shared_req + [r for rs in expert_req for r in rs])

        t = reader.read(router_req)
        _check_values(reader, t, config.n_routed_experts)
        p = layer_prefix(layer_idx)
        router = prepare.prepare_router(
            t[p + "gate.weight"], None if is_hash else t[p + "gate.bias"], t[p + "gate.tid2eid"] if is_hash else None)

        t = reader.read(shared_req)
        _check_values(reader, t, config.n_routed_experts)
        shared = prepare.prepare_shared({".".join(r.spec.name.split(".")[-2:]): t[r.spec.name] for r in shared_req})

        routed = prepare.empty_routed(len(local), config.hidden_size, config.local_intermediate(tp_size),
                                      first_expert=local.start, num_experts=config.n_routed_experts, device=device)
        from tqdm.auto import tqdm

        with tqdm(total=len(local), desc=f"layer {layer_idx} experts", unit="expert",
                  disable=not _show_progress(progress, len(local))) as bar:
            for j, reqs in enumerate(expert_req):
                t = reader.read(reqs)
                _check_values(reader, t, config.n_routed_experts)
                prepare.place_expert(routed, j, {".".join(r.spec.name.split(".")[-2:]): t[r.spec.name] for r in reqs})
                bar.update(1)

    weights = MoELayerWeights(router=router.to(device), shared=shared.to(device), routed=routed,
                              layer_idx=layer_idx, tp_rank=tp_rank, tp_size=tp_size,
                              ep_rank=ep_rank, ep_size=ep_size)
    return config, weights
