"""Shard reader for official safetensors checkpoints (SPEC §3).

A checkpoint directory holds either `model.safetensors.index.json`
(`{"metadata": {...}, "weight_map": {name: shard file}}`) plus its shards, or one
`model.safetensors`. The reader:

* maps name -> shard from the index alone (no shard is opened to build the map);
* opens only the shards holding requested tensors (`safe_open`, framework "pt"),
  recording each file it opens in `opened_files`, in order;
* checks every requested tensor *before reading any*: present in the index, its shard
  file exists and parses (a truncated or corrupt shard makes safetensors raise; that
  is wrapped), the header's dtype and shape equal the expected `TensorSpec`, the
  requested slice lies inside the shape;
* reads a slice with `get_slice` so a TP rank touches only its own bytes, and returns
  tensors that own their memory (not views of the memory map).

Every failure is a `CheckpointError` (a ValueError) naming the tensor and the shard
file; a failing `read` returns nothing, so nothing half-loaded escapes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from .names import SAFETENSORS_DTYPES, TensorSpec
from .slicing import Index, sliced_shape

__all__ = ["CheckpointError", "CheckpointReader", "TensorRequest", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not match what the config and name table expect."""


@dataclass(frozen=True)
class TensorRequest:
    """Read tensor `spec` (checked against its full shape and dtype), optionally only the
    part `index` (a tuple of unit-step slices, one per dim)."""

    spec: TensorSpec
    index: Index = None


class CheckpointReader:
    """Index + shard reader over one checkpoint directory.

        reader = CheckpointReader(dir)
        tensors = reader.read([TensorRequest(spec, index), ...])   # {name: tensor}
        reader.opened_files                                        # ["model-00004-of-00005.safetensors"]

    Shard handles stay open until `close()` (or the end of a `with` block) so that the
    check pass and the read pass open each shard once.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike) -> None:
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        if not os.path.isdir(self.checkpoint_dir):
            raise CheckpointError(f"checkpoint_dir={self.checkpoint_dir!r}: not a directory")
        self.opened_files: list[str] = []
        self._handles: dict[str, Any] = {}
        index_path = os.path.join(self.checkpoint_dir, INDEX_FILE)
        single_path = os.path.join(self.checkpoint_dir, SINGLE_FILE)
        if os.path.isfile(index_path):
            self.index_path: Optional[str] = index_path
            self.weight_map = self._read_index(index_path)
        elif os.path.isfile(single_path):
            # A single-file checkpoint has no index: its header is the map.
            self.index_path = None
            self.weight_map = {name: SINGLE_FILE for name in self._open(SINGLE_FILE, names=()).keys()}
        else:
            raise CheckpointError(
                f"checkpoint_dir={self.checkpoint_dir!r}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    # ------------------------------------------------------------------ index
    @staticmethod
    def _read_index(path: str) -> dict[str, str]:
        def no_duplicates(pairs):
            out: dict = {}
            for k, v in pairs:
                if k in out:   # json would keep the last silently
                    raise CheckpointError(f"{path}: key {k!r} appears more than once")
                out[k] = v
            return out

        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"), object_pairs_hook=no_duplicates)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid UTF-8 JSON ({e})") from e
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{path}: expected an object with a 'weight_map' object")
        for name, shard in wm.items():
            # Shard names are plain file names in the checkpoint directory; anything else
            # (paths, non-strings) would let the index point outside it.
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
                raise CheckpointError(f"{path}: weight_map[{name!r}]={shard!r}: expected a shard file name")
        return dict(wm)

    def names(self) -> list[str]:
        """Every tensor name the index lists."""
        return list(self.weight_map)

    def shard_of(self, name: str) -> str:
        """The shard file holding `name`; CheckpointError when the index does not list it."""
        shard = self.weight_map.get(name)
        if shard is None:
            where = self.index_path or os.path.join(self.checkpoint_dir, SINGLE_FILE)
            raise CheckpointError(f"tensor {name!r} is missing: {where} does not list it")
        return shard

    # ------------------------------------------------------------------ shards
    def _open(self, shard: str, names: Sequence[str]) -> Any:
        handle = self._handles.get(shard)
        if handle is not None:
            return handle
        path = os.path.join(self.checkpoint_dir, shard)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"shard {shard!r} (holding {_few(names)}) does not exist in {self.checkpoint_dir!r}, "
                f"though {INDEX_FILE} names it")
        try:
            handle = safe_open(path, framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"shard {path!r} (holding {_few(names)}) is truncated or corrupt: {e}") from e
        self._handles[shard] = handle
        self.opened_files.append(shard)
        return handle

    def close(self) -> None:
        # Dropping the handles releases the memory maps.
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ check / read
    def check(self, requests: Iterable[TensorRequest]) -> None:
        """Validate every request against the index and the shard headers, reading no
        tensor data. Raises CheckpointError naming the tensor and the shard."""
        requests = list(requests)
        by_shard: dict[str, list[TensorRequest]] = {}
        for r in requests:
            by_shard.setdefault(self.shard_of(r.spec.name), []).append(r)
        wanted = {r.spec.name for r in requests}
        stray: list[tuple[str, str]] = []
        for shard, reqs in by_shard.items():
            handle = self._open(shard, [r.spec.name for r in reqs])
            keys = set(handle.keys())
            for r in reqs:
                self._check_one(handle, keys, shard, r)
            stray += [(n, shard) for n in sorted(keys & wanted) if self.weight_map.get(n) != shard]
        # a requested tensor also in a shard the index does not map it to: two copies, and which
        # one is meant is not knowable (only the shards opened for the request are looked at)
        if stray:
            name, shard = stray[0]
            raise CheckpointError(
                f"tensor {name!r} is in shard {os.path.join(self.checkpoint_dir, shard)!r} and, by the index, in "
                f"{self.weight_map.get(name)!r}: duplicated ({len(stray)} such tensors)")

    def _check_one(self, handle: Any, keys: set, shard: str, r: TensorRequest) -> None:
        spec = r.spec
        where = os.path.join(self.checkpoint_dir, shard)
        if spec.name not in keys:
            raise CheckpointError(f"tensor {spec.name!r} is missing from shard {where!r}, though the index maps it there")
        try:
            sl = handle.get_slice(spec.name)
            dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"tensor {spec.name!r} in shard {where!r}: unreadable header ({e})") from e
        if dtype != spec.dtype:
            raise CheckpointError(
                f"tensor {spec.name!r} in shard {where!r}: dtype {dtype}, expected {spec.dtype}")
        if shape != spec.shape:
            raise CheckpointError(
                f"tensor {spec.name!r} in shard {where!r}: shape {list(shape)}, expected {list(spec.shape)} "
                "(the checkpoint and config.json disagree)")
        try:
            sliced_shape(shape, r.index)
        except ValueError as e:
            raise CheckpointError(f"tensor {spec.name!r} in shard {where!r}: bad slice: {e}") from e

    def read(self, requests: Sequence[TensorRequest], *,
             on_tensor: Optional[Callable[[str], None]] = None) -> dict[str, torch.Tensor]:
        """Check all `requests`, then read them: {name: CPU tensor of the header's dtype,
        contiguous, owning its memory, shaped `spec.shape[index]`}. `on_tensor(name)` is
        called after each tensor is read (progress bars)."""
        requests = list(requests)
        self.check(requests)
        out: dict[str, torch.Tensor] = {}
        for r in requests:
            shard = self.shard_of(r.spec.name)
            handle = self._handles[shard]
            try:
                if r.index is None:
                    t = handle.get_tensor(r.spec.name)
                else:
                    t = handle.get_slice(r.spec.name)[r.index]
            except SafetensorError as e:
                raise CheckpointError(
                    f"tensor {r.spec.name!r} in shard {os.path.join(self.checkpoint_dir, shard)!r}: "
                    f"read failed ({e})") from e
            expected = sliced_shape(r.spec.shape, r.index)
            if t.dtype != SAFETENSORS_DTYPES[r.spec.dtype] or tuple(t.shape) != expected:
                raise CheckpointError(
                    f"tensor {r.spec.name!r} in shard {shard!r}: read {t.dtype} {list(t.shape)}, "
                    f"expected {r.spec.dtype} {list(expected)}")
            # clone(): own the bytes instead of pinning the shard's memory map; for a
            # column slice this is also where only the rank's columns are gathered.
            out[r.spec.name] = t.clone(memory_format=torch.contiguous_format)
            if on_tensor is not None:
                on_tensor(r.spec.name)
        return out


def _few(names: Sequence[str], n: int = 3) -> str:
    names = list(names)
    if not names:
        return "its header"
    head = ", ".join(repr(x) for x in names[:n])
    return head + (f" and {len(names) - n} more" if len(names) > n else "")
