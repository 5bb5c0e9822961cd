"""Layer API: shapes, dtypes, errors naming the bad value, zero tokens, dispatch and
the CLI's main job on the embedded default."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from dsv4_moe import DeepseekV4MLP, DeepseekV4MoE, MoEConfig, dispatch, force_paths, load_moe_layer, reference
from dsv4_moe.dispatch import DispatchContext
from dsv4_moe.testing import assert_bitwise_equal, random_layer_weights

CFG = MoEConfig.tiny()


@pytest.fixture(scope="module")
def layers():
    return {li: DeepseekV4MoE(CFG, random_layer_weights(CFG, layer_idx=li, seed=li)) for li in (0, 1)}


def _x(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, CFG.hidden_size, generator=g).to(torch.bfloat16)
    return x, torch.randint(0, CFG.vocab_size, (t,), generator=g)


@pytest.mark.parametrize("li", [0, 1], ids=["hash_layer", "topk_layer"])
@pytest.mark.parametrize("t", [1, 7])
def test_forward_equals_reference(layers, li, t):
    """On the CPU every stage takes its reference path, so this checks the module's own
    composition (routing into slots, finalize order, shared add, one rounding) against
    reference.moe_forward's. The kernel paths against the reference: test_layer_kernels_
    interpreted.py (interpreter) and scripts/gpu_check_layer.py (GPU)."""
    x, ids = _x(t, seed=t)
    out = layers[li](x, ids)
    assert out.shape == (t, CFG.hidden_size) and out.dtype == torch.bfloat16
    ref = reference.moe_forward(x, ids, layers[li].weights, CFG)
    assert_bitwise_equal(out, ref, "layer vs reference on CPU", layer=li, t=t)


def test_shared_expert_module(layers):
    x, _ = _x(3)
    mlp = layers[1].shared_experts
    assert isinstance(mlp, DeepseekV4MLP)
    out = mlp(x)
    assert_bitwise_equal(out, reference.shared_forward(x, mlp.weights, CFG.swiglu_limit), "shared expert")


def test_hash_layer_requires_input_ids(layers):
    x, _ = _x(2)
    with pytest.raises(ValueError, match="hash-routed layer: input_ids"):
        layers[0](x)
    with pytest.raises(ValueError, match=r"input_ids.shape=\(3,\)"):
        layers[0](x, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="input_ids.dtype=torch.float32"):
        layers[0](x, torch.zeros(2))


@pytest.mark.parametrize("bad,match", [
    (lambda x: x.float(), "hidden_states.dtype=torch.float32"),
    (lambda x: x[None], r"hidden_states.shape=\(1, 2, 256\)"),
    (lambda x: x[:, :100], r"hidden_states.shape=\(2, 100\)"),
    (lambda x: x.tolist(), "must be a torch.Tensor"),
])
def test_bad_inputs_name_the_argument(layers, bad, match):
    x, ids = _x(2)
    with pytest.raises((ValueError, TypeError), match=match):
        layers[1](bad(x), ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to put the input elsewhere")
def test_wrong_device(layers):
    x, ids = _x(2)
    with pytest.raises(ValueError, match="on cuda"):
        layers[1](x.cuda(), ids)


def test_wrong_device_meta(layers):
    x, ids = _x(2)
    with pytest.raises(ValueError, match="is on meta but the layer's weights are on cpu"):
        layers[1](x.to("meta"), ids)


def test_zero_tokens(layers):
    x = torch.empty(0, CFG.hidden_size, dtype=torch.bfloat16)
    for li in (0, 1):
        out = layers[li](x, torch.empty(0, dtype=torch.int64))
        assert out.shape == (0, CFG.hidden_size) and out.dtype == torch.bfloat16
    assert layers[1].shared_experts(x).shape == (0, CFG.hidden_size)


def test_weights_mismatch_rejected():
    w = random_layer_weights(CFG, layer_idx=1)
    with pytest.raises(ValueError, match="routed gate_up.shape"):
        DeepseekV4MoE(CFG.replace(moe_intermediate_size=256), w)


# --------------------------------------------------------------------------- dispatch
def test_explain_names_every_stage_and_reason(layers):
    text = layers[1].explain(16)
    for stage in dispatch.STAGES:
        assert stage in text
    assert "not triton: device is cpu, not cuda" in text


def test_explain_routed_gemm_plan(monkeypatch):
    """explain()'s routed GEMM plan (shown when the routed stage takes the Triton path; planning
    launches nothing, so it runs on the CPU with the choice forced): per GEMM its body, and
    for folded configs the swap body's ordering; DSV4_MOE_FOLD_SWAP=0 named when off."""
    import types

    from dsv4_moe.kernels import routed_experts as rx

    layer = DeepseekV4MoE(CFG, random_layer_weights(CFG, layer_idx=1))
    layer.set_routed_layout("mma64")
    select = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda stage, ctx, *a, **k: types.SimpleNamespace(name="triton")
                        if stage == "routed_experts" else select(stage, ctx, *a, **k))
    up, down = rx.routed_configs(16 * CFG.num_experts_per_tok, layer.routed)
    text = layer.explain(16)
    assert f"gate_up {up.kind} {up.block_m}x{up.block_n}" in text and f"down {down.kind} {down.block_m}x" in text
    order = {"split": "odd-k half converted after the even-k MMA)", "wait": "each block's MMAs waited on)"}
    assert f"(one MMA chain over K, {order[down.fold_order]}" in text, text
    up, down = rx.routed_configs(256 * CFG.num_experts_per_tok, layer.routed)  # 96 rows per expert
    assert (up.kind, up.block_m) == ("swap", 64) and "down swap 64x128" in layer.explain(256), layer.explain(256)
    assert up.n_fastest and "weight blocks fastest in the grid" in layer.explain(256)
    assert "weight blocks fastest" not in layer.explain(16)  # 16-row blocks keep the m-blocks fastest
    # a gate_up split over K (hidden 256: two 128-blocks, so 2 partials): the SwiGLU-quant sums
    # them itself (SWIGLU_SUMS_SPLIT), or after the reduce launch when switched off / unfused
    from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig

    split_up = GemmConfig(16, 128, 4, 4, kind="swap", split_k=2)
    with monkeypatch.context() as m:
        m.setattr(rx, "routed_configs", lambda routes, routed: (split_up, down))
        assert "summing the split gate_up's 2 fp32 partials itself (no reduce launch" in layer.explain(1)
        patched = dispatch.select
        m.setattr(dispatch, "select", lambda stage, ctx, *a, **k: types.SimpleNamespace(name="unfused")
                  if stage == "swiglu_quant" else patched(stage, ctx, *a, **k))
        assert "after the split gate_up's reduce launch (2 fp32 partials)" in layer.explain(1)
        m.setattr(dispatch, "select", patched)
        m.setattr(rx, "SWIGLU_SUMS_SPLIT", False)
        assert "after the split gate_up's reduce launch (2 fp32 partials)" in layer.explain(1)
    assert "fp32 partials" not in layer.explain(16)
    monkeypatch.setattr(rx, "FOLD_SWAP", False)
    assert "per-128-block scaling (DSV4_MOE_FOLD_SWAP=0)" in layer.explain(16)
    up, down = rx.routed_configs(256 * CFG.num_experts_per_tok, layer.routed)  # unfolded swaps: the tile
    assert up.kind == "tile" and "(one MMA chain over K), 168-register cap" in layer.explain(256), layer.explain(256)


def test_explain_shared_gemm_plan(monkeypatch):
    """explain()'s shared FP8 GEMM line (when fp8_gemm takes the Triton path; planning launches
    nothing, so it runs on the CPU with the choice forced): each GEMM's shape and the tile
    choose_config gives it, with the side stream's settings where the shared expert overlaps."""
    import types

    from dsv4_moe.kernels import fp8_block_gemm as F

    layer = DeepseekV4MoE(CFG, random_layer_weights(CFG, layer_idx=1))
    h, i = CFG.hidden_size, CFG.local_intermediate(1)
    assert "shared FP8 GEMMs" not in layer.explain(4)      # the CPU takes the reference path
    select = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda stage, ctx, *a, **k: types.SimpleNamespace(name="triton")
                        if stage == "fp8_gemm" else select(stage, ctx, *a, **k))
    assert f"shared FP8 GEMMs: gate_up [1 x {2 * i} x {h}] CUDA-core GEMV, one pass" in layer.explain(1)
    assert f"down [4 x {h} x {i}] 16x64 mma.sync, one pass" in layer.explain(4)
    text = layer.explain(64)
    assert f"gate_up [64 x {2 * i} x {h}] 64x64 wgmma (fp32 promotion every 32 K), one pass" in text, text
    monkeypatch.setattr(F, "MID_M_MIN_KB", 0)               # the tiny K of this layer passes the rule
    assert f"gate_up [64 x {2 * i} x {h}] 16x64 mma.sync, one pass" in layer.explain(64)
    monkeypatch.setattr(layer, "shared_overlap", lambda t: (True, "on a side stream"))   # as on CUDA
    cfg = F.choose_config(2, 2 * i, h, overlapped=True, split_k_programs_per_sm=dispatch.shared_split_policy(2, i)[0])
    assert f"gate_up [2 x {2 * i} x {h}] 16x64 mma.sync, " + (
        f"exact split-K over {cfg['SPLIT_K']} K-block groups" if cfg["SPLIT_K"] > 1 else "one pass") in layer.explain(2)
    monkeypatch.setattr(F, "SPLIT_K_MIN_KB", 1)             # this layer's K = 2 blocks may split
    assert f"gate_up [2 x {2 * i} x {h}] 16x64 mma.sync, exact split-K over 2 K-block groups" in layer.explain(2)


def test_explain_router_sub_choices(monkeypatch):
    """The router's reason names how the logits and the scores are computed for this T on
    a CUDA context (planning never launches anything, so it runs on the CPU)."""
    from dsv4_moe.kernels.router import GEMV_MAX_T, MMA_MAX_T

    def reason(t):
        return dispatch.explain(DispatchContext(device=torch.device("cuda"), num_tokens=t), ["router"])

    assert f"logits by the Triton GEMV (T <= {GEMV_MAX_T})" in reason(1)
    assert (f"logits by the Triton tensor-core kernel (T <= {MMA_MAX_T}, bf16 gate, its split-K partials summed by "
            f"the top-k kernel)") in reason(GEMV_MAX_T + 1)
    from dsv4_moe.kernels import router as rt

    monkeypatch.setattr(rt, "MMA_PARTIALS_IN_TOPK", False)
    dispatch.clear_plan_cache()
    assert f"logits by the Triton tensor-core kernel (T <= {MMA_MAX_T}, bf16 gate)" in reason(GEMV_MAX_T + 1)
    monkeypatch.setattr(rt, "MMA_PARTIALS_IN_TOPK", True)
    dispatch.clear_plan_cache()
    assert "logits by cuBLAS (fp32 out)" in reason(MMA_MAX_T + 1)
    assert "sqrt(softplus) in the top-k kernel" in reason(1)
    from dsv4_moe.kernels import router as router_mod

    def reason_h(t, h):
        return dispatch.explain(DispatchContext(device=torch.device("cuda"), num_tokens=t, hidden=h), ["router"])

    pre = "gate rows loaded before the PDL wait"
    assert pre in reason_h(1, 7168) and pre in reason_h(2, 4096) and pre not in reason_h(2, 7168)
    assert pre not in reason_h(3, 4096)
    monkeypatch.setattr(router_mod, "GEMV_PREWAIT", False)  # the A/B switch takes it away
    dispatch.clear_plan_cache()
    try:
        assert pre not in reason_h(1, 4096)
    finally:
        monkeypatch.undo()
        dispatch.clear_plan_cache()


def test_force_paths_validates_and_fails_closed():
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        with force_paths(nope="reference"):
            pass
    with pytest.raises(ValueError, match="has no path 'magic'"):
        with force_paths(finalize="magic"):
            pass
    ctx = DispatchContext(device=torch.device("cpu"))
    with force_paths(finalize="fused"):
        with pytest.raises(RuntimeError, match="forced path 'fused' cannot run here: device is cpu"):
            dispatch.select("finalize", ctx)
    with force_paths(all="reference"):
        plans = {p.stage: p for p in dispatch.plan(ctx)}
        assert all(p.chosen.name == "reference" and p.forced for s, p in plans.items() if s != "front")
        # the front has no reference path: it runs the (forced) stages it would merge
        assert plans["front"].chosen.name == "separate" and not plans["front"].forced
    with pytest.raises(ValueError, match="no stage has a path 'magic'"):
        with force_paths(all="magic"):
            pass


@pytest.mark.parametrize("stage, path", [("finalize", "unfused"), ("routed_experts", "triton"), ("fp8_gemm", "triton"),
                                         ("swiglu_quant", "fused")])
def test_explain_reports_a_forced_path_that_cannot_run(layers, stage, path):
    """explain() under force_paths with a path this device cannot run prints the whole plan, that
    stage's line saying what a forward raises (it used to raise itself); the forward raises it."""
    layer = layers[1]
    with force_paths(**{stage: path}):
        text = layer.explain(4)
        with pytest.raises(RuntimeError, match=f"forced path '{path}' cannot run here"):
            layer(_x(4)[0])
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(stage + " "))
    assert f"-> (none)     a forward raises: stage '{stage}': forced path '{path}' cannot run here: device is cpu" \
        in line
    assert sum(" -> " in ln for ln in text.splitlines()) == len(dispatch.STAGES) + 1   # every stage + launches


def test_log_dispatch_env(monkeypatch, capsys):
    monkeypatch.setenv("DSV4_MOE_LOG_DISPATCH", "1")
    dispatch.select("router", DispatchContext(device=torch.device("cpu"), num_tokens=12345))
    assert "router: reference" in capsys.readouterr().err


def test_env_force(monkeypatch):
    monkeypatch.setenv("DSV4_MOE_FORCE", "finalize=reference")
    p = dispatch.plan_stage("finalize", DispatchContext(device=torch.device("cpu")))
    assert p.forced and p.chosen.name == "reference"
    # a misspelt stage, a path the stage lacks, or all= a path no stage has: an error naming it,
    # not a silently ignored entry
    ctx = DispatchContext(device=torch.device("cpu"))
    for bad, what in (("finalise=unfused", "unknown stage 'finalise'"), ("finalize=fast", "no path 'fast'"),
                      ("all=fastest", "all='fastest'")):
        monkeypatch.setenv("DSV4_MOE_FORCE", bad)
        with pytest.raises(ValueError, match=what):
            dispatch.plan_stage("router", ctx)
    monkeypatch.setenv("DSV4_MOE_FORCE", "all=reference")
    assert dispatch.plan_stage("router", ctx).chosen.name == "reference"


# --------------------------------------------------------------------------- CLI / loading
def test_load_default_and_run_cli(tmp_path):
    from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR

    layer = load_moe_layer(DEFAULT_CHECKPOINT_DIR, 0)
    assert layer.is_hash and layer.config == CFG
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # NOTE: run from a neutral directory: from the repository root `python -m dsv4_moe` would import
    # the source folder dsv4_moe/ (which lacks the mapped subpackages weights/ and kernels/) instead
    # of the installed package, e.g. under `python -P -m pytest` with a non-editable install
    r = subprocess.run([sys.executable, "-m", "dsv4_moe", "run", "--tokens", "4"], capture_output=True, text=True,
                       env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "layer 0:" in r.stdout and "layer 1:" in r.stdout and "finite=True" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dsv4_moe", "explain", "--layer", "1", "--tokens", "8"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "finalize" in r.stdout, r.stderr


def test_overlap_shared_option():
    """The shared expert's side stream is a CUDA-only execution choice: rejected unless
    'auto' or a bool, stated by explain(), and the same output either way (on CPU it runs
    in line whatever the option says)."""
    cfg = MoEConfig.tiny()
    w = random_layer_weights(cfg, layer_idx=cfg.num_hash_layers, seed=2)
    with pytest.raises(TypeError, match="overlap_shared='yes': expected 'auto', True or False"):
        DeepseekV4MoE(cfg, w, overlap_shared="yes")
    on, off = DeepseekV4MoE(cfg, w), DeepseekV4MoE(cfg, w, overlap_shared=False)
    assert on.overlap_shared == "auto"
    assert "shared expert: in line (device cpu)" in on.explain(2)
    assert "shared expert: in line (device cpu)" in off.explain(2)
    assert on.shared_overlap(2) == (False, "in line (device cpu)")
    x = torch.randn(3, cfg.hidden_size).bfloat16()
    # on the CPU both run in line: this checks only that the option leaves the forward intact
    # (the side stream's bits: test_overlap_shared_same_bits_on_gpu, gpu_check_layer.py)
    assert_bitwise_equal(on(x), off(x), "overlap_shared on vs off")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the shared expert's side stream exists only on CUDA")
@pytest.mark.parametrize("t", [1, 4, 64])
@pytest.mark.parametrize("fork", ["auto", "logits", "front", "align"])
def test_overlap_shared_same_bits_on_gpu(t, fork, monkeypatch):
    """The shared expert on its side stream (forced, forked at each point) and in line: the same
    output bits."""
    from dsv4_moe import layers

    monkeypatch.setattr(layers, "SHARED_FORK", fork)
    cfg = MoEConfig.tiny()
    w = random_layer_weights(cfg, layer_idx=cfg.num_hash_layers, seed=2).to("cuda")
    side, inline = DeepseekV4MoE(cfg, w, overlap_shared=True), DeepseekV4MoE(cfg, w, overlap_shared=False)
    assert side.shared_overlap(t)[0] and not inline.shared_overlap(t)[0]
    x = torch.randn(t, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        assert_bitwise_equal(side(x), inline(x), "overlap_shared True vs False on the GPU", t=t)


def test_shared_overlap_policy_rule():
    """dispatch.shared_overlap_policy: in line for the Flash-shaped layer (I >= 2048) at
    0.5-8 routed rows per expert (measured 4-10 % faster there on the H200), overlapped at
    other decode sizes (T = 2 again since session 28), above the band and for Pro-TP8's
    I/tp = 384 at every T (its session-22 in-line band at T = 3-4 measured slower in session 27);
    dispatch.shared_fork_policy: the fork after the routed alignment at Flash-shaped T = 1 and 3-6 (session 51), after the
    router's logits at Pro-shaped T = 1-2 and 4-8 (sessions 30, 50), else after the front;
    dispatch.shared_split_policy: unsplit shared GEMMs at Flash-shaped T = 2-4 only."""
    from dsv4_moe import dispatch

    flash = dict(num_local_experts=256, top_k=6, intermediate=2048)
    pro = dict(num_local_experts=384, top_k=6, intermediate=384)
    assert [dispatch.shared_overlap_policy(t, **flash)[0] for t in (1, 2, 3, 16, 32, 256, 384, 4096)] == \
        [True, True, True, True, False, False, True, True]
    assert [dispatch.shared_split_policy(t, 2048)[0] for t in (1, 2, 3, 4, 5, 16)] == [None, 0, 0, 0, None, None]
    assert all(dispatch.shared_split_policy(t, 384)[0] is None for t in (1, 2, 3, 4, 16))
    assert "leaving SMs to the routed front" in dispatch.shared_split_policy(3, 2048)[1]
    assert all(dispatch.shared_overlap_policy(t, **pro)[0] for t in (1, 2, 3, 4, 5, 16, 64, 256, 1024, 8192))
    ov, why = dispatch.shared_overlap_policy(64, **flash)
    assert not ov and "1.50 routed rows per expert" in why and "I = 2048" in why
    assert [dispatch.shared_fork_policy(t, 2048)[0] for t in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)] == \
        ["align", "front", "align", "align", "align", "align", "front", "front", "front", "front"]
    assert [dispatch.shared_fork_policy(t, 384)[0] for t in (1, 2, 3, 4, 8, 9, 16, 63, 64, 128, 129)] == \
        ["logits", "logits", "front", "logits", "logits", "front", "front", "front", "align", "align", "front"]
    assert [dispatch.shared_fork_policy(t, i)[0] for t in (64, 128) for i in (768, 2048)] == ["front"] * 4


def test_shared_fork_switch(monkeypatch):
    """layers.SHARED_FORK: "auto" follows shared_fork_policy, "logits" / "front" / "align" force a
    point, anything else is a ValueError naming the value; explain() says where the shared expert forks."""
    from dsv4_moe import _explain, layers

    cfg = MoEConfig(hidden_size=256, moe_intermediate_size=2048, n_routed_experts=8, num_experts_per_tok=4,
                    num_hidden_layers=2, num_hash_layers=0, vocab_size=64)
    layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=1, seed=1))
    assert [layer._shared_fork(t) for t in (1, 2, 8, 16)] == ["align", "front", "front", "front"]
    for point in ("logits", "front", "align"):
        monkeypatch.setattr(layers, "SHARED_FORK", point)
        assert layer._shared_fork(1) == point == layer._shared_fork(16)
    monkeypatch.setattr(layers, "SHARED_FORK", True)
    with pytest.raises(ValueError, match="SHARED_FORK=True: expected 'auto' or one of"):
        layer._shared_fork(1)
    monkeypatch.setattr(layers, "SHARED_FORK", "auto")
    assert _explain.shared_line(layer, 1) == "in line (device cpu)"
    monkeypatch.setattr(layer, "shared_overlap", lambda t: (True, "on a side stream"))  # as on CUDA
    assert "forked after the routed alignment (T = 1, I = 2048" in _explain.shared_line(layer, 1)
    assert "forked right after the front" in _explain.shared_line(layer, 2)
    assert _explain.shared_line(layer, 3).endswith("decode GEMMs unsplit (N / 64 programs), leaving SMs to the "
                                                   "routed front (measured faster on the H200)")
    assert _explain.shared_line(layer, 16).endswith("decode GEMMs on their in-line split-K grids")
    assert _explain.shared_line(layer, 17).endswith("GEMMs in one pass (T > 16): 64-row tiles, or 16 / 32-row "
                                                    "ones on narrow GEMMs with a long K "
                                                    "(fp8_block_gemm.MID_M_MAX_N)")
    monkeypatch.setattr(layers, "SHARED_FORK", "logits")
    assert "forked after the router's logits launch" in _explain.shared_line(layer, 2)
    monkeypatch.setattr(layers, "SHARED_FORK", "start")  # measured slower in session 50, removed
    with pytest.raises(ValueError, match="SHARED_FORK='start': expected 'auto' or one of"):
        layer._shared_fork(1)
    monkeypatch.setattr(layers, "SHARED_FORK", "gate_up")  # measured slower in session 32, removed
    with pytest.raises(ValueError, match="SHARED_FORK='gate_up': expected 'auto' or one of"):
        layer._shared_fork(1)
    monkeypatch.setattr(layers, "SHARED_FORK", "auto")
    pro = DeepseekV4MoE(cfg.replace(moe_intermediate_size=384), random_layer_weights(
        cfg.replace(moe_intermediate_size=384), layer_idx=1, seed=1))
    monkeypatch.setattr(pro, "shared_overlap", lambda t: (True, "on a side stream"))
    forks = [pro._shared_fork(t) for t in (1, 2, 3, 4, 8, 9)]
    assert forks == ["logits", "logits", "front", "logits", "logits", "front"]
    assert "forked after the router's logits launch (on the quant_in_logits front; else after the front) " \
           "(T = 2, I = 384: shared expert forked after the router's logits launch" in _explain.shared_line(pro, 2)


def test_probe_skip_shared_is_the_layer_without_its_shared_output(monkeypatch):
    """layers.PROBE_SKIP_SHARED (a timing probe) runs the layer with a zero shared output: equal to
    the layer whose shared down weights are zero (shared output exactly 0), unequal to the layer's own
    output, and explain() says the probe is on."""
    import dataclasses as dc

    from dsv4_moe import layers

    cfg = MoEConfig(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
                    num_hidden_layers=2, num_hash_layers=0, vocab_size=64)
    w = random_layer_weights(cfg, layer_idx=1, seed=3)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    full = DeepseekV4MoE(cfg, w)(x)
    zero_down = dc.replace(w, shared=dc.replace(w.shared, down=torch.zeros_like(w.shared.down)))
    no_shared = DeepseekV4MoE(cfg, zero_down)(x)
    monkeypatch.setattr(layers, "PROBE_SKIP_SHARED", True)
    layer = DeepseekV4MoE(cfg, w)
    probed = layer(x)
    assert torch.equal(probed, no_shared)
    assert not torch.equal(probed, full)
    assert "shared expert: skipped: layers.PROBE_SKIP_SHARED is on" in layer.explain(5)


def test_shared_split_switch(monkeypatch):
    """dispatch.SHARED_SPLIT_K_PROGRAMS_PER_SM: -1 follows shared_split_policy's rule, >= 0 forces
    that target at every T, anything else is a ValueError naming the value; side_stream_scope
    hands the target to the fp8_gemm stage, which passes it to the kernel."""
    from dsv4_moe import dispatch, stages
    import dsv4_moe.kernels.fp8_block_gemm as fbg

    monkeypatch.setattr(dispatch, "SHARED_SPLIT_K_PROGRAMS_PER_SM", 2)
    assert dispatch.shared_split_policy(8, 384) == (2, "split-K target 2 programs per SM "
                                                       "(dispatch.SHARED_SPLIT_K_PROGRAMS_PER_SM)")
    for bad in (-2, True, 1.5):
        monkeypatch.setattr(dispatch, "SHARED_SPLIT_K_PROGRAMS_PER_SM", bad)
        with pytest.raises(ValueError, match=f"SHARED_SPLIT_K_PROGRAMS_PER_SM={bad!r}: expected -1"):
            dispatch.shared_split_policy(3, 2048)
    seen = []
    monkeypatch.setattr(fbg, "fp8_block_gemm_nt", lambda *a, **kw: seen.append(
        (kw["overlapped"], kw["split_k_programs_per_sm"])))
    stages.fp8_gemm_triton(None, None, None, None)
    with dispatch.side_stream_scope(0):
        assert dispatch.on_side_stream() and dispatch.side_stream_split_k() == 0
        stages.fp8_gemm_triton(None, None, None, None)
    with dispatch.side_stream_scope():
        stages.fp8_gemm_triton(None, None, None, None)
    assert not dispatch.on_side_stream() and dispatch.side_stream_split_k() is None
    assert seen == [(False, None), (True, 0), (True, None)]


def test_front_dispatch_reasons(monkeypatch):
    """The one-launch decode front (kernels/route_front.py) measured level in the layer bench,
    so the separate launches are the default and the fused front runs only when forced, and
    only where the stages it merges take their Triton paths and the sizes fit (fail closed).
    Planning runs on the CPU."""
    import dsv4_moe.kernels._triton_utils as tu
    from dsv4_moe.kernels.route_front import FRONT_MAX_T

    monkeypatch.setattr(dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(tu, "interpreting", lambda: False)

    def ctx(t):
        return DispatchContext(device=torch.device("cuda", 0), num_tokens=t)

    import dsv4_moe.kernels.router as rt
    monkeypatch.setattr(rt, "QUANT_IN_LOGITS", False)  # the separate launches' reason (quant_in_logits: below)
    dispatch.clear_plan_cache()
    p = dispatch.plan_stage("front", ctx(1))
    assert p.chosen.name == "separate" and "measured level" in p.reason and "force_paths(front='fused')" in p.reason
    with force_paths(front="fused"):
        p = dispatch.plan_stage("front", ctx(1))
        assert p.chosen.name == "fused" and "one launch" in p.reason and "R = 6 routes" in p.reason
        with pytest.raises(RuntimeError, match=f"forced path 'fused' cannot run here: T = {FRONT_MAX_T + 1} tokens: "
                                               f"the one-launch front covers 1 <= T <= {FRONT_MAX_T}"):
            dispatch.select("front", ctx(FRONT_MAX_T + 1))
        with force_paths(router="reference"):
            with pytest.raises(RuntimeError, match="stage 'router' takes its 'reference' path"):
                dispatch.select("front", ctx(1))
        monkeypatch.setattr(tu, "interpreting", lambda: True)
        dispatch.clear_plan_cache()  # select() memoises; a swapped fact needs a fresh plan
        with pytest.raises(RuntimeError, match="Triton interpreter"):
            dispatch.select("front", ctx(1))


def test_front_quant_in_logits_dispatch(monkeypatch):
    """act_quant inside the router's logits launch: taken where the logits are the Triton GEMV
    (T <= GEMV_MAX_T) or tensor-core kernel (bf16 gate, T <= MMA_MAX_T), rejected with the
    reason elsewhere, when the router / act_quant stages leave Triton, or when switched off."""
    import dsv4_moe.kernels._triton_utils as tu
    import dsv4_moe.kernels.router as rt

    monkeypatch.setattr(dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(tu, "interpreting", lambda: False)
    dispatch.clear_plan_cache()

    def ctx(t, dtype=torch.bfloat16):
        return DispatchContext(device=torch.device("cuda", 0), num_tokens=t, router_dtype=dtype)

    p = dispatch.plan_stage("front", ctx(1))
    assert p.chosen.name == "quant_in_logits" and "gemv logits launch" in p.reason
    p = dispatch.plan_stage("front", ctx(rt.MMA_MAX_T))
    assert p.chosen.name == "quant_in_logits" and "mma logits launch" in p.reason
    for c in (ctx(rt.MMA_MAX_T + 1), ctx(rt.GEMV_MAX_T + 1, torch.float32)):
        p = dispatch.plan_stage("front", c)
        assert p.chosen.name == "separate"
        assert "the logits are cuBLAS here" in dict(p.rejected)["quant_in_logits"]
    assert dispatch.plan_stage("front", ctx(rt.GEMV_MAX_T, torch.float32)).chosen.name == "quant_in_logits"
    with force_paths(act_quant="reference"):
        p = dispatch.plan_stage("front", ctx(1))
        assert p.chosen.name == "separate"
        assert "stage 'act_quant' takes its 'reference' path" in dict(p.rejected)["quant_in_logits"]
    monkeypatch.setattr(rt, "QUANT_IN_LOGITS", False)
    dispatch.clear_plan_cache()
    p = dispatch.plan_stage("front", ctx(1))
    assert p.chosen.name == "separate" and "switched off" in dict(p.rejected)["quant_in_logits"]
    dispatch.clear_plan_cache()


def test_topk_aligns_dispatch(monkeypatch):
    """The decode front's top-k also writes the routed alignment (stages.topk_aligns) at T = 1 only,
    not on hash layers, not below a per-rank intermediate of 2048 (measured slower at Pro-TP8), not
    when the routed stage leaves Triton, not when switched off - and the front's reason says so
    where it does."""
    import dsv4_moe.kernels._triton_utils as tu
    import dsv4_moe.kernels.router as rt
    from dsv4_moe import stages

    monkeypatch.setattr(dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(tu, "interpreting", lambda: False)
    dispatch.clear_plan_cache()

    def ctx(t, **kw):
        return DispatchContext(device=torch.device("cuda", 0), num_tokens=t, **{"intermediate": 2048, **kw})

    ok, why = stages.topk_aligns(ctx(1))
    assert ok and "no moe_align launch" in why
    assert "routed alignment" in dispatch.plan_stage("front", ctx(1)).reason
    assert "routed alignment" not in dispatch.plan_stage("front", ctx(2)).reason
    assert stages.topk_aligns(ctx(2)) == (False, "T=2: the top-k aligns one token's routes only")
    assert not stages.topk_aligns(ctx(1, is_hash=True))[0]
    ok, why = stages.topk_aligns(ctx(1, intermediate=384))           # Pro-TP8-shaped: measured slower
    assert not ok and "I = 384 per rank < 2048" in why
    assert "routed alignment" not in dispatch.plan_stage("front", ctx(1, intermediate=384)).reason
    with force_paths(routed_experts="reference"):
        ok, why = stages.topk_aligns(ctx(1))
        assert not ok and "not the Triton one" in why
    monkeypatch.setattr(rt, "TOPK_ALIGN_T1", False)
    assert stages.topk_aligns(ctx(1)) == (False, "switched off (kernels/router.py TOPK_ALIGN_T1)")
    dispatch.clear_plan_cache()


def test_optional_backend_import_is_tried_once():
    """A failed optional import (deep_gemm) is not retried on every forward: the dispatch
    predicate asks once per GEMM shape per forward, and each retry searched sys.path again
    (~100-200 us of host time per forward, scripts/cpu_dispatch_cost.py)."""
    from dsv4_moe.kernels import deep_gemm_fp8 as dg

    dg._import.cache_clear()
    first = dg.deep_gemm_supported(128, 128, 128, "cpu")
    assert dg.deep_gemm_supported(128, 128, 128, "cpu") == first
    info = dg._import.cache_info()
    assert info.misses == 1 and info.hits >= 1


def test_graphed_moe_rejects_bad_arguments(layers):
    """GraphedMoE (dsv4_moe/graphs.py) names the bad argument; a CPU layer is refused
    (graphs are CUDA-only); on the H200 scripts/gpu_check_layer.py checks replay == eager."""
    from dsv4_moe import GraphedMoE

    layer = layers[1]
    with pytest.raises(TypeError, match="layer: expected a DeepseekV4MoE, got DeepseekV4MLP"):
        GraphedMoE(layer.shared_experts, (1,))
    for bad in ((), (0,), (1, True), (2.0,)):
        with pytest.raises(ValueError, match=r"token_counts=.*expected one or more ints >= 1"):
            GraphedMoE(layer, bad)
    for bad in (None, "16"):
        with pytest.raises(ValueError, match=r"token_counts=.*expected an int or an iterable of ints >= 1"):
            GraphedMoE(layer, bad)
    with pytest.raises(ValueError, match="strict='no': expected True or False"):
        GraphedMoE(layer, (1,), strict="no")
    with pytest.raises(ValueError, match="layer is on cpu: CUDA graphs need the layer on a CUDA device"):
        GraphedMoE(layer, (1, 4))


def test_select_memo_follows_forcing_and_env(monkeypatch):
    """dispatch.select memoises per (stage, context, forced paths, environment): forcing by
    context manager or DSV4_MOE_FORCE still takes effect at once, and clear_plan_cache()
    re-plans after a predicate is swapped."""
    monkeypatch.setattr(dispatch, "_capability", lambda index: (9, 0))
    ctx = DispatchContext(device=torch.device("cuda", 0), num_tokens=4)
    assert dispatch.select("finalize", ctx).name == "fused"
    with force_paths(finalize="unfused"):
        assert dispatch.select("finalize", ctx).name == "unfused"
    monkeypatch.setenv("DSV4_MOE_FORCE", "finalize=reference")
    assert dispatch.select("finalize", ctx).name == "reference"
    monkeypatch.delenv("DSV4_MOE_FORCE")
    assert dispatch.select("finalize", ctx).name == "fused"
    monkeypatch.setattr(dispatch, "has_cuda", lambda device: (False, "no cuda (test)"))
    assert dispatch.select("finalize", ctx).name == "fused"  # memoised
    dispatch.clear_plan_cache()
    assert dispatch.select("finalize", ctx).name == "reference"


def test_input_ids_checked_on_every_layer(layers):
    """Hash layer: ids outside [0, vocab_size) (-1 would read the table's last row) are a
    ValueError naming the range; any layer: a non-tensor is a TypeError, a wrong shape a
    ValueError (engines pass the ids to every layer)."""
    x, ids = _x(4)
    for bad in (torch.tensor([0, 1, -1, 2]), torch.tensor([0, CFG.vocab_size, 1, 2], dtype=torch.int32)):
        with pytest.raises(ValueError,
                           match=rf"input_ids: ids in \[-?\d+, \d+\], expected \[0, vocab_size={CFG.vocab_size}\)"):
            layers[0](x, bad)
    for li in (0, 1):
        with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
            layers[li](x, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"input_ids.shape=\(7,\): expected \[4\]"):
        layers[1](x, torch.zeros(7, dtype=torch.int64))
    assert_bitwise_equal(layers[1](x, ids), layers[1](x), "top-k layer: input_ids unused")


def _router_edit(li, **router):
    w = random_layer_weights(CFG, layer_idx=li, seed=li)
    return dataclasses.replace(w, router=dataclasses.replace(w.router, **router))


@pytest.mark.parametrize("make,err,match", [
    (lambda: (dataclasses.replace(CFG, num_hash_layers=0), random_layer_weights(CFG, layer_idx=0)), ValueError,
     "the weights are hash-routed, but the config's num_hash_layers=0 makes it top-k routed"),
    (lambda: (dataclasses.replace(CFG, num_experts_per_tok=2), random_layer_weights(CFG, layer_idx=0)), ValueError,
     r"router tid2eid: torch.int64 shape \(1024, 6\), expected int64 \(or int32\) \[vocab_size=1024, "
     r"num_experts_per_tok=2\]"),
    (lambda: (CFG, _router_edit(0, tid2eid=torch.full((CFG.vocab_size, 6), CFG.n_routed_experts))), ValueError,
     r"router tid2eid: ids in \[16, 16\], expected \[0, n_routed_experts=16\)"),
    (lambda: (CFG, _router_edit(1, bias=torch.zeros(3))), ValueError, r"router bias: torch.float32 shape \(3,\)"),
    (lambda: (CFG, dataclasses.replace(random_layer_weights(CFG, layer_idx=1), layer_idx=-5)), ValueError,
     "weights.layer_idx=-5"),
    (lambda: (None, random_layer_weights(CFG, layer_idx=1)), TypeError, "config: expected a MoEConfig, got NoneType"),
    (lambda: (CFG, "x"), TypeError, "weights: expected MoELayerWeights, got str"),
])
def test_weights_that_do_not_fit_the_config(make, err, match):
    cfg, w = make()
    with pytest.raises(err, match=match):
        DeepseekV4MoE(cfg, w)


def test_mlp_arguments_and_explain_token_counts(layers):
    w = random_layer_weights(CFG, layer_idx=1).shared
    with pytest.raises(ValueError, match="tp_size=0: expected an int >= 1"):
        DeepseekV4MLP(CFG, w, tp_size=0)
    with pytest.raises(ValueError, match="tp_size=1.0"):
        DeepseekV4MLP(CFG, w, tp_size=1.0)
    with pytest.raises(TypeError, match="weights: expected SharedExpertWeights"):
        DeepseekV4MLP(CFG, random_layer_weights(CFG, layer_idx=1).router)
    for bad in (-3, 3.5, True, "16", None):
        with pytest.raises(ValueError, match=r"num_tokens=.*: expected an int >= 0"):
            layers[1].explain(bad)
        with pytest.raises(ValueError, match=r"num_tokens=.*: expected an int >= 0"):
            layers[1].shared_experts.explain(bad)


@pytest.mark.parametrize("kw,match", [
    ({"device": "foo"}, "device='foo': not a device torch knows"),
    ({"device": None}, "device=None: expected 'cpu', 'cuda', 'cuda:N' or a torch.device"),
    ({"device": "meta"}, "device='meta': expected a cpu or cuda device"),
    ({"device": "cpu:1"}, "device='cpu:1': the CPU has no index 1"),
    ({"device": "cuda:99"}, "device='cuda:99': "),
    ({"progress": "yes"}, "progress='yes': expected True, False or None"),
])
def test_load_arguments_named(kw, match):
    from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR

    with pytest.raises(ValueError, match=match):
        load_moe_layer(DEFAULT_CHECKPOINT_DIR, 1, **kw)


def test_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="group='notagroup'"):
        DeepseekV4MoE(CFG, random_layer_weights(CFG, layer_idx=1), group="notagroup")


def test_cli_arguments_named(tmp_path, capsys):
    """Bad CLI values end with a message naming the flag, never a traceback."""
    from dsv4_moe.cli import main
    from dsv4_moe.weights.cli import make_checkpoint_main

    for argv, msg in ((["run", "--layer", ","], "--layer=',': names no layer"),
                      (["run", "--layer", "1,1"], "--layer='1,1': layer 1 is named twice"),
                      (["run", "--device", "meta"], "--device='meta': expected a cpu or cuda device"),
                      (["explain", "--device", "foo"], "--device='foo': not a device torch knows")):
        with pytest.raises(SystemExit, match=re.escape(msg)):
            main(argv)
    for argv, flag in ((["run", "--tokens", "0"], "--tokens=0"), (["run", "--checkpoint", str(tmp_path / "nope")],
                       "--checkpoint="), (["run", "--seed", str(2 ** 64)], "--seed="),
                       (["bench", "--reps", "-1"], "--reps=-1"), (["bench", "--budget-s", "nan"], "--budget-s=nan")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2 and flag in capsys.readouterr().err, argv     # argparse's usage error
    out = tmp_path / "ck"
    assert make_checkpoint_main(["--out", str(out), "--layers", "0", "--no-progress"]) == 0
    capsys.readouterr()
    assert make_checkpoint_main(["--out", str(out), "--layers", "0", "--no-progress"]) == 2
    assert "make-checkpoint --overwrite" in capsys.readouterr().err
    assert make_checkpoint_main(["--out", "/dev/null/x", "--layers", "0", "--no-progress"]) == 2
    assert "--out='/dev/null/x'" in capsys.readouterr().err


def test_dtype_changes_refused_device_moves_kept():
    """layer.to(dtype) / .half() / .float() would cast the native FP8 codes, e8m0 scales and the
    fp32 router: refused with a TypeError naming a buffer, before any buffer is touched; a device
    move (.to("cpu"), .cpu()) works and changes nothing. Forwards build no autograd graph."""
    layer = DeepseekV4MoE(CFG, random_layer_weights(CFG, layer_idx=1, seed=1))
    x, _ = _x(3)
    want = layer(x)
    dtypes = {n: b.dtype for n, b in layer.named_buffers()}
    ptrs = {n: b.data_ptr() for n, b in layer.named_buffers()}
    for f in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(), lambda m: m.bfloat16(),
              lambda m: m.to("cpu", torch.float32), lambda m: m.shared_experts.double()):
        with pytest.raises(TypeError, match=r"a dtype change \(here buffer '\w+' torch\.\w+ -> torch\.\w+\) is not "
                                            r"supported.*\.to\(device\) only"):
            f(layer)
        assert {n: b.dtype for n, b in layer.named_buffers()} == dtypes
        assert {n: b.data_ptr() for n, b in layer.named_buffers()} == ptrs
    assert layer.to("cpu") is layer and layer.cpu() is layer
    assert_bitwise_equal(layer(x), want)
    y = layer(x.clone().requires_grad_())
    assert not y.requires_grad and not layer.shared_experts(x.clone().requires_grad_()).requires_grad


def test_cli_bad_checkpoints_and_token_counts(tmp_path, capsys):
    """A checkpoint that cannot be read ends `run` / `explain` with one line naming --checkpoint and
    the error (the reader's names the tensor and shard), not a traceback; --tokens has an upper
    bound; a missing --checkpoint directory is named as such."""
    import shutil

    from dsv4_moe.cli import MAX_TOKENS, main
    from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR

    noshards = tmp_path / "noshards"
    noshards.mkdir()
    shutil.copy(os.path.join(DEFAULT_CHECKPOINT_DIR, "config.json"), noshards / "config.json")
    badjson = tmp_path / "badjson"
    badjson.mkdir()
    (badjson / "config.json").write_text("{")
    for argv, msg in ((["run", "--checkpoint", str(noshards), "--layer", "1"], "CheckpointError"),
                      (["explain", "--checkpoint", str(noshards), "--layer", "1"], "CheckpointError"),
                      (["run", "--checkpoint", str(badjson)], "config.json")):
        with pytest.raises(SystemExit, match=re.escape(f"--checkpoint={argv[2]!r}: ") + f".*{msg}") as ei:
            main(argv)
        assert ei.value.code != 0
    for argv, msg in ((["run", "--tokens", str(MAX_TOKENS + 1)], f"expected an int in [1, {MAX_TOKENS}]"),
                      (["explain", "--tokens", "99999999999999999999"], "--tokens=99999999999999999999"),
                      (["run", "--checkpoint", str(tmp_path / "nope")], "no such directory")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2 and msg in capsys.readouterr().err, argv
