"""finalize (kernels/finalize.py): fused == unfused bitwise and == the reference (finalize +
shared add + one rounding) bitwise; non-local routes skipped. Under TRITON_INTERPRET=1 on CPU,
natively on a GPU (inputs moved there, outputs compared on the CPU)."""
import _triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 where there is no GPU; must precede triton)

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_moe import reference as ref  # noqa: E402
from dsv4_moe.kernels.finalize import (add_shared_round, finalize_partial, finalize_shared_add,  # noqa: E402
                                       finalize_split_shared_add, finalize_unfused)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _on(fn, *args):
    """fn on DEV (tensor arguments moved there), its result back on the CPU."""
    return fn(*[a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]).cpu()


def _case(t, k, h, e, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 2^-12 .. 2^12 per element: the fp32 sums of these bf16 terms are
    # inexact, so the summation order shows in the bits (equal magnitudes sum exactly in any order)
    y = (torch.randn(t, k, h, generator=g) * torch.randint(-12, 13, (t, k, h), generator=g).float().exp2()).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).sort(1).values
    shared = torch.randn(t, h, generator=g).bfloat16()
    return y, ids, shared


def _bits_equal(a, b, what):
    av, bv = a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32), \
        b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)
    bad = torch.nonzero(av != bv)
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} differing elements, first at {bad[0].tolist()}: "
                              f"{a[tuple(bad[0])].item()} vs {b[tuple(bad[0])].item()}")


@pytest.mark.parametrize("t,h", [(1, 256), (5, 2880 // 9), (70, 200)])
def test_fused_equals_unfused_and_reference(t, h):
    k, e, first, nl = 6, 16, 4, 8  # this rank owns 4..11: some routes are not local
    y, ids, shared = _case(t, k, h, e, t)
    y[~ref.local_mask(ids, first, nl)] = float("nan")  # non-local rows are garbage: must never be read
    fused = _on(finalize_shared_add, y, ids, first, nl, shared)
    unfused = _on(finalize_unfused, y, ids, first, nl, shared)
    _bits_equal(fused, unfused, "fused vs unfused")
    acc_ref = ref.finalize(torch.nan_to_num(y), ids, first, nl)
    _bits_equal(_on(finalize_partial, y, ids, first, nl), acc_ref, "partial vs reference")
    _bits_equal(fused, (acc_ref + shared.float()).bfloat16(), "fused vs reference")
    _bits_equal(_on(finalize_shared_add, y, ids.int(), first, nl), acc_ref.bfloat16(), "no shared")
    # negative control: the check sees the order - the same local rows summed right to left (or
    # pairwise, as a tree reduction over the slots would) give other fp32 bits on these inputs
    # (order needs >= 3 local terms in a token: T = 1 here has one, so it has no order to see)
    local = ref.local_mask(ids, first, nl)
    assert (local.sum(1) >= 3).any() or t == 1
    if (local.sum(1) >= 3).any():
        yl = torch.where(local[..., None], torch.nan_to_num(y).float(), 0.0)
        assert not torch.equal(ref.finalize(y.flip(1).nan_to_num(), ids.flip(1), first, nl), acc_ref)
        assert not torch.equal((yl[:, 0::2] + yl[:, 1::2]).sum(1), acc_ref)


def test_negative_zero_sum_kept():
    # all local slots -0.0: acc = +0.0 + -0.0 = +0.0 ... a skipped slot must not add +0.0 either
    y = torch.full((1, 2, 32), -0.0).bfloat16()
    ids = torch.tensor([[0, 9]])
    out = _on(finalize_partial, y, ids, 0, 8)
    _bits_equal(out, ref.finalize(y, ids, 0, 8), "signed zero")


def test_ep_split_equals_fused():
    y, ids, shared = _case(9, 4, 128, 8, 1)
    acc = _on(finalize_partial, y, ids, 0, 8)
    _bits_equal(_on(add_shared_round, acc, shared), _on(finalize_shared_add, y, ids, 0, 8, shared), "EP split")


def test_zero_tokens_and_guards():
    y = torch.empty(0, 6, 64, dtype=torch.bfloat16)
    assert finalize_shared_add(y, torch.empty(0, 6, dtype=torch.long), 0, 8).shape == (0, 64)
    y, ids, shared = _case(2, 3, 64, 8, 0)
    with pytest.raises(ValueError, match="y"):
        finalize_shared_add(y.float(), ids, 0, 8)
    with pytest.raises(ValueError, match="topk_ids"):
        finalize_shared_add(y, ids[:, :2], 0, 8)
    with pytest.raises(ValueError, match="shared_out"):
        finalize_shared_add(y, ids, 0, 8, shared.float())
    with pytest.raises(ValueError, match="num_local"):
        finalize_partial(y, ids, 0, 0)
    with pytest.raises(ValueError, match="acc"):
        add_shared_round(shared, None)


@pytest.mark.parametrize("p,t,h", [(2, 1, 4096 // 8), (3, 4, 2880 // 9), (2, 70, 200)])
def test_split_partials_equal_reduce_then_finalize(p, t, h):
    """finalize_split_shared_add (FINALIZE_SUMS_SPLIT): each local slot's row is the split-K
    reduce launch's bf16(+0.0 + parts[0] + ... + parts[P-1]) before the finalize's fp32 sum,
    so the result is bitwise the reduce + finalize_shared_add pair; non-local partial rows
    (NaN here) are never read. Negative control: summing the partials without that per-route
    bf16 rounding gives other bits, so the check can see a missing rounding."""
    k, e, first, nl = 6, 16, 4, 8
    g = torch.Generator().manual_seed(p * 100 + t)
    parts = torch.randn(p, t, k, h, generator=g) * torch.rand(p, 1, 1, h, generator=g).exp2()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).sort(1).values
    shared = torch.randn(t, h, generator=g).bfloat16()
    local = ref.local_mask(ids, first, nl)
    assert 0 < int(local.sum()) < t * k
    parts[:, ~local] = float("nan")
    reduced = torch.zeros(t, k, h)
    for i in range(p):                          # the reduce launch: in order from +0.0, one rounding
        reduced = reduced + parts[i]
    y = reduced.bfloat16()
    for sh in (shared, None):
        got = _on(finalize_split_shared_add, parts, ids, first, nl, sh)
        _bits_equal(got, _on(finalize_shared_add, y, ids, first, nl, sh), f"split partials vs reduce + finalize, P={p}")
    unrounded = (torch.where(local[..., None], torch.nan_to_num(reduced), 0.0).sum(1)
                 + shared.float()).bfloat16()
    assert not torch.equal(unrounded, _on(finalize_split_shared_add, parts, ids, first, nl, shared))


def test_split_partials_guards():
    parts = torch.zeros(2, 3, 4, 64)
    ids = torch.zeros(3, 4, dtype=torch.long)
    assert finalize_split_shared_add(torch.zeros(2, 0, 4, 64), ids[:0], 0, 8).shape == (0, 64)
    with pytest.raises(ValueError, match=r"parts: expected a \[P, T, k, H\] float32"):
        finalize_split_shared_add(parts.bfloat16(), ids, 0, 8)
    with pytest.raises(ValueError, match="parts"):
        finalize_split_shared_add(parts[0], ids, 0, 8)
    with pytest.raises(ValueError, match="unit stride"):
        finalize_split_shared_add(parts.transpose(2, 3).contiguous().transpose(2, 3), ids, 0, 8)
    with pytest.raises(ValueError, match="topk_ids"):
        finalize_split_shared_add(parts, ids[:, :2], 0, 8)
    with pytest.raises(ValueError, match="shared_out"):
        finalize_split_shared_add(parts, ids, 0, 8, torch.zeros(3, 64))
