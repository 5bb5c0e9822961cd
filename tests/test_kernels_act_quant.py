"""act_quant (Triton) vs dsv4_moe.reference.act_quant, bitwise.

On CPU the kernel runs under TRITON_INTERPRET=1. The interpreter's own float->fp8 cast
is wrong (SPEC §7), so under the interpreter the kernel uses its software RNE cast
(kernels/_triton_utils.cast_e4m3_bytes); the hardware cast is checked bitwise on the
GPU (scripts/gpu_check_shared.py and the gpu-marked test below).
"""

import _triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from dsv4_moe import reference as ref
from dsv4_moe.kernels import act_quant as aq_mod
from dsv4_moe.kernels.act_quant import act_quant

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def assert_bytes_equal(a, b, what):
    a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    bad = (a8 != b8).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {a8.numel()} bytes differ; first at "
                              f"{tuple(bad[0].tolist())}: got {a8[tuple(bad[0])].item():#04x} "
                              f"want {b8[tuple(bad[0])].item():#04x}")


def check_vs_reference(x):
    q, s = act_quant(x.to(DEV))
    rq, rs = ref.act_quant(x)
    assert_bytes_equal(s.cpu(), rs, "scales")
    assert_bytes_equal(q.cpu(), rq, "codes")
    return q, s


# (130, 300) and (531, 256): the 8- and 32-row programs of larger M (partial row blocks,
# a partial last group); (40, 136) and (531, 200): K % 16 == 8 over several row blocks, the widths
# at which swiglu_quant's persistent kernel went wrong on the H200 (session 35)
@pytest.mark.parametrize("shape", [(1, 128), (5, 384), (7, 300), (3, 1000), (17, 256), (130, 300), (531, 256),
                                   (40, 136), (531, 200)])
def test_random_matches_reference_bitwise(shape):
    torch.manual_seed(shape[0] * 1000 + shape[1])
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[0])[:, None]).bfloat16()
    check_vs_reference(x)


def test_exactly_representable_codes():
    # Each group holds +-448 * 2^k, so s = 2^k and every x / s is an exact e4m3 value:
    # the cast is exercised on exact inputs only (SPEC §7), every code 0..0x7e included.
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    row = torch.cat([vals, -vals[1:]])[:253]
    x = torch.zeros(4, 256)
    for r, k in enumerate((-10, -3, 0, 5)):
        x[r, :253] = row * 2.0 ** k
        x[r, 127] = 448.0 * 2.0 ** k
        x[r, 255] = -448.0 * 2.0 ** k
    q, s = check_vs_reference(x.bfloat16())
    assert torch.equal(s.cpu(), torch.tensor([[2.0 ** k] * 2 for k in (-10, -3, 0, 5)]))


def test_zero_group_hits_amax_floor():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[1, 128:] = 1.0
    q, s = check_vs_reference(x)
    assert s[0, 0].item() == 2.0 ** -22  # ceil(log2(1e-4 / 448)) = -22
    assert (q[0].float() == 0).all()


def test_nan_ignored_in_amax_and_inf_gives_inf_scale():
    x = torch.full((2, 128), 2.0, dtype=torch.bfloat16)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    q, s = act_quant(x.to(DEV))
    rq, rs = ref.act_quant(x)
    assert_bytes_equal(s.cpu(), rs, "scales")
    assert s[0, 0].item() == 2.0 ** -7  # from amax 2, NaN ignored
    q8 = q.cpu().view(torch.uint8)
    # NaN codes: an input NaN keeps its sign (0x7F here); the NaN made by inf / inf has
    # the platform's default sign (x86: negative, CUDA: positive), so only 0x7F | any
    # sign is asserted there.
    assert q8[0, 5].item() == 0x7F and (q8[1, 7].item() & 0x7F) == 0x7F
    rq8 = rq.view(torch.uint8).clone()
    rq8[1, 7] = q8[1, 7]
    assert_bytes_equal(q8, rq8, "codes")
    _, se = act_quant(x.to(DEV), scale_fmt="e8m0")
    assert se.cpu().view(torch.uint8)[1, 0].item() == 255  # inf scale -> e8m0 byte 255


def test_nan_rows_quantise_without_runtime_warning():
    """NaN inputs (as in the block padding that the unfused twins quantise and then discard)
    give 0x7F | sign codes and, under the interpreter, no numpy "invalid value" warning: the
    software e4m3 cast rounds subnormals only on the values that are subnormal (session 35:
    such warnings came and went with the contents of uninitialised padding rows)."""
    import warnings

    x = torch.full((3, 256), 0.5, dtype=torch.bfloat16)
    x[0] = float("nan")
    x[1, 130] = -float("nan")
    x[2, :64] = 1e-3  # the subnormal codes still round right beside it
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        q, s = act_quant(x.to(DEV))
    q8 = q.cpu().view(torch.uint8)
    assert (q8[0] & 0x7F == 0x7F).all() and (q8[1, 130].item() & 0x7F) == 0x7F  # NaN, either sign
    rq, rs = ref.act_quant(x)
    assert_bytes_equal(s.cpu(), rs, "scales")
    rq8 = rq.view(torch.uint8).clone()
    rq8[1, 130] = q8[1, 130]
    assert_bytes_equal(q8[1:], rq8[1:], "codes")


@pytest.mark.parametrize("m", [1, 5, 8, 130])
def test_scale_formats(m):
    torch.manual_seed(m)
    x = (torch.randn(m, 300) * 50).bfloat16()
    rq, rs = ref.act_quant(x)
    q, se = act_quant(x.to(DEV), scale_fmt="e8m0")
    assert se.dtype == torch.float8_e8m0fnu and se.shape == (m, 3)
    assert_bytes_equal(se.cpu(), ref.quant.scale_to_e8m0_bits(rs), "e8m0 bytes")
    assert_bytes_equal(q.cpu(), rq, "codes (e8m0)")
    q, sc = act_quant(x.to(DEV), scale_fmt="fp32_cm")
    m4 = (m + 3) // 4 * 4
    assert sc.shape == (m4, 3) and sc.stride() == (1, m4)
    assert torch.equal(sc[:m].cpu(), rs)
    assert (sc[m:].cpu() == 2.0 ** -22).all()  # padded rows: all-zero-group scale
    q, sm = act_quant(x.to(DEV), scale_fmt="amax")
    amax = ref.quant.group_amax(x, 128)
    want_s = amax / 448.0
    assert_bytes_equal(sm.cpu(), want_s, "amax scales")
    want_q = torch.clamp(x.float() / want_s.repeat_interleave(128, 1)[:, :300], -448, 448)
    # every code: the kernel divides with div_rn as torch does, and torch's CPU cast is RNE (the
    # interpreter's own float -> e4m3 cast is not, which the kernel's software cast replaces);
    # ~98 % of these quotients are not representable, so this checks the rounding itself
    exact = want_q.to(torch.float8_e4m3fn).float() == want_q
    assert exact.float().mean() < 0.1
    assert_bytes_equal(q.cpu(), want_q.to(torch.float8_e4m3fn), "codes (amax)")


def test_m0_returns_empty_without_launch(monkeypatch):
    import dsv4_moe.kernels._act_quant as body

    monkeypatch.setattr(body, "launch_act_quant", lambda *a, **k: pytest.fail("launched for M=0"))
    q, s = act_quant(torch.empty(0, 256, dtype=torch.bfloat16, device=DEV))
    assert q.shape == (0, 256) and q.dtype == torch.float8_e4m3fn and s.shape == (0, 2)


def test_wrapper_errors_name_the_argument():
    with pytest.raises(ValueError, match="x.dtype"):
        act_quant(torch.zeros(2, 128))
    with pytest.raises(ValueError, match="2-D"):
        act_quant(torch.zeros(128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="scale_fmt"):
        act_quant(torch.zeros(2, 128, dtype=torch.bfloat16), scale_fmt="ue8m0")
    with pytest.raises(ValueError, match="out_s"):
        act_quant(torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV),
                  out_s=torch.empty(2, 2, device=DEV))
    assert aq_mod.padded_rows(5) == 8


def _pairs_of(q):
    """bf16(q) with each 128-column group as its 64 even then 64 odd columns (torch)."""
    m, k = q.shape
    return q.float().bfloat16().view(m, k // 128, 64, 2).transpose(2, 3).reshape(m, k)


@pytest.mark.parametrize("shape", [(1, 128), (5, 384), (3, 256), (131, 256), (515, 128)])
def test_pairs_output_bitwise(shape):
    """pairs=True: the same codes and scales, plus bf16(q) in the "pairs" layout, bit for
    bit (subnormal codes, -0.0 and NaN included); the reference stage makes the same."""
    from dsv4_moe import stages

    torch.manual_seed(shape[1])
    x = (torch.randn(shape) * torch.logspace(-4, 2, shape[1])[None, :]).bfloat16()
    x[0, :3] = torch.tensor([-0.0, 1e-30, float("nan")])  # -0 code, subnormal code, NaN
    if shape[0] > 1:
        x[1, 5] = float("inf")  # inf scale: the whole group quantises to +-0
    q, s, p = act_quant(x.to(DEV), pairs=True)
    q0, s0 = act_quant(x.to(DEV))
    assert_bytes_equal(q, q0, "codes")
    assert_bytes_equal(s, s0, "scales")
    assert p.dtype == torch.bfloat16 and p.shape == shape and p.is_contiguous()
    want = _pairs_of(q.cpu())
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(p.cpu()), nan)
    assert_bytes_equal(p.cpu()[~nan], want[~nan], "pairs")
    rq, rs, rp = stages.act_quant_reference(x, pairs=True)
    assert torch.equal(rp.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    out = torch.full(shape, 7.0, dtype=torch.bfloat16, device=DEV)
    assert act_quant(x.to(DEV), pairs=True, out_pairs=out)[2] is out
    assert_bytes_equal(out.cpu()[~nan], want[~nan], "pairs into out_pairs")


def test_pairs_errors_and_m0():
    with pytest.raises(ValueError, match="pairs=True needs K % 128 == 0.*K=200"):
        act_quant(torch.zeros(2, 200, dtype=torch.bfloat16, device=DEV), pairs=True)
    with pytest.raises(ValueError, match="out_pairs given with pairs=False"):
        act_quant(torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV),
                  out_pairs=torch.empty(2, 128, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="out_pairs must be bfloat16"):
        act_quant(torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV), pairs=True,
                  out_pairs=torch.empty(2, 128, device=DEV))
    q, s, p = act_quant(torch.empty(0, 256, dtype=torch.bfloat16, device=DEV), pairs=True)
    assert p.shape == (0, 256) and p.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware e4m3 cast is checked on a CUDA device")
def test_gpu_large_random_bitwise():
    torch.manual_seed(0)
    x = (torch.randn(512, 7168) * 3).bfloat16()
    check_vs_reference(x)
