"""The kernel wrappers' argument checks that session 38's audit found missing: each bad
argument is a ValueError / TypeError naming it, before any launch could read out of bounds
or return a wrong result (run under the interpreter on the CPU, natively on a GPU)."""
import _triton_interp  # noqa: F401  (TRITON_INTERPRET=1 where there is no GPU; must precede triton)

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_moe.kernels.act_quant import act_quant  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.mxfp4_grouped_gemm import mxfp4_grouped_gemm  # noqa: E402
from dsv4_moe.kernels.router import route_topk, router_logits, router_logits_gemv, router_logits_mma  # noqa: E402
from dsv4_moe.kernels.swiglu_quant import swiglu_quant, swiglu_quant_partials, swiglu_quant_unfused  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _router_inputs(t=5, h=256, e=16):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    w = (torch.randn(e, h, generator=g) * 0.05).bfloat16().to(DEV)
    bias = (torch.randn(e, generator=g) * 0.1).to(DEV)
    return x, w, bias


def test_route_topk_reads_a_strided_bias_by_its_strides():
    """The top-k kernel indexes bias[col]: a strided view must give the contiguous bias's result."""
    x, w, bias = _router_inputs()
    strided = torch.stack([bias, torch.full_like(bias, 100.0)], 1)[:, 0]
    assert strided.stride(0) == 2
    want = route_topk(x, w, bias, None, None, 4, 1.5)
    got = route_topk(x, w, strided, None, None, 4, 1.5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("fn", [router_logits, router_logits_gemv, router_logits_mma])
def test_router_logits_check_their_arguments(fn):
    x, w, _ = _router_inputs()
    with pytest.raises(ValueError, match=r"weight: expected \[E, H=256\]"):
        fn(x, w[:, :128])
    with pytest.raises(ValueError, match=r"x: expected a \[T, H\] bfloat16 tensor, got torch.float32"):
        fn(x.float(), w)
    with pytest.raises(ValueError, match=r"x: expected a \[T, H\] bfloat16 tensor"):
        fn(x[0], w)


def test_route_topk_scalar_arguments():
    x, w, bias = _router_inputs()
    with pytest.raises(ValueError, match="top_k=True"):
        route_topk(x, w, bias, None, None, True, 1.5)
    with pytest.raises(ValueError, match="routed_scaling_factor='abc'"):
        route_topk(x, w, bias, None, None, 4, "abc")
    with pytest.raises(ValueError, match="bias: expected a torch.Tensor or None, got list"):
        route_topk(x, w, [0.0] * 16, None, None, 4, 1.5)


@pytest.mark.parametrize("limit", [0.0, -1.0, float("nan"), float("inf"), "10", True])
def test_swiglu_limit_checked(limit):
    gu = torch.randn(4, 256).bfloat16().to(DEV)
    for fn in (swiglu_quant, swiglu_quant_unfused):
        with pytest.raises(ValueError, match=r"limit=.*expected a finite number > 0"):
            fn(gu, limit=limit)
    parts = torch.randn(1, 4, 256, device=DEV)
    rows = torch.arange(4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"limit=.*expected a finite number > 0"):
        swiglu_quant_partials(parts, rows, 4, limit=limit)


def test_swiglu_optional_tensors_typed():
    gu = torch.randn(4, 256).bfloat16().to(DEV)
    with pytest.raises(TypeError, match="route_weight: expected a torch.Tensor or None, got list"):
        swiglu_quant(gu, limit=10.0, route_weight=[1.0] * 4)
    with pytest.raises(ValueError, match="rows is required"):
        swiglu_quant_partials(torch.randn(1, 4, 256, device=DEV), None, 4, limit=10.0)


def test_grouped_gemm_alignment_must_match_the_weights():
    """An alignment over more local experts than w4 holds would make the kernel read weights
    past the last expert."""
    k, n = 256, 64
    q, sa = act_quant(torch.randn(3, k).bfloat16().to(DEV))
    w4 = torch.randint(0, 255, (4, n, k // 2), dtype=torch.uint8, device=DEV)
    sw = torch.full((4, n, k // 32), 127, dtype=torch.uint8, device=DEV)
    ids = torch.tensor([[0, 5], [1, 2], [7, 3]], dtype=torch.int32, device=DEV)
    align = moe_align(ids, 16, 0, 16)
    with pytest.raises(ValueError, match="align: made for num_local=16 experts, but w4 holds E_local=4"):
        mxfp4_grouped_gemm(q, sa, w4, sw, align, gather_a=True, scatter_out=True)
    with pytest.raises(TypeError, match="sa: expected a torch.Tensor, got NoneType"):
        mxfp4_grouped_gemm(q, None, w4, sw, moe_align(ids, 4, 0, 16), gather_a=True, scatter_out=True)


def test_act_quant_outputs_checked():
    x = torch.randn(4, 256).bfloat16().to(DEV)
    shared_rows = torch.empty(1, 256, dtype=torch.float8_e4m3fn, device=DEV).expand(4, 256)
    with pytest.raises(ValueError, match="rows that do not overlap"):
        act_quant(x, out_q=shared_rows)
    with pytest.raises(TypeError, match="out_q: expected a torch.Tensor or None, got int"):
        act_quant(x, out_q=5)


def test_remaining_wrappers_name_non_tensor_and_bool_arguments():
    from dsv4_moe.kernels.finalize import finalize_shared_add
    from dsv4_moe.kernels.fp8_block_gemm import fp8_block_gemm_nt

    q, sa = act_quant(torch.randn(3, 256).bfloat16().to(DEV))
    w = torch.randn(128, 256).to(torch.float8_e4m3fn).to(DEV)
    sw = torch.full((1, 2), 127, dtype=torch.uint8, device=DEV)
    with pytest.raises(TypeError, match="sa: expected a torch.Tensor, got float"):
        fp8_block_gemm_nt(q, 1.0, w, sw)
    with pytest.raises(TypeError, match="out: expected a torch.Tensor or None, got int"):
        fp8_block_gemm_nt(q, sa, w, sw, out=3)
    with pytest.raises(ValueError, match=r"config=\{\}: expected None or a dict with at least BLOCK_M"):
        fp8_block_gemm_nt(q, sa, w, sw, config={})
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="topk_weights: expected a torch.Tensor or None, got list"):
        moe_align(ids, 4, 0, 16, [[0.5, 0.5]])
    with pytest.raises(ValueError, match="block_m=True"):
        moe_align(ids, 4, 0, True)
    y = torch.zeros(1, 2, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="first_expert=True"):
        finalize_shared_add(y, ids, True, 4, torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV))


def test_routed_experts_forward_arguments():
    from dsv4_moe import MoEConfig
    from dsv4_moe.kernels.routed_experts import routed_configs, routed_experts_forward
    from dsv4_moe.testing import random_layer_weights

    r = random_layer_weights(MoEConfig.tiny(), layer_idx=1, seed=0).routed.to(DEV)
    q, sa = act_quant(torch.randn(2, r.hidden).bfloat16().to(DEV))
    tw = torch.full((2, 6), 0.25, device=DEV)
    ids = torch.arange(12, dtype=torch.int32, device=DEV).view(2, 6)
    with pytest.raises(TypeError, match="sa: expected a torch.Tensor"):
        routed_experts_forward(q, None, tw, ids, r, 10.0)
    with pytest.raises(ValueError, match=r"configs=\(1, 2\): expected None or \(gate_up GemmConfig"):
        routed_experts_forward(q, sa, tw, ids, r, 10.0, configs=(1, 2))
    with pytest.raises(ValueError, match="limit='10': expected a finite number > 0"):
        routed_experts_forward(q, sa, tw, ids, r, "10")
    up, down = routed_configs(12, r)
    plain = (dataclasses.replace(up, a_bf16=False, fold_sa=False), down)   # a gate_up without bf16 pairs
    with pytest.raises(ValueError, match="q_pairs: given"):
        routed_experts_forward(q, sa, tw, ids, r, 10.0, configs=plain, q_pairs=torch.zeros(1))
