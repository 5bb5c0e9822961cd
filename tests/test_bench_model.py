"""The benchmark's byte / FLOP model (dsv4_moe/bench/model.py) on hand-counted cases.

Shape used by the hand counts: H=256, I=128, E=8, k=2.

    one routed expert  gate_up codes 2*128*256/2 = 32768, scales 2*128*256/32 = 2048
                       down    codes 256*128/2   = 16384, scales 256*128/32   = 1024
                       -> 52224 bytes
    shared expert      e4m3 2*128*256 + 256*128 = 98304; e8m0 blocks (256/128)*(256/128) = 4
                       + (256/128)*(128/128) = 2 -> 98310 bytes
    router             bf16 8*256*2 = 4096 + fp32 bias 8*4 = 32 -> 4128 bytes
    activations        T*256*2 in + T*256*2 out
    flops per route    2*(2*128*256 + 256*128) = 196608 (same per token for the shared expert)
    router flops       2*T*8*256 = 4096*T
"""

import pytest
import torch

from dsv4_moe.bench.model import (LayerDims, count_routes, floor_us, layer_work, routed_expert_bytes,
                                  shared_expert_bytes)
from dsv4_moe.config import MoEConfig

DIMS = LayerDims(hidden=256, intermediate=128, num_experts=8, top_k=2)
EXPERT = 52224
SHARED = 98310
ROUTER = 4128
PER_ROUTE_FLOPS = 196608


def ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_unit_sizes_hand_counted():
    assert routed_expert_bytes(256, 128) == EXPERT
    assert shared_expert_bytes(256, 128) == SHARED
    # V4-Flash expert: 3 * 2048 * 4096 e2m1 (half a byte) + one e8m0 per 32 values.
    assert routed_expert_bytes(4096, 2048) == 3 * 2048 * 4096 // 2 + 3 * 2048 * 4096 // 32 == 13_369_344
    # V4-Pro at TP8 (I = 384 per rank): 3 FP8 blocks along I, 56 along H.
    assert shared_expert_bytes(7168, 384) == 3 * 384 * 7168 + (6 * 56 + 56 * 3)


def test_one_token():
    w = layer_work(DIMS, 1, ids([[0, 3]]))
    layer = w["layer"]
    assert (layer.unique_experts, layer.local_routes) == (2, 2)
    assert layer.bytes == 2 * EXPERT + SHARED + ROUTER + 512 + 512
    assert layer.flops == 2 * PER_ROUTE_FLOPS + PER_ROUTE_FLOPS + 2 * 8 * 256
    assert w["routed"].bytes == 2 * EXPERT + 1024
    assert w["routed"].flops == 2 * PER_ROUTE_FLOPS
    assert w["shared"].bytes == SHARED + 1024
    assert w["router"].bytes == ROUTER + 512
    assert w["router"].flops == 4096
    # finalize on its own reads the 2 expert rows and the shared output, writes the result.
    assert w["finalize"].bytes == 2 * 512 + 512 + 512
    # act_quant reads x, writes 256 e4m3 codes + 2 fp32 scales.
    assert w["act_quant"].bytes == 512 + 256 + 8


def test_one_expert_hit_twice_counts_its_bytes_once():
    w = layer_work(DIMS, 2, ids([[1, 2], [1, 3]]))["layer"]
    assert (w.unique_experts, w.local_routes) == (3, 4)
    assert w.bytes == 3 * EXPERT + SHARED + ROUTER + 2 * 1024
    assert w.flops == 4 * PER_ROUTE_FLOPS + 2 * PER_ROUTE_FLOPS + 2 * 4096


def test_all_experts_hit():
    w = layer_work(DIMS, 4, ids([[0, 1], [2, 3], [4, 5], [6, 7]]))["layer"]
    assert (w.unique_experts, w.local_routes) == (8, 8)
    assert w.bytes == 8 * EXPERT + SHARED + ROUTER + 4 * 1024


def test_expert_parallel_counts_only_local_routes():
    # rank 1 of 2 holds experts 4..7; routes to 0..3 and dropped routes (-1) cost it nothing.
    ep = LayerDims(hidden=256, intermediate=128, num_experts=8, top_k=2, first_expert=4, num_local=4)
    topk = ids([[0, 4], [5, 7], [1, 2], [-1, 4]])
    assert count_routes(topk, 4, 4) == (3, 4)
    w = layer_work(ep, 4, topk)
    assert w["layer"].bytes == 3 * EXPERT + SHARED + ROUTER + 4 * 1024
    assert w["layer"].flops == 4 * PER_ROUTE_FLOPS + 4 * PER_ROUTE_FLOPS + 4 * 4096
    assert w["routed"].flops == 4 * PER_ROUTE_FLOPS


def test_no_local_route_at_all():
    ep = LayerDims(hidden=256, intermediate=128, num_experts=8, top_k=2, first_expert=4, num_local=4)
    w = layer_work(ep, 1, ids([[0, 1]]))
    assert w["routed"].bytes == 1024 and w["routed"].flops == 0
    assert w["layer"].bytes == SHARED + ROUTER + 1024


def test_hash_layer_reads_table_rows_not_bias():
    dims = LayerDims(hidden=256, intermediate=128, num_experts=8, top_k=2, hash_layer=True)
    w = layer_work(dims, 3, ids([[0, 1], [0, 1], [2, 3]]))
    assert w["router"].bytes == 4096 + 3 * 2 * 8 + 3 * 8 + 3 * 512


def test_means_over_rotated_routings():
    w = layer_work(DIMS, 1, unique_experts=1.5, local_routes=2)["layer"]
    assert w.bytes == round(1.5 * EXPERT) + SHARED + ROUTER + 1024


def test_from_config_pro_tp8_and_flash_ep():
    pro = LayerDims.from_config(MoEConfig.pro(), tp_size=8)
    assert (pro.hidden, pro.intermediate, pro.num_experts, pro.num_local) == (7168, 384, 384, 384)
    fl = LayerDims.from_config(MoEConfig.flash(), ep_rank=3, ep_size=4)
    assert (fl.first_expert, fl.num_local) == (192, 64)


def test_floor_is_the_slower_of_bytes_and_flops():
    assert floor_us(1e6, 3e9, 1e12, 1e15) == pytest.approx(3.0)  # compute-bound: 3 us vs 1 us
    assert floor_us(5e6, 1e9, 1e12, 1e15) == pytest.approx(5.0)  # memory-bound
    w = layer_work(DIMS, 1, ids([[0, 3]]))["layer"]
    assert w.floor_us(4e12, 1.4e15) == pytest.approx(w.bytes / 4e12 * 1e6)


@pytest.mark.parametrize("kw, match", [
    (dict(hidden=0, intermediate=128, num_experts=8, top_k=2), "hidden"),
    (dict(hidden=256, intermediate=100, num_experts=8, top_k=2), "intermediate"),
    (dict(hidden=256, intermediate=128, num_experts=8, top_k=2, first_expert=6, num_local=4), "local experts"),
])
def test_bad_dims_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        LayerDims(**kw)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="topk_ids or both"):
        layer_work(DIMS, 1)
    with pytest.raises(ValueError, match="rows"):
        layer_work(DIMS, 2, ids([[0, 1]]))
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        count_routes(ids([0, 1]), 0, 8)
    with pytest.raises(ValueError, match="rates"):
        floor_us(1, 1, 0, 1)


def test_rotation_covers_every_weight_copy_at_small_T():
    """Session 9: at small T the timed calls rotate over max(input sets, weight copies), so a
    stage whose weights are small (Pro-TP8's shared expert) does not read them from L2."""
    from dsv4_moe.bench.sweep import _L2_BYTES, rotation
    sets = ["a", "b"]
    assert rotation(sets, 5, 1e6) == [(0, "a"), (1, "b"), (2, "a"), (3, "b"), (4, "a")]
    assert rotation(sets, 5, 3 * _L2_BYTES) == [(0, "a"), (1, "b")]   # one set alone exceeds the L2
    assert rotation(["a", "b", "c"], 2, 1e6) == [(0, "a"), (1, "b"), (2, "c")]
    assert rotation([], 4, 1e6) == []
