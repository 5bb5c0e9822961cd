"""Full-size synthetic MoE layer weights, generated directly on the target device.

    synthetic_layer_weights(config, *, device, tp_rank, tp_size, ep_rank, ep_size,
                            hash_layer, seed) -> MoELayerWeights

Going through the safetensors writer would cost minutes at V4-Flash/Pro size; the
benchmark only needs containers with the right dtypes, shapes and realistic value ranges
(weights/tensors.py), so they are drawn here with a device-side generator:

    router.weight        randn * 0.02                          bf16   [E, H]
    router.bias          randn * 1e-3                          fp32   [E]        (non-hash)
    router.tid2eid       k distinct uniform experts per id     int64  [vocab, k] (hash)
    shared gate_up/down  randn * 0.02, quantised per 128x128 block to e4m3 with a UE8M0
                         scale 2^ceil(log2(amax/448)) (what a quantiser would write)
    routed codes         uniform random bytes (two e2m1 per byte)
    routed scales        e8m0 bytes uniform in [118, 124] (2^-9 .. 2^-3: |w| up to 0.75,
                         mean |w| ~ 0.04 ~ a N(0, 0.02) weight)

Only the local experts (EP) and the per-rank intermediate I / tp_size (TP) are made; the
values differ per rank through the seed.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_moe.weights.tensors import MoELayerWeights, RoutedExpertWeights, RouterWeights, SharedExpertWeights

__all__ = ["synthetic_layer_weights", "E8M0_SYNTH_RANGE"]

E8M0_SYNTH_RANGE = (118, 124)  # inclusive e8m0 byte range of the synthetic MXFP4 scales
_FP8_BLOCK = 128
_E4M3_MAX = 448.0


def _fp8_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] (N, K multiples of 128) -> (e4m3 [N, K], e8m0 [N/128, K/128])."""
    n, k = w.shape
    blocks = w.view(n // _FP8_BLOCK, _FP8_BLOCK, k // _FP8_BLOCK, _FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    r = amax / _E4M3_MAX
    bits = r.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # ceil(log2(r)), exact
    scale = (exp << 23).view(torch.float32)
    q = (blocks / scale[:, None, :, None]).clamp(-_E4M3_MAX, _E4M3_MAX).view(n, k).to(torch.float8_e4m3fn)
    return q, exp.to(torch.uint8).view(torch.float8_e8m0fnu)


def synthetic_layer_weights(config, *, device="cpu", tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0,
                            ep_size: int = 1, hash_layer: bool = False, seed: int = 0,
                            layer_idx: Optional[int] = None) -> MoELayerWeights:
    """Random layer weights with the checkpoint's dtypes and realistic ranges (module docstring)."""
    config.check_parallel(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)
    h = config.hidden_size
    i = config.local_intermediate(tp_size)
    e = config.n_routed_experts
    k = config.num_experts_per_tok
    if h % _FP8_BLOCK or i % _FP8_BLOCK:
        raise ValueError(f"synthetic_layer_weights: hidden={h} and per-rank intermediate={i} must be multiples "
                         f"of {_FP8_BLOCK} for the synthetic FP8 shared expert")
    local = config.local_experts(ep_rank, ep_size)
    dev = torch.device(device)
    g = torch.Generator(device=dev)
    g.manual_seed(seed * 1_000_003 + tp_rank * 1009 + ep_rank * 7919)

    router_w = (torch.randn(e, h, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    if hash_layer:
        # k distinct experts per vocab id, uniform: top-k of iid uniforms, in chunks to bound memory.
        tid2eid = torch.empty(config.vocab_size, k, device=dev, dtype=torch.int64)
        for v0 in range(0, config.vocab_size, 16384):
            v1 = min(config.vocab_size, v0 + 16384)
            tid2eid[v0:v1] = torch.rand(v1 - v0, e, device=dev, generator=g).topk(k, dim=1).indices
        router = RouterWeights(router_w, None, tid2eid)
    else:
        router = RouterWeights(router_w, torch.randn(e, device=dev, generator=g) * 1e-3, None)

    gu_q, gu_s = _fp8_block_quant(torch.randn(2 * i, h, device=dev, generator=g) * 0.02)
    dn_q, dn_s = _fp8_block_quant(torch.randn(h, i, device=dev, generator=g) * 0.02)
    shared = SharedExpertWeights(gu_q, gu_s, dn_q, dn_s)

    lo, hi = E8M0_SYNTH_RANGE
    n_loc = len(local)

    def codes(*shape):
        return torch.randint(0, 256, shape, device=dev, dtype=torch.uint8, generator=g)

    def scales(*shape):
        return torch.randint(lo, hi + 1, shape, device=dev, dtype=torch.uint8, generator=g).view(
            torch.float8_e8m0fnu)

    routed = RoutedExpertWeights(
        gate_up=codes(n_loc, 2 * i, h // 2), gate_up_scale=scales(n_loc, 2 * i, h // 32),
        down=codes(n_loc, h, i // 2), down_scale=scales(n_loc, h, i // 32),
        first_expert=local.start, num_experts=e)
    if layer_idx is None:  # the first hash / non-hash layer index of this config
        layer_idx = 0 if hash_layer else config.num_hash_layers
    return MoELayerWeights(router, shared, routed, layer_idx=layer_idx, tp_rank=tp_rank, tp_size=tp_size,
                           ep_rank=ep_rank, ep_size=ep_size)
