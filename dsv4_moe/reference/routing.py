"""The router (SPEC §4.1): sqrt-softplus scores, biased top-k selection (or hash table),
unbiased renormalised weights times routed_scaling_factor. All fp32.

Conventions fixed here (DESIGN.md):
* ids are returned sorted ascending per token, weights permuted with them, so the
  combine's "ascending expert id" order is slot order.
* the renormalisation sum runs left to right over the slots in that ascending-id order
  (DeepSeek's code sums the k weights with torch's sum; the order of 6 fp32 adds is not
  pinned there, so it is pinned here).
* logits: bf16 x bf16 products are exact in fp32; the reference sums them in float64 and
  rounds once (a correctly rounded fp32 logit); kernels may differ in summation order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["route", "router_scores", "renormalise"]


def router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """scores [T, E] fp32 = sqrt(softplus(x @ W^T)) (softplus beta 1, threshold 20)."""
    logits = (x.double() @ weight.double().T).float()
    return torch.sqrt(F.softplus(logits, beta=1.0, threshold=20.0))


def renormalise(w: torch.Tensor, scale: float) -> torch.Tensor:
    """w / (w[:, 0] + w[:, 1] + ...) * scale, summed left to right, no epsilon."""
    total = w[:, 0].clone()
    for j in range(1, w.shape[1]):
        total = total + w[:, j]
    return w / total[:, None] * scale


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def route(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], tid2eid: Optional[torch.Tensor],
          input_ids: Optional[torch.Tensor], top_k: int, routed_scaling_factor: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Args:
        x                [T, H]        bfloat16 (float32/64 accepted for the unquantised mode)
        weight           [E, H]        bfloat16 gate weight
        bias             [E]           float32 selection bias (non-hash layers) or None
        tid2eid          [vocab, k]    int64 hash table (hash layers) or None
        input_ids        [T]           int64 token ids (hash layers) or None
    Returns:
        topk_weights     [T, k]        float32
        topk_ids         [T, k]        int64, ascending per token
    """
    if (tid2eid is None) == (bias is None):
        raise ValueError("route: exactly one of bias (non-hash layer) and tid2eid (hash layer) must be given")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"route: x.shape={tuple(x.shape)} and weight.shape={tuple(weight.shape)}: expected [T, H] "
                         f"and [E, H] with the same H")
    e = weight.shape[0]
    if tid2eid is None:
        if bias.shape != (e,):
            raise ValueError(f"route: bias.shape={tuple(bias.shape)}: expected [{e}] (one per expert of weight)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
            raise ValueError(f"route: top_k={top_k!r}: expected an int in [1, {e}]")
    elif tid2eid.dim() != 2 or tid2eid.dtype.is_floating_point:
        raise ValueError(f"route: tid2eid {tuple(tid2eid.shape)} {tid2eid.dtype}: expected an int [vocab, k] table")
    scores = router_scores(x, weight)
    if tid2eid is not None:
        if input_ids is None:
            raise ValueError("route: this is a hash layer; input_ids [T] int64 is required")
        if input_ids.shape != (x.shape[0],):
            raise ValueError(f"route: input_ids.shape={tuple(input_ids.shape)}, expected {(x.shape[0],)}")
        # (a host sync on a GPU; skipped inside a CUDA-graph capture, as the layer skips its own check)
        if input_ids.numel() and not _capturing(input_ids) \
                and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < tid2eid.shape[0]:
            raise ValueError(f"route: input_ids in [{int(input_ids.min())}, {int(input_ids.max())}]: expected ids in "
                             f"[0, {tid2eid.shape[0]}) (the rows of tid2eid)")
        if input_ids.dtype.is_floating_point:
            raise ValueError(f"route: input_ids.dtype={input_ids.dtype}: expected an int dtype (token ids)")
        ids = tid2eid[input_ids.long()].long()
        if ids.numel() and not _capturing(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < e:
            raise ValueError(f"route: tid2eid gives expert ids in [{int(ids.min())}, {int(ids.max())}] for these "
                             f"tokens: expected ids in [0, {e}) (the rows of weight)")
    else:
        ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    ids, _ = torch.sort(ids, dim=-1, stable=True)
    w = scores.gather(1, ids)
    return renormalise(w, routed_scaling_factor), ids
