"""Bit-exact tests of the checkpoint formats and quantisers (weights.formats, weights.quantize).

Every expected byte below is worked by hand from SPEC §3 and the rules in
weights/quantize.py's docstring; comparisons are exact (rtol=0, atol=0, on raw bytes).
"""

import math

import pytest
import torch

from dsv4_moe.weights.formats import (E2M1_VALUES, dequant_mxfp4, e2m1_codes_to_float, e8m0_to_float32,
                                      pack_e2m1, unpack_e2m1)
from dsv4_moe.weights.quantize import e2m1_round, quantize_fp8_block, quantize_mxfp4


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def _assert_bytes_equal(got: torch.Tensor, want: list[int], what: str) -> None:
    g = _bytes(got)
    bad = [i for i, (a, b) in enumerate(zip(g, want)) if a != b]
    assert len(g) == len(want), f"{what}: {len(g)} bytes, expected {len(want)}"
    assert not bad, f"{what}: {len(bad)} bytes differ, first at {bad[0]}: got {g[bad[0]]:#04x}, want {want[bad[0]]:#04x}"


# ---------------------------------------------------------------- formats
@pytest.mark.parametrize("byte,value", [
    (0, 2.0 ** -127), (1, 2.0 ** -126), (126, 0.5), (127, 1.0), (128, 2.0), (254, 2.0 ** 127)])
def test_e8m0_byte_to_float32_exact(byte, value):
    got = e8m0_to_float32(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float32
    assert got.item() == value  # exact: every e8m0 value is an fp32 (2^-127 as a subnormal)


def test_e8m0_byte_255_is_nan():
    assert math.isnan(e8m0_to_float32(torch.tensor([255], dtype=torch.uint8)).item())


def test_e2m1_all_16_codes():
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = e2m1_codes_to_float(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == want
    assert torch.signbit(got[8]).item()  # code 8 is -0.0, not +0.0


def test_e2m1_nibble_order_low_nibble_is_even_k():
    # k=0 -> code 1 (0.5), k=1 -> code 7 (6.0): byte = 1 | 7 << 4 = 0x71.
    packed = pack_e2m1(torch.tensor([[1, 7, 15, 8]], dtype=torch.uint8))
    assert packed.tolist() == [[0x71, 0x8F]]
    assert unpack_e2m1(packed).tolist() == [[1, 7, 15, 8]]
    # Dequantise with scale 2^0 (byte 127): element order follows k.
    vals = dequant_mxfp4(torch.tensor([[0x71] * 16], dtype=torch.uint8),
                         torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert vals[0, :4].tolist() == [0.5, 6.0, 0.5, 6.0]


# ---------------------------------------------------------------- MXFP4 quantiser
def _python_e2m1(y: float) -> int:
    """Independent scalar rule: nearest magnitude, ties to the even code, sign bit of y."""
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    a = abs(y)
    code = min(range(8), key=lambda c: (abs(mags[c] - a), c % 2))
    return code | (8 if math.copysign(1.0, y) < 0 else 0)


def test_e2m1_round_matches_scalar_rule_on_dense_sweep():
    # Every multiple of 2^-10 in [-6, 6], plus each midpoint's fp32 neighbours.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.0, 4.0, 6.0])
    ys = torch.cat([torch.arange(-6 * 1024, 6 * 1024 + 1) / 1024.0,
                    torch.nextafter(mids, torch.zeros_like(mids)), -torch.nextafter(mids, torch.zeros_like(mids)),
                    torch.nextafter(mids, torch.full_like(mids, 7.0)).clamp(max=6.0),
                    torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    got = e2m1_round(ys).tolist()
    want = [_python_e2m1(y) for y in ys.tolist()]
    bad = [(y, g, w) for y, g, w in zip(ys.tolist(), got, want) if g != w]
    assert not bad, f"{len(bad)} mismatches, first (y, got, want) = {bad[0]}"


def test_mxfp4_all_16_codes_at_scale_one():
    # amax = 6 -> 6/6 = 1 = 2^0 -> scale byte 127 and every value is exactly representable.
    vals = E2M1_VALUES.tolist() * 2
    packed, scale = quantize_mxfp4(torch.tensor([vals]))
    _assert_bytes_equal(scale, [127], "scale")
    _assert_bytes_equal(packed, [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2, "packed")


def test_mxfp4_ties_go_to_even_code():
    # Scale 1 (6.0 sets amax). Ties: .25->0 (code 0), .75->1.0 (2), 1.25->1.0 (2), 1.75->2 (4),
    # 2.5->2 (4), 3.5->4 (6), 5->4 (6); negatives take the sign bit.
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
    row += [0.0] * 16
    packed, scale = quantize_mxfp4(torch.tensor([row]))
    codes = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0] + [0] * 16
    _assert_bytes_equal(scale, [127], "scale")
    _assert_bytes_equal(packed, [codes[i] | codes[i + 1] << 4 for i in range(0, 32, 2)], "packed")


def test_mxfp4_saturates_to_plus_minus_six():
    # amax 12 -> 12/6 = 2 -> scale byte 128; x/2: 12 -> 6 (7), -11.9 -> -5.95 -> -6 (15),
    # 10.5 -> 5.25 -> 6 (7), 9.9 -> 4.95 -> 4 (6), -10 -> -5 -> tie -> -4 (14).
    row = [12.0, -11.9, 10.5, 9.9, -10.0, 0.0] + [0.0] * 26
    packed, scale = quantize_mxfp4(torch.tensor([row]))
    codes = [7, 15, 7, 6, 14, 0] + [0] * 26
    _assert_bytes_equal(scale, [128], "scale")
    _assert_bytes_equal(packed, [codes[i] | codes[i + 1] << 4 for i in range(0, 32, 2)], "packed")


@pytest.mark.parametrize("amax,byte", [
    (6.0, 127), (12.0, 128), (3.0, 126), (1.5, 125), (7.0, 128), (5.9, 127),
    (0.02, 119),  # 0.02/6 = 0.00333 = 2^-8.2 -> 2^-8
])
def test_mxfp4_scale_is_ceil_pow2_of_amax_over_6(amax, byte):
    row = torch.zeros(1, 32)
    row[0, 5] = -amax  # the sign of the largest value must not matter
    _, scale = quantize_mxfp4(row)
    _assert_bytes_equal(scale, [byte], f"scale for amax {amax}")


def test_mxfp4_zero_group_gets_floor_scale_and_zero_codes():
    # amax floored at 6*2^-126 -> scale 2^-126 -> byte 1; +0.0 -> code 0, -0.0 -> code 8.
    w = torch.zeros(2, 64)
    w[1, 32:] = -0.0
    packed, scale = quantize_mxfp4(w)
    _assert_bytes_equal(scale, [1, 1, 1, 1], "scale")
    _assert_bytes_equal(packed, [0] * 16 * 3 + [0x88] * 16, "packed")


def test_mxfp4_groups_are_independent_and_dequant_round_trips():
    # Two groups with different scales in one row: values exactly on the e2m1 grid x scale
    # come back exactly.
    g0 = torch.tensor(E2M1_VALUES.tolist() * 2) * 2.0 ** -5
    g1 = torch.tensor(E2M1_VALUES.tolist() * 2) * 2.0 ** 3
    w = torch.cat([g0, g1])[None]
    packed, scale = quantize_mxfp4(w)
    _assert_bytes_equal(scale, [127 - 5, 127 + 3], "scale")
    assert torch.equal(dequant_mxfp4(packed, scale), w)


def test_mxfp4_rejects_nonfinite_and_bad_k():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(torch.tensor([[float("nan")] + [0.0] * 31]))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))


# ---------------------------------------------------------------- FP8 block quantiser
def test_fp8_block_scales_per_128x128_block_with_edge_blocks():
    # w [256, 200]: blocks (0,0) amax 448 -> byte 127; (0,1) amax 1 -> 1/448 = 2^-8.8 -> 2^-8
    # -> byte 119; (1,0) zero -> floor 1e-4/448 = 2^-22.1 -> 2^-22 -> byte 105;
    # (1,1) amax 896 -> 2 -> byte 128. The edge column block is 72 wide.
    w = torch.zeros(256, 200)
    w[3, 7] = -448.0
    w[5, 9] = 1.0625  # tie between 1.0 and 1.125 at scale 1 -> 1.0 (even mantissa)
    w[6, 9] = 1.1875  # tie between 1.125 and 1.25 -> 1.25
    w[10, 150] = 1.0  # -> 1 / 2^-8 = 256, exact in e4m3
    w[200, 199] = 896.0  # -> 448
    w[201, 130] = 3.0  # -> 1.5
    q, s = quantize_fp8_block(w)
    _assert_bytes_equal(s, [127, 119, 105, 128], "scale")
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 200)
    qf = q.float()
    assert qf[3, 7].item() == -448.0
    assert qf[5, 9].item() == 1.0
    assert qf[6, 9].item() == 1.25
    assert qf[10, 150].item() == 256.0
    assert qf[200, 199].item() == 448.0
    assert qf[201, 130].item() == 1.5
    assert int((qf != 0).sum()) == 6


def test_fp8_block_dequant_is_within_half_ulp_of_e4m3():
    # Random ~N(0, 0.02): w/s lands in e4m3's normal range, so |err| <= 2^-4 relative (3-bit mantissa).
    from dsv4_moe.weights.formats import dequant_fp8_block
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1)) * 0.02
    q, s = quantize_fp8_block(w)
    assert s.shape == (3, 3)
    deq = dequant_fp8_block(q, s)
    scale = e8m0_to_float32(s).repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    err = (deq - w).abs()
    # Normal values: half an ulp = 2^-4 * 2^floor(log2|w/s|) * s; subnormals: 2^-10 * s.
    bound = torch.maximum(2.0 ** -4 * 2.0 ** torch.floor(torch.log2((w / scale).abs().clamp_min(2.0 ** -6))),
                          torch.tensor(2.0 ** -10)) * scale
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max())}"
