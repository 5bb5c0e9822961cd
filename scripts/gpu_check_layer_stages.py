"""Where the GPU layer and the CPU reference part: every stage of the layer's own path against
the reference fed that stage's GPU inputs (H200).

    OUT=./out python scripts/gpu_check_layer_stages.py --case pro-tp8 --tokens 4096

The layer and its inputs are gpu_check_layer.py's (synthetic layer 5, seed 0; x and input_ids
of seed T). For each T:
  * routing: the GPU router's ids (tokens that differ from the reference's, near-ties among them)
  * act_quant: q, sa bitwise the reference's
  * routed gate_up (the layer's config and layout): each route's row against ref.fp4_gemm of the
    same q, sa (recipe "fp4_gemm")
  * SwiGLU-quant: the GPU's h codes and scales bitwise ref.swiglu_quant of the GPU's gate_up rows
    (run on the GPU: the kernel's exp is CUDA's expf, torch's CPU exp differs in last bits)
  * routed down: each route's row against ref.fp4_gemm of the GPU's h (recipe "fp4_gemm")
  * the stages above compose to routed_experts_forward's y (bitwise), and finalize + shared add
    of y and the GPU's shared output equals the layer's output (bitwise)
  * shared expert: against ref.shared_forward on the same q, sa (recipe "layer": two GEMMs and a
    requantisation)
  * the shared expert's gate_up, SwiGLU-quant and down the same way (the FP8 wgmma tiles of M > 16
    on the error against the terms' magnitude, as tests/test_kernels_fp8_gemm.py on the GPU)
  * the layer against the reference on the GPU's route weights with the GPU's shared output
    added (gpu_check_layer.py's bound, "layer" recipe; see its _references), and against the
    reference with its own route weights and against the whole reference (reported)
  * the amplification: how many SwiGLU-quant scales and FP8 codes of the GPU differ from those the
    reference computes from its own gate_up (a 1-ulp gate_up difference can flip a code, or at a
    group's absmax double a UE8M0 scale, requantising all 128 codes), and the largest layer
    differences with, for each, its routes' and its shared expert's flips.
  * the worst token piece by piece: ids, route weights, each route's y against the reference's
    own, the SwiGLU-quant of its gate_up on the GPU's weight against on the reference's (scales,
    codes, group absmax), the shared output, magnitudes, the logits against float64; its pieces
    saved to $OUT/worst_token_<case>_T<T>.pt.
Writes $OUT/gpu_check_layer_stages.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_layer import ROUTE_WEIGHT_REL, _inputs, _references, _route_differences, case_config, parse_tokens  # noqa: E402

from dsv4_moe import DeepseekV4MoE, MoEConfig, dispatch, reference as ref  # noqa: E402
from dsv4_moe.config import ACT_BLOCK  # noqa: E402
from dsv4_moe.kernels.act_quant import act_quant  # noqa: E402
from dsv4_moe.kernels.finalize import finalize_shared_add  # noqa: E402
from dsv4_moe.kernels.moe_align import moe_align  # noqa: E402
from dsv4_moe.kernels.mxfp4_grouped_gemm import mxfp4_grouped_gemm  # noqa: E402
from dsv4_moe.kernels.routed_experts import pairs_mode, routed_configs, routed_experts_forward  # noqa: E402
from dsv4_moe.kernels.swiglu_quant import swiglu_quant  # noqa: E402
from dsv4_moe.testing import TOLERANCES, bf16_diff_stats, local_mismatch_frac, random_layer_weights  # noqa: E402


def _fmt(st: dict) -> str:
    return f"{st['mismatch_frac'] * 100:.3f}% differ, max {st['max_ulp']:.0f} ulp, rel L2 {st['rel_l2']:.2e}"


def _within(st: dict, recipe: str) -> bool:
    tol = TOLERANCES[recipe]
    return (st["mismatch_frac"] <= tol.max_mismatch_frac and st["max_ulp"] <= tol.max_ulp
            and st["rel_l2"] <= tol.max_rel_l2)


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.uint8) if a.element_size() == 1 else a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)


# The FP8 wgmma tiles (M > 16) sum each 32-wide K chunk inside the tensor core before the fp32
# promotion (SPEC §4.3's documented deviation, DESIGN "Numerics decisions"): their bound on the
# GPU is TOLERANCES["fp8_gemm_wgmma"] (a share of differing outputs and the error against the
# magnitude of the summed terms, as tests/test_kernels_fp8_gemm.py); the mma.sync tiles and the
# GEMV (M <= 16) keep the "fp8_gemm" recipe.
WGMMA = TOLERANCES["fp8_gemm_wgmma"]


def _fp8_gemm_vs_ref(got, want, case, m) -> tuple[bool, str]:
    st = bf16_diff_stats(got, want)
    if m <= 16:
        return _within(st, "fp8_gemm"), _fmt(st)
    q, sa, w, sw = case

    def absolute(v):
        return (v.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    mag = ref.fp8_gemm(absolute(q), sa, absolute(w), sw).float()
    rel = ((got.float() - want.float()).abs() / mag.clamp_min(1e-30)).max().item()
    local = local_mismatch_frac(got, want)
    ok = (st["mismatch_frac"] <= WGMMA.max_mismatch_frac and rel <= WGMMA.max_rel_magnitude
          and local <= WGMMA.max_local_mismatch_frac)
    return ok, _fmt(st) + (f"; {local:.2%} in the worst row or 128-column block; max |d| / magnitude {rel:.2e} "
                           f"(wgmma bound {WGMMA.max_mismatch_frac:.0%} differing, {WGMMA.max_local_mismatch_frac:.0%} "
                           f"locally, {WGMMA.max_rel_magnitude:.2e} of the magnitude)")


def layer_logits_path(layer, t: int) -> str:
    from dsv4_moe.kernels.router import logits_path

    return logits_path(t, layer.router.weight.dtype, cuda=layer.device.type == "cuda")


def dispatch_logits(layer, x: torch.Tensor) -> torch.Tensor:
    """The GPU router's fp32 logits for the whole batch, by the path route_topk takes at this T."""
    from dsv4_moe.kernels.router import logits_fn

    return logits_fn(layer_logits_path(layer, x.shape[0]))(x, layer.router.weight)


def check(cfg: MoEConfig, weights, t: int, rows: list[dict], name: str, dev: torch.device) -> None:
    layer = DeepseekV4MoE(cfg, weights)
    k, limit = cfg.num_experts_per_tok, cfg.swiglu_limit
    x, ids = _inputs(cfg, t, t, dev)
    wc = weights.to("cpu")
    rc = wc.routed.with_layout("nk")

    def add(check_name, ok, detail):
        rows.append({"case": name, "check": check_name, "T": t, "ok": bool(ok), "detail": detail})
        print(f"{name:10s} T={t:5d} {check_name:34s} {'ok ' if ok else 'BAD'} {detail}", flush=True)

    with torch.no_grad():
        out = layer(x, ids)
        ctx = layer.context(t)
        ties, off_tie = _route_differences(layer, x, ids, wc, cfg)
        tw, tid = dispatch.select("router", ctx).impl(x, layer.router, ids, k, cfg.routed_scaling_factor)
        rw_all, rid_all = ref.route(x.cpu(), wc.router.weight, wc.router.bias, wc.router.tid2eid, ids.cpu(), k,
                                    cfg.routed_scaling_factor)
        same = (tid.cpu().long() == rid_all).all(1)   # both ascending per token
        wrel = ((tw.cpu() - rw_all).abs() / rw_all.abs()).max(1).values
        wrel[~same] = 0
        add("routing vs reference", not off_tie, f"{len(ties)} tokens on a near-tie routed otherwise {ties[:8]}, "
                                                 f"{len(off_tie)} off a tie {off_tie[:8]}; route weights of the tokens "
                                                 f"routed alike: largest relative difference {float(wrel.max()):.2e} "
                                                 f"(token {int(wrel.argmax())}), > 1e-5 on {int((wrel > 1e-5).sum())} "
                                                 f"tokens; logits path {layer_logits_path(layer, t)}")
        q, sa = act_quant(x)
        rq, rsa = ref.act_quant(x.cpu())
        add("act_quant bitwise", torch.equal(_bits(q.cpu()), _bits(rq)) and torch.equal(sa.cpu(), rsa), "")
        r = layer.routed
        up, down = routed_configs(t * k, r)
        align = moe_align(tid, r.num_local, r.first_expert, up.block_m, tw)
        gu = mxfp4_grouped_gemm(q, sa, r.gate_up, r.gate_up_scale, align, gather_a=True, scatter_out=False,
                                config=up, layout=r.layout)
        hq, hs, *hp = swiglu_quant(gu, limit=float(limit), route_weight=align.row_weight, pairs=pairs_mode(down),
                                   rows=align.route_rows)
        y = mxfp4_grouped_gemm(hq, hs, r.down, r.down_scale, align, gather_a=False, scatter_out=True, config=down,
                               layout=r.layout, a_pairs=hp[0] if hp else None,
                               a_pairs_scaled=bool(hp) and down.fold_sa).view(t, k, -1)
        y_fwd = routed_experts_forward(q, sa, tw, tid, r, limit)
        add("stages == routed_experts_forward", torch.equal(_bits(y), _bits(y_fwd)), f"configs {up} / {down}")
        shared = layer.shared_experts.forward_quantised(q, sa, ctx)
        fin = finalize_shared_add(y, tid, r.first_expert, r.num_local, shared)
        add("finalize(stages) == layer output", torch.equal(_bits(fin), _bits(out)), "")
        t0 = time.time()
        qc, sac, guc, hqc, hsc, yc = q.cpu(), sa.cpu(), gu.cpu(), hq.cpu(), hs.cpu(), y.cpu().view(t * k, -1)
        rr = align.route_rows.cpu().long()
        flat = tid.cpu().long().flatten()
        twf = tw.cpu().flatten()
        got_gu, ref_gu, got_h, ref_h, got_y, ref_y = [], [], [], [], [], []
        scale_flips = torch.zeros(t * k, dtype=torch.long)   # per route: h scales differing from the full reference's
        code_flips = torch.zeros(t * k, dtype=torch.long)
        for e in range(r.num_local):
            routes = torch.nonzero(flat == e + r.first_expert).flatten()
            if not routes.numel():
                continue
            toks, grow = routes // k, rr[routes]
            g_ref = ref.fp4_gemm(qc[toks], sac[toks], rc.gate_up[e], rc.gate_up_scale[e])
            got_gu.append(guc[grow])
            ref_gu.append(g_ref)
            # on the GPU's gate_up, on the GPU: the kernel's exp is CUDA's expf, as torch's there
            h_ref_q, h_ref_s = (v.cpu() for v in ref.swiglu_quant(gu[grow.to(dev)], limit, tw.flatten()[routes.to(dev)]))
            got_h.append(torch.cat([_bits(hqc[grow]).float(), hsc[grow]], 1))
            ref_h.append(torch.cat([_bits(h_ref_q).float(), h_ref_s], 1))
            full_q, full_s = ref.swiglu_quant(g_ref, limit, twf[routes])           # the CPU reference's own
            scale_flips[routes] = (full_s != hsc[grow]).sum(1)
            code_flips[routes] = (_bits(full_q) != _bits(hqc[grow])).sum(1)
            got_y.append(yc[routes])
            ref_y.append(ref.fp4_gemm(hqc[grow], hsc[grow], rc.down[e], rc.down_scale[e]))
        st = bf16_diff_stats(torch.cat(got_gu), torch.cat(ref_gu))
        add("gate_up vs ref (same q, sa)", _within(st, "fp4_gemm"), _fmt(st))
        same_h = torch.equal(torch.cat(got_h), torch.cat(ref_h))
        add("swiglu_quant bitwise (same gate_up)", same_h, "codes and scales")
        st = bf16_diff_stats(torch.cat(got_y), torch.cat(ref_y))
        add("down vs ref (same h)", _within(st, "fp4_gemm"), _fmt(st))
        # the shared expert's stages, as DeepseekV4MLP.forward_quantised runs them
        se, ws = layer.shared_experts, wc.shared
        gemm = dispatch.select("fp8_gemm", ctx)
        sgu = gemm.impl(q, sa, se.w_gate_up, se.w_gate_up_scale)
        shq, shs = dispatch.select("swiglu_quant", ctx).impl(sgu, limit)
        sy = gemm.impl(shq, shs, se.w_down, se.w_down_scale)
        add("shared stages == shared forward", torch.equal(_bits(sy), _bits(shared)), f"fp8_gemm path {gemm.name}")
        sguc, shqc, shsc = sgu.cpu(), shq.cpu(), shs.cpu()
        sgu_ref = ref.fp8_gemm(rq, rsa, ws.gate_up, ws.gate_up_scale)
        ok, detail = _fp8_gemm_vs_ref(sguc, sgu_ref, (rq, rsa, ws.gate_up, ws.gate_up_scale), t)
        add("shared gate_up vs ref (same q, sa)", ok, detail)
        hq_r, hs_r = (v.cpu() for v in ref.swiglu_quant(sgu, limit))           # on the GPU (CUDA's expf)
        add("shared swiglu_quant bitwise", torch.equal(_bits(hq_r), _bits(shqc)) and torch.equal(hs_r, shsc),
            "codes and scales (same gate_up)")
        ok, detail = _fp8_gemm_vs_ref(sy.cpu(), ref.fp8_gemm(shqc, shsc, ws.down, ws.down_scale),
                                      (shqc, shsc, ws.down, ws.down_scale), t)
        add("shared down vs ref (same h)", ok, detail)
        full_hq, full_hs = ref.swiglu_quant(sgu_ref, limit)
        shared_scale_flips = (full_hs != shsc).sum(1)
        shared_code_flips = (_bits(full_hq) != _bits(shqc)).sum(1)
        sh_ref = ref.shared_forward(x.cpu(), wc.shared, limit, quantised=(rq, rsa))
        st = bf16_diff_stats(shared.cpu(), sh_ref)
        add("shared vs ref (same q, sa)", True, _fmt(st) + f" (reported: the composition of the stages above); h "
            f"scales differing from the reference's own in {int((shared_scale_flips > 0).sum())} of {t} tokens, codes "
            f"in {int((shared_code_flips > 0).sum())} tokens ({int(shared_code_flips.sum())} codes)")
        n_routes = t * k
        add("h scales: GPU vs full reference", True,
            f"{int(scale_flips.sum())} of {n_routes * hsc.shape[1]} group scales differ, in "
            f"{int((scale_flips > 0).sum())} routes; codes differ in {int((code_flips > 0).sum())} of {n_routes} "
            f"routes ({int(code_flips.sum())} codes)")
        refs = _references(layer, x, ids, wc, cfg)
        bounded, with_gpu_shared, full = refs["bounded"], refs["gpu_shared"], refs["own"]
        agree = torch.ones(t, dtype=torch.bool)
        agree[ties + off_tie] = False
        st = bf16_diff_stats(out.cpu()[agree], bounded[agree])
        add("layer vs ref (GPU weights + shared)", _within(st, "layer") and refs["weight_rel"] <= ROUTE_WEIGHT_REL,
            _fmt(st) + f" over the {int(agree.sum())} tokens routed alike (gpu_check_layer.py's bound; route weights "
            f"{refs['weight_rel']:.2e} relative off at most, token {refs['weight_token']})")
        st = bf16_diff_stats(out.cpu()[agree], with_gpu_shared[agree])
        # the difference against the magnitude of the summed terms (sum_j |y_j| + |shared|): a 1-ulp
        # difference of a large y_j is many ulp of an output that cancels to a small value
        terms = yc.view(t, k, -1).float().abs().sum(1) + shared.cpu().float().abs()
        dmag = (out.cpu().float() - with_gpu_shared.float()).abs() / terms.clamp_min(1e-30)
        dmag[~agree] = 0
        add("layer vs reference + GPU shared", True, "(reported) " + _fmt(st) + f" over the {int(agree.sum())} tokens "
            f"routed alike (gpu_check_layer.py's bound); max |d| / (sum |y_j| + |shared|) {float(dmag.max()):.2e} "
            f"(token {int(dmag.flatten().argmax()) // dmag.shape[1]})")
        g, f = out.cpu().float(), full.float()
        st = bf16_diff_stats(out.cpu()[agree], full[agree])
        rms = f[agree].pow(2).mean().sqrt()
        row_rms = f.pow(2).mean(1).sqrt()
        err = ((g - f).abs() / rms)
        err[~agree] = 0
        worst = torch.topk(err.flatten(), 5)
        lines = []
        for v, idx in zip(worst.values.tolist(), worst.indices.tolist()):
            tok, col = divmod(idx, g.shape[1])
            rs = list(range(tok * k, tok * k + k))
            lines.append(f"token {tok} col {col}: |diff| {v:.4f} of the rms (~{v * 256:.0f} bf16 ulp of it; the token's "
                         f"row rms is {float(row_rms[tok] / rms):.2f}x it), its routes' h scale flips "
                         f"{scale_flips[rs].tolist()}, code flips {code_flips[rs].tolist()}, shared h scale flips "
                         f"{int(shared_scale_flips[tok])}, code flips {int(shared_code_flips[tok])}")
        add("layer vs full reference", True, _fmt(st) + " (reported; tokens routed alike); worst: "
            + "; ".join(lines) + f" (ref {time.time() - t0:.1f}s)")
        # the worst token, piece by piece: its route weights, each route's y and the shared output
        # against the reference's own (one token: the reference is per token)
        tok = int(worst.indices[0]) // g.shape[1]
        xt = x[tok:tok + 1].cpu()
        rw, rid = ref.route(xt, wc.router.weight, wc.router.bias, wc.router.tid2eid, ids[tok:tok + 1].cpu(), k,
                            cfg.routed_scaling_factor)
        q1, s1 = ref.act_quant(xt)
        y1 = ref.routed_forward(q1, s1, rw, rid, wc.routed, limit)[0]
        gw = tw[tok].cpu()
        parts = [f"ids GPU {tid[tok].tolist()} ref {rid[0].tolist()}",
                 "weights rel diff " + ", ".join(f"{float((gw[j] - rw[0, j]).abs() / rw[0, j].abs()):.1e}"
                                                  for j in range(k))]
        for j in range(k):
            d = bf16_diff_stats(y[tok, j].cpu(), y1[j])
            # the SwiGLU-quant of the GPU's gate_up row on the GPU's weight and on the reference's
            # (on the GPU: CUDA's expf): a scale flip here is the route weight's doing
            row = gu[rr[tok * k + j]][None]
            hg_q, hg_s = ref.swiglu_quant(row, limit, tw[tok, j:j + 1].float())
            hr_q, hr_s = ref.swiglu_quant(row, limit, rw[0, j:j + 1].to(dev))
            amax = (ref.swiglu(row, limit, rw[0, j:j + 1].to(dev)).to(torch.bfloat16).float()
                    .view(-1, ACT_BLOCK).abs().amax(1))
            parts.append(f"slot {j}: {_fmt(d)}, max |d| {d['max_abs']:.3g}; h on the GPU's vs the reference's weight: "
                         f"{int((hg_s != hr_s).sum())} scales ({hg_s[0].tolist()} vs {hr_s[0].tolist()}), "
                         f"{int((_bits(hg_q) != _bits(hr_q)).sum())} codes differ; bf16 group absmax "
                         f"{[float(v) for v in amax.cpu()]}")
        d = bf16_diff_stats(shared[tok].cpu(), sh_ref[tok])
        parts.append(f"shared: {_fmt(d)}, max |d| {d['max_abs']:.3g}; layer row max |d| "
                     f"{float((g[tok] - f[tok]).abs().max()):.3g}")
        # magnitudes: each slot's largest |y|, the shared's and the output's (a cancelling sum turns
        # one ulp of a large term into many of the output)
        yt = y[tok].cpu().float()
        parts.append("max |y_j| " + ", ".join(f"{float(v):.3g}" for v in yt.abs().max(1).values)
                     + f"; max |shared| {float(shared[tok].abs().max()):.3g}; output rms {float(g[tok].pow(2).mean().sqrt()):.3g}"
                     + f", max {float(g[tok].abs().max()):.3g}")
        logits = layer.router.weight.cpu().double() @ xt.double().t()
        gl = dispatch_logits(layer, x)[tok].cpu().double()
        parts.append(f"logits path {layer_logits_path(layer, t)}: max |GPU - float64| {float((gl - logits[:, 0]).abs().max()):.2e}"
                     f" (max |logit| {float(logits.abs().max()):.3g})")
        add(f"worst token {tok} by piece", True, "; ".join(parts))
        out_dir = os.environ.get("OUT", "./out")
        os.makedirs(out_dir, exist_ok=True)
        pieces = {"token": tok, "x": xt, "input_id": ids[tok].cpu(), "gpu_weights": gw, "gpu_ids": tid[tok].cpu(),
                  "ref_weights": rw[0], "ref_ids": rid[0], "gpu_logits": gl.float(), "gpu_y": y[tok].cpu(),
                  "ref_y": y1, "gpu_shared": shared[tok].cpu(), "ref_shared": sh_ref[tok], "gpu_out": out[tok].cpu(),
                  "ref_out": full[tok], "ref_out_gpu_shared": with_gpu_shared[tok], "ref_out_bounded": bounded[tok]}
        # clones: a saved view would carry its whole [T, H] storage
        torch.save({key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in pieces.items()},
                   os.path.join(out_dir, f"worst_token_{name}_T{t}.pt"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="pro-tp8", choices=("flash", "pro-tp8", "tiny"),
                   help="layer shapes ('tiny': the embedded checkpoint's, for a CPU smoke run under TRITON_INTERPRET=1)")
    p.add_argument("--tokens", default="4096", help="comma-separated T list")
    args = p.parse_args(argv)
    tokens = parse_tokens(p, "--tokens", args.tokens)
    cfg = case_config(args.case)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = random_layer_weights(cfg, layer_idx=min(5, cfg.num_hidden_layers - 1), seed=0, device=dev)
    rows: list[dict] = []
    for t in tokens:
        check(cfg, weights, t, rows, args.case, dev)
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check_layer_stages.json"), "w") as f:
        json.dump(rows, f, indent=1)
    bad = [row for row in rows if not row["ok"]]
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "the CPU (Triton interpreter)"
    print(f"{len(rows) - len(bad)}/{len(rows)} checks ok on {where}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
