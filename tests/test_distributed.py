"""Expert and tensor parallelism across 2 CPU ranks (gloo): each rank's layer holds its
slice; the all-reduced fp32 result matches the single-rank layer up to the
association of the fp32 partial sums (SPEC §6)."""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4_moe import DeepseekV4MoE, MoEConfig, reference
from dsv4_moe.testing import assert_bf16_close

CFG = MoEConfig(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=4,
                num_hidden_layers=2, num_hash_layers=1, vocab_size=64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slice_full(full, cfg, *, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1):
    """This rank's view of a full single-rank layer, by the checkpoint slicing rules."""
    from dsv4_moe.weights.tensors import MoELayerWeights, RoutedExpertWeights, SharedExpertWeights

    i, it = cfg.moe_intermediate_size, cfg.moe_intermediate_size // tp_size
    s, r = full.shared, full.routed
    rows = torch.cat([torch.arange(tp_rank * it, (tp_rank + 1) * it), i + torch.arange(tp_rank * it, (tp_rank + 1) * it)])
    srows = torch.cat([torch.arange(tp_rank * it // 128, (tp_rank + 1) * it // 128),
                       i // 128 + torch.arange(tp_rank * it // 128, (tp_rank + 1) * it // 128)])
    shared = SharedExpertWeights(s.gate_up[rows], s.gate_up_scale[srows],
                                 s.down[:, tp_rank * it:(tp_rank + 1) * it].contiguous(),
                                 s.down_scale[:, tp_rank * it // 128:(tp_rank + 1) * it // 128].contiguous())
    el = cfg.n_routed_experts // ep_size
    es = slice(ep_rank * el, (ep_rank + 1) * el)
    routed = RoutedExpertWeights(r.gate_up[es][:, rows].contiguous(), r.gate_up_scale[es][:, rows].contiguous(),
                                 r.down[es][:, :, tp_rank * it // 2:(tp_rank + 1) * it // 2].contiguous(),
                                 r.down_scale[es][:, :, tp_rank * it // 32:(tp_rank + 1) * it // 32].contiguous(),
                                 first_expert=ep_rank * el, num_experts=cfg.n_routed_experts)
    return MoELayerWeights(full.router, shared, routed, full.layer_idx, tp_rank, tp_size, ep_rank, ep_size)


def _worker(rank, world, port, mode, layer_idx, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from dsv4_moe.testing import random_layer_weights

        full = random_layer_weights(CFG, layer_idx=layer_idx, seed=11)
        if mode == "badgroup":
            _bad_group(rank, full, q)
            return
        kw = dict(tp_rank=rank, tp_size=world) if mode == "tp" else dict(ep_rank=rank, ep_size=world)
        layer = DeepseekV4MoE(CFG, _slice_full(full, CFG, **kw))
        g = torch.Generator().manual_seed(5)
        x = torch.randn(6, CFG.hidden_size, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, CFG.vocab_size, (6,), generator=g)
        out = layer(x, ids)
        if rank == 0:
            ref = reference.moe_forward(x, ids, full, CFG)
            # the negative control: the reference without the SwiGLU clamps
            unclamped = reference.moe_forward(x, ids, full, dataclasses.replace(CFG, swiglu_limit=1e30))
            # and without the shared expert (its down projection zeroed)
            s = full.shared
            no_shared = reference.moe_forward(x, ids, dataclasses.replace(
                full, shared=type(s)(s.gate_up, s.gate_up_scale, torch.zeros_like(s.down), s.down_scale)), CFG)
            # numpy copies pickle by value (torch tensors would be shared-memory handles
            # that die with this process)
            q.put(("ok", out.float().numpy(), tuple(r.float().numpy() for r in (ref, unclamped, no_shared))))
    except Exception as e:  # report to the parent instead of hanging it
        q.put(("error", repr(e), None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_two_ranks_match_single_rank(mode):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, mode, 1, q)) for r in range(2)]
    for p in procs:
        p.start()
    status, out, refs = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    assert status == "ok", out
    out = torch.from_numpy(out).to(torch.bfloat16)
    ref, unclamped, no_shared = (torch.from_numpy(r).to(torch.bfloat16) for r in refs)
    # EP: partial sums associate differently (p0 + p1 vs one left-to-right sum);
    # TP: each rank's down GEMM output is rounded to bf16 before the reduce.
    recipe = "layer" if mode == "ep" else "tp_vs_single_rank"
    assert_bf16_close(out, ref, recipe, f"{mode}2 vs single rank")
    assert not torch.equal(out, torch.zeros_like(out))
    # the bound would catch a missing clamp or a missing shared expert on these inputs (TP's recipe
    # bounds only rel L2: 1e-2, against ~2e-2 for the clamps and ~0.15 for the shared expert here)
    for wrong, what in ((unclamped, "the unclamped reference"), (no_shared, "the reference without its shared expert")):
        with pytest.raises(AssertionError):
            assert_bf16_close(out, wrong, recipe, f"{mode}2 vs {what}")


def _bad_group(rank, full, q):
    """A slice that does not match the process group is refused on entry to the forward (no
    communication: nothing hangs), naming the slice and the group."""
    from dsv4_moe.reference.moe import check_group

    errors = []
    layer = DeepseekV4MoE(CFG, _slice_full(full, CFG, ep_rank=rank, ep_size=4))   # 4 slices on 2 ranks
    x = torch.randn(3, CFG.hidden_size).to(torch.bfloat16)
    try:
        layer(x, torch.zeros(3, dtype=torch.long))
    except ValueError as e:
        errors.append(str(e))
    try:   # both ranks holding slice 0 of 2: rank 1 is refused (check only: a forward would leave rank 0 waiting)
        check_group(_slice_full(full, CFG, ep_rank=0, ep_size=2))
    except ValueError as e:
        errors.append(str(e))
    q.put((rank, errors))


def test_slice_must_match_the_process_group():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, "badgroup", 1, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert set(got) == {0, 1}, got
    for rank in (0, 1):
        assert f"ep_size=4, ep_rank={rank}: the layer's slice does not match its process group (size 2, this " \
               f"process's rank {rank})" in got[rank][0], got
    assert len(got[0]) == 1 and len(got[1]) == 2 and "ep_size=2, ep_rank=0" in got[1][1] and "rank 1)" in got[1][1]


def test_parallel_layer_without_process_group_fails_on_entry(monkeypatch):
    """Without init_process_group a TP / EP layer's forward raises before any stage runs."""
    from dsv4_moe import dispatch
    from dsv4_moe.testing import random_layer_weights

    layer = DeepseekV4MoE(CFG, _slice_full(random_layer_weights(CFG, layer_idx=1, seed=11), CFG, tp_rank=0, tp_size=2))
    calls = []
    monkeypatch.setattr(dispatch, "select", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        layer(torch.randn(2, CFG.hidden_size).to(torch.bfloat16))
    assert not calls
