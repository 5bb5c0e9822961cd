"""The routed experts (gate_up GEMM, SwiGLU-quant, down GEMM) natively on a GPU, at widths the
check scripts never run, with the configs `routed_configs` picks on CUDA, against the plain-torch
reference on the CPU (same quantised inputs).

test_kernels_mxfp4_gemm.py runs these kernels under the Triton interpreter on CPU tensors (and
skips on a GPU host); scripts/gpu_check_layer.py runs them inside the layer at DeepSeek-V4 shapes.
This module is the native pytest between the two (session 36; the same cases as session 35's
`scripts/gpu_probe_native_bounds.py --parts mxfp4`, which measured <= 0.02 % of outputs off, by
<= 1 bf16 ulp, rel L2 <= 3.7e-5 on the H200).

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

E, K, LIMIT = 8, 6, 10.0          # 8 local experts of E + 2: the routes to experts 0 and 9 are another rank's
MAX_FRAC, MAX_ULP, MAX_REL_L2 = 1e-3, 8, 1e-4
# (H, I, layouts): H 2880 / 1056 are not multiples of 128 (only the checkpoint's "nk" order takes them)
CASES = [(256, 128, ("nk", "mma64e")), (2880, 160, ("nk",)), (1056, 96, ("nk",)), (512, 384, ("mma64", "mma64e"))]
TOKENS = (1, 5, 300)              # split-K decode GEMVs / 16-row swap blocks / 64-row prefill blocks


def _case(h, i, t, seed):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randint(0, 256, (E, 2 * i, h // 2), dtype=torch.uint8, generator=g)
    gus = torch.randint(118, 125, (E, 2 * i, h // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    dn = torch.randint(0, 256, (E, h, i // 2), dtype=torch.uint8, generator=g)
    dns = torch.randint(118, 125, (E, h, i // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    base = RoutedExpertWeights(gu, gus, dn, dns, first_expert=1, num_experts=E + 2)
    x = torch.randn(t, h, generator=g).bfloat16() * 4        # large enough that the clamp (L = 10) acts
    q, sa = ref.act_quant(x)
    ids = torch.stack([torch.randperm(E + 2, generator=g)[:K] for _ in range(t)]).sort(1).values
    tw = torch.rand(t, K, generator=g)
    return base, q, sa, ids, tw


def _on_gpu(routed: RoutedExpertWeights, layout: str) -> RoutedExpertWeights:
    r = routed.with_layout(layout)
    return RoutedExpertWeights(r.gate_up.cuda(), r.gate_up_scale.cuda(), r.down.cuda(), r.down_scale.cuda(),
                               r.first_expert, r.num_experts, r.layout)


def _within(got, want):
    st = bf16_diff_stats(got, want)
    return st["mismatch_frac"] <= MAX_FRAC and st["max_ulp"] <= MAX_ULP and st["rel_l2"] <= MAX_REL_L2, st


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h,i,layouts", CASES, ids=[f"H{h}-I{i}" for h, i, _ in CASES])
def test_routed_forward_native_vs_reference(h, i, layouts, t):
    base, q, sa, ids, tw = _case(h, i, t, seed=h + i + t)
    local = ref.local_mask(ids, 1, E)
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
    local = ref.local_mask(ids, 1, E)
    y = routed_experts_forward(q.cuda(), sa.cuda(), tw.cuda(), ids.cuda(), _on_gpu(base, layout), LIMIT).cpu()[local]
    assert _within(y, ref.routed_forward(q, sa, tw, ids, base, LIMIT)[local])[0]
    scaled = RoutedExpertWeights(base.gate_up, base.gate_up_scale, base.down,
                                 (base.down_scale.view(torch.uint8) + 1).view(torch.float8_e8m0fnu),
                                 base.first_expert, base.num_experts)
    assert not _within(y, ref.routed_forward(q, sa, tw, ids, scaled, LIMIT)[local])[0], "a 2x down scale passed"
    assert not _within(y, ref.routed_forward(q, sa, tw, ids, base, 1e30)[local])[0], "a missing clamp passed"
