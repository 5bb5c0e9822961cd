"""Programmatic dependent launch (PDL): the pairing rule and the dispatch fact.

A kernel launched with the programmatic-serialisation attribute may start before its
predecessor on the stream has finished; it is only correct if its first action is
`griddepcontrol.wait` (kernels._triton_utils.pdl_enter). These tests hold every Triton
kernel of the package to that rule by reading the source (the GPU run itself is checked
bitwise PDL on == off by scripts/gpu_check_layer.py), and check the CPU side of the switch.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import dsv4_moe.kernels
from dsv4_moe import dispatch
from dsv4_moe.kernels._triton_utils import pdl_options

KERNELS = pathlib.Path(dsv4_moe.kernels.__file__).resolve().parent
# Kernels always launched plain (never with the PDL attribute, so never racing a predecessor),
# with the reason. Nothing else may be listed.
PLAIN_LAUNCH = {
    "_l2_prefetch_kernel": "l2_prefetch.py: first kernel on the layer's own prefetch stream, after an event "
                           "wait; reads static weights only and writes nothing",
}


def _jit_kernels():
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield path.name, node


def test_every_kernel_waits_first():
    found = list(_jit_kernels())
    assert len(found) >= 15, [n.name for _, n in found]
    for fname, node in found:
        args = [a.arg for a in node.args.args]
        if node.name in PLAIN_LAUNCH:
            assert "PDL" not in args, f"{fname}:{node.name} is listed as launched plain but takes PDL"
            continue
        assert "PDL" in args, f"{fname}:{node.name} has no PDL parameter"
        default = node.args.defaults[args.index("PDL") - (len(args) - len(node.args.defaults))]
        assert ast.unparse(default) == "0", f"{fname}:{node.name}: PDL must default to 0 (plain launch)"
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        first = ast.unparse(body[0])
        if isinstance(body[0], ast.If) and ast.unparse(body[0].test) == "PREWAIT":
            # the one exception (router.GEMV_PREWAIT): static gate rows - weights no kernel of the
            # forward writes - loaded before the wait; nothing else, and the wait right after
            pre, other = body[0].body, body[0].orelse
            assert ast.unparse(pre[0]).startswith("w_pre = _gate_rows("), f"{fname}:{node.name}: {ast.unparse(pre[0])!r}"
            assert ast.unparse(pre[1]) == "pdl_enter(PDL)" and ast.unparse(other[0]) == "pdl_enter(PDL)", \
                f"{fname}:{node.name}: the PREWAIT branches must wait right after the gate rows' load"
            continue
        assert first == "pdl_enter(PDL)", f"{fname}:{node.name}: first statement is {first!r}, not pdl_enter(PDL)"


def test_every_launch_passes_the_options():
    """Every `name_kernel[grid](...)` launch in kernels/ carries pdl_options (directly, via a
    `pdl` dict built from it, or via a kwargs dict that does)."""
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                    ast.unparse(node.func.value).endswith("_kernel"):
                starred = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                if ast.unparse(node.func.value) in PLAIN_LAUNCH:
                    assert not any("pdl" in s for s in starred), f"{path.name}: plain launch given pdl options"
                    continue
                assert any("pdl" in s or s == "common" for s in starred), \
                    f"{path.name}: launch of {ast.unparse(node.func.value)} without pdl_options ({starred})"
                if "common" in starred:
                    src = path.read_text()
                    assert "**pdl_options(out.device))" in src.split("common = dict(")[1].split("\n    if ")[0]


def test_cpu_and_interpreter_never_get_pdl(monkeypatch):
    assert pdl_options(torch.device("cpu")) == {}
    ok, why = dispatch.has_pdl(torch.device("cpu"))
    assert not ok and "cpu" in why
    monkeypatch.setattr(dispatch, "PDL_MODE", "off")
    ok, why = dispatch.has_pdl(torch.device("cuda", 0))
    assert not ok and "DSV4_MOE_PDL=off" in why
    monkeypatch.setattr(dispatch, "PDL_MODE", "sometimes")
    with pytest.raises(ValueError, match="PDL_MODE='sometimes'.*DSV4_MOE_PDL"):
        dispatch.has_pdl(torch.device("cuda", 0))


def test_auto_mode_scopes_and_policy(monkeypatch):
    monkeypatch.setattr(dispatch, "PDL_MODE", "auto")
    assert dispatch.pdl_mode() == "early"            # standalone kernels
    with dispatch.pdl_scope("exit"):
        assert dispatch.pdl_mode() == "exit"
        monkeypatch.setattr(dispatch, "PDL_MODE", "off")  # an explicit mode wins over the scope
        assert dispatch.pdl_mode() == "off"
        monkeypatch.setattr(dispatch, "PDL_MODE", "auto")
    assert dispatch.pdl_mode() == "early"
    with pytest.raises(ValueError, match="pdl_scope"):
        with dispatch.pdl_scope("auto"):
            pass
    assert dispatch.pdl_policy(1, True)[0] == "early"
    assert dispatch.pdl_policy(4, True)[0] == "exit"
    assert dispatch.pdl_policy(4096, False)[0] == "early"
    # the Flash-shaped layer overlapped (unsplit shared GEMMs) at T = 2-6: early (session 28; the
    # layer bench kept it in session 41)
    assert [dispatch.pdl_policy(t, True, 2048)[0] for t in (1, 2, 3, 4, 5, 6, 8)] == \
        ["early", "early", "early", "early", "early", "early", "exit"]
    # the Pro-TP8-shaped layer: early to T = 3, at exit T = 4-8 (session 30), early again at T = 9-16
    # and at exit above (session 41)
    assert [dispatch.pdl_policy(t, True, 384)[0] for t in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == \
        ["early", "early", "early", "exit", "exit", "exit", "early", "early", "exit", "exit"]
    assert "measured faster than at exit" in dispatch.pdl_policy(2, True, 384)[1]
    assert dispatch.pdl_policy(4, False, 2048)[0] == "early"
    assert "I = 2048" in dispatch.pdl_policy(3, True, 2048)[1]
    assert "released at CTA exit" in dispatch.pdl_policy(4, True, 384)[1]


def test_explain_names_the_launch_mode():
    text = dispatch.explain(dispatch.DispatchContext(device=torch.device("cpu")))
    line = next(li for li in text.splitlines() if li.strip().startswith("launches"))
    assert "plain" in line and "cpu" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (sm_90 for PDL)")
def test_cuda_options_follow_the_capability():
    dev = torch.device("cuda", torch.cuda.current_device())
    ok, _ = dispatch.has_pdl(dev)
    opts = pdl_options(dev)
    if not ok:
        assert opts == {}
    else:  # the launch mode code (1 early, 2 exit) with Triton's attribute, or nothing when the mode is off
        assert (opts.get("PDL") in (1, 2) and opts.get("launch_pdl") is True) or \
            (opts == {} and dispatch.pdl_mode() == "off"), opts


def test_unknown_env_value_is_an_error_not_a_default(tmp_path):
    import subprocess
    import sys
    code = ("import torch; from dsv4_moe import dispatch; "
            "dispatch.has_pdl(torch.device('cuda', 0))")
    # cwd elsewhere: run from a source checkout, `-c` would import its unmapped dsv4_moe/ folder
    # (no weights/ subpackage) instead of the installed package
    r = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "DSV4_MOE_PDL": "yes"},
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "DSV4_MOE_PDL='yes'" in r.stderr, r.stderr[-500:]
