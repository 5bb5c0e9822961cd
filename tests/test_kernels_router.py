"""route_topk (kernels/router.py) vs dsv4_moe.reference.route: under TRITON_INTERPRET=1 on the
CPU, natively on a GPU host (DEV: the inputs are made on the CPU, the kernels run on DEV; the
reference runs on DEV where it must share the device's softplus / sqrt bits, on the CPU
elsewhere).

The reference sums logits in float64 (correctly rounded), the kernel path in fp32, so
scores can differ in the last bits: ids must match except on (near-)ties, which are
counted and bounded; weights are compared to a tight relative bound (a few fp32 ulps).
Given the *same* scores the kernel is bitwise the reference (renormalisation order is
pinned), which is tested by feeding logits that are exact in fp32.
"""
import _triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 where there is no GPU; must precede triton)

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_moe import reference as ref  # noqa: E402
from dsv4_moe.testing import MAX_REL, assert_bitwise_equal  # noqa: E402
from dsv4_moe.kernels.router import gemv_blocks, mma_blocks, route_topk, router_logits_gemv, router_logits_mma  # noqa: E402

# the kernels' device: the GPU when Triton runs natively, else the CPU (interpreter)
DEV = torch.device("cpu" if _triton_interp.INTERPRETING else "cuda")

SCALE = 1.5


def _inputs(t, h, e, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    w = (torch.randn(e, h, generator=g) * 0.05).bfloat16()
    bias = torch.randn(e, generator=g) * 0.1
    return x.to(DEV), w.to(DEV), bias.to(DEV)


@pytest.mark.parametrize("logits_impl", ["mm", "gemv", "mma"])
@pytest.mark.parametrize("t,e,k", [(1, 8, 3), (5, 16, 6), (33, 16, 4), (17, 384, 6)])
def test_biased_topk_vs_reference(t, e, k, logits_impl):
    x, w, bias = _inputs(t, 256, e, t + e)
    tw, ids = route_topk(x, w, bias, None, None, k, SCALE, logits_impl=logits_impl)
    assert ids.dtype == torch.int32 and tw.dtype == torch.float32
    tw, ids, x, w, bias = tw.cpu(), ids.cpu(), x.cpu(), w.cpu(), bias.cpu()
    rw, rids = ref.route(x, w, bias, None, None, k, SCALE)
    assert torch.equal(ids, ids.sort(1).values), "ids must be ascending per token"
    mism = (ids.long() != rids).any(1)
    # a mismatch is allowed only where the k-th and (k+1)-th biased scores tie within fp32 noise
    biased = ref.router_scores(x, w) + bias
    top = biased.topk(k + 1, dim=1).values
    near_tie = (top[:, k - 1] - top[:, k]).abs() <= 1e-5 * top[:, k - 1].abs()
    assert not (mism & ~near_tie).any(), f"id mismatch off a tie at tokens {torch.nonzero(mism & ~near_tie).flatten().tolist()}"
    ok = ~mism
    rel = ((tw[ok] - rw[ok]).abs() / rw[ok].abs()).max().item() if ok.any() else 0.0
    assert rel <= MAX_REL["route_weights_small_h"], f"weights differ by {rel:.3g} relative (fp32 summation order allows a few ulp)"


def test_exact_scores_bitwise():
    # one-hot gate rows make every logit an exact bf16 value, so scores are equal bit for bit
    t, e, k = 9, 16, 4
    x, _, bias = _inputs(t, 64, e, 0)
    w = torch.zeros(e, 64)
    w[torch.arange(e), torch.arange(e)] = 1.0
    w = w.bfloat16().to(DEV)
    tw, ids = route_topk(x, w, bias, None, None, k, SCALE)
    rw, rids = ref.route(x, w, bias, None, None, k, SCALE)
    assert torch.equal(ids.long(), rids)
    assert_bitwise_equal(tw, rw, "route weights")


@pytest.mark.parametrize("logits_impl", ["mm", "gemv"])
def test_hash_routing_vs_reference(logits_impl):
    t, e, k, vocab = 7, 16, 6, 50
    x, w, _ = _inputs(t, 128, e, 3)
    g = torch.Generator().manual_seed(5)
    tid2eid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(vocab)]).to(DEV)  # unsorted rows
    input_ids = torch.randint(0, vocab, (t,), generator=g).to(DEV)
    tw, ids = route_topk(x, w, None, tid2eid, input_ids, k, SCALE, logits_impl=logits_impl)
    rw, rids = ref.route(x, w, None, tid2eid, input_ids, k, SCALE)
    assert torch.equal(ids.long(), rids)
    assert ((tw - rw).abs() / rw).max() <= MAX_REL["route_weights_small_h"]


def test_zero_tokens():
    x, w, bias = _inputs(0, 64, 8, 0)
    tw, ids = route_topk(x, w, bias, None, None, 2, SCALE)
    assert tw.shape == (0, 2) and ids.shape == (0, 2)


def test_guards():
    x, w, bias = _inputs(2, 64, 8, 0)
    with pytest.raises(ValueError, match="x"):
        route_topk(x.float(), w, bias, None, None, 2, SCALE)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(x, w, bias, None, None, 9, SCALE)
    with pytest.raises(ValueError, match="bias"):
        route_topk(x, w, bias.double(), None, None, 2, SCALE)
    with pytest.raises(ValueError, match="input_ids"):
        route_topk(x, w, None, torch.zeros(10, 2, dtype=torch.long, device=DEV), None, 2, SCALE)


@pytest.mark.parametrize("t,e,h,wdtype", [(1, 256, 512, torch.bfloat16), (11, 15, 200, torch.bfloat16),
                                          (3, 7, 96, torch.float32), (20, 6, 160, torch.bfloat16)])
def test_logits_gemv(t, e, h, wdtype):
    # products of bf16 values are exact in fp32: only the summation order may differ from
    # the float64 sum, so the GEMV sits within fp32 accumulation error of it (and a wrong
    # row/column, a missed tail block or a dropped token would be far outside that bound)
    g = torch.Generator().manual_seed(t * 100 + e)
    x = torch.randn(t, h, generator=g).bfloat16()
    w = (torch.randn(e, h, generator=g) * 0.05).bfloat16().to(wdtype)
    got = router_logits_gemv(x.to(DEV), w.to(DEV))
    assert got.dtype == torch.float32 and got.shape == (t, e) and got.device.type == DEV.type
    got = got.cpu()
    exact = x.double() @ w.double().T
    bound = 4 * h * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all()
    # exact sums (one-hot rows): bitwise
    w1 = torch.zeros(e, h, dtype=wdtype)
    w1[torch.arange(e), torch.arange(e) * 3 % h] = 2.0
    assert_bitwise_equal(router_logits_gemv(x.to(DEV), w1.to(DEV)).cpu(), x.float() @ w1.float().T, "exact logits")


@pytest.mark.parametrize("t,e,h,blocks", [
    (8, 384, 640, None),                  # 2 splits of 512 (the last one a quarter), 6 gate tiles
    (17, 70, 512, None),                  # unsplit (one chunk), a partial gate tile, 17 tokens in 32
    (5, 96, 1024, (64, 16, 128, 256, 4)),
    (70, 64, 256, (64, 64, 128, 128, 2)),  # two token tiles, the second partial
    (3, 40, 384, (64, 16, 128, 384, 1))])  # unsplit: stored without the reduction
def test_logits_mma(t, e, h, blocks):
    """The tensor-core logits (split over H, the splits summed in order by the tile's last
    program): within fp32 accumulation error of the float64 sum, and bitwise wherever the
    sums are exact (one-hot gate rows); the arrival counters are left at 0, so a second
    call (as a CUDA-graph replay would) gives the same bits."""
    from dsv4_moe.kernels.split_k import tile_counters

    g = torch.Generator().manual_seed(t * 7 + e)
    x = torch.randn(t, h, generator=g).bfloat16()
    w = (torch.randn(e, h, generator=g) * 0.05).bfloat16()
    xd, wd = x.to(DEV), w.to(DEV)
    got = router_logits_mma(xd, wd, blocks)
    assert got.dtype == torch.float32 and got.shape == (t, e)
    exact = x.double() @ w.double().T
    bound = 4 * h * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    bad = (got.cpu().double() - exact).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} logits off the fp32 bound; first at {bad.nonzero()[0].tolist()}"
    assert_bitwise_equal(router_logits_mma(xd, wd, blocks), got, "a second run")
    assert int(tile_counters(xd.device, 1).abs().sum()) == 0, "arrival counters not reset"
    w1 = torch.zeros(e, h, dtype=torch.bfloat16)
    w1[torch.arange(e), torch.arange(e) * 5 % h] = 2.0
    assert_bitwise_equal(router_logits_mma(xd, w1.to(DEV), blocks).cpu(), x.float() @ w1.float().T, "exact logits")
    # negative control: a gate row shifted by one column is far outside the bound
    shifted = router_logits_mma(xd, torch.roll(wd, 1, dims=1), blocks).cpu()
    assert ((shifted.double() - exact).abs() > bound).any()


@pytest.mark.parametrize("t,e,h,blocks", [(8, 384, 640, None), (9, 96, 1024, (32, 16, 128, 256, 4)),
                                           (3, 40, 384, (64, 16, 128, 384, 1))])
def test_logits_mma_partials(t, e, h, blocks):
    """router_logits_mma(reduce=False) (router.MMA_PARTIALS_IN_TOPK, session 44): the split-K
    partials [P, T, E], whose in-order fp32 sum from +0.0 is the reduced launch's output bit for
    bit ([1, T, E] = the logits when H is not split); no arrival counter is touched."""
    from dsv4_moe.kernels.split_k import tile_counters

    g = torch.Generator().manual_seed(t + e + h)
    xd = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    wd = (torch.randn(e, h, generator=g) * 0.05).bfloat16().to(DEV)
    want = router_logits_mma(xd, wd, blocks)
    parts = router_logits_mma(xd, wd, blocks, reduce=False)
    splits = (blocks or mma_blocks(t, e, h))[4]
    assert parts.shape == (splits, t, e) and parts.dtype == torch.float32
    acc = torch.zeros(t, e, device=DEV)
    for p in range(splits):
        acc = acc + parts[p]
    assert torch.equal(acc.view(torch.int32), want.view(torch.int32))
    assert (splits == 1) == torch.equal(parts[0], want)
    assert int(tile_counters(xd.device, 1).abs().sum()) == 0


def _topk_launch(scores, parts, t, e, k, bias, apply_scores):
    """_route_topk_kernel on `scores` ([T, E] logits, or [P, T, E] partials when parts > 1)."""
    import triton

    from dsv4_moe.kernels._router import _route_topk_kernel
    out_w = torch.empty((t, k), dtype=torch.float32, device=scores.device)
    out_ids = torch.empty((t, k), dtype=torch.int32, device=scores.device)
    _route_topk_kernel[(t,)](scores, bias, scores, scores, out_w, out_ids, e, scores.stride(-2), 0, SCALE,
                             TOP_K=k, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(e),
                             HAS_BIAS=True, HASH=False, APPLY_SCORES=apply_scores, num_warps=4, PACKED=True,
                             PARTS=parts, part_stride=t * e if parts > 1 else 0,
                             **({} if DEV.type == "cpu" else {"enable_reflect_ftz": False}))
    return out_w, out_ids


@pytest.mark.parametrize("t,e,h,k", [(9, 384, 1024, 6), (16, 256, 768, 6), (5, 70, 512, 3)])
def test_topk_sums_logit_partials_same_bits(t, e, h, k):
    """The top-k kernel on the tensor-core logits' partials (PARTS > 1) picks the same ids with
    the same weights, bit for bit, as on the logits the arrival reduction makes - on raw logits
    here (the interpreter has no libdevice), with the scores applied in the kernel on a GPU."""
    g = torch.Generator().manual_seed(t * e)
    xd = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    wd = (torch.randn(e, h, generator=g) * 0.05).bfloat16().to(DEV)
    bias = (torch.randn(e, generator=g) * 0.1).to(DEV)
    blocks = (32, 16, 128, 256, -(-h // 256))
    logits = router_logits_mma(xd, wd, blocks)
    parts = router_logits_mma(xd, wd, blocks, reduce=False)
    assert parts.shape[0] > 1
    for apply in (False,) if DEV.type == "cpu" else (False, True):
        w0, i0 = _topk_launch(logits, 1, t, e, k, bias, apply)
        w1, i1 = _topk_launch(parts, parts.shape[0], t, e, k, bias, apply)
        assert torch.equal(i0, i1) and torch.equal(w0.view(torch.int32), w1.view(torch.int32)), apply
    # negative control: a partial dropped moves some pick or weight
    w2, i2 = _topk_launch(parts[1:].contiguous(), parts.shape[0] - 1, t, e, k, bias, False)
    w0, i0 = _topk_launch(logits, 1, t, e, k, bias, False)
    assert not (torch.equal(i0, i2) and torch.equal(w0, w2))


@pytest.mark.skipif(DEV.type == "cpu", reason="route_topk applies the scores in the kernel on a GPU only "
                    "(libdevice); the interpreter runs test_topk_sums_logit_partials_same_bits instead")
@pytest.mark.parametrize("t", [5, 9, 16])
def test_route_topk_partials_switch_same_bits(monkeypatch, t):
    """route_topk at T = 5-16 (tensor-core logits): MMA_PARTIALS_IN_TOPK on and off give the same
    ids, weights and act_quant outputs, bit for bit - biased top-k and a hash layer (tid2eid)."""
    import dsv4_moe.kernels.router as router

    x, w, bias = _inputs(t, 7168, 384, t)
    g = torch.Generator().manual_seed(t)
    tid2eid = torch.stack([torch.randperm(384, generator=g)[:6] for _ in range(50)]).int().to(DEV)
    input_ids = torch.randint(0, 50, (t,), generator=g).to(DEV)
    for args in ((bias, None, None), (None, tid2eid, input_ids)):
        out = {}
        for on in (True, False):
            monkeypatch.setattr(router, "MMA_PARTIALS_IN_TOPK", on)
            out[on] = route_topk(x, w, *args, 6, SCALE, act_quant="scaled")
        for a, b in zip(out[True], out[False]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), args[0] is None


def test_logits_mma_blocks_and_guards():
    for t in range(1, 65):
        be, bt, bk, k_per, splits = mma_blocks(t, 384, 7168)
        assert be == 32 and 16 <= bt <= 64 and bt >= t and k_per % bk == 0 and splits * k_per >= 7168
    assert mma_blocks(16, 384, 7168) == (32, 16, 128, 512, 14)
    assert mma_blocks(8, 256, 4096)[4] == 8
    with pytest.raises(ValueError, match="must be bfloat16"):
        router_logits_mma(torch.randn(2, 128, device=DEV).bfloat16(), torch.randn(8, 128, device=DEV))
    with pytest.raises(ValueError, match="K_PER must be a multiple of BLOCK_K"):
        router_logits_mma(torch.randn(2, 256, device=DEV).bfloat16(), torch.randn(8, 256, device=DEV).bfloat16(),
                          (64, 16, 128, 192, 2))
    assert router_logits_mma(torch.randn(0, 64, device=DEV).bfloat16(),
                             torch.randn(8, 64, device=DEV).bfloat16()).shape == (0, 8)


@pytest.mark.parametrize("t,e,h,impl,pairs", [
    (1, 64, 1024, "gemv", True),        # the decode GEMV: one group per program
    (9, 8, 1024, "gemv", "scaled"),     # 4 gate programs for 8 groups (two rounds), two token tiles
    (3, 64, 960, "gemv", False),        # a partial last group
    (7, 64, 1024, "mma", True),         # the tensor-core kernel: 2 chunks of 512, 4 groups each
    (17, 16, 1024, "mma", "scaled"),    # one gate program quantises all 4 groups of its chunk
    (6, 96, 960, "mma", False)])
def test_act_quant_in_logits(t, e, h, impl, pairs):
    """route_topk(..., act_quant=pairs): the logits launch also quantises x; q, the scales and
    the pairs are bitwise act_quant's (the same body), the routing is unchanged; a wrong
    result would show in the codes: a quantisation of another row fails the same compare."""
    from dsv4_moe.kernels.act_quant import act_quant

    x, w, bias = _inputs(t, h, e, seed=t + h)
    x = x * 3
    got = route_topk(x, w, bias, None, None, 6, SCALE, logits_impl=impl, act_quant=pairs)
    plain = route_topk(x, w, bias, None, None, 6, SCALE, logits_impl=impl)
    want = act_quant(x, pairs=pairs)
    assert len(got) == 2 + len(want)
    for a, b, what in zip(got, plain + want, ("weights", "ids", "q", "sa", "pairs")):
        assert_bitwise_equal(a, b, what)
    q_ref, s_ref = ref.act_quant(x.cpu())
    assert_bitwise_equal(got[2].cpu(), q_ref, "q vs the reference")
    assert_bitwise_equal(got[3].cpu(), s_ref, "sa vs the reference")
    other = act_quant(torch.roll(x, 1, dims=0))[0]  # negative control
    assert t == 1 or not torch.equal(got[2].view(torch.uint8), other.view(torch.uint8))


def test_act_quant_in_logits_guards():
    x, w, bias = _inputs(20, 256, 16, seed=1)
    with pytest.raises(ValueError, match="x is quantised inside the Triton logits launch"):
        route_topk(x, w, bias, None, None, 4, SCALE, logits_impl="mm", act_quant=False)
    with pytest.raises(ValueError, match="pairs="):
        route_topk(x, w, bias, None, None, 4, SCALE, logits_impl="gemv", act_quant="yes")
    out = route_topk(x[:0], w, bias, None, None, 4, SCALE, logits_impl="gemv", act_quant=True)
    assert [tuple(o.shape) for o in out] == [(0, 4), (0, 4), (0, 256), (0, 2), (0, 256)]


def test_logits_gemv_blocks_cover_every_t():
    for t in range(1, 70):
        bt, be, bh, warps = gemv_blocks(t)
        assert bt & (bt - 1) == 0 and bt <= 8 and (bt >= t or bt == 8)
        assert bt * be * bh <= 8192 and bh >= 64 and warps == 4
    for t, h in ((1, 4096), (1, 7168), (2, 7168), (2, 4096), (1, 64)):   # whole gate rows at T <= 2
        bt, be, bh, warps = gemv_blocks(t, h)
        assert be == 1 and bh >= h and bh < 2 * max(h, 64) and bt * bh <= 64 * 32 * warps, (t, h)
    assert gemv_blocks(4, 7168) == gemv_blocks(4) and gemv_blocks(1, 16384) == gemv_blocks(1)
    x = torch.randn(0, 64, device=DEV).bfloat16()
    assert router_logits_gemv(x, torch.randn(8, 64, device=DEV).bfloat16()).shape == (0, 8)


def test_impl_guards():
    x, w, bias = (a.cpu() for a in _inputs(2, 64, 8, 0))   # the scores_impl refusal is about CPU tensors
    with pytest.raises(ValueError, match="logits_impl='fast'"):
        route_topk(x, w, bias, None, None, 2, SCALE, logits_impl="fast")
    with pytest.raises(ValueError, match="scores_impl='gpu'"):
        route_topk(x, w, bias, None, None, 2, SCALE, scores_impl="gpu")
    # the in-kernel scores need libdevice: refused on the CPU / under the interpreter
    with pytest.raises(ValueError, match="scores_impl='kernel' needs a CUDA tensor"):
        route_topk(x, w, bias, None, None, 2, SCALE, scores_impl="kernel")


@pytest.mark.parametrize("e,k,bias_kind", [(16, 4, "ties"), (384, 6, "negative"), (300, 6, "random"),
                                           (256, 8, "zero-sum"), (384, 6, "random")])
def test_packed_selection_same_bits(monkeypatch, e, k, bias_kind):
    """router.TOPK_PACKED (one int64 (score, index) max per round, session 25) picks what max +
    lowest-index min picks - exact ties included, negative biased scores, +0.0 / -0.0 - so
    the same ids and weights, bitwise; also at other warp counts (TOPK_WARPS)."""
    import dsv4_moe.kernels.router as router

    g = torch.Generator().manual_seed(e + k)
    t, h = 7, 64
    x = torch.randn(t, h, generator=g).bfloat16()
    # few distinct logit values: one-hot gate rows onto 8 columns of x make exact ties
    w = torch.zeros(e, h)
    w[torch.arange(e), torch.arange(e) % 8] = 1.0
    if bias_kind == "random":
        w = torch.randn(e, h, generator=g) * 0.05
    w = w.bfloat16()
    scores = ref.router_scores(x, w)
    bias = {"ties": torch.zeros(e), "negative": -1.0 - torch.rand(e, generator=g) * 4,
            "random": torch.randn(e, generator=g) * 0.1,
            # biased = score + bias exactly 0 for some experts (+0.0 in RNE), -0.0 bias elsewhere
            "zero-sum": torch.where(torch.arange(e) % 3 == 0, -scores[0], torch.tensor(-0.0))}[bias_kind]
    if bias_kind == "zero-sum":
        x = x[:1].expand(t, h).contiguous()  # every token the one whose scores the bias cancels
    x, w, bias = x.to(DEV), w.to(DEV), bias.to(DEV)
    out = {}
    assert router.TOPK_PACKED and router.TOPK_PACKED_MAX_T >= t  # the default (session 25)
    for packed, warps in ((False, 0), (True, 0), (True, 1), (False, 1)):
        monkeypatch.setattr(router, "TOPK_PACKED", packed)
        monkeypatch.setattr(router, "TOPK_WARPS", warps)
        out[packed, warps] = route_topk(x, w, bias, None, None, k, SCALE, logits_impl="mm")
    base_w, base_ids = out[False, 0]
    # (many exact ties here: the reference's torch.topk need not take the lowest index among
    # them, so the unpacked kernel is the oracle; test_exact_scores_bitwise ties it to the reference)
    assert len(set(base_ids.flatten().tolist())) > k if bias_kind != "zero-sum" else True
    for key, (tw, ids) in out.items():
        assert torch.equal(ids, base_ids) and torch.equal(tw.view(torch.int32), base_w.view(torch.int32)), key


def test_after_logits_hook():
    """route_topk(after_logits=f): f gets act_quant's outputs - the very tensors returned - once,
    between the logits and the top-k launches (the layer forks the shared expert there); the
    routing is unchanged; without act_quant it is a ValueError."""
    x, w, bias = _inputs(3, 256, 16, seed=5)
    seen = []
    got = route_topk(x, w, bias, None, None, 4, SCALE, logits_impl="gemv", act_quant=True,
                     after_logits=lambda *a: seen.append(a))
    plain = route_topk(x, w, bias, None, None, 4, SCALE, logits_impl="gemv")
    assert len(seen) == 1 and len(seen[0]) == 3
    assert all(a is b for a, b in zip(seen[0], got[2:]))
    assert_bitwise_equal(got[0], plain[0], "weights")
    assert_bitwise_equal(got[1], plain[1], "ids")
    with pytest.raises(ValueError, match="after_logits: needs act_quant"):
        route_topk(x, w, bias, None, None, 4, SCALE, logits_impl="gemv", after_logits=lambda *a: None)


@pytest.mark.parametrize("t,e,h", [(1, 40, 200), (2, 384, 512), (1, 16, 96), (2, 9, 4096), (1, 24, 7168)])
def test_logits_gemv_prewait_same_bits(monkeypatch, t, e, h):
    """router.GEMV_PREWAIT: the whole-row forms load their gate rows before the PDL wait - the
    same values into the same arithmetic, so the same bits as without it; the rule takes it at
    T = 1, at T = 2 up to GEMV_PREWAIT_MAX_H, never in the streamed forms."""
    from dsv4_moe.kernels import router as router_mod

    g = torch.Generator().manual_seed(t * 7 + h)
    x = torch.randn(t, h, generator=g).bfloat16()
    w = (torch.randn(e, h, generator=g) * 0.05).bfloat16()
    x, w = x.to(DEV), w.to(DEV)
    monkeypatch.setattr(router_mod, "GEMV_PREWAIT", False)
    want = router_logits_gemv(x, w)
    monkeypatch.setattr(router_mod, "GEMV_PREWAIT", True)
    bh = gemv_blocks(t, h)[2]
    assert bh >= h and router_mod.gemv_prewait(t, h, bh)
    got = router_logits_gemv(x, w)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    x, w, got = x.cpu(), w.cpu(), got.cpu()
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).abs() <= 4 * h * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)).all()
    assert not router_mod.gemv_prewait(2, 7168, 8192)            # Pro-shaped T = 2: slower, off
    assert not router_mod.gemv_prewait(4, 4096, 1024)            # the streamed forms load in their loop


_ALIGN_FIELDS = ("sorted_route_ids", "block_expert", "num_valid_blocks", "expert_offsets", "expert_counts",
                 "route_rows", "row_expert", "row_weight")


@pytest.mark.parametrize("e,k,block_m,first,num_local,force", [
    (16, 4, 16, 0, 16, None),         # every route local (one rank / TP)
    (384, 6, 16, 0, 384, None),       # Pro-shaped
    (16, 4, 16, 4, 6, None),          # EP: some routes on other ranks
    (16, 4, 32, 10, 6, "low"),        # EP, the picks forced to 0..3: no local route, no valid block
    (16, 6, 64, 0, 3, "low"),         # fewer local experts than k: max_blocks = 4
    (8, 3, 1, 0, 8, None),            # one-row blocks
    (40, 6, 16, 2, 30, "spread")])    # picks forced across the local range's edges
def test_topk_align_one_token_is_moe_align(e, k, block_m, first, num_local, force):
    """route_topk(align=...) at T = 1: the top-k program's alignment is moe_align's, entry for entry
    (sentinels, -1s and padding included), and the routing is the plain call's."""
    from dsv4_moe.kernels.moe_align import moe_align

    x, w, bias = _inputs(1, 256, e, seed=e + k + block_m + first)
    if force == "low":       # the k lowest ids win by a wide margin
        bias = torch.where(torch.arange(e, device=DEV) < k, 100.0, -100.0).to(DEV)
    elif force == "spread":  # ids 0, 1, 2 (non-local), 2 (the first local), 31 (the last local), 32 (non-local)
        b = torch.full((e,), -100.0)
        b[[0, 1, 2, 31, 32, 20]] = 100.0
        bias = b.to(DEV)
    tw, ids, al = route_topk(x, w, bias, None, None, k, SCALE, logits_impl="gemv", align=(num_local, first, block_m))
    pw, pids = route_topk(x, w, bias, None, None, k, SCALE, logits_impl="gemv")
    assert_bitwise_equal(tw, pw, "weights")
    assert_bitwise_equal(ids, pids, "ids")
    want = moe_align(ids, num_local, first, block_m, tw)
    for f in ("block_m", "top_k", "num_routes", "max_blocks"):
        assert getattr(al, f) == getattr(want, f), f
    for f in _ALIGN_FIELDS:
        assert_bitwise_equal(getattr(al, f), getattr(want, f), f, e=e, k=k, block_m=block_m, first=first)
    if force == "low" and first >= k:
        assert int(al.num_valid_blocks.item()) == 0


def test_topk_align_unpacked_rounds(monkeypatch):
    """The same alignment from the unpacked selection rounds (router.TOPK_PACKED off), with EP."""
    from dsv4_moe.kernels import router as router_mod
    from dsv4_moe.kernels.moe_align import moe_align

    monkeypatch.setattr(router_mod, "TOPK_PACKED", False)
    x, w, bias = _inputs(1, 256, 40, seed=11)
    tw, ids, al = route_topk(x, w, bias, None, None, 6, SCALE, logits_impl="gemv", align=(17, 9, 16))
    want = moe_align(ids, 17, 9, 16, tw)
    for f in _ALIGN_FIELDS:
        assert_bitwise_equal(getattr(al, f), getattr(want, f), f)


def test_topk_align_guards():
    x, w, bias = _inputs(2, 256, 16, seed=3)
    with pytest.raises(ValueError, match="aligns one token's routes only, x has T=2"):
        route_topk(x, w, bias, None, None, 4, SCALE, logits_impl="gemv", align=(16, 0, 16))
    with pytest.raises(ValueError, match=r"align=\(16, 0\): expected None or a tuple"):
        route_topk(x[:1], w, bias, None, None, 4, SCALE, logits_impl="gemv", align=(16, 0))
    with pytest.raises(ValueError, match="block_m=12: expected a power of two"):
        route_topk(x[:1], w, bias, None, None, 4, SCALE, logits_impl="gemv", align=(16, 0, 12))
    tab = torch.randint(0, 16, (32, 4)).to(DEV)
    with pytest.raises(ValueError, match="not for a hash-routed layer"):
        route_topk(x[:1], w, None, tab, torch.tensor([5]).to(DEV), 4, SCALE, logits_impl="gemv", align=(16, 0, 16))
