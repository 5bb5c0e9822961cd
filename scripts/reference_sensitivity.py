"""How far the reference's own layer output moves under the freedoms SPEC §4 leaves an
implementation - what a GPU layer checked against the reference can be held to.

    python scripts/reference_sensitivity.py --case pro-tp8 --tokens 1024,4096

Each perturbation alone, against the unperturbed reference (same synthetic layer 5, seed 0, and
gpu_check_layer.py's x of seed T; CPU only):
  route_weights  every route weight moved by one fp32 ulp (random sign): the router's logits
                 summed in another order (SPEC §4.1 allows it; the GPU's weights differ from the
                 reference's by a few ulp, tests/test_kernels_router.py).
  route_weights_rel  every route weight times (1 + u), u uniform in [-R, R] (--route-weight-rel,
                 default 2e-6: the largest relative difference between the H200's weights and the
                 reference's at T = 1024, where the logits come from cuBLAS, session 36's
                 gpu_check_router.py; 1e-5 on hash layers).
  gate_up        a share of the routed gate_up outputs (--gate-up-share, default 1.1e-4: the
                 H200's measured share against the reference on the same inputs, session 37)
                 moved by one bf16 ulp: the in-block summation order of SPEC §4.3.
  both           route_weights_rel and gate_up together (the GPU's routed path has both).
  logits_fp32    the route weights of the same ids from logits summed in fp32 (torch's CPU matmul)
                 instead of float64: an fp32 summation order of the kind the GPU's logits have
                 (cuBLAS above T = 16), with its own token-to-token spread.
Prints, per T and perturbation: the share of bf16 outputs that differ, the largest difference in
bf16 ulps (at max(|ref|, rms), as dsv4_moe.testing.bf16_diff_stats) and the relative L2 over all
tokens; how many FP8 codes and UE8M0 scales of the routed h moved; and the worst token's largest
differences. The routed part only moves (the shared expert is computed once).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_layer import _inputs, case_config, parse_tokens  # noqa: E402

from dsv4_moe import reference as ref  # noqa: E402
from dsv4_moe.testing import bf16_diff_stats, random_layer_weights  # noqa: E402


def _routed(q, sa, tw, ids, r, limit, gate_ups=None, perturb=None):
    """ref.routed_forward's loop, keeping each expert's gate_up output (to reuse) and h."""
    t, k = ids.shape
    y = torch.zeros(t, k, r.hidden, dtype=torch.bfloat16)
    hq_all = torch.zeros(t, k, r.intermediate, dtype=torch.uint8)
    hs_all = torch.zeros(t, k, -(-r.intermediate // 128))
    kept = {}
    for e in range(r.num_local):
        tok, slot = torch.nonzero(ids == e + r.first_expert, as_tuple=True)
        if not tok.numel():
            continue
        gu = gate_ups[e] if gate_ups is not None else ref.fp4_gemm(q[tok], sa[tok], r.gate_up[e], r.gate_up_scale[e])
        kept[e] = gu
        if perturb is not None:
            gu = perturb(gu)
        hq, hs = ref.swiglu_quant(gu, limit, tw[tok, slot])
        hq_all[tok, slot] = hq.view(torch.uint8)
        hs_all[tok, slot] = hs
        y[tok, slot] = ref.fp4_gemm(hq, hs, r.down[e], r.down_scale[e])
    return y, hq_all, hs_all, kept


def _one_ulp_bf16(share: float, g: torch.Generator):
    def perturb(gu: torch.Tensor) -> torch.Tensor:
        bits = gu.view(torch.int16).clone()
        pick = (torch.rand(gu.shape, generator=g) < share) & (gu != 0) & torch.isfinite(gu)
        step = torch.where(torch.rand(gu.shape, generator=g) < 0.5, -1, 1).to(torch.int16)
        bits[pick] += step[pick]          # the neighbouring bf16 value (magnitude up or down)
        return bits.view(torch.bfloat16)
    return perturb


def _fp32_logit_weights(x, gate, ids, scale):
    """ref.route's weights for the given ids, with the logits summed in fp32 rather than float64."""
    scores = torch.sqrt(torch.nn.functional.softplus(x.float() @ gate.float().T, beta=1.0, threshold=20.0))
    return ref.renormalise(scores.gather(1, ids), scale)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="pro-tp8", choices=("flash", "pro-tp8", "tiny"))
    p.add_argument("--tokens", default="1024", help="comma-separated T list")
    p.add_argument("--gate-up-share", type=float, default=1.1e-4)
    p.add_argument("--route-weight-rel", type=float, default=2e-6)
    args = p.parse_args(argv)
    tokens = parse_tokens(p, "--tokens", args.tokens)
    cfg = case_config(args.case)
    t0 = time.time()
    w = random_layer_weights(cfg, layer_idx=min(5, cfg.num_hidden_layers - 1), seed=0)
    r = w.routed.with_layout("nk")
    print(f"{args.case}: synthetic weights in {time.time() - t0:.1f}s", flush=True)
    k, limit = cfg.num_experts_per_tok, cfg.swiglu_limit
    for t in tokens:
        t0 = time.time()
        x, ids = _inputs(cfg, t, t, "cpu")
        tw, tid = ref.route(x, w.router.weight, w.router.bias, w.router.tid2eid, ids, k, cfg.routed_scaling_factor)
        q, sa = ref.act_quant(x)
        shared = ref.shared_forward(x, w.shared, limit, quantised=(q, sa))
        y0, hq0, hs0, gate_ups = _routed(q, sa, tw, tid, r, limit)
        out0 = ref.combine(ref.finalize(y0, tid, r.first_expert, r.num_local), shared, w)
        g = torch.Generator().manual_seed(t)
        sign = torch.where(torch.rand(tw.shape, generator=g) < 0.5, -float("inf"), float("inf"))
        rel = (torch.rand(tw.shape, generator=g) * 2 - 1) * args.route_weight_rel
        runs = {"route_weights": dict(tw=torch.nextafter(tw, sign)),
                "route_weights_rel": dict(tw=tw * (1 + rel)),
                "gate_up": dict(tw=tw, perturb=_one_ulp_bf16(args.gate_up_share, g)),
                "both": dict(tw=tw * (1 + rel), perturb=_one_ulp_bf16(args.gate_up_share, g)),
                "logits_fp32": dict(tw=_fp32_logit_weights(x, w.router.weight, tid, cfg.routed_scaling_factor))}
        print(f"T={t}: reference in {time.time() - t0:.1f}s", flush=True)
        wr = ((runs["logits_fp32"]["tw"] - tw).abs() / tw.abs()).max(1).values
        print(f"  logits_fp32 route weights: largest relative difference {float(wr.max()):.2e} (token "
              f"{int(wr.argmax())}), 99.9th percentile over tokens {float(wr.quantile(0.999)):.2e}, median "
              f"{float(wr.median()):.2e}", flush=True)
        for name, kw in runs.items():
            y, hq, hs, _ = _routed(q, sa, kw["tw"], tid, r, limit, gate_ups, kw.get("perturb"))
            out = ref.combine(ref.finalize(y, tid, r.first_expert, r.num_local), shared, w)
            st = bf16_diff_stats(out, out0)
            d = (out.float() - out0.float()).abs()
            tok = int(d.max(1).values.argmax())
            rms = out0.float().pow(2).mean().sqrt()
            codes = int((hq != hq0).sum())
            scales = int((hs != hs0).sum())
            print(f"  {args.case} T={t:5d} {name:17s}: {st['mismatch_frac'] * 100:.3f}% differ, max "
                  f"{st['max_ulp']:.0f} ulp, rel L2 {st['rel_l2']:.2e}; h codes moved {codes} "
                  f"({int((hq != hq0).any(2).sum())} routes), scales {scales}; worst token {tok}: max |d| "
                  f"{float(d[tok].max() / rms):.3f} of the rms, {int((d[tok] > 0).sum())} of {d.shape[1]} columns "
                  f"differ, its routes' codes moved {(hq[tok] != hq0[tok]).sum(1).tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
