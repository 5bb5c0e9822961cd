"""L2 prefetch of weight bytes that a later kernel of the same forward reads (decode).

    l2_prefetch(tensors)    up to 4 contiguous CUDA tensors, whole
    -> None; one launch on the current stream, nothing written

Why: at decode the MoE layer's front (router logits, top-k, alignment: three small
dependent launches) leaves the DRAM nearly idle for several microseconds, while the
shared expert's weights - which do not depend on the routing - are read later, beside the
routed GEMMs, on the same DRAM. Prefetching them into the L2 on a stream of their own
during the front moves those bytes into the idle time; the shared GEMMs then read the
L2. The layer decides where (`layers.SHARED_L2_PREFETCH`, `dispatch.shared_prefetch_policy`:
where it measured faster on the H200); this module only issues the prefetches.

A prefetch changes no value anywhere (no register is loaded, nothing is stored), so the
layer's outputs are the same bits with or without it; only the timing moves.

MODE "line": `prefetch.global.L2` per 128-byte line (one lane per line); "bulk": the TMA's
`cp.async.bulk.prefetch.L2` per BULK_CHUNK bytes (one lane per chunk). EVICT_LAST adds the
L2 evict_last hint, so the lines outlive the routed weights streaming through the L2
until the shared GEMMs read them. PROGRAMS per range: few, so the prefetch leaves the
SMs to the one-program top-k and alignment it runs beside.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsv4_moe._types import is_int

__all__ = ["l2_prefetch", "MODES"]

MODES = ("line", "bulk")
MODE = "line"        # A/B switch (scripts/gpu_profile_layer.py --ab dsv4_moe.kernels.l2_prefetch.MODE=line,bulk)
EVICT_LAST = False   # A/B switch
PROGRAMS = 16        # programs per range (grid axis 0)
BULK_CHUNK = 16384   # bytes per bulk prefetch instruction
_BLOCK = 128         # lanes per program per step (4 warps, one unit each)


def _opts(mode, evict_last, programs) -> tuple[int, bool, int, int]:
    mode = MODE if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    evict_last = EVICT_LAST if evict_last is None else evict_last
    programs = PROGRAMS if programs is None else programs
    if not is_int(programs) or programs < 1:
        raise ValueError(f"programs={programs!r}: expected an int >= 1")
    return MODES.index(mode), bool(evict_last), (128 if mode == "line" else BULK_CHUNK), programs


def _check_cuda(name: str, t, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}: the L2 prefetch runs on CUDA only")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the first tensor's device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous: "
                         f"the prefetch covers a tensor's bytes as one range")


def l2_prefetch(tensors: Sequence[torch.Tensor], *, mode: str | None = None, evict_last: bool | None = None,
                programs: int | None = None) -> None:
    """Prefetch the bytes of 1-4 contiguous CUDA tensors into the L2 (one launch, current stream)."""
    tensors = list(tensors)
    if not 1 <= len(tensors) <= 4:
        raise ValueError(f"tensors: expected 1 to 4 tensors, got {len(tensors)}")
    for i, t in enumerate(tensors):
        _check_cuda(f"tensors[{i}]", t, tensors[0].device if i else None)
    code, last, unit, progs = _opts(mode, evict_last, programs)
    ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    ranges += [(0, 0)] * (4 - len(ranges))
    if not any(n for _, n in ranges):
        return
    from ._l2_prefetch import _l2_prefetch_kernel

    with torch.cuda.device(tensors[0].device):
        _l2_prefetch_kernel[(progs, len(tensors))](*(v for r in ranges for v in r), MODE=code, EVICT_LAST=last,
                                                   UNIT=unit, BLOCK=_BLOCK, num_warps=4)
