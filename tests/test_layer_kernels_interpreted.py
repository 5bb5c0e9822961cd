"""The whole layer through the kernel paths (Triton interpreter on CPU): every fused
path bitwise equal to its unfused twin, and the layer against the CPU reference.
On the GPU the same comparisons run natively in scripts/gpu_check_layer.py."""

import dataclasses

import pytest
import torch

import _triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU; must precede triton)
from dsv4_moe import DeepseekV4MoE, MoEConfig, dispatch, force_paths, reference
from dsv4_moe.testing import assert_bf16_close, assert_bitwise_equal, random_layer_weights

CFG = MoEConfig(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=4,
                num_hidden_layers=2, num_hash_layers=1, vocab_size=64)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    if torch.cuda.is_available():
        return torch.device("cuda")
    # Let the CUDA predicates accept the CPU: the kernels run in Triton's interpreter.
    monkeypatch.setattr(dispatch, "has_cuda", lambda device: (True, "Triton interpreter on CPU (test)"))
    return torch.device("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("li,layout", [(0, "auto"), (1, "auto"), (1, "mma64")],
                         ids=["hash_layer", "topk_layer", "topk_layer_mma64"])
def test_layer_kernel_paths(kernels_on_cpu, li, layout):
    dev = kernels_on_cpu
    w = random_layer_weights(CFG, layer_idx=li, seed=3 + li, device=dev)
    layer = DeepseekV4MoE(CFG, w, routed_layout=layout)
    g = torch.Generator().manual_seed(li)
    x = (torch.randn(5, CFG.hidden_size, generator=g) * 4).to(torch.bfloat16).to(dev)
    ids = torch.randint(0, CFG.vocab_size, (5,), generator=g).to(dev)
    plan = {p.stage: p.chosen.name for p in dispatch.plan(layer.context(5))}
    assert plan["finalize"] == "fused" and plan["swiglu_quant"] == "fused" and plan["routed_experts"] == "triton", plan
    assert plan["front"] == "quant_in_logits", plan
    fused = layer(x, ids)
    with force_paths(swiglu_quant="unfused", finalize="unfused"):
        unfused = layer(x, ids)
    assert_bitwise_equal(fused, unfused, "fused vs unfused layer", layer=li)
    with force_paths(front="separate"):  # act_quant in its own launch
        assert_bitwise_equal(layer(x, ids), fused, "quant_in_logits vs separate front", layer=li)
    wc = w.to("cpu")
    ref = reference.moe_forward(x.cpu(), ids.cpu(), wc, CFG)
    assert_bf16_close(fused.cpu(), ref, "layer", "kernel layer vs CPU reference", layer=li)
    # negative controls: the recipe sees a layer without its shared expert or without the clamps
    s = wc.shared
    no_shared = dataclasses.replace(wc, shared=type(s)(s.gate_up, s.gate_up_scale, torch.zeros_like(s.down),
                                                       s.down_scale))
    for wrong in (reference.moe_forward(x.cpu(), ids.cpu(), no_shared, CFG),
                  reference.moe_forward(x.cpu(), ids.cpu(), wc, dataclasses.replace(CFG, swiglu_limit=1e30))):
        with pytest.raises(AssertionError):
            assert_bf16_close(fused.cpu(), wrong, "layer")


@pytest.mark.slow
def test_layer_mma64e_bitwise_mma64(kernels_on_cpu):
    """routed_layout="mma64e" (the CUDA default since session 20): the layer through the
    kernel paths gives the "mma64" layer's bits (the same configs up to bit-neutral fields;
    the bodies decode the re-encoded words), and explain() names the layout."""
    w = random_layer_weights(CFG, layer_idx=1, seed=7, device=kernels_on_cpu)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(40, CFG.hidden_size, generator=g) * 4).to(torch.bfloat16).to(kernels_on_cpu)
    outs = {}
    for layout in ("mma64", "mma64e"):
        layer = DeepseekV4MoE(CFG, w, routed_layout=layout)
        assert layer.routed.layout == layout
        outs[layout] = layer(x)
    assert_bitwise_equal(outs["mma64e"], outs["mma64"], "mma64e vs mma64 layer")
    assert "routed weights in layout 'mma64e'" in layer.explain(40)


def test_routed_kernel_rejects_scales_outside_exact_folding(kernels_on_cpu):
    """Scale bytes above 128 would overflow the kernel's exact fp32 scale factor: dispatch
    falls back (closed) to the reference path and says why."""
    w = random_layer_weights(CFG, layer_idx=1, seed=5, device=kernels_on_cpu)
    w.routed.down_scale.view(torch.uint8)[0, 0, 0] = 200
    layer = DeepseekV4MoE(CFG, w)
    assert layer.routed_scale_range[1] == 200
    plan = {p.stage: p for p in dispatch.plan(layer.context(3))}
    assert plan["routed_experts"].chosen.name == "reference"
    assert any("outside [0, 128]" in why for _, why in plan["routed_experts"].rejected)
    assert "outside [0, 128]" in layer.explain(3)


def test_explain_names_the_routed_gemm_bodies(kernels_on_cpu):
    """explain() lists the MXFP4 GEMM bodies routed_configs picks for this T when the routed
    stage runs the kernels, and nothing when it does not."""
    from dsv4_moe.kernels.routed_experts import SWIGLU_ROUTE_LIST_MIN_ROUTES, routed_configs

    w = random_layer_weights(CFG, layer_idx=1, seed=5, device=kernels_on_cpu)
    layer = DeepseekV4MoE(CFG, w, routed_layout="mma64")
    for t in (1, 3, 200):
        up, down = routed_configs(t * CFG.num_experts_per_tok, layer.routed)
        text = layer.explain(t)
        assert f"gate_up {up.kind} {up.block_m}x{up.block_n}" in text, text
        assert f"down {down.kind} {down.block_m}x{down.block_n}" in text
        assert ("bf16 activation pairs" in text) == up.a_bf16
        assert f"gate_up {up.kind} {up.block_m}x{up.block_n}, {up.num_warps} warps, {up.num_stages} stages" in text
        routes = t * CFG.num_experts_per_tok
        listed = routes >= SWIGLU_ROUTE_LIST_MIN_ROUTES
        assert (f"SwiGLU-quant over the {routes} routes' rows (route list)" in text) == listed, text
        assert ("SwiGLU-quant over the alignment's rows" in text) == (not listed), text
    w.routed.down_scale.view(torch.uint8)[0, 0, 0] = 200   # routed stage falls back: no GEMM line
    assert "routed GEMMs" not in DeepseekV4MoE(CFG, w).explain(3)


@pytest.mark.parametrize("t", [1, 3, 40])
def test_routed_align_ahead_of_the_routed_stage(kernels_on_cpu, t):
    """stages.routed_align (the alignment the layer launches before forking the shared expert,
    layers.SHARED_FORK "align") is the one the triton routed stage computes itself: same BLOCK_M,
    and the routed output is bitwise the same whether it is passed in or not."""
    from dsv4_moe import stages

    w = random_layer_weights(CFG, layer_idx=1, seed=9, device=kernels_on_cpu)
    layer = DeepseekV4MoE(CFG, w)
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, CFG.hidden_size, generator=g) * 4).to(torch.bfloat16).to(kernels_on_cpu)
    topk_w, topk_ids = stages.router_triton(x, layer.router, None, CFG.num_experts_per_tok, CFG.routed_scaling_factor)
    q, sa = stages.act_quant_triton(x)
    align = stages.routed_align(topk_w, topk_ids, layer.routed)
    args = (q, sa, topk_w, topk_ids, layer.routed, CFG.swiglu_limit, "fused")
    pairs = stages.routed_wants_pairs(t * CFG.num_experts_per_tok, layer.routed)
    q_pairs = stages.act_quant_triton(x, pairs=pairs)[2] if pairs else None
    ahead = stages.routed_experts_triton(*args, q_pairs=q_pairs, align=align)
    itself = stages.routed_experts_triton(*args, q_pairs=q_pairs)
    assert_bitwise_equal(ahead, itself, "routed stage with the alignment passed in", T=t)
    # negative control: an alignment of other routes reaches the output (the stage reads its rows
    # from the alignment passed in, so the check above can see a wrong one)
    if t > 1:
        other = stages.routed_align(topk_w, topk_ids.flip(1).roll(1, dims=0), layer.routed)
        wrong = stages.routed_experts_triton(*args, q_pairs=q_pairs, align=other)
        assert not torch.equal(wrong.view(torch.int16), itself.view(torch.int16))


@pytest.mark.parametrize("t", [1, 3])
def test_finalize_sums_split_down_bitwise(kernels_on_cpu, t, monkeypatch):
    """routed_experts.FINALIZE_SUMS_SPLIT (session 32): where the routed down GEMM splits K, the
    layer's fused finalize sums its fp32 partials itself (no reduce launch). The layer is bitwise
    the same with the switch off (reduce launch + fused finalize) and with the unfused finalize
    (reduce launch, fp32 partial written, then the add), and explain() says which runs. The down
    is forced to split here (the policy splits it only at Flash-sized decode)."""
    from dsv4_moe import stages
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig

    cfg = MoEConfig(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=4,
                    num_hidden_layers=2, num_hash_layers=1, vocab_size=64)
    real = rx.routed_configs

    def split_down(num_routes, routed):
        up = real(num_routes, routed)[0]
        return up, GemmConfig(up.block_m, 64, 4, 2, kind="swap", split_k=2)

    monkeypatch.setattr(rx, "routed_configs", split_down)
    w = random_layer_weights(cfg, layer_idx=1, seed=11, device=kernels_on_cpu)
    layer = DeepseekV4MoE(cfg, w)
    assert rx.down_split_parts(t * 4, layer.routed) > 1
    g = torch.Generator().manual_seed(t + 7)
    x = (torch.randn(t, cfg.hidden_size, generator=g) * 4).to(torch.bfloat16).to(kernels_on_cpu)
    calls = []
    spy = stages.finalize_fused_split
    monkeypatch.setattr(stages, "finalize_fused_split", lambda *a: (calls.append(1), spy(*a))[1])
    fused = layer(x)
    assert calls == [1], "the fused finalize did not take the down's partials"
    assert "the fused finalize sums its" in layer.explain(t)
    with force_paths(finalize="unfused"):
        assert "a reduce launch sums its" in layer.explain(t)
        assert_bitwise_equal(layer(x), fused, "finalize on the down's partials vs the unfused finalize", T=t)
    monkeypatch.setattr(rx, "FINALIZE_SUMS_SPLIT", False)
    assert_bitwise_equal(layer(x), fused, "finalize on the down's partials vs reduce + fused finalize", T=t)
    assert calls == [1] and "FINALIZE_SUMS_SPLIT is off" in layer.explain(t)
    ref = reference.moe_forward(x.cpu(), None, w.to("cpu"), cfg)
    assert_bf16_close(fused.cpu(), ref, "layer", "kernel layer (down partials summed in finalize) vs CPU reference")
