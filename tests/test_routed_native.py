"""The routed experts (gate_up GEMM, SwiGLU-quant, down GEMM) natively on a GPU, at widths the
check scripts never run, with the configs `routed_configs` picks on CUDA, against the plain-torch
reference on the CPU (same quantised inputs).

test_kernels_mxfp4_gemm.py runs these kernels under the Triton interpreter on CPU tensors (and
skips on a GPU host); scripts/gpu_check_layer.py runs them inside the layer at DeepSeek-V4 shapes.
This module is the native pytest between the two (session 36; widths like session 35's
`scripts/gpu_probe_native_bounds.py --parts mxfp4`, which measured <= 0.02 % of outputs off, by
<= 1 bf16 ulp, rel L2 <= 3.7e-5 on the H200, and token counts that reach every config band).

Bounds (measured, with room for other seeds): <= 0.1 % of outputs differ, by <= 8 ulp (an in-block
summation-order flip in gate_up can move one FP8 code of h, SPEC §4.3), rel L2 <= 1e-4. The
negative controls show the same bound rejects a down scale off by one exponent step (2x), and the
gate clamp missing (the reference run without it).
"""
import _triton_interp  # noqa: F401  (decides TRITON_INTERPRET before triton is imported)

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_moe import reference as ref  # noqa: E402
from dsv4_moe.kernels.routed_experts import routed_experts_forward  # noqa: E402
from dsv4_moe.testing import bf16_diff_stats  # noqa: E402
from dsv4_moe.weights.tensors import RoutedExpertWeights  # noqa: E402

pytestmark = pytest.mark.skipif(_triton_interp.INTERPRETING or not torch.cuda.is_available(),
                                reason="native routed-expert kernels: needs a CUDA GPU with Triton running natively "
                                       "(on the CPU, test_kernels_mxfp4_gemm.py runs them in the interpreter)")

K, LIMIT = 6, 10.0                # top-6; E local experts of E + 2: routes to experts 0 and E + 1 are another rank's
MAX_FRAC, MAX_ULP, MAX_REL_L2 = 1e-3, 8, 1e-4
# (H, I, E, byte orders, T): H 2880 / 1056 are not multiples of 128 (only the checkpoint's "nk" order
# takes them). The T reach every band routed_configs has at these sizes: 16-row swap blocks (down on
# 64- then 128-wide tiles), 32- and 64-row swap blocks with the weight blocks fastest, the "nk" tiles,
# and (7168 x 256 over 64 experts, T = 1 / 2) the gate_up split 8 / 4 ways over K.
CASES = [(256, 128, 8, ("nk", "mma64e"), (1, 16, 40, 300)),
         (2880, 160, 8, ("nk",), (1, 16, 300)),
         (1056, 96, 8, ("nk",), (1, 40, 300)),
         (512, 384, 8, ("mma64", "mma64e"), (1, 16, 40, 300)),
         (7168, 256, 64, ("mma64e",), (1, 2))]
PARAMS = [(h, i, e, lay, t) for h, i, e, lay, ts in CASES for t in ts]


def _case(h, i, t, seed, e=8):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g)
    gus = torch.randint(118, 125, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    dn = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g)
    dns = torch.randint(118, 125, (e, h, i // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    base = RoutedExpertWeights(gu, gus, dn, dns, first_expert=1, num_experts=e + 2)
    x = torch.randn(t, h, generator=g).bfloat16() * 4        # large enough that the clamp (L = 10) acts
    q, sa = ref.act_quant(x)
    ids = torch.stack([torch.randperm(e + 2, generator=g)[:K] for _ in range(t)])
    if t > 1 and not (ids[-1] == 0).any():
        ids[-1, 0] = 0                                       # at least one route to another rank's expert
    ids = ids.sort(1).values
    tw = torch.rand(t, K, generator=g)
    return base, q, sa, ids, tw


def _on_gpu(routed: RoutedExpertWeights, layout: str) -> RoutedExpertWeights:
    r = routed.with_layout(layout)
    return RoutedExpertWeights(r.gate_up.cuda(), r.gate_up_scale.cuda(), r.down.cuda(), r.down_scale.cuda(),
                               r.first_expert, r.num_experts, r.layout)


def _within(got, want):
    st = bf16_diff_stats(got, want)
    return st["mismatch_frac"] <= MAX_FRAC and st["max_ulp"] <= MAX_ULP and st["rel_l2"] <= MAX_REL_L2, st


@pytest.mark.parametrize("h,i,e,layouts,t", PARAMS, ids=[f"H{h}-I{i}-E{e}-T{t}" for h, i, e, _, t in PARAMS])
def test_routed_forward_native_vs_reference(h, i, e, layouts, t):
    base, q, sa, ids, tw = _case(h, i, t, seed=h + i + t, e=e)
    local = ref.local_mask(ids, 1, e)
    assert 0 < int(local.sum()) < t * K or t == 1
    want = ref.routed_forward(q, sa, tw, ids, base, LIMIT)[local]
    outs = {}
    for layout in layouts:
        routed = _on_gpu(base, layout)
        args = (q.cuda(), sa.cuda(), tw.cuda(), ids.cuda(), routed, LIMIT)
        got = routed_experts_forward(*args).cpu()[local]   # slots of other ranks' experts: never written
        again = routed_experts_forward(*args).cpu()[local]
        assert torch.equal(got.view(torch.int16), again.view(torch.int16)), f"{layout}: two calls differ"
        ok, st = _within(got, want)
        assert ok, f"{layout} H={h} I={i} T={t}: {st}"
        outs[layout] = got
    if "mma64" in outs and "mma64e" in outs:   # the re-encoded weights and their configs: the same bits
        assert torch.equal(outs["mma64"].view(torch.int16), outs["mma64e"].view(torch.int16))


@pytest.mark.parametrize("layout", ["nk", "mma64e"])
def test_routed_native_bound_catches_scale_and_clamp(layout):
    """Negative controls: the bound above rejects the reference with every down scale doubled,
    and the reference without the gate's clamp (which these inputs reach)."""
    h, i, t = 256, 128, 5
    base, q, sa, ids, tw = _case(h, i, t, seed=3)
    local = ref.local_mask(ids, 1, 8)
    y = routed_experts_forward(q.cuda(), sa.cuda(), tw.cuda(), ids.cuda(), _on_gpu(base, layout), LIMIT).cpu()[local]
    assert _within(y, ref.routed_forward(q, sa, tw, ids, base, LIMIT)[local])[0]
    scaled = RoutedExpertWeights(base.gate_up, base.gate_up_scale, base.down,
                                 (base.down_scale.view(torch.uint8) + 1).view(torch.float8_e8m0fnu),
                                 base.first_expert, base.num_experts)
    assert not _within(y, ref.routed_forward(q, sa, tw, ids, scaled, LIMIT)[local])[0], "a 2x down scale passed"
    assert not _within(y, ref.routed_forward(q, sa, tw, ids, base, 1e30)[local])[0], "a missing clamp passed"
