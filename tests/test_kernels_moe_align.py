"""moe_align (kernels/moe_align.py), tested by invariants: under TRITON_INTERPRET=1 on CPU,
natively on a GPU (ids moved there, the alignment's tensors checked on the CPU)."""
import _triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 where there is no GPU; must precede triton)

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_moe.kernels.moe_align import align_sizes, moe_align  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _align(ids, num_local, first, bm, tw=None, impl="auto"):
    """moe_align on DEV, every tensor of the result back on the CPU."""
    a = moe_align(ids.to(DEV), num_local, first, bm, None if tw is None else tw.to(DEV), impl=impl)
    return dataclasses.replace(a, **{f.name: getattr(a, f.name).cpu() for f in dataclasses.fields(a)
                                     if isinstance(getattr(a, f.name), torch.Tensor)})


def _ids(t, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    if t == 0:
        return torch.empty(0, k, dtype=torch.int32)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).sort(1).values.int()


def _check(ids, num_local, first, bm, tw=None, impl="auto"):
    a = _align(ids, num_local, first, bm, tw, impl=impl)
    t, k = ids.shape
    r = t * k
    flat = ids.flatten().long()
    local = (flat >= first) & (flat < first + num_local)
    key = torch.where(local, flat - first, torch.full_like(flat, -1))
    hist = torch.bincount(key[local], minlength=num_local)
    assert torch.equal(a.expert_counts.long(), hist), (a.expert_counts, hist)
    padded = (hist + bm - 1) // bm * bm
    offs = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    assert torch.equal(a.expert_offsets.long(), offs), "offsets != prefix sums of padded histogram"
    nvb = int(a.num_valid_blocks.item())
    assert nvb * bm == offs[-1].item()
    assert a.max_blocks == align_sizes(r, num_local, bm)[0] and nvb <= a.max_blocks
    rows = a.route_rows.long()
    assert torch.equal(rows[~local], torch.full_like(rows[~local], -1)), "non-local routes must be skipped"
    sri = a.sorted_route_ids.long()
    # inverse permutation on local routes; rows of one expert in route order
    assert torch.equal(sri[rows[local]], torch.nonzero(local).flatten())
    for e in range(num_local):
        seg = sri[offs[e]:offs[e] + hist[e]]
        assert torch.equal(seg, torch.nonzero(key == e).flatten()), f"expert {e} rows"
        assert (sri[offs[e] + hist[e]:offs[e + 1]] == r).all(), f"expert {e} padding not marked"
        assert (a.row_expert[offs[e]:offs[e] + hist[e]] == e).all()
        assert (a.row_expert[offs[e] + hist[e]:offs[e + 1]] == -1).all()
        assert (a.block_expert[offs[e] // bm:offs[e + 1] // bm] == e).all()
    assert (sri[nvb * bm:] == r).all() and (a.block_expert[nvb:] == -1).all()
    if tw is not None:
        fw = tw.flatten()
        assert torch.equal(a.row_weight[rows[local]], fw[local])
        assert (a.row_weight[sri == r] == 0).all()
    return a


@pytest.mark.parametrize("t,k,e,bm", [(1, 6, 16, 16), (5, 3, 8, 4), (33, 6, 16, 16), (200, 4, 16, 8)])
def test_invariants(t, k, e, bm):
    ids = _ids(t, k, e, t)
    tw = torch.rand(t, k)
    _check(ids, e, 0, bm, tw)


FIELDS = ("sorted_route_ids", "block_expert", "num_valid_blocks", "expert_offsets", "expert_counts",
          "route_rows", "row_expert", "row_weight")


@pytest.mark.parametrize("t,k,e,first,num_local,bm,weights", [
    (1, 6, 256, 0, 256, 16, True),      # Flash decode
    (2, 6, 384, 0, 384, 1, False),      # GEMV alignment (block_m 1)
    (10, 6, 32, 8, 8, 16, True),        # 60 routes, EP rank owning experts 8..15
    (4, 6, 16, 0, 16, 64, True),        # fewer experts than routes, big blocks
    (3, 2, 8, 0, 8, 4, False),
    (16, 6, 384, 0, 384, 16, True),     # Pro-TP8 T = 16: 96 routes (SMALL_MAX_ROUTES raised)
    (21, 6, 64, 16, 32, 16, True),      # 126 routes, EP rank owning 16..47
    (8, 6, 384, 0, 384, 16, True),      # Pro-TP8 T = 8: 48 routes
    (10, 6, 64, 16, 32, 16, True),      # 60 routes, EP rank owning 16..47, experts hit many times
    (32, 2, 16, 0, 16, 16, False)])     # 64 routes over 16 experts: counts up to 11
@pytest.mark.parametrize("pairwise", [True, False], ids=["pairwise", "one-hot"])
def test_small_path_equals_chunked(monkeypatch, t, k, e, first, num_local, bm, weights, pairwise):
    """The one-launch decode kernel (its [routes x routes] form and the [routes x experts]
    one-hot form it replaced): the invariants, and every output equal to the three-launch
    path's (padding, sentinels and unused blocks included). With SMALL_MAX_ROUTES raised
    both forms run 65-128 routes too (the H200 measured the pairwise one slower there)."""
    import dsv4_moe.kernels.moe_align as ma

    monkeypatch.setattr(ma, "SMALL_PAIRWISE", pairwise)
    monkeypatch.setattr(ma, "SMALL_PAIRWISE_MIN_ROUTES", 0)   # every size on the form under test
    monkeypatch.setattr(ma, "SMALL_MAX_ROUTES", 128)
    ids = _ids(t, k, e, t + e)
    tw = torch.rand(t, k) if weights else None
    a = _check(ids, num_local, first, bm, tw, impl="small")
    b = _check(ids, num_local, first, bm, tw, impl="chunked")
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f


def test_small_path_no_local_route():
    """An EP rank none of whose experts is hit: no valid block, every row a sentinel, on
    both paths alike."""
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)   # experts 0..5; this rank owns 8..15
    tw = torch.rand(2, 3)
    a = _check(ids, 8, 8, 16, tw, impl="small")
    b = _check(ids, 8, 8, 16, tw, impl="chunked")
    assert int(a.num_valid_blocks) == 0 and (a.route_rows == -1).all() and (a.block_expert == -1).all()
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_small_path_limits():
    ids = _ids(11, 6, 16, 0)   # 66 routes > 64
    with pytest.raises(ValueError, match="impl='small': needs R <= 64"):
        moe_align(ids.to(DEV), 16, 0, 16, impl="small")
    with pytest.raises(ValueError, match="impl='fast'"):
        moe_align(ids.to(DEV), 16, 0, 16, impl="fast")


def test_multi_step_scan_carries_offsets():
    # 700 tokens x 6 = 4200 routes = 66 chunks, 130 local experts (E_PAD 256): the scan
    # runs 8 programs of 32 experts each (4096 / C_PAD 128); every scatter program sums the
    # padded totals of all of them into the same offsets
    ids = _ids(700, 6, 130, 5)
    _check(ids, 130, 0, 16, torch.rand(700, 6))


def test_routes_to_other_ranks_skipped():
    ids = _ids(40, 6, 32, 1)
    a = _check(ids, 8, 8, 16)  # this rank owns experts 8..15
    assert (a.route_rows >= 0).sum() < ids.numel()


def test_all_tokens_one_expert():
    ids = torch.tensor([[0, 3], [0, 5], [0, 7]] * 30, dtype=torch.int32)  # 90 tokens, >1 chunk
    a = _check(ids, 8, 0, 16)
    assert a.expert_counts[0] == 90


def test_zero_tokens_no_launch():
    a = _align(torch.empty(0, 6, dtype=torch.int32), 8, 0, 16)
    assert a.max_rows == 0 and a.num_valid_blocks.item() == 0


@pytest.mark.parametrize("bad", [dict(num_local=0), dict(block_m=12), dict(first_expert=-1)])
def test_bad_args(bad):
    kw = dict(num_local=8, first_expert=0, block_m=16) | bad
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        moe_align(_ids(2, 2, 8, 0).to(DEV), **kw)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align(torch.zeros(2, 2, device=DEV), 8, 0, 16)



@pytest.mark.parametrize("t,k,e,first,num_local,bm,weights", [
    (1, 6, 256, 0, 256, 16, True),      # Flash decode
    (7, 6, 384, 0, 384, 16, True),      # Pro-TP8, a 64-route tile
    (16, 6, 384, 0, 384, 16, True),     # Pro-TP8 T = 16: 96 routes (three launches by default)
    (21, 6, 256, 0, 256, 16, False),    # 126 routes, no weights
    (40, 6, 384, 96, 48, 16, True),     # an EP rank: 240 routes, most not local
    (9, 6, 256, 0, 256, 64, True),      # 64-row blocks
    (30, 4, 16, 0, 16, 1, True),        # block_m 1, every expert hit several times
    (3, 2, 8, 8, 8, 16, True)])         # no local route at all
def test_sorted_form_equals_chunked(t, k, e, first, num_local, bm, weights):
    """The one-program kernel's sorted form (a sort of packed (expert, route) keys and vector
    scans) gives the three launches' outputs bit for bit and passes the invariants."""
    ids = _ids(t, k, e, t + e + bm)
    tw = torch.rand(t, k) if weights else None
    a = _check(ids, num_local, first, bm, tw, impl="sorted")
    b = _check(ids, num_local, first, bm, tw, impl="chunked")
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or torch.equal(x, y), f


def test_sorted_form_limits_and_switch(monkeypatch):
    import dsv4_moe.kernels._moe_align as body
    import dsv4_moe.kernels.moe_align as ma

    with pytest.raises(ValueError, match="impl='sorted': needs R <= 256 routes"):
        moe_align(_ids(43, 6, 64, 0).to(DEV), 64, 0, 16, impl="sorted")      # 258 routes
    seen = []
    kern = body._align_small_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["SORTED"])
                return kern[grid](*args, **kw)
            return launch
    monkeypatch.setattr(body, "_align_small_kernel", Spy())
    ids = _ids(16, 6, 64, 2)                 # 96 routes: past the pairwise limit
    want = _align(ids, 64, 0, 16, impl="chunked")
    monkeypatch.setattr(ma, "SMALL_SORTED", True)
    got = _align(ids, 64, 0, 16)
    assert seen == [True] and torch.equal(got.sorted_route_ids, want.sorted_route_ids)
    _align(_ids(2, 6, 64, 2), 64, 0, 16)   # small too: the sorted form when switched on
    monkeypatch.setattr(ma, "SMALL_SORTED", False)
    _align(_ids(2, 6, 64, 2), 64, 0, 16)
    assert seen == [True, True, False]
