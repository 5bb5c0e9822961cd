"""The AITER heterogeneous fused-MoE adapter's pure parts (SPEC §5.3, kernels/aiter_fhmoe.py)
on the CPU, with a fake `aiter` module: the capability probe fails closed, the shared
expert's scales expand to AITER's 1x32 granularity with neutral padding, the routes gain
the shared expert as expert E with weight 1.0, and the layer explains why it stays on
the separate path."""

import sys
from types import ModuleType

import pytest
import torch

from dsv4_moe import DeepseekV4MoE, MoEConfig, dispatch
from dsv4_moe.dispatch import DispatchContext
from dsv4_moe.kernels import aiter_fhmoe as F
from dsv4_moe.testing import random_layer_weights
from dsv4_moe.weights.tensors import SharedExpertWeights


def _fused_moe_full(hidden_states, w1, w2, topk_weight, topk_ids, shared_w1=None, shared_w2=None,
                    shared_w1_scale=None, shared_w2_scale=None, shared_expert_id=-1):
    pass


def _fused_moe_old(hidden_states, w1, w2, topk_weight, topk_ids, shared_w1=None, shared_w2=None,
                   shared_w1_scale=None, shared_w2_scale=None):
    pass


def _fake_aiter(monkeypatch, supports, fused_moe=_fused_moe_full):
    aiter = ModuleType("aiter")
    aiter.__path__ = []
    fhmoe = ModuleType("aiter.fhmoe")
    if supports is not None:
        fhmoe.supports_dsv4_i384_fhmoe = supports
    fm = ModuleType("aiter.fused_moe")
    fm.fused_moe = fused_moe
    aiter.fhmoe, aiter.fused_moe = fhmoe, fm
    for name, mod in (("aiter", aiter), ("aiter.fhmoe", fhmoe), ("aiter.fused_moe", fm)):
        monkeypatch.setitem(sys.modules, name, mod)


def _raises(m):
    raise OSError("config CSV unreadable")


@pytest.mark.parametrize("m,supports,fused_moe,ok,why", [
    (2048, lambda m: m <= 2048, _fused_moe_full, True, "AITER covers M = 2048"),
    (2049, lambda m: m <= 2048, _fused_moe_full, False, "returned False, not True"),
    (16, lambda m: 1, _fused_moe_full, False, "returned 1, not True"),
    (16, _raises, _fused_moe_full, False, "raised OSError"),
    (16, None, _fused_moe_full, False, "has no supports_dsv4_i384_fhmoe"),
    (16, lambda m: True, _fused_moe_old, False, "lacks the shared-expert parameters ['shared_expert_id']"),
    (0, lambda m: True, _fused_moe_full, False, "expected an int >= 1"),
    (True, lambda m: True, _fused_moe_full, False, "expected an int >= 1"),
])
def test_capability_fails_closed(monkeypatch, m, supports, fused_moe, ok, why):
    _fake_aiter(monkeypatch, supports, fused_moe)
    got, reason = F.fhmoe_capability(m)
    assert got is ok and why in reason, reason


def test_capability_without_aiter(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)
    ok, why = F.fhmoe_capability(4)
    assert not ok and "not importable" in why


def test_shared_expert_preparation_keeps_i384():
    """V4-Pro TP8's per-rank shared expert: w1 [1, 768, 7168] and w2 [1, 7168, 384] are views
    of the native FP8 weights; scales at 1x32: [768, 224] and [7168, 12 -> 16] with 0x7F."""
    g = torch.Generator().manual_seed(0)
    h, i = 7168, 384
    shared = SharedExpertWeights(
        torch.randn(2 * i, h, generator=g).to(torch.float8_e4m3fn),
        torch.randint(100, 140, (2 * i // 128, h // 128), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        torch.randn(h, i, generator=g).to(torch.float8_e4m3fn),
        torch.randint(100, 140, (h // 128, i // 128), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    p = F.prepare_shared_expert(shared)
    assert p.w1.shape == (1, 768, 7168) and p.w2.shape == (1, 7168, 384)
    assert p.w1.data_ptr() == shared.gate_up.data_ptr() and p.w2.data_ptr() == shared.down.data_ptr()
    assert p.w1_scale.shape == (768, 224) and p.w2_scale.shape == (7168, 16)
    assert p.w1_scale.dtype == p.w2_scale.dtype == torch.float8_e8m0fnu
    b1 = shared.gate_up_scale.view(torch.uint8)
    b2 = shared.down_scale.view(torch.uint8)
    assert torch.equal(p.w1_scale.view(torch.uint8), b1.repeat_interleave(128, 0).repeat_interleave(4, 1))
    assert torch.equal(p.w2_scale.view(torch.uint8)[:, :12], b2.repeat_interleave(128, 0).repeat_interleave(4, 1))
    assert bool((p.w2_scale.view(torch.uint8)[:, 12:] == F.NEUTRAL_E8M0).all())
    # element (r, c) of the expanded scale is the block scale of (r // 128, c // 4)
    assert p.w2_scale.view(torch.uint8)[300, 7].item() == b2[300 // 128, 7 // 4].item()
    with pytest.raises(ValueError, match=r"scale.shape=\(6, 56\): expected \(6, 3\)"):
        F.expand_block_scales(shared.gate_up_scale, 768, 384)
    with pytest.raises(ValueError, match="cols a multiple of 32"):
        F.expand_block_scales(shared.down_scale, 7168, 380)


def test_append_shared_route():
    ids = torch.tensor([[3, 7, 9], [0, 1, 2]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    ids2, w2 = F.append_shared_route(ids, w, 384)
    assert ids2.dtype == torch.int32 and ids2.tolist() == [[3, 7, 9, 384], [0, 1, 2, 384]]
    assert torch.equal(w2[:, :3], w) and w2[:, 3].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="expected equal"):
        F.append_shared_route(ids, w[:, :2], 384)
    with pytest.raises(ValueError, match="shared_expert_id=-1"):
        F.append_shared_route(ids, w, -1)
    with pytest.raises(ValueError, match="int32/int64 ids and float weights"):
        F.append_shared_route(ids.float(), w, 384)


def test_supported_closes_with_reasons(monkeypatch):
    """Not gfx950 -> closed; gfx950 with the wrong shape -> closed; the right shape and a
    covering AITER -> still closed, naming the unbuilt call (no silent fused path)."""
    pro = dict(hidden=7168, intermediate=384, num_experts=384, num_local_experts=384, top_k=6)
    ok, why = F.fhmoe_supported(DispatchContext(device=torch.device("cpu"), num_tokens=4, **pro))
    assert not ok and "not a ROCm gfx950 device" in why
    monkeypatch.setattr(dispatch, "is_gfx950", lambda device: (True, "gcnArchName gfx950 (test)"))
    ok, why = F.fhmoe_supported(DispatchContext(device=torch.device("cpu"), num_tokens=4))
    assert not ok and "is not the one AITER's FHMoE config covers" in why
    _fake_aiter(monkeypatch, lambda m: m <= 2048)
    ok, why = F.fhmoe_supported(DispatchContext(device=torch.device("cpu"), num_tokens=4, **pro))
    assert not ok and "AITER covers M = 4" in why and "is not written" in why
    ok, why = F.fhmoe_supported(DispatchContext(device=torch.device("cpu"), num_tokens=4, ep_size=2, **pro))
    assert not ok and "ep_size=2" in why


def test_layer_explains_the_heterogeneous_path():
    cfg = MoEConfig.tiny()
    layer = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=1))
    text = layer.explain(4)
    head = f"shared expert as expert {cfg.n_routed_experts} in the routed launch (SPEC §5.3): not taken: "
    assert head + "not a ROCm gfx950 device" in text
    if torch.cuda.is_available() and torch.version.hip is None:   # on CUDA it says what is missing first
        text = DeepseekV4MoE(cfg, random_layer_weights(cfg, layer_idx=1).to("cuda")).explain(4)
        assert head + "this package has no CUDA kernel for it" in text and "AITER's: not a ROCm gfx950" in text
