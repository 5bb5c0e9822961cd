"""Shared Triton helpers: the FP8 activation quantisers' group step (act_quant,
swiglu_quant), bf16/e4m3 rounding, the split-K arrival protocol, and programmatic
dependent launch (`pdl_enter` / `pdl_options`, used by every kernel of the CUDA path).

Both quantisers end in the same per-128-column group step (SPEC §4.2); keeping it in one
`@triton.jit` function is what makes the fused SwiGLU-quant and the unfused
"torch ops + act_quant" twin bitwise equal by construction.

Numerics, and why each choice:
* amax ignores NaN (like CUDA's fmaxf and the reference `group_amax`), floor 1e-4.
* The UE8M0 scale is built on the bits of the fp32 quotient amax / 448 (exponent field,
  +1 when the mantissa is non-zero), never with log2: log2/exp2 are approximate on GPUs.
* Every division uses `div_rn` (IEEE round-to-nearest), not Triton's default `/`, so it
  matches torch's `/` bit for bit (matters for the non-power-of-two "amax" scales).
* The clamp propagates NaN (torch.clamp does); the e4m3 code of a NaN is written
  explicitly as 0x7F | sign, the byte torch's cast produces, instead of trusting the
  hardware convert (always 0x7F) or the interpreter (wrong, SPEC §7).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4; without it dispatch.has_pdl is False and PDL is never set
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "SCALE_FMT_FP32", "SCALE_FMT_E8M0", "SCALE_FMT_FP32_CM", "SCALE_FMT_AMAX", "SCALE_FMTS",
    "QUANT_BLOCK", "E4M3_MAX", "AMAX_FLOOR", "interpreting", "quant_group_tile", "ue8m0_from_amax",
    "round_to_bf16", "cast_e4m3_bytes", "split_k_arrive", "split_k_reset", "pdl_enter", "pdl_options",
]

# NOTE: integer codes are constexpr kernel arguments; fp32 and fp32_cm compute the same
# values and differ only in the strides the wrapper passes.
SCALE_FMT_FP32 = 0     # fp32 power of two (UE8M0 value), row-major [M, G]
SCALE_FMT_E8M0 = 1     # the UE8M0 exponent byte, torch.float8_e8m0fnu [M, G]
SCALE_FMT_FP32_CM = 2  # fp32 power of two, column-major [M_pad4, G] strides (1, M_pad4)
SCALE_FMT_AMAX = 3     # plain fp32 amax / 448 (not a power of two), row-major [M, G]
SCALE_FMTS = {"fp32": SCALE_FMT_FP32, "e8m0": SCALE_FMT_E8M0, "fp32_cm": SCALE_FMT_FP32_CM,
              "amax": SCALE_FMT_AMAX}

QUANT_BLOCK = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU); kernels then avoid libdevice calls, which the
    interpreter does not implement."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    from dsv4_moe.dispatch import has_pdl  # noqa: PLC0415
    return has_pdl(torch.device("cuda", index))[0]


_PDL_CODE = {"early": 1, "exit": 2}


def pdl_options(device: torch.device) -> dict:
    """Launch options for a kernel that starts with `pdl_enter(PDL)`: PDL (1 early, 2 exit:
    dispatch.pdl_mode()) and Triton's launch_pdl=True together (dispatch.has_pdl), or nothing.
    Always a pair: a kernel launched with the attribute but not waiting would race its
    predecessor."""
    from dsv4_moe import dispatch  # noqa: PLC0415
    mode = dispatch.pdl_mode()
    key = (mode, device, device.index is None and device.type == "cuda" and torch.cuda.current_device())
    opts = _PDL_OPTIONS.get(key)
    if opts is None:
        opts = _PDL_OPTIONS[key] = _pdl_options(_PDL_CODE.get(mode, 0), device)
    return opts


def _pdl_options(code: int, device: torch.device) -> dict:
    if not code or device.type != "cuda" or interpreting():
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": code, "launch_pdl": True} if _pdl_capable(index) else {}


# pdl_options per (mode, device): every launch asks (10-12 per eager forward). Shared dicts:
# callers only unpack them. Cleared with dispatch.clear_plan_cache() (tests patch
# interpreting() and the capability).
_PDL_OPTIONS: dict = {}


def _clear_host_caches() -> None:
    _PDL_OPTIONS.clear()
    _pdl_capable.cache_clear()


def _register_host_caches() -> None:
    from dsv4_moe import dispatch  # noqa: PLC0415
    dispatch.register_cache(_clear_host_caches)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of every kernel of the CUDA path. PDL 0: nothing (plain launch, the
    interpreter). 1 or 2: wait for the previous kernel on the stream (complete, memory
    visible); 1 then lets the next kernel launch at once, 2 leaves that to CTA exit."""
    if PDL > 0:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()


@triton.jit
def ue8m0_from_amax(amax):
    """fp32 amax (> 0, NaN-free) -> (2^ceil(log2(amax/448)) as fp32, its exponent byte int32).

    amax = +inf gives (inf, 255), as the reference's bit manipulation does.
    """
    r = tl.math.div_rn(amax, 448.0)
    bits = r.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (exp << 23).to(tl.float32, bitcast=True)
    return s, exp


@triton.jit
def round_to_bf16(x, SOFTWARE: tl.constexpr):
    """fp32 -> the fp32 value of bf16(x), round-to-nearest-even.

    SOFTWARE=True (interpreter only): the Triton 3.6 interpreter truncates fp32 -> bf16,
    so the RNE is done on the bits (add 0x7FFF + lsb, drop 16 bits; NaN kept quiet).
    On the GPU the hardware cvt.rn.bf16.f32 is used.
    """
    if SOFTWARE:
        b = x.to(tl.uint32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        r = tl.where(x != x, ((b >> 16) | 0x40) << 16, r)
        return r.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def cast_e4m3_bytes(y, SOFTWARE: tl.constexpr):
    """fp32 y, already clamped to [-448, 448] (or NaN) -> e4m3 bytes (uint8), RNE.

    SOFTWARE=True (interpreter only, whose fp8 cast is wrong, SPEC §7): RNE on the bits.
    Subnormals (|y| < 2^-6) round y * 512 to an integer with the 2^23 magic number;
    normals round the fp32 mantissa to 3 bits (add 0x7FFFF + lsb, shift by 20) and
    re-bias the exponent (127 -> 7). On the GPU: cvt.rn.satfinite.e4m3x2.f32.
    NaN -> 0x7F | sign in both modes (torch's byte; the hardware always gives 0x7F).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    if SOFTWARE:
        a = tl.abs(y)
        # NOTE: the subnormal rounding only on the values it serves (0 for the others, which
        # the select below drops): a NaN (e.g. block padding the unfused twins quantise and then
        # discard) would otherwise meet numpy's float -> int cast ("invalid value" warning)
        sub = ((tl.where(a < 0.015625, a, 0.0) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        ab = a.to(tl.int32, bitcast=True)
        nrm = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
        q = (tl.where(a < 0.015625, sub, nrm).to(tl.uint8)) | sign
        return tl.where(y != y, sign | 0x7F, q)
    else:
        # NOTE: the hardware code of a non-NaN y already carries y's sign bit (RNE and
        # satfinite are symmetric; -0.0 -> 0x80), so OR-ing the sign changes only NaN:
        # 0x7F -> 0x7F | sign, torch's byte. Two integer ops instead of compare + select.
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True) | sign


@triton.jit
def e4m3_bytes_to_bf16(q, SOFTWARE: tl.constexpr):
    """e4m3 bytes (uint8) -> bf16, exact (every e4m3 value is a bf16 value; NaN -> NaN).
    SOFTWARE=True (interpreter, whose fp8 casts are wrong): the value built in fp32 from
    the bits (normal (8 + m) * 2^(e - 10), subnormal m * 2^-9), then cast (exact)."""
    if SOFTWARE:
        b = q.to(tl.int32)
        e = (b >> 3) & 0xF
        m = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * ((e + 117) << 23).to(tl.float32, bitcast=True))
        mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
        signed = mag.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)  # the sign on the bits: -0.0 stays
        return signed.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return q.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def store_pairs(p_row_ptrs, q, row_ok, SOFTWARE: tl.constexpr, s, SCALED: tl.constexpr):
    """Store bf16(q) of an [R, 128] e4m3-byte tile in the "pairs" layout: its 64 even
    columns at p_row_ptrs + 0..63, its 64 odd ones at + 64..127 (what `bf16_pairs` writes).
    Split in registers, then two contiguous stores (a per-element permuted scatter measured
    2-4x slower act_quant / swiglu_quant at T = 1024, session 11).
    SCALED: bf16(q * s) instead, s [R] the rows' fp32 scales (powers of two, so exact):
    the "scaled pairs" the routed swap body takes with GemmConfig.fold_sa."""
    v = e4m3_bytes_to_bf16(q, SOFTWARE)
    if SCALED:
        v = (v.to(tl.float32) * s[:, None]).to(tl.bfloat16)
    ev, od = tl.split(tl.reshape(v, (q.shape[0], 64, 2)))
    ptrs = p_row_ptrs[:, None] + tl.arange(0, 64)[None, :]
    tl.store(ptrs, ev, mask=row_ok[:, None])
    tl.store(ptrs + 64, od, mask=row_ok[:, None])


@triton.jit
def quant_group_tile(x, SCALE_FMT: tl.constexpr, SOFTWARE: tl.constexpr):
    """Quantise a [R, 128] fp32 tile (exact bf16 values; masked entries must be 0.0).

    Returns (q_bytes uint8 [R, 128], s_store [R]) where s_store is the value to write in
    the requested scale format (fp32, or uint8 e8m0 bytes).
    """
    a = tl.abs(x)
    if SOFTWARE:
        a = tl.where(a != a, 0.0, a)  # NaN ignored in amax (reference group_amax)
    # NOTE: on the GPU tl.max / tl.maximum lower to max.f32, which already returns the
    # non-NaN operand (IEEE maxNum), so NaN is ignored without the select (numpy's max in
    # the interpreter propagates NaN, hence the select there). An all-NaN group gives
    # max(NaN, 1e-4) = 1e-4, the reference's floored 0.
    amax = tl.maximum(tl.max(a, axis=1), 1e-4)
    if SCALE_FMT == 3:
        s = tl.math.div_rn(amax, 448.0)
        s_store = s
        y = tl.math.div_rn(x, s[:, None])
    else:
        s, e = ue8m0_from_amax(amax)
        if SCALE_FMT == 1:
            s_store = e.to(tl.uint8)
        else:
            s_store = s
        # NOTE: s = 2^(e-127) is a power of two, so x / s == x * 2^(127-e) bit for bit
        # (both are the correctly rounded value of the same real number; the GPU does not
        # flush fp32 subnormals here). e is in [105, 247] for finite amax >= 1e-4, or 255
        # (amax = inf: s = inf, x / inf = x * 0). One multiply instead of an IEEE divide
        # per element (measured in scripts/bench_swiglu_quant.py).
        inv = tl.where(e == 255, 0, (254 - e) << 23).to(tl.float32, bitcast=True)
        y = x * inv[:, None]
    if SOFTWARE:
        y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    # NOTE: on the GPU the clamp is the convert itself: cvt.rn.satfinite.e4m3x2.f32 maps
    # finite |y| > 448 and +-inf to +-448 exactly as clamp-then-convert does, and NaN stays
    # NaN (fixed up in cast_e4m3_bytes). With UE8M0 scales and bf16 inputs |y| <= 448
    # anyway; the "amax" format's divide can land just above it.
    return cast_e4m3_bytes(y, SOFTWARE), s_store


@triton.jit
def split_k_arrive(cnt_ptr, num_splits):
    """Count this program's arrival at its split-K tile (after its partials are stored) and
    return True in the program that arrives last (kernels/split_k.py has the protocol).

    The CTA barrier orders every thread's workspace stores before the one atomic (Triton
    issues a scalar atomic from one thread and broadcasts the result); acq_rel at GPU
    scope makes the other programs' stores visible to the last one, which then reads the
    workspace through L2 (`.cg`) and resets the counter with `split_k_reset`."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    return old == num_splits - 1


@triton.jit
def split_k_reset(cnt_ptr):
    """Set a split-K tile counter back to 0 (done by the tile's last program)."""
    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


_register_host_caches()
