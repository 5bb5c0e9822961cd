"""route_front (kernels/route_front.py): the decode front in one launch is bitwise the separate
launches - the router's logits GEMV, the top-k kernel, act_quant and moe_align's one-program
path. Under TRITON_INTERPRET=1 (no libdevice) both sides select on the raw logits
(`_raw_logits=True` / the top-k kernel with APPLY_SCORES=False); natively on a GPU host (DEV)
both apply sqrt(softplus) in the kernel, as the layer does. scripts/gpu_check_layer.py also
compares the two inside the layer.
"""
import _triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU; tests/ is on sys.path via conftest)

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from dsv4_moe.kernels.act_quant import act_quant  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.route_front import FRONT_MAX_T, front_limits, route_front  # noqa: E402
from dsv4_moe.kernels.router import router_logits_gemv  # noqa: E402
from dsv4_moe.kernels.split_k import tile_counters  # noqa: E402
from dsv4_moe.testing import assert_bitwise_equal  # noqa: E402

SCALE = 2.5
RAW = _triton_interp.INTERPRETING            # the raw-logits selection exists only under the interpreter
DEV = torch.device("cpu" if RAW else "cuda")


def _separate(x, w, bias, tid2eid, input_ids, k, num_local, first, block_m, pairs):
    """The four separate launches, the top-k on the raw logits."""
    from dsv4_moe.kernels._router import _route_topk_kernel

    t, e = x.shape[0], w.shape[0]
    logits = router_logits_gemv(x, w)
    tw = torch.empty(t, k, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=x.device)
    dummy = logits
    _route_topk_kernel[(t,)](logits, bias if bias is not None else dummy,
                             tid2eid if tid2eid is not None else dummy,
                             input_ids if input_ids is not None else dummy, tw, ids,
                             e, logits.stride(0), k if tid2eid is not None else 0, SCALE,
                             TOP_K=k, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(e),
                             HAS_BIAS=bias is not None, HASH=tid2eid is not None, APPLY_SCORES=not RAW)
    qs = act_quant(x, pairs=pairs)
    align = moe_align(ids, num_local, first, block_m, tw, impl="small")
    return tw, ids, qs[0], qs[1], (qs[2] if pairs else None), align


_FIELDS = ("sorted_route_ids", "block_expert", "num_valid_blocks", "expert_offsets", "expert_counts",
           "route_rows", "row_expert", "row_weight")


@pytest.mark.parametrize("t,h,e,k,num_local,first,block_m,pairs,hashed", [
    (1, 256, 64, 6, 64, 0, 16, False, False),
    (2, 384, 48, 4, 16, 16, 16, True, False),     # expert parallel: only experts 16..31 local
    (3, 256, 64, 6, 64, 0, 32, True, True),       # hash layer
    (2, 256, 64, 6, 64, 0, 16, "scaled", False),  # scaled pairs (GemmConfig.fold_sa's operand)
    (4, 320, 32, 6, 32, 0, 16, False, False),     # H not a multiple of 128 (partial last group)
])
@pytest.mark.parametrize("sorted_align", [True, False])
def test_front_bitwise_separate(monkeypatch, t, h, e, k, num_local, first, block_m, pairs, hashed, sorted_align):
    """The last program aligns by sorting (moe_align.SMALL_SORTED, session 29) or by the compares;
    the separate moe_align follows the same switch, and both forms give the same alignment."""
    from dsv4_moe.kernels import moe_align as moe_align_mod

    monkeypatch.setattr(moe_align_mod, "SMALL_SORTED", sorted_align)
    g = torch.Generator().manual_seed(t * 100 + h)
    x = torch.randn(t, h, generator=g).bfloat16()
    x[0, :7] = 0.0  # a group with zeros; the amax floor is exercised by an all-zero group below
    if h >= 256:
        x[-1, 128:256] = 0.0
    w = (torch.randn(e, h, generator=g) * 0.05).bfloat16()
    bias = None if hashed else torch.randn(e, generator=g) * 0.1
    tid2eid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(50)]).int() if hashed else None
    input_ids = torch.randint(0, 50, (t,), generator=g) if hashed else None
    x, w = x.to(DEV), w.to(DEV)
    bias, tid2eid, input_ids = (a if a is None else a.to(DEV) for a in (bias, tid2eid, input_ids))
    cnt = tile_counters(x.device, 1)
    got = route_front(x, w, bias, tid2eid, input_ids, k, SCALE, num_local=num_local, first_expert=first,
                      block_m=block_m, pairs=pairs, _raw_logits=RAW)
    exp = _separate(x, w, bias, tid2eid, input_ids, k, num_local, first, block_m, pairs)
    for name, a, b in zip(("topk_weights", "topk_ids", "q", "sa"), got[:4], exp[:4]):
        assert_bitwise_equal(a, b, name)
    assert (got[4] is None) == (not pairs)
    if pairs:
        assert_bitwise_equal(got[4], exp[4], "pairs")
    ga, ea = got[5], exp[5]
    assert (ga.block_m, ga.top_k, ga.num_routes, ga.max_blocks) == (ea.block_m, ea.top_k, ea.num_routes, ea.max_blocks)
    for f in _FIELDS:
        assert torch.equal(getattr(ga, f), getattr(ea, f)), f
    assert int(cnt[0]) == 0, "the arrival counter must be left at 0 (next launch, graph replay)"
    # the selection really ran: ascending ids, weights summing to the scale
    assert torch.equal(got[1], got[1].sort(1).values)
    assert torch.allclose(got[0].sum(1).cpu(), torch.full((t,), SCALE), rtol=1e-6)


def test_front_limits_and_errors():
    assert front_limits(1, 6, 256, 16)[0]
    ok, why = front_limits(FRONT_MAX_T + 1, 6, 256, 16)
    assert not ok and f"T = {FRONT_MAX_T + 1}" in why
    ok, why = front_limits(4, 6, 256, 16, hidden=200, pairs=True)
    assert not ok and "H % 128" in why
    x = torch.randn(FRONT_MAX_T + 1, 128, device=DEV).bfloat16()
    w = torch.randn(16, 128, device=DEV).bfloat16()
    with pytest.raises(ValueError, match="1 <= T <= "):
        route_front(x, w, None, None, None, 2, 1.0, num_local=16, first_expert=0, block_m=16, _raw_logits=RAW)
    with pytest.raises(ValueError, match="block_m=24"):
        route_front(x[:1], w, None, None, None, 2, 1.0, num_local=16, first_expert=0, block_m=24, _raw_logits=RAW)
    with pytest.raises(ValueError, match=f"_raw_logits={not RAW}"):   # the other mode is refused
        route_front(x[:1], w, None, None, None, 2, 1.0, num_local=16, first_expert=0, block_m=16,
                    _raw_logits=not RAW)
    with pytest.raises(ValueError, match="_warps=3"):
        route_front(x[:1], w, None, None, None, 2, 1.0, num_local=16, first_expert=0, block_m=16,
                    _raw_logits=RAW, _warps=3)
    with pytest.raises(ValueError, match="x: expected a"):
        route_front(x[:1].float(), w, None, None, None, 2, 1.0, num_local=16, first_expert=0, block_m=16,
                    _raw_logits=RAW)
