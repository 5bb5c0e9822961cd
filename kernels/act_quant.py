"""act_quant — per-row, per-128-column UE8M0 FP8 quantisation of bf16 activations (SPEC §4.2).

    amax = max |x[m, group]| (fp32, NaN ignored), floored at 1e-4
    s    = 2^ceil(log2(amax / 448))    exact, on the fp32 bits of amax / 448
    q    = e4m3(clamp(x / s, -448, 448))   round-to-nearest-even

Scale formats (`scale_fmt`), all [M, G] with G = ceil(K/128):

    "fp32"     float32            row-major, powers of two (the package default)
    "e8m0"     float8_e8m0fnu     row-major, the exponent byte of the fp32 scale
    "fp32_cm"  float32            shape [M4, G], strides (1, M4), M4 = M rounded up to a
                                  multiple of 4: the activation-scale layout torch's
                                  blockwise scaled_mm wants. Rows M..M4-1 hold the scale
                                  of an all-zero group (2^-22); their q rows do not exist.
    "amax"     float32            row-major, plain amax / 448 (not a power of two), for
                                  consumers that do not want UE8M0 scales

`pairs=True` also returns bf16(q) (exact) with each 128-column group stored as its 64 even
columns, then its 64 odd ones ("pairs" layout, K % 128 == 0): the second operand the
routed MXFP4 swap GEMM loads as is (GemmConfig.a_bf16), written by the same kernel
instead of a separate conversion launch.

Triton is imported lazily (on the first call), so importing this module never needs it.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["act_quant", "alloc_scales", "check_scales_out", "check_pairs_out", "scale_fmt_code", "padded_rows"]

_BLOCK = 128


def padded_rows(m: int) -> int:
    """M rounded up to a multiple of 4 (torch's blockwise scaled_mm scale alignment)."""
    return (m + 3) // 4 * 4


def scale_fmt_code(scale_fmt: str, fn: str) -> int:
    from ._triton_utils import SCALE_FMTS

    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"{fn}: scale_fmt={scale_fmt!r}, expected one of {sorted(SCALE_FMTS)}")
    return SCALE_FMTS[scale_fmt]


def _scale_spec(m: int, g: int, scale_fmt: str):
    """(shape, strides, dtype) of the scale tensor for a format."""
    if scale_fmt == "fp32_cm":
        m4 = padded_rows(m)
        return (m4, g), (1, m4), torch.float32
    if scale_fmt == "e8m0":
        return (m, g), (g, 1), torch.float8_e8m0fnu
    return (m, g), (g, 1), torch.float32


def alloc_scales(m: int, g: int, scale_fmt: str, device) -> torch.Tensor:
    shape, _, dtype = _scale_spec(m, g, scale_fmt)
    if scale_fmt == "fp32_cm":
        return torch.empty(shape[1], shape[0], dtype=dtype, device=device).t()
    return torch.empty(shape, dtype=dtype, device=device)


def check_scales_out(out_s: torch.Tensor, m: int, g: int, scale_fmt: str, device, fn: str) -> None:
    shape, strides, dtype = _scale_spec(m, g, scale_fmt)
    if out_s.dtype != dtype:
        raise ValueError(f"{fn}: out_s.dtype={out_s.dtype}, expected {dtype} for scale_fmt={scale_fmt!r}")
    if tuple(out_s.shape) != shape:
        raise ValueError(f"{fn}: out_s.shape={tuple(out_s.shape)}, expected {shape} for scale_fmt={scale_fmt!r}")
    if out_s.device != torch.device(device) and out_s.device.type != torch.device(device).type:
        raise ValueError(f"{fn}: out_s.device={out_s.device}, expected {device}")
    if shape[0] > 1 and shape[1] > 1 and tuple(out_s.stride()) != strides:
        raise ValueError(f"{fn}: out_s.stride()={tuple(out_s.stride())}, expected {strides} for "
                         f"scale_fmt={scale_fmt!r}")


PAIRS_MODES = (False, True, "scaled")


def pairs_scaled(pairs, fn: str, scale_fmt: str = "fp32") -> bool:
    """Validate a `pairs` argument (False, True or "scaled") -> whether the pairs are scaled
    (bf16(q * s): each row's group scale folded in, exact for power-of-two scales; the
    routed swap body's operand with GemmConfig.fold_sa). Scaled pairs need fp32 scales."""
    if not any(pairs is v or (isinstance(v, str) and pairs == v) for v in PAIRS_MODES):
        raise ValueError(f"{fn}: pairs={pairs!r}, expected False, True or 'scaled'")
    if pairs == "scaled" and scale_fmt != "fp32":
        raise ValueError(f"{fn}: pairs='scaled' needs scale_fmt='fp32' (power-of-two fp32 scales), "
                         f"got {scale_fmt!r}")
    return pairs == "scaled"


def check_pairs_out(out_pairs: Optional[torch.Tensor], m: int, k: int, device, fn: str,
                    dim: str = "K") -> torch.Tensor:
    """A [M, K] bf16 buffer for the "pairs" output (allocated when out_pairs is None)."""
    if k % _BLOCK:
        raise ValueError(f"{fn}: pairs=True needs {dim} % {_BLOCK} == 0 (whole 128-column groups), got {dim}={k}")
    if out_pairs is None:
        return torch.empty(m, k, dtype=torch.bfloat16, device=device)
    if (not isinstance(out_pairs, torch.Tensor) or out_pairs.dtype != torch.bfloat16
            or tuple(out_pairs.shape) != (m, k) or (m and out_pairs.stride(1) != 1)
            or out_pairs.device.type != torch.device(device).type):
        raise ValueError(f"{fn}: out_pairs must be bfloat16 {(m, k)} with unit column stride on {device}, got "
                         f"{getattr(out_pairs, 'dtype', type(out_pairs).__name__)} "
                         f"{tuple(getattr(out_pairs, 'shape', ()))}")
    return out_pairs


def _scales_as_store_view(s: torch.Tensor) -> torch.Tensor:
    # Triton has no e8m0 pointer type: store bytes through a uint8 view.
    return s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s


def act_quant(x: torch.Tensor, *, scale_fmt: str = "fp32",
              out_q: Optional[torch.Tensor] = None, out_s: Optional[torch.Tensor] = None,
              pairs: "bool | str" = False, out_pairs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """Quantise activations to FP8 e4m3 with one scale per 128 columns (Triton).

    Args:
        x          [M, K]   bfloat16, unit column stride (any row stride); K need not be
                            a multiple of 128 (the last group is partial)
        scale_fmt  str      "fp32" | "e8m0" | "fp32_cm" | "amax" (module docstring)
        out_q      [M, K]   float8_e4m3fn, optional preallocated output
        out_s      scales   optional preallocated output, exactly the format's layout
        pairs      bool     also return bf16(q) in the "pairs" layout (module docstring);
                            "scaled": bf16(q * s) (each row's group scale folded in, exact)
        out_pairs  [M, K]   bfloat16, optional preallocated pairs output (with pairs=True)
    Returns:
        q          [M, K]   float8_e4m3fn
        s          [M, G] (or [M4, G] for "fp32_cm")  see the module docstring
        p          [M, K]   bfloat16, only with pairs=True
    M = 0 returns empty outputs without a launch.
    """
    fn = "act_quant"
    code = scale_fmt_code(scale_fmt, fn)
    scaled = pairs_scaled(pairs, fn, scale_fmt)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{fn}: x must be a 2-D tensor [M, K], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{fn}: x.dtype={x.dtype}, expected torch.bfloat16")
    m, k = x.shape
    if k == 0:
        raise ValueError(f"{fn}: x.shape={tuple(x.shape)} has K=0")
    if m > 0 and x.stride(1) != 1:
        raise ValueError(f"{fn}: x.stride()={tuple(x.stride())}, expected unit column stride")
    g = -(-k // _BLOCK)
    for name, t in (("out_q", out_q), ("out_s", out_s)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if out_q is None:
        out_q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    elif (out_q.dtype != torch.float8_e4m3fn or tuple(out_q.shape) != (m, k) or (m and out_q.stride(1) != 1)
          or (m > 1 and out_q.stride(0) < k)):   # rows that overlap (an expanded view) would share bytes
        raise ValueError(f"{fn}: out_q must be float8_e4m3fn {(m, k)} with unit column stride and rows that do "
                         f"not overlap, got {out_q.dtype} {tuple(out_q.shape)} strides {tuple(out_q.stride())}")
    if out_s is None:
        out_s = alloc_scales(m, g, scale_fmt, x.device)
    else:
        check_scales_out(out_s, m, g, scale_fmt, x.device, fn)
    if out_pairs is not None and not pairs:
        raise ValueError(f"{fn}: out_pairs given with pairs=False")
    p = check_pairs_out(out_pairs, m, k, x.device, fn) if pairs else None
    m_s = out_s.shape[0]
    if m_s == 0:
        return (out_q, out_s, p) if pairs else (out_q, out_s)
    from ._act_quant import launch_act_quant

    launch_act_quant(x, out_q.view(torch.uint8), _scales_as_store_view(out_s), m_s, code, p, pairs_scaled=scaled)
    return (out_q, out_s, p) if pairs else (out_q, out_s)
