"""The two quantised GEMMs of SPEC §4.3, in plain torch. Output bf16 [M, N].

fp8_gemm (shared expert, 1x128 activation scales x 128x128 weight blocks):

    for each 128-wide K block kb (ascending):
        partial = sum_{k in kb} q[m, k] * W[n, k]               (fp32)
        acc    += partial * sa[m, kb] * sw[n // 128, kb]
    out = bf16(acc)

fp4_gemm (routed experts, W4A8: e2m1 values are exact e4m3 values):

    for each 32-wide K sub-block j (ascending):
        partial = sum_{k in j} q[m, k] * e2m1(W4[n, k])          (fp32)
        acc    += partial * sa[m, j // 4] * sw[n, j]
    out = bf16(acc)

NOTE: the products inside a block are exact in fp32 but their sum may not be; the
reference sums in float64 (exactly: at most 128 products of <= 8 significant bits)
and rounds once to fp32, i.e. it is the correctly rounded in-block sum. A GPU kernel
summing in fp32 in another order may differ in the last fp32 bit of `partial`; that
is the only freedom the contract allows. The scales are powers of two, so the order
in which they are multiplied in is exact (barring under/overflow).
"""

from __future__ import annotations

import torch

from dsv4_moe.weights.formats import as_uint8, e2m1_codes_to_float, e8m0_to_float32, unpack_e2m1

__all__ = ["fp8_gemm", "fp4_gemm"]

_BLOCK = 128
_GROUP = 32


def _scales_f32(s: torch.Tensor) -> torch.Tensor:
    return s if s.dtype == torch.float32 else e8m0_to_float32(s)


def _check_2d(name: str, t: torch.Tensor, dtype) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"{name}.dtype={t.dtype}, expected {dtype}")


def fp8_gemm(q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Args:
        q   [M, K]                       float8_e4m3fn  activations
        sa  [M, ceil(K/128)]             float32        activation scales (powers of two)
        w   [N, K]                       float8_e4m3fn  weights
        sw  [ceil(N/128), ceil(K/128)]   float8_e8m0fnu or float32  weight block scales
    Returns: [M, N] bfloat16
    """
    _check_2d("fp8_gemm: q", q, torch.float8_e4m3fn)
    _check_2d("fp8_gemm: w", w, torch.float8_e4m3fn)
    m, k = q.shape
    n, kw = w.shape
    if kw != k:
        raise ValueError(f"fp8_gemm: q has K={k} but w has K={kw}")
    kb_n = -(-k // _BLOCK)
    if tuple(sa.shape) != (m, kb_n):
        raise ValueError(f"fp8_gemm: sa.shape={tuple(sa.shape)}, expected {(m, kb_n)}")
    if tuple(sw.shape) != (-(-n // _BLOCK), kb_n):
        raise ValueError(f"fp8_gemm: sw.shape={tuple(sw.shape)}, expected {(-(-n // _BLOCK), kb_n)}")
    qd = q.double()
    wd = w.double()
    saf = sa.float()
    swf = _scales_f32(sw).repeat_interleave(_BLOCK, dim=0)[:n]  # [N, Kb]
    acc = torch.zeros(m, n, dtype=torch.float32, device=q.device)
    for kb in range(kb_n):
        ks = slice(kb * _BLOCK, min(k, (kb + 1) * _BLOCK))
        partial = (qd[:, ks] @ wd[:, ks].T).float()
        acc += partial * saf[:, kb : kb + 1] * swf[:, kb][None, :]
    return acc.to(torch.bfloat16)


def fp4_gemm(q: torch.Tensor, sa: torch.Tensor, w4: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Args:
        q   [M, K]          float8_e4m3fn   activations
        sa  [M, ceil(K/128)] float32        activation scales (powers of two)
        w4  [N, K/2]        uint8 (or int8) packed e2m1, low nibble = even k
        sw  [N, K/32]       float8_e8m0fnu (or float32) per-32 weight scales
    Returns: [M, N] bfloat16
    """
    _check_2d("fp4_gemm: q", q, torch.float8_e4m3fn)
    _check_2d("fp4_gemm: w4", w4, None)
    m, k = q.shape
    n = w4.shape[0]
    if w4.shape[1] * 2 != k:
        raise ValueError(f"fp4_gemm: w4.shape={tuple(w4.shape)} does not pack K={k} (expected [N, {k // 2}])")
    if k % _GROUP:
        raise ValueError(f"fp4_gemm: K={k} must be a multiple of {_GROUP}")
    if tuple(sa.shape) != (m, -(-k // _BLOCK)):
        raise ValueError(f"fp4_gemm: sa.shape={tuple(sa.shape)}, expected {(m, -(-k // _BLOCK))}")
    if tuple(sw.shape) != (n, k // _GROUP):
        raise ValueError(f"fp4_gemm: sw.shape={tuple(sw.shape)}, expected {(n, k // _GROUP)}")
    wv = e2m1_codes_to_float(unpack_e2m1(as_uint8(w4))).double()  # [N, K] exact
    qd = q.double()
    saf = sa.float()
    swf = _scales_f32(sw)
    acc = torch.zeros(m, n, dtype=torch.float32, device=q.device)
    for j in range(k // _GROUP):
        ks = slice(j * _GROUP, (j + 1) * _GROUP)
        partial = (qd[:, ks] @ wv[:, ks].T).float()
        acc += partial * saf[:, j // 4 : j // 4 + 1] * swf[:, j][None, :]
    return acc.to(torch.bfloat16)
