"""The layer check scripts' CPU-runnable parts (session 37): gpu_check_layer.py's reference pair
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
    """_references: (the reference with the layer's shared output, the whole reference) - the
    second is reference.moe_forward bitwise, the first differs from it only through the shared
    output; _route_differences finds nothing on a layer routed like the reference."""
    cfg = MoEConfig.tiny()
    w = random_layer_weights(cfg, layer_idx=1, seed=0)
    layer = DeepseekV4MoE(cfg, w)
    x, ids = gcl._inputs(cfg, 7, 7, "cpu")
    with_gpu_shared, own = gcl._references(layer, x, ids, w, cfg)
    assert torch.equal(own.view(torch.int16), reference.moe_forward(x, ids, w, cfg).view(torch.int16))
    assert torch.equal(with_gpu_shared.view(torch.int16), own.view(torch.int16))   # CPU: the same shared bits
    assert gcl._route_differences(layer, x, ids, w, cfg) == ([], [])


@cpu_only
def test_route_differences_names_a_changed_route(monkeypatch):
    """A router that picks another expert for one token (far from any tie) is reported off a tie."""
    from dsv4_moe import dispatch

    cfg = MoEConfig.tiny()
    w = random_layer_weights(cfg, layer_idx=1, seed=0)
    layer = DeepseekV4MoE(cfg, w)
    x, ids = gcl._inputs(cfg, 5, 5, "cpu")
    real = dispatch.select

    class Wrong:
        def __init__(self, impl):
            self.impl_ = impl

        def impl(self, *a):
            tw, tid = self.impl_(*a)
            tid = tid.clone()
            free = [e for e in range(cfg.n_routed_experts) if e not in tid[2].tolist()]
            tid[2, 0] = free[0]
            return tw, tid

    monkeypatch.setattr(dispatch, "select", lambda stage, ctx: Wrong(real(stage, ctx).impl) if stage == "router"
                        else real(stage, ctx))
    ties, off = gcl._route_differences(layer, x, ids, w, cfg)
    assert ties == [] and off == [2]


def test_ref_tokens_validated_before_any_device():
    for extra, msg in ((["--tokens", "4,16", "--ref-tokens", "4,8"], "T=[8] not among the checked T"),
                       (["--ref-tokens", "a"], "expected comma-separated ints")):
        r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check_layer.py"), *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


@cpu_only
@pytest.mark.parametrize("script,args,want", [
    ("gpu_check_layer_stages.py", ["--case", "tiny", "--tokens", "5"], "16/16 checks ok"),
    ("reference_sensitivity.py", ["--case", "tiny", "--tokens", "64"], "logits_fp32 route weights: largest"),
])
def test_script_runs_on_the_tiny_layer(tmp_path, script, args, want):
    env = dict(os.environ, OUT=str(tmp_path), TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0 and want in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
