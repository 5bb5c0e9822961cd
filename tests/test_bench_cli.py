"""`python -m dsv4_moe bench` on CPU (tiny preset, reference path): table, JSON, skips.

The sweep itself (graphs, peers, the fused paths) needs the H200; here the CPU run must
produce a well-formed table and strict JSON, report every peer skipped with a reason,
and the pieces the GPU run relies on (timing loop, synthetic weights, speedup columns,
import guards) are checked on their own.
"""

import dataclasses
import json
import os
import sys

import pytest
import torch

from dsv4_moe.bench import report
from dsv4_moe.bench.peers import PEERS, make_peer
from dsv4_moe.bench.run import main
from dsv4_moe.bench.synthetic import E8M0_SYNTH_RANGE, synthetic_layer_weights
from dsv4_moe.bench.timing import time_sets
from dsv4_moe.config import MoEConfig

# --reps 1 --sets 1: the CPU reference forward takes ~0.1-1 s, this keeps the file < 1 min.
FAST = ["--preset", "tiny", "--device", "cpu", "--reps", "1", "--sets", "1"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One CPU run with the layer and peers parts (stages are covered by a separate test)."""
    d = tmp_path_factory.mktemp("bench")
    path = d / "out.json"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(FAST + ["--tokens", "1,2", "--parts", "layer,peers", "--json", str(path), "--plot", str(d / "p.png")])
    return rc, buf.getvalue(), json.loads(path.read_text())


def test_plot_and_graphs_notes(tiny_run):
    """--plot without matplotlib is said before the run and again at its end (the run goes on);
    with it the plot is written. On the CPU the note says the rows were timed without graphs."""
    rc, out, doc = tiny_run
    why = report.plot_unavailable()
    lines = out.splitlines()
    if why:
        assert lines[0].startswith("# --plot ") and lines[0].endswith(f"will be skipped: {why}")
        assert f"# plot skipped: {why}" in out
    else:
        assert "# plot: " in out
    assert any("timed eagerly (CUDA graphs need a CUDA device" in n for n in doc["notes"])


def test_cli_exit_code_and_reproduce_line(tiny_run):
    rc, out, doc = tiny_run
    assert rc == 0
    assert "# reproduce: python -m dsv4_moe bench --preset tiny --device cpu" in out
    assert doc["command"].startswith("python -m dsv4_moe bench --preset tiny")


def test_table_is_aligned(tiny_run):
    _, out, _ = tiny_run
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("case "))
    table = [lines[head]] + [ln for ln in lines[head + 2:] if ln.count(" | ") >= 9]
    assert len(table) > 1 + 6, out  # header + 6 peers + 2 T x 3 paths
    # the first 9 column separators sit at the same offsets on every line
    def seps(ln):
        pos, out_ = [], -1
        for _ in range(9):
            out_ = ln.index(" | ", out_ + 1)
            pos.append(out_)
        return pos
    ref = seps(table[0])
    for ln in table[1:]:
        assert seps(ln) == ref, ln


def test_json_is_complete(tiny_run):
    _, _, doc = tiny_run
    for key in ("command", "env", "hardware", "config", "rows", "notes", "tolerances"):
        assert key in doc
    for key in ("device_name", "torch", "triton", "git_commit", "python"):
        assert doc["env"][key], key
    hw = doc["hardware"]
    assert hw["copy_TBps"] > 0 and hw["floor_matmul"] == "fp32" and hw["floor_TFLOPs"] > 0
    ref_rows = [r for r in doc["rows"] if r["case"] == "layer reference"]
    assert [r["T"] for r in ref_rows] == [1, 2]
    for r in ref_rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] == 0.0  # the layer's reference path is the reference
        assert r["us"] > 0 and r["MB"] > 0 and r["GFLOP"] > 0
        assert r["TBps"] == pytest.approx(r["MB"] / r["us"])
        assert 0 < r["pct_floor"] == pytest.approx(100 * r["floor_us"] / r["us"])
        assert r["mode"] == "cpu"
        assert 1 <= r["unique_experts"] <= 6 * r["T"]


def test_cpu_skips_gpu_paths_with_a_reason(tiny_run):
    _, _, doc = tiny_run
    for case in ("layer default", "layer unfused"):
        rows = [r for r in doc["rows"] if r["case"] == case]
        assert rows and all(r["status"] == "skipped" and "CPU" in r["reason"] for r in rows)


def test_every_peer_reported_skipped_not_crashed(tiny_run):
    _, out, doc = tiny_run
    peers = {r["case"]: r for r in doc["rows"] if r["kind"] == "peer"}
    for name in ("torch_router", "hum16", "hum8t", "grouped", "scaled_mm", "deep_gemm"):
        r = peers[f"peer {name}"]
        assert r["status"] == "skipped" and r["reason"], r
        assert f"peer {name}" in out


def test_stages_run_through_dispatch_on_cpu(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(FAST + ["--tokens", "1", "--parts", "stages", "--stages", "router,act_quant,finalize",
                        "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    got = {r["case"]: r for r in rows}
    for st in ("router", "act_quant", "finalize"):
        r = got[f"stage {st}"]
        assert r["status"] == "ok" and r["rel_err"] == 0.0, r
        assert r["label"] == "reference"  # what dispatch picks on CPU


def test_check_rows_zero_reports_no_error_figure(tmp_path, capsys):
    """--check-rows 0 (a timing probe whose output is not the layer's) times the rows unchecked: no
    rel_err figure in the JSON or the table, and a note says so (it printed 0.0e+00 before)."""
    path = tmp_path / "c.json"
    assert main(FAST + ["--tokens", "1", "--parts", "stages", "--stages", "router,finalize", "--check-rows", "0",
                        "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if r["case"].startswith("stage ")]
    assert rows and all(r["status"] == "ok" and r["rel_err"] is None for r in rows), rows
    assert any("--check-rows 0: no row was checked" in n for n in doc["notes"])
    assert "0.0e+00" not in out and "--check-rows 0: no row was checked" in out


def test_routed_layout_option_reaches_the_layer_and_the_notes(tmp_path):
    """--routed-layout picks the byte order of this package's routed weights (the layer is
    built with it, not converted back by "auto"); the JSON notes say which and why."""
    path = tmp_path / "l.json"
    assert main(FAST + ["--tokens", "2", "--parts", "layer,stages", "--stages", "routed", "--routed-layout", "mma64e",
                        "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert any("layout 'mma64e' (requested)" in n for n in data["notes"]), data["notes"]
    assert all(r["status"] in ("ok", "skipped") for r in data["rows"])
    assert any(r["case"] == "stage routed" and r["status"] == "ok" for r in data["rows"])


def test_overlap_shared_option_reaches_the_layers_and_the_notes(tmp_path, monkeypatch):
    """--overlap-shared on / off builds the layers with overlap_shared True / False (the A/B
    switch for the shared expert's side stream); the JSON notes say so; "auto" adds no note."""
    from dsv4_moe.bench import ours

    built = []
    real = ours.build_layer

    def spy(config, weights, routed_layout="auto", overlap_shared="auto"):
        built.append(overlap_shared)
        return real(config, weights, routed_layout, overlap_shared)

    monkeypatch.setattr(ours, "build_layer", spy)
    for flag, want in (("off", False), ("on", True), ("auto", "auto")):
        built.clear()
        path = tmp_path / f"ov_{flag}.json"
        assert main(FAST + ["--tokens", "2", "--parts", "layer", "--overlap-shared", flag, "--json", str(path)]) == 0
        assert built, flag
        assert all((v == "auto") if want == "auto" else (v is want) for v in built), built
        notes = json.loads(path.read_text())["notes"]
        assert any("overlap_shared" in n for n in notes) == (flag != "auto"), notes
    with pytest.raises(SystemExit):
        main(FAST + ["--overlap-shared", "sometimes"])


def test_graph_chain_min_calls_flag(capsys):
    """--graph-chain-min-calls is refused below 1 before anything is built, with the flag and value named."""
    with pytest.raises(SystemExit):
        main(FAST + ["--graph-chain-min-calls", "0"])
    assert "--graph-chain-min-calls=0: expected >= 1" in capsys.readouterr().err


def test_expert_parallel_rank_runs_stages_and_explains_the_layer_skip(tmp_path):
    path = tmp_path / "ep.json"
    assert main(FAST + ["--tokens", "4", "--ep-size", "2", "--ep-rank", "1", "--parts", "layer,stages",
                        "--stages", "router,finalize", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    got = {r["case"]: r for r in doc["rows"]}
    assert got["layer reference"]["status"] == "skipped" and "EP rank" in got["layer reference"]["reason"]
    assert got["stage finalize"]["status"] == "ok" and got["stage finalize"]["rel_err"] == 0.0
    assert doc["layer"]["ep_size"] == 2
    # rank 1 of 2 holds experts 8..15 of tiny's 16: only its routes count in the byte model
    assert got["stage finalize"]["local_routes"] < 4 * 6


def test_time_budget_skips_rows_with_a_reason(tmp_path):
    path = tmp_path / "b.json"
    assert main(FAST + ["--tokens", "1,4", "--parts", "layer", "--budget-s", "0", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    ref = [r for r in rows if r["case"] == "layer reference"]
    assert len(ref) == 2 and all(r["status"] == "skipped" and "time budget" in r["reason"] for r in ref)


def test_missing_optional_peer_import_is_a_skip_reason(monkeypatch):
    """humming / deep_gemm not installed: the adapters say so instead of raising (the device
    check is passed by asking as if on CUDA; nothing is launched)."""
    w = synthetic_layer_weights(MoEConfig.tiny())
    monkeypatch.setitem(sys.modules, "humming", None)  # import humming -> ImportError
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    why = make_peer("hum16").unavailable("cuda", w)
    assert why and "humming-kernels not importable" in why
    why = make_peer("deep_gemm").unavailable("cuda", w)
    assert why and "deep_gemm not importable" in why
    assert "CUDA" in make_peer("grouped").unavailable("cpu", w)
    with pytest.raises(ValueError, match="peer='nope'"):
        make_peer("nope")
    assert set(PEERS) >= {"hum16", "hum8t", "hum8g", "grouped", "scaled_mm", "deep_gemm", "torch_router"}


@pytest.mark.parametrize("argv, match", [
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "a,b"], "--tokens"),
    (["--parts", "layer,bogus"], "--parts"),
    (["--peers", "vllm"], "--peers"),
    (["--tokens", "1,,2"], "--tokens='1,,2'"),
    (["--tokens", "4,"], "--tokens='4,'"),
    (["--json", "/"], "--json='/': is a directory"),
    (["--json", os.path.abspath(__file__) + "/x.json"], "is a file, not a directory"),
    (["--plot", os.path.abspath(__file__) + "/a/b.png"], "--plot=.*is a file, not a directory"),
    (["--checkpoint", "/nonexistent/ckpt"], "FileNotFoundError: .*no config.json"),
])
def test_bad_arguments_exit_with_a_message(argv, match):
    """Refused before anything is timed (an output path that cannot be written used to fail with a
    traceback after the whole run), with a message naming the flag."""
    with pytest.raises(SystemExit, match=match):
        main(["--preset", "tiny", "--device", "cpu"] + argv)


def test_uniform_routing_builds_a_hash_layer_with_distinct_experts():
    cfg = MoEConfig.tiny()
    w = synthetic_layer_weights(cfg, hash_layer=True, seed=3)
    t = w.router.tid2eid
    assert w.router.bias is None and t.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert int(t.min()) >= 0 and int(t.max()) < cfg.n_routed_experts
    assert all(len(set(row)) == cfg.num_experts_per_tok for row in t[:64].tolist())


def test_synthetic_weights_tp_shapes_dtypes_and_ranges():
    # A small config split like V4-Pro at TP8: per-rank I = 1024 / 8 = 128, kept unpadded.
    cfg = MoEConfig(hidden_size=256, moe_intermediate_size=1024, n_routed_experts=8, num_hidden_layers=2,
                    num_hash_layers=1, vocab_size=64)
    w = synthetic_layer_weights(cfg, tp_rank=5, tp_size=8)
    r, s = w.routed, w.shared
    assert r.gate_up.shape == (8, 256, 128) and r.gate_up.dtype == torch.uint8
    assert r.gate_up_scale.shape == (8, 256, 8) and r.gate_up_scale.dtype == torch.float8_e8m0fnu
    assert r.down.shape == (8, 256, 64) and r.down_scale.shape == (8, 256, 4)
    sc = r.down_scale.view(torch.uint8)
    assert int(sc.min()) >= E8M0_SYNTH_RANGE[0] and int(sc.max()) <= E8M0_SYNTH_RANGE[1]
    assert s.gate_up.shape == (256, 256) and s.gate_up.dtype == torch.float8_e4m3fn
    assert s.gate_up_scale.shape == (2, 2) and s.down_scale.shape == (2, 1)
    # UE8M0 block scales chosen from the data: every block's amax lands in (224, 448].
    from dsv4_moe.weights.formats import e8m0_to_float32

    blocks = s.gate_up.float().view(2, 128, 2, 128).abs().amax(dim=(1, 3))
    assert bool((blocks <= 448).all()) and bool((blocks > 224).all())
    std = (s.gate_up.float() * e8m0_to_float32(s.gate_up_scale).repeat_interleave(128, 0)
           .repeat_interleave(128, 1)).std().item()
    from dsv4_moe.testing import SHARED_SYNTH_STD

    assert 0.9 * SHARED_SYNTH_STD < std < 1.1 * SHARED_SYNTH_STD
    assert w.router.weight.dtype == torch.bfloat16 and w.router.bias.dtype == torch.float32
    assert w.layer_idx == cfg.num_hash_layers  # synthetic default: first non-hash layer
    other = synthetic_layer_weights(cfg, tp_rank=4, tp_size=8)
    assert not torch.equal(other.routed.down, r.down)  # ranks differ


def test_time_sets_cpu_median_and_rotation():
    calls = []
    t = time_sets([lambda: calls.append(0), lambda: calls.append(1)], device="cpu", reps=3, target_ms=0.01)
    assert t.mode == "cpu" and t.n_sets == 2 and len(t.samples_us) == 3
    assert t.min_us <= t.median_us
    assert calls.count(0) == calls.count(1)  # both sets are used equally often
    with pytest.raises(ValueError, match="fns is empty"):
        time_sets([], device="cpu")
    assert t.as_dict()["graph_calls"] == 1
    with pytest.raises(ValueError, match="chain_min_calls=0"):
        time_sets([lambda: None], device="cpu", chain_min_calls=0)


def test_chain_repeats():
    """The chained graph's rotation repeats until it holds CHAIN_MIN_CALLS calls (a model's graph holds
    43-61 MoE layers; session 50 measured the time per call moving by up to 3.5 us at T = 1 between
    16- and 48-call graphs), but never past CHAIN_MAX_MS of device time per replay, and at least once."""
    from dsv4_moe.bench.timing import CHAIN_MAX_MS, CHAIN_MIN_CALLS, chain_repeats
    assert CHAIN_MIN_CALLS == 64
    assert chain_repeats(16, 0.5) == 4            # Pro-TP8 T = 1: 16 calls of ~31 us -> 64 calls, ~2 ms
    assert chain_repeats(16, 0.5, min_calls=48) == 3
    assert chain_repeats(12, 0.5) == 6            # ceil(64 / 12): 72 calls, never fewer than 64
    assert chain_repeats(64, 0.5) == 1 and chain_repeats(100, 0.1) == 1
    assert chain_repeats(4, CHAIN_MAX_MS / 3) == 3    # large T: as many as fit in CHAIN_MAX_MS
    assert chain_repeats(4, 2 * CHAIN_MAX_MS) == 1    # one replay already past it: the rotation once
    assert chain_repeats(16, 0.0) == 4
    with pytest.raises(ValueError, match="n_calls=0"):
        chain_repeats(0, 1.0)


def test_speedups_compare_default_with_same_scope_baselines():
    rows = [
        dict(case="layer default", kind="path", path="default", scope="layer", T=1, status="ok", us=10.0),
        dict(case="layer unfused", kind="path", path="unfused", scope="layer", T=1, status="ok", us=15.0),
        dict(case="peers best sum", kind="sum", scope="layer", T=1, status="ok", us=40.0),
        dict(case="peer hum8t", kind="peer", scope="routed", T=1, status="ok", us=30.0),
        dict(case="stage routed", kind="stage", scope="routed", T=1, status="ok", us=20.0),
        dict(case="peer grouped", kind="peer", scope="routed", T=4, status="ok", us=99.0),
        dict(case="peer hum16", kind="peer", scope="routed", T=1, status="wrong", rel_err=0.9, tol=0.08),
    ]
    report.add_speedups(rows)
    assert rows[0]["vs"] == {"layer unfused": 1.5, "peers best sum": 4.0}
    assert rows[4]["vs"] == {"peer hum8t": 1.5}  # not the T=4 row, not the wrong one
    assert "vs" not in rows[1] and "vs" not in rows[3]
    text = report.format_table(rows)
    assert "wrong (rel err 0.9 > tol 0.08)" in text
    assert "1.50x layer unfused" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the sweep's GPU paths)")
def test_gpu_tiny_sweep_checks_and_times_every_row(tmp_path, capsys):
    """On the GPU: every row of ours is checked then timed; torch peers run; nothing errors."""
    path = tmp_path / "g.json"
    assert main(["--preset", "tiny", "--device", "cuda", "--tokens", "1,16,300", "--reps", "3",
                 "--budget-s", "300", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    # humming / deep_gemm are outside this package (optional installs): only ours and torch's peers must pass.
    mine = ("peer torch_router", "peer grouped", "peer scaled_mm")
    problems = [(r["case"], r["T"], r["status"], r.get("reason"), r.get("rel_err")) for r in rows
                if r["status"] in ("error", "wrong") and (r["kind"] != "peer" or r["case"] in mine)]
    assert not problems, problems
    for r in rows:
        if r["kind"] in ("path", "stage") and not (r.get("path") == "reference" and r["T"] > 4):
            assert r["status"] == "ok", r
    for name in ("torch_router", "grouped", "scaled_mm"):
        assert {r["status"] for r in rows if r["case"] == f"peer {name}"} == {"ok"}, name
    default = [r for r in rows if r["case"] == "layer default"]
    assert all(r["vs"].get("layer reference") or r["T"] > 4 for r in default)
    assert {r["mode"] for r in default if r["T"] == 300} == {"eager"}  # above --graph-max-tokens
    assert "x vs baselines" in out and doc["hardware"]["floor_matmul"] == "fp8"


def _tiny_set(T=6, seed=0):
    from dsv4_moe import reference as R
    from dsv4_moe.bench import ours

    cfg = MoEConfig.tiny()
    w = synthetic_layer_weights(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    tw, ids = R.route(x, w.router.weight, w.router.bias, None, None, cfg.num_experts_per_tok,
                      cfg.routed_scaling_factor)
    return cfg, w, ours.StageSet(x, None, tw, ids)


def test_peer_adapters_that_run_on_cpu_match_the_reference():
    """The torch peers' weight layout, SwiGLU clamp and weighted combine, checked on CPU
    (the GPU run repeats the check at full size before timing)."""
    from dsv4_moe.bench import ours
    from dsv4_moe.bench.peers import PEER_TOLERANCE
    from dsv4_moe.bench.sweep import rel_err

    cfg, w, s = _tiny_set()
    p = make_peer("torch_router")
    p.prepare(cfg, w, [w.shared], "cpu")
    tw, ids = p.bind(s, 0)()
    assert torch.equal(ids, s.topk_ids) and rel_err(tw, s.topk_w) < 1e-6
    p = make_peer("grouped")
    p.prepare(cfg, w, [w.shared], "cpu")
    try:
        out = p.bind(s, 0)()
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {e}")
    exact = ours.exact_output("routed", w, cfg, s)
    ref = ours.stage_reference("routed", w, cfg, s)
    assert rel_err(out, exact) < 0.01  # bf16 activations, exact dequantised weights
    assert rel_err(out, ref) < PEER_TOLERANCE["grouped"]
    # the check catches a broken adapter: gate and up swapped
    r = w.routed
    i = r.intermediate
    swapped = dataclasses.replace(w, routed=dataclasses.replace(
        r, gate_up=torch.cat([r.gate_up[:, i:], r.gate_up[:, :i]], 1),
        gate_up_scale=torch.cat([r.gate_up_scale[:, i:], r.gate_up_scale[:, :i]], 1)))
    bad = make_peer("grouped")
    bad.prepare(cfg, swapped, [w.shared], "cpu")
    assert rel_err(bad.bind(s, 0)(), ref) > 0.5


def test_align_layout_invariants():
    from dsv4_moe.bench._humming import align_routes

    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [5, 7]], dtype=torch.int32)
    sorted_ids, expert_ids, total = align_routes(ids, 8, 4)
    n = ids.numel()
    assert int(total) == sorted_ids.numel() == 4 * expert_ids.numel()
    real = sorted_ids[sorted_ids != n]
    assert sorted(real.tolist()) == list(range(n))  # every route exactly once, rest is sentinel
    flat = ids.reshape(-1)
    for blk, e in enumerate(expert_ids.tolist()):
        rows = sorted_ids[4 * blk:4 * blk + 4]
        assert all(int(flat[r]) == e for r in rows if r != n)  # a block holds one expert's routes



def _fake_run(title, rows):
    hw = {"copy_TBps": 4.2, "fp8_TFLOPs": 1400.0, "bf16_TFLOPs": 780.0}
    env = {"device_name": "GPU", "torch": "t", "triton": "3.6.0", "git_commit": "abc1234"}
    return {"title": title, "command": "bench", "hardware": hw, "env": env, "rows": [
        {"case": case, "T": t, "status": status, "us": us, "TBps": 1.0, "TFLOPs": 1.0, "pct_floor": 10.0}
        for case, t, status, us in rows]}


def test_bench_tables_merge_runs(tmp_path, capsys):
    """scripts/bench_tables.py a.json+b.json: one table; b's measured rows replace a's
    (a budget-limited sweep completed by a second run for the T it skipped)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_tables", Path(__file__).resolve().parents[1] / "scripts" / "bench_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    first = _fake_run("layer A", [("layer default", 1, "ok", 80.0), ("layer default", 8192, "skipped", None),
                                  ("layer unfused", 1, "ok", 120.0)])
    second = _fake_run("layer A", [("layer default", 8192, "ok", 12345.0), ("layer default", 1, "skipped", None)])
    got = {(r["case"], r["T"]): r for r in tables.merge([first, second])["rows"]}
    assert got[("layer default", 8192)]["us"] == 12345.0          # measured row replaces a skip
    assert got[("layer default", 1)]["us"] == 80.0                # a skip never replaces a measurement
    assert got[("layer unfused", 1)]["us"] == 120.0 and len(got) == 3
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    assert tables.main([f"{a}+{b}"]) == 0
    out = capsys.readouterr().out
    assert out.count("ceilings measured in the same run") == 2
    assert "| 1 | 80.0 |" in out and "| 8192 | 12345.0 |" in out
    with pytest.raises(ValueError, match="different layers"):
        tables.merge([first, _fake_run("layer B", [])])


def test_set_option_sets_a_module_constant_and_notes_it(tmp_path, monkeypatch):
    """--set MODULE.ATTR=VALUE (an A/B switch for module constants) parses VALUE as the
    constant's type, sets it before the layers run, says so in the notes, and names what is
    wrong with a bad item."""
    from dsv4_moe.kernels import mxfp4_grouped_gemm as mg

    monkeypatch.setattr(mg, "A_PAD_ROWS", mg.A_PAD_ROWS)  # restored after the test
    path = tmp_path / "set.json"
    assert main(FAST + ["--tokens", "2", "--parts", "layer", "--set",
                        "dsv4_moe.kernels.mxfp4_grouped_gemm.A_PAD_ROWS=0", "--json", str(path)]) == 0
    assert mg.A_PAD_ROWS == 0
    notes = json.loads(path.read_text())["notes"]
    assert any("A_PAD_ROWS = 0 (default 2)" in n for n in notes), notes
    for item, match in (("nodot=1", "MODULE.ATTR=VALUE"), ("dsv4_moe.nope.X=1", "does not import"),
                        ("dsv4_moe.kernels.mxfp4_grouped_gemm.NOPE=1", "no attribute 'NOPE'"),
                        ("dsv4_moe.kernels.mxfp4_grouped_gemm.A_PAD_ROWS=x", "is of type int: cannot parse 'x'")):
        with pytest.raises(SystemExit, match=match):
            main(FAST + ["--set", item])


def test_timeline_forward_table():
    """scripts/gpu_timeline_layer.py's cut of a graph replay's kernel events into forwards:
    medians per (kernel, occurrence) relative to each forward's first start, ordered by end;
    the period inside a replay only (the gap between replays is not a forward's cost, and is given on
    its own: replay 0's last end 294 us, replay 1's first start 10 ms); a
    kernel whose count does not divide into forwards is set aside and named, and nothing left
    is refused."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from gpu_timeline_layer import forward_table

    evs = []
    for rep in range(2):                       # 2 replays x 3 forwards, 100 us apart, replays 10 ms apart
        for f in range(3):
            t0 = rep * 10_000_000 + f * 100_000
            evs += [("_router_logits_kernel(int)", t0, t0 + 5_000),
                    ("_mxfp4_grouped_gemm_swap_kernel", t0 + 4_000, t0 + 60_000),   # PDL: starts early
                    ("_mxfp4_grouped_gemm_swap_kernel", t0 + 61_000, t0 + 90_000),
                    ("_finalize_kernel", t0 + 90_500, t0 + 92_000 + f * 1_000)]
    (table, summary), why = forward_table(list(reversed(evs)), inner=3, replays=2)
    assert why == ""
    assert summary == dict(kernels_per_forward=4, span_us=93.0, period_us=100.0, replay_gap_us=9706.0,
                           set_aside={})
    names = [(k[0], k[1]) for k, _ in table]
    assert names == [("_router_logits_kernel", 0), ("_mxfp4_grouped_gemm_swap_kernel", 0),
                     ("_mxfp4_grouped_gemm_swap_kernel", 1), ("_finalize_kernel", 0)]
    assert table[1][1] == dict(start=4.0, end=60.0, dur=56.0)
    assert table[3][1]["end"] == 93.0
    once = [("nvjet_memset_like_kernel", rep * 10_000_000 + 50_000, rep * 10_000_000 + 51_000) for rep in range(2)]
    (t2, s2), why = forward_table(evs[:-1] + once, inner=3, replays=2)   # a finalize lost, one kernel per replay
    assert why == "" and s2["kernels_per_forward"] == 3
    assert s2["set_aside"] == {"_finalize_kernel": 5, "nvjet_memset_like_kernel": 2}
    assert [k for k, _ in t2] == [k for k, _ in table][:3] and t2[1][1] == table[1][1]
    res, why = forward_table(once, inner=3, replays=2)
    assert res is None and "0 kernel events for 2 x 3 forwards" in why and "nvjet_memset_like_kernel" in why


def test_gpu_check_layer_checkpoint_only_flag():
    """scripts/gpu_check_layer.py --checkpoint-only (session 34: the checkpoint case as its own step
    of a time-limited call) refuses the flags that contradict it before touching a device."""
    import subprocess
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_check_layer.py")
    for extra in ("--no-checkpoint", "--front-only"):
        r = subprocess.run([sys.executable, script, "--checkpoint-only", extra], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and "--checkpoint-only cannot be combined" in r.stderr, r.stderr


def test_timeline_rotations_build_what_they_name():
    """gpu_timeline_layer.build_sets (session 49): "bench" is the layer bench's rotation - every layer
    reads the same routed expert tensors and its own router and shared copies (equal values); "layers"
    builds whole layers with different weights."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from gpu_timeline_layer import build_sets

    from dsv4_moe import MoEConfig

    cfg = MoEConfig.tiny().replace(num_hidden_layers=6)   # the tool builds layer 5, as in a V4 model
    bench = build_sets(cfg, "bench", 3, device="cpu")
    assert len(bench) == 3
    ptr = {lay.routed.gate_up.data_ptr() for lay in bench}
    assert len(ptr) == 1, "the bench rotation shares one set of routed experts"
    assert len({lay.router.weight.data_ptr() for lay in bench}) == 3
    assert len({lay.shared_experts.w_gate_up.data_ptr() for lay in bench}) == 3
    assert all(torch.equal(lay.router.weight, bench[0].router.weight) for lay in bench)
    whole = build_sets(cfg, "layers", 2, device="cpu")
    assert whole[0].routed.gate_up.data_ptr() != whole[1].routed.gate_up.data_ptr()
    assert not torch.equal(whole[0].routed.gate_up, whole[1].routed.gate_up)
