"""Optional adapter to DeepGEMM's `fp8_gemm_nt` (import-guarded; SPEC §8: the PyPI
`deep-gemm` is a placeholder and sgl-deep-gemm does not load on torch 2.11, so on the
H200 here this path is normally absent and says why)."""

from __future__ import annotations

import functools

import torch

__all__ = ["deep_gemm_supported", "fp8_deep_gemm_nt"]


@functools.lru_cache(maxsize=None)
def _import():
    # NOTE: cached: a failed import searches sys.path again on every call (~100 us each on the
    # CPU here, and the dispatch predicate asks once per GEMM shape on every forward)
    try:
        import deep_gemm
        return deep_gemm, None
    except Exception as e:  # any import failure (missing, ABI mismatch) closes the path
        return None, f"{type(e).__name__}: {e}"


def deep_gemm_supported(m: int, n: int, k: int, device) -> tuple[bool, str]:
    mod, err = _import()
    if mod is None:
        return False, f"deep_gemm not importable: {err}"
    if not hasattr(mod, "fp8_gemm_nt"):
        return False, f"deep_gemm {getattr(mod, '__version__', '?')} has no fp8_gemm_nt"
    dev = torch.device(device)
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9:
        return False, f"deep_gemm needs SM90+, got {dev}"
    if k % 128 or n % 64:
        return False, f"deep_gemm fp8_gemm_nt needs K % 128 == 0 and N % 64 == 0, got N={n} K={k}"
    return True, f"deep_gemm {getattr(mod, '__version__', '?')} fp8_gemm_nt"


def fp8_deep_gemm_nt(q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """q [M, K] e4m3, sa [M, K/128] fp32, w [N, K] e4m3, sw [N/128, K/128] fp32 -> [M, N] bf16."""
    mod, err = _import()
    if mod is None:
        raise RuntimeError(f"deep_gemm not importable: {err}")
    out = torch.empty(q.shape[0], w.shape[0], dtype=torch.bfloat16, device=q.device)
    mod.fp8_gemm_nt((q, sa), (w, sw.float()), out)
    return out
