"""L2 prefetch (kernels/l2_prefetch.py): argument checks (CPU), and on a CUDA device that
the launches run on ranges of every alignment, write nothing, and leave the layer's
output bits unchanged. The PTX (prefetch / cp.async.bulk.prefetch) has no interpreter
form, so the kernels themselves only run on the GPU."""

import pytest
import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig, dispatch, layers as layers_mod, reference
from dsv4_moe.kernels import l2_prefetch as l2p
from dsv4_moe.testing import assert_bitwise_equal, random_layer_weights

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (prefetch PTX, no interpreter form)")


def test_cpu_tensor_is_refused():
    with pytest.raises(ValueError, match=r"tensors\[0\] is on cpu: the L2 prefetch runs on CUDA only"):
        l2p.l2_prefetch([torch.zeros(4)])


@pytest.mark.parametrize("bad,match", [
    (lambda: l2p.l2_prefetch([]), "expected 1 to 4 tensors, got 0"),
    (lambda: l2p.l2_prefetch([torch.zeros(1)] * 5), "expected 1 to 4 tensors, got 5"),
    (lambda: l2p.l2_prefetch(["w"]), r"tensors\[0\]: expected a torch.Tensor, got str"),
])
def test_bad_arguments_are_named(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


def test_bad_options_are_named(monkeypatch):
    with pytest.raises(ValueError, match=r"mode='tma': expected one of \('line', 'bulk'\)"):
        l2p._opts("tma", None, None)
    with pytest.raises(ValueError, match="programs=0: expected an int >= 1"):
        l2p._opts(None, None, 0)
    assert l2p._opts("bulk", False, 3) == (1, False, l2p.BULK_CHUNK, 3)
    assert l2p._opts("line", True, None) == (0, True, 128, l2p.PROGRAMS)


def test_policy_prefetches_only_where_measured():
    pol = dispatch.shared_prefetch_policy
    assert pol(3, 384, "front")[0] == "logits" and "measured faster" in pol(3, 384, "front")[1]
    # Pro-shaped T = 9-16 with the fork after the front (session 51)
    assert [pol(t, 384, "front")[0] for t in (8, 9, 12, 16, 17)] == ["off", "logits", "logits", "logits", "off"]
    # Flash-shaped, other T, other fork points, in line: off (measured level or slower)
    assert [pol(t, i, f)[0] for t, i, f in [(3, 2048, "front"), (1, 384, "front"), (2, 384, "logits"),
                                            (4, 384, "logits"), (12, 2048, "front"), (12, 384, "align"),
                                            (32, 384, "front"), (3, 384, None)]] == ["off"] * 8
    assert pol(3, 384, None)[1] == "shared expert in line"


def test_layer_switch_is_checked_and_explained(monkeypatch):
    cfg = MoEConfig.tiny()
    layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=1, seed=1))
    assert "shared expert weights not prefetched into the L2 (device cpu)" in layer.explain(3)
    assert layer._shared_prefetch_point(3) == "off"  # "auto" on the CPU: never
    monkeypatch.setattr(layers_mod, "SHARED_L2_PREFETCH", "early")
    with pytest.raises(ValueError, match=r"layers.SHARED_L2_PREFETCH='early': expected 'auto' or one of \('off'"):
        layer._shared_prefetch_point(1)
    monkeypatch.setattr(layers_mod, "SHARED_L2_PREFETCH", "start")
    assert layer._shared_prefetch_point(1) == "start"
    assert "not prefetched into the L2 (device cpu)" in layer.explain(1)  # as the CPU forward does
    x = torch.randn(2, cfg.hidden_size).bfloat16()
    # the CPU never prefetches: this checks only that the switch leaves its forward intact (the
    # bits with the prefetch issued: test_layer_output_bits_unchanged, on the GPU)
    assert_bitwise_equal(layer(x), reference.moe_forward(x, None, layer.weights, cfg), "CPU forward, switch set")


@gpu
@pytest.mark.parametrize("mode", l2p.MODES)
@pytest.mark.parametrize("evict_last", [False, True])
def test_ranges_of_every_alignment_run_and_write_nothing(mode, evict_last):
    dev = torch.device("cuda")
    buf = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device=dev)
    keep = buf.clone()
    # offsets off every boundary, lengths below one line / chunk, a whole buffer, an empty one
    views = [buf[3:3 + 77], buf[129:129 + 300_001], buf[16:16 + 16], buf, buf[5:5]]
    l2p.l2_prefetch(views[:4], mode=mode, evict_last=evict_last)
    l2p.l2_prefetch(views[4:], mode=mode, evict_last=evict_last)
    torch.cuda.synchronize()
    assert torch.equal(buf, keep)


@gpu
@pytest.mark.parametrize("point", ["start", "logits"])
@pytest.mark.parametrize("t", [1, 4])
def test_layer_output_bits_unchanged(monkeypatch, point, t):
    cfg = MoEConfig.tiny()
    layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=1, seed=1).to("cuda"), overlap_shared=True)
    x = torch.randn(t, cfg.hidden_size, device="cuda").bfloat16()
    base = layer(x)
    monkeypatch.setattr(layers_mod, "SHARED_L2_PREFETCH", point)
    assert (f"prefetched into the L2 {'before' if point == 'start' else 'after'} the router's logits launch (own "
            f"stream) (layers.SHARED_L2_PREFETCH = {point!r})") in layer.explain(t)
    assert_bitwise_equal(layer(x), base, "layer with the L2 prefetch", point=point, t=t)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer(x)
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, base, "captured layer with the L2 prefetch", point=point, t=t)
