"""The layer check scripts' CPU-runnable parts (sessions 37-38): gpu_check_layer.py's references
and route comparison, its --ref-tokens validation, gpu_check_layer_stages.py and
reference_sensitivity.py end to end on the tiny layer (Triton under the interpreter)."""
import _triton_interp  # noqa: F401  (TRITON_INTERPRET=1 where there is no GPU; must precede triton)

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
sys.path.insert(0, SCRIPTS)

import gpu_check_layer as gcl  # noqa: E402

from dsv4_moe import DeepseekV4MoE, MoEConfig, reference  # noqa: E402
from dsv4_moe.testing import random_layer_weights  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny layer on CPU tensors; on a GPU host the "
                                                                "scripts themselves run (scripts/gpu_check_layer*.py)")


@cpu_only
def test_references_and_route_differences():
    """_references: the whole reference ("own") is reference.moe_forward bitwise; the bounded one
    (the layer's route weights and shared output) and "gpu_shared" differ from it only through
    those, which on the CPU are the reference's bits; _route_differences finds nothing on a layer
    routed like the reference."""
    cfg = MoEConfig.tiny()
    w = random_layer_weights(cfg, layer_idx=1, seed=0)
    layer = DeepseekV4MoE(cfg, w)
    x, ids = gcl._inputs(cfg, 7, 7, "cpu")
    refs = gcl._references(layer, x, ids, w, cfg)
    own = refs["own"]
    assert torch.equal(own.view(torch.int16), reference.moe_forward(x, ids, w, cfg).view(torch.int16))
    for key in ("bounded", "gpu_shared"):   # CPU: the same route weights and shared bits
        assert torch.equal(refs[key].view(torch.int16), own.view(torch.int16)), key
    assert refs["weight_rel"] == 0.0
    assert gcl._route_differences(layer, x, ids, w, cfg) == ([], [])


def _tiny_layer_with_router(monkeypatch, t: int, edit):
    """The tiny layer and T inputs, its router's (weights, ids) passed through edit(tw, tid)."""
    from dsv4_moe import dispatch

    cfg = MoEConfig.tiny()
    w = random_layer_weights(cfg, layer_idx=1, seed=0)
    layer = DeepseekV4MoE(cfg, w)
    x, ids = gcl._inputs(cfg, t, t, "cpu")
    real = dispatch.select

    class Edited:
        def __init__(self, impl):
            self.impl_ = impl

        def impl(self, *a):
            return edit(*self.impl_(*a))

    monkeypatch.setattr(dispatch, "select", lambda stage, ctx: Edited(real(stage, ctx).impl) if stage == "router"
                        else real(stage, ctx))
    return cfg, w, layer, x, ids


@cpu_only
def test_route_differences_names_a_changed_route(monkeypatch):
    """A router that picks another expert for one token (far from any tie) is reported off a tie."""
    def wrong(tw, tid):
        tid = tid.clone()
        tid[2, 0] = next(e for e in range(MoEConfig.tiny().n_routed_experts) if e not in tid[2].tolist())
        return tw, tid

    cfg, w, layer, x, ids = _tiny_layer_with_router(monkeypatch, 5, wrong)
    ties, off = gcl._route_differences(layer, x, ids, w, cfg)
    assert ties == [] and off == [2]


@cpu_only
def test_references_take_the_layers_route_weights(monkeypatch):
    """A router whose weights for one token are 1e-3 off: the bounded reference is the routed
    reference on exactly those weights (the others untouched), and weight_rel names the token
    and exceeds ROUTE_WEIGHT_REL, so the layer check fails on it."""
    def skewed(tw, tid):
        tw = tw.clone()
        tw[3, 0] *= 1.001
        return tw, tid

    cfg, w, layer, x, ids = _tiny_layer_with_router(monkeypatch, 6, skewed)
    refs = gcl._references(layer, x, ids, w, cfg)
    assert refs["weight_token"] == 3 and 0.9e-3 < refs["weight_rel"] < 1.1e-3 > gcl.ROUTE_WEIGHT_REL
    k, c = cfg.num_experts_per_tok, cfg
    rw, rid = reference.route(x, w.router.weight, w.router.bias, w.router.tid2eid, ids, k, c.routed_scaling_factor)
    rw[3, 0] *= 1.001
    q, sa = reference.act_quant(x)
    acc = reference.finalize(reference.routed_forward(q, sa, rw, rid, w.routed, c.swiglu_limit), rid,
                             w.routed.first_expert, w.routed.num_local)
    want = reference.combine(acc, reference.shared_forward(x, w.shared, c.swiglu_limit, quantised=(q, sa)), w)
    assert torch.equal(refs["bounded"].view(torch.int16), want.view(torch.int16))
    assert not torch.equal(refs["bounded"][3], refs["own"][3])
    assert torch.equal(refs["bounded"][:3].view(torch.int16), refs["own"][:3].view(torch.int16))


def test_ref_tokens_validated_before_any_device():
    for extra, msg in ((["--tokens", "4,16", "--ref-tokens", "4,8"], "T=[8] not among the checked T"),
                       (["--ref-tokens", "a"], "expected comma-separated ints")):
        r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check_layer.py"), *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


@cpu_only
@pytest.mark.parametrize("script,args,want", [
    ("gpu_check_layer_stages.py", ["--case", "tiny", "--tokens", "5"], "17/17 checks ok"),
    ("reference_sensitivity.py", ["--case", "tiny", "--tokens", "64"], "logits_fp32 route weights: largest"),
])
def test_script_runs_on_the_tiny_layer(tmp_path, script, args, want):
    env = dict(os.environ, OUT=str(tmp_path), TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0 and want in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_scale_spread_script(tmp_path):
    """scripts/scale_spread.py: the spread of a block is over its groups with a nonzero code (a zero
    group counts at no scale), a block of zeros is -1, K need not be whole 128-blocks; on the
    embedded checkpoint (Gaussian weights through the checkpoint quantiser) every row-block spreads
    over <= 2 binades, so the s8 fold of DESIGN.md's lead covers all of them."""
    import json

    import scale_spread as ss
    from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR

    codes = torch.zeros(1, 2, 80, dtype=torch.uint8)            # K = 160: one whole block, one of 1 group
    codes[0, 0, :] = 0x11
    codes[0, 0, 16:32] = 0x88                                    # row 0, group 1: only -0 codes
    scales = torch.tensor([[[120, 90, 123, 121, 119], [127, 127, 127, 127, 127]]], dtype=torch.uint8)
    got = ss.block_spreads(codes, scales.view(torch.float8_e8m0fnu))
    assert got.tolist() == [[[3, 0], [-1, -1]]]                  # 123 - 120 (90 skipped); 119 alone; row 1 zeros
    assert ss.spread_counts(got) == {"blocks": 4, "empty": 2, "by_spread": [1, 0, 0, 1] + [0] * (ss.MAX_BIN - 3)}
    out = tmp_path / "spread.json"
    assert ss.main([DEFAULT_CHECKPOINT_DIR, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["layer"] == 1 and d["experts"] == 16
    for gemm in ("gate_up", "down"):
        c = d[gemm]
        assert sum(c["by_spread"]) + c["empty"] == c["blocks"] > 0
        assert sum(c["by_spread"][3:]) == 0, c


def test_ab_layer_driver_parts():
    """gpu_ab_layer.py (session 49): the bench row parser takes the default path's layer rows only,
    cases need a label, and each round starts one case later."""
    import gpu_ab_layer as ab

    text = ("case          | scope | T |   us | TB/s\n"
            "layer default | layer | 1 | 53.6 | 2.01 | 6.62 |\n"
            "layer unfused | layer | 1 | 60.1 | 1.80 |\n"
            "layer default | layer | 16 | 332.3 | 2.6 |\n"
            "layer default | layer | 4 | skipped |  |\n")
    assert ab.parse_rows(text) == {1: 53.6, 16: 332.3}
    skipped = "layer default | layer | 8 | skipped |      |         |  | time budget (--budget-s 15)\n"
    assert ab.parse_skipped(text + skipped) == {4: "", 8: "time budget (--budget-s 15)"}
    assert ab.parse_case("default=") == ("default", [])
    assert ab.parse_case("s4=--set a.B=4 --tokens 1") == ("s4", ["--set", "a.B=4", "--tokens", "1"])
    for bad in ("noequals", "=--set a.B=1", "two words=x"):
        with pytest.raises(ValueError, match="--case"):
            ab.parse_case(bad)
    assert [ab.order(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    lines = ab.table({"a": {1: [2.0, 1.0, 3.0]}})
    assert lines[1].split()[:4] == ["a", "1", "2.0", "-"]
    lines = ab.table({"a": {1: [2.0, 1.0, 3.0]}}, {"a": {1: {"MB": 5.0, "graph_calls": 64}}})
    assert lines[1].split() == ["a", "1", "2.0", "2.50", "2.0,", "1.0,", "3.0"]   # 5 MB in 2 us


def test_graph_length_probe_parts():
    """gpu_probe_graph_length.py (session 50): the rotation repeated k times in graph order (forward j:
    layer j % layers, input j % inputs), with session 51's stand-in after each forward where given, the
    lengths alternating by round, the flags' values checked with the flag named, and one table row per
    case with a column per forwards-per-graph."""
    import gpu_probe_graph_length as pgl

    calls = []
    layers = [lambda x, i, n=n: calls.append((n, x, i)) for n in range(4)]
    fns = pgl.rotation_calls(layers, ["x0", "x1"], ["i0", "i1"], 2)
    assert len(fns) == 8
    for f in fns:
        f()
    assert calls == [(0, "x0", "i0"), (1, "x1", "i1"), (2, "x0", "i0"), (3, "x1", "i1")] * 2
    calls.clear()
    for f in pgl.rotation_calls(layers[:2], ["x0"], ["i0"], 1, between=lambda: calls.append("copy")):
        f()
    assert calls == [(0, "x0", "i0"), "copy", (1, "x0", "i0"), "copy"]  # session 51: a stand-in after each forward
    assert pgl.copy_stand_in(0) == (None, "")
    with pytest.raises(SystemExit, match="--between-bytes=-1: expected >= 0"):
        pgl.copy_stand_in(-1)
    copy, label = pgl.copy_stand_in(4_000_000, device="cpu")
    assert label == "net of a 4 MB copy after every forward"
    copy()  # runs: dst.copy_(src) on the device given
    assert [pgl.order([1, 2, 4], r) for r in range(4)] == [[1, 2, 4], [2, 4, 1], [4, 1, 2], [1, 2, 4]]
    assert pgl.parse_ints("1,3,2", "--lengths") == [1, 3, 2]
    for bad in ("0,1", "1,1", "a", ""):
        with pytest.raises(SystemExit, match="--lengths="):
            pgl.parse_ints(bad, "--lengths")
    from gpu_timeline_layer import preset_config
    assert preset_config("pro-tp8").moe_intermediate_size == 384 and preset_config("flash").hidden_size == 4096
    with pytest.raises(SystemExit, match="unknown preset 'pro'"):
        preset_config("pro")
    lines = pgl.table({("flash", 1, "stream"): {1: [53.0, 54.0, 55.0], 3: [51.0]}}, 16, [1, 3, 4])
    assert lines[1].split() == ["case", "16", "48", "64"]
    assert lines[2].split() == ["flash", "T=1", "stream", "54.0", "51.0", "-"]
    assert pgl.table({}, 16, [1], ", net of a 4 MB copy after every forward")[0].endswith(
        "(the rotation of 16 forwards repeated, net of a 4 MB copy after every forward)")


def test_ab_layer_run_facts(tmp_path):
    """gpu_ab_layer.run_facts: the bytes and the graph length of the default path's ok layer rows of one
    bench JSON; a missing or unreadable file gives {} (the run's µs still count)."""
    import json

    import gpu_ab_layer as ab

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": [
        {"case": "layer default", "status": "ok", "T": 1, "MB": 40.11, "graph_calls": 64},
        {"case": "layer default", "status": "skipped", "T": 4},
        {"case": "layer unfused", "status": "ok", "T": 1, "MB": 1.0, "graph_calls": 64}]}))
    assert ab.run_facts(str(path)) == {1: {"MB": 40.11, "graph_calls": 64}}
    assert ab.run_facts(str(tmp_path / "missing.json")) == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert ab.run_facts(str(tmp_path / "bad.json")) == {}
