"""torch blockwise FP8 scaled_mm (1x128 activations x 128x128 weights) as an fp8 GEMM path.

    out[M, N] = bf16( (q * sa) @ (w * sw)^T )   via torch.nn.functional.scaled_mm (cuBLASLt)

torch (2.10+) on SM90 takes fp32 scales: the activation scale [M4, K/128] column-major
(strides (1, M4), M4 = M rounded up to a multiple of 4: act_quant/swiglu_quant
scale_fmt="fp32_cm" write exactly that) and the weight scale in one of a few layouts;
which one torch 2.11 accepts is settled on the H200 by scripts/gpu_check_shared.py
(it tries every `WEIGHT_SCALE_LAYOUTS` entry and reports). cuBLASLt's accumulation
order is its own, so this path is a dispatch candidate only after that check shows it
within the §7 bound of the reference.
"""

from __future__ import annotations

import torch

__all__ = ["scaled_mm_supported", "prepare_weight_scale", "fp8_scaled_mm_nt", "WEIGHT_SCALE_LAYOUTS",
           "DEFAULT_WEIGHT_SCALE_LAYOUT"]

_BLOCK = 128
# kn_cm4: [KB4, N/128] column-major view of the [N/128, KB4] zero-padded fp32 scales (KB4 =
#         K/128 rounded up to 4), the layout a public DeepSeek-V4 integration passes;
# kn_cm:  the same view cut to [KB, N/128]; nk_rm: plain [N/128, KB] row-major.
WEIGHT_SCALE_LAYOUTS = ("kn_cm4", "kn_cm", "nk_rm")
DEFAULT_WEIGHT_SCALE_LAYOUT = "kn_cm4"


def scaled_mm_supported(m: int, n: int, k: int, device) -> tuple[bool, str]:
    """(ok, reason) for running an [M, K] x [N, K]^T blockwise GEMM through torch."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return False, f"blockwise scaled_mm needs a CUDA device, got {dev}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    cap = torch.cuda.get_device_capability(dev)
    if cap != (9, 0):
        return False, f"blockwise 1x128 x 128x128 scaled_mm is used on SM90 only, device is sm_{cap[0]}{cap[1]}"
    try:
        from torch.nn.functional import ScalingType, scaled_mm  # noqa: F401
        ScalingType.BlockWise1x128, ScalingType.BlockWise128x128  # noqa: B018
    except (ImportError, AttributeError) as e:
        return False, f"torch {torch.__version__} has no blockwise F.scaled_mm: {type(e).__name__}: {e}"
    if k % _BLOCK or n % _BLOCK:
        return False, f"needs N and K multiples of 128, got N={n} K={k}"
    if m < 1:
        return False, f"M={m} < 1"
    return True, "torch blockwise scaled_mm (cuBLASLt, SM90)"


def prepare_weight_scale(sw: torch.Tensor, layout: str = DEFAULT_WEIGHT_SCALE_LAYOUT) -> torch.Tensor:
    """[N/128, K/128] e8m0 (or fp32) weight scales -> fp32 in `layout` (a pure function,
    run once at load time)."""
    from dsv4_moe.weights.formats import e8m0_to_float32

    s = sw.float() if sw.dtype == torch.float32 else e8m0_to_float32(sw)
    nb, kb = s.shape
    if layout == "nk_rm":
        return s.contiguous()
    kb4 = (kb + 3) // 4 * 4
    pad = torch.zeros(nb, kb4, dtype=torch.float32, device=s.device)
    pad[:, :kb] = s
    if layout == "kn_cm4":
        return pad.t()
    if layout == "kn_cm":
        return pad.t()[:kb]
    raise ValueError(f"prepare_weight_scale: layout={layout!r}, expected one of {WEIGHT_SCALE_LAYOUTS}")


def fp8_scaled_mm_nt(q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw_prepared: torch.Tensor
                     ) -> torch.Tensor:
    """Args:
        q            [M, K]        float8_e4m3fn
        sa           [M4, K/128]   float32, strides (1, M4) (scale_fmt="fp32_cm")
        w            [N, K]        float8_e4m3fn
        sw_prepared  prepare_weight_scale(sw, layout)
    Returns: [M, N] bfloat16 (rows beyond M computed on zero padding are dropped).
    """
    from torch.nn.functional import ScalingType, scaled_mm

    m, k = q.shape
    m4 = sa.shape[0]
    if m4 < m or m4 % 4 or sa.stride() != (1, m4):
        raise ValueError(f"fp8_scaled_mm_nt: sa must be [M4>={m}, K/128] with strides (1, M4), M4 % 4 == 0; "
                         f"got shape {tuple(sa.shape)} strides {tuple(sa.stride())}")
    if m4 != m:  # NOTE: one small copy for M % 4 != 0 (decode M=1 pads to 4 rows)
        qp = torch.zeros(m4, k, dtype=q.dtype, device=q.device)
        qp[:m] = q
        q = qp
    out = scaled_mm(q, w.t(), sa, ScalingType.BlockWise1x128, sw_prepared, ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16)
    return out[:m] if m4 != m else out
