"""H200 probe (session 35): what the test suite's kernel checks see when Triton runs natively.

Until session 35 four test modules set TRITON_INTERPRET=1 for the whole pytest process, so on a
GPU machine every kernel test ran in the interpreter; run natively, three kinds of check failed.
This probe measures each, so that the tests' bounds (or the kernels) can be fixed from data:

  swiglu   swiglu_quant's "group" / "persistent" / "rows" strategies against the reference (on
           the GPU, same expf) for intermediate widths I in WIDTHS, M in (4, 40), and the
           persistent kernel at several warps / row blocks: bytes of codes and scales that
           differ, and where (odd / even columns, which 128-group)
  fp8      fp8_block_gemm_nt against the reference at the tests' shapes: share of bf16 outputs
           that differ, largest ulp distance, and the largest |got - want| / mag, mag = the same
           GEMM on |q| and |w| (the scale of the terms summed), per config kind (GEMV, mma.sync
           16-row tiles, wgmma tiles, split-K)
  mxfp4    the routed experts (both GEMMs and the SwiGLU-quant) at widths the check scripts never
           run (H 2880 / 1056, I 160 / 224 / 96), in each byte order that takes them
  oracle   the external oracle's router (tests/test_reference_oracle.py) on this host's CPU: the
           largest |F.linear logits - the reference's float64-summed logits| and the largest
           relative difference of the renormalised weights

    OUT=./out python3 scripts/gpu_probe_native_bounds.py [--parts swiglu,fp8,oracle] [--widths 136,200]

(TRITON_PTXAS_PATH=... assembles with another ptxas, e.g. the CUDA toolkit's: Triton's knob.)

Writes $OUT/probe_native_bounds.json and prints a table per part.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

WIDTHS = (100, 136, 144, 152, 176, 192, 196, 200, 208, 216, 256, 384, 1000, 1008)
MXFP4_SHAPES = ((2880, 160), (2880, 224), (1056, 96), (4096, 512))   # (H, I)
MXFP4_TOKENS = (1, 5, 40, 300)
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a dry run under TRITON_INTERPRET=1


def _gate_up(m, i, seed):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(m, i, generator=g) * 4.0)
    up = torch.randn(m, i, generator=g) * 4.0
    return torch.cat([gate, up], 1).bfloat16()


def _diff(a, b):
    a8, b8 = a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()
    bad = (a8 != b8)
    if a8.dim() == 2 and bad.any():
        cols = bad.nonzero()[:, 1]
        return dict(n=int(bad.sum()), of=a8.numel(), odd=int((cols % 2 == 1).sum()), even=int((cols % 2 == 0).sum()),
                    groups=sorted(set((cols // 128).tolist())), first=[int(v) for v in bad.nonzero()[0]],
                    got=int(a8[bad][0]), want=int(b8[bad][0]))
    return dict(n=int(bad.sum()), of=a8.numel())


def part_swiglu(rows_out, widths=WIDTHS):
    from dsv4_moe import reference as ref
    from dsv4_moe.kernels import _swiglu_quant as body
    from dsv4_moe.kernels import swiglu_quant as wrapper
    from dsv4_moe.kernels.swiglu_quant import swiglu_quant
    # the kernel itself at every width: the wrapper's guard (PERSISTENT_I_MULTIPLE, session 35)
    # would refuse the persistent grid at the widths it went wrong at
    wrapper.PERSISTENT_I_MULTIPLE = 1
    print("== swiglu: bytes differing from the reference (codes / scales); ptxas:",
          os.environ.get("TRITON_PTXAS_PATH", "Triton's bundled"))
    print(f"{'I':>5} {'M':>3} {'strategy':<18} {'codes':>14} {'scales':>8}  where")
    base = (body.PERSISTENT_NUM_WARPS, body.PERSISTENT_BLOCK_M)
    for i in widths:
        for m in (4, 40):
            x = _gate_up(m, i, seed=m * 7 + i).cuda()
            rq, rs = ref.swiglu_quant(x, 10.0)
            variants = [("group", None), ("rows", None), ("persistent", base)]
            variants += [("persistent", (w, bm)) for w, bm in ((1, 16), (2, 16), (8, 16), (4, 4), (1, 1), (4, 32))]
            for strat, cfg in variants:
                if cfg is not None:
                    body.PERSISTENT_NUM_WARPS, body.PERSISTENT_BLOCK_M = cfg
                kw = dict(rows=torch.arange(m, dtype=torch.int32, device="cuda")) if strat == "rows" else {}
                try:
                    q, s = swiglu_quant(x, strategy=strat, **kw)
                    torch.cuda.synchronize()
                    dq, ds = _diff(q, rq), _diff(s, rs)
                    err = None
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    dq, ds, err = {}, {}, f"{type(e).__name__}: {e}"[:200]
                finally:
                    body.PERSISTENT_NUM_WARPS, body.PERSISTENT_BLOCK_M = base
                name = strat + (f" w{cfg[0]} bm{cfg[1]}" if cfg else "")
                where = err or (f"odd {dq['odd']} even {dq['even']} groups {dq['groups']} first {dq['first']} "
                                f"got {dq['got']:#04x} want {dq['want']:#04x}" if dq.get("n") else "")
                print(f"{i:>5} {m:>3} {name:<18} {dq.get('n', -1):>6}/{dq.get('of', 0):<7} "
                      f"{ds.get('n', -1):>8}  {where}")
                rows_out.append(dict(part="swiglu", I=i, M=m, strategy=name, codes=dq, scales=ds, error=err))


def _abs_e4m3(t):
    return (t.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def part_fp8(rows_out):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from dsv4_moe import reference as ref
    from dsv4_moe.kernels.fp8_block_gemm import choose_config, fp8_block_gemm_nt
    from test_kernels_fp8_gemm import bf16_ulp_diff, make_case
    print("== fp8_block_gemm_nt on the GPU against the reference")
    print(f"{'M':>5} {'N':>5} {'K':>5} {'split':>5} {'kind':<10} {'differ':>8} {'max ulp':>8} {'max |d|/mag':>12}")
    cases = [(1, 128, 128, None), (3, 256, 384, None), (17, 384, 256, None), (5, 200, 300, None),
             (33, 768, 384, None), (1, 128, 1024, 8), (3, 256, 1024, 3), (17, 384, 640, 100), (2, 768, 384, 3),
             (64, 768, 7168, None), (128, 4096, 2048, None), (1024, 768, 7168, None), (4096, 4096, 2048, None)]
    for m, n, k, split in cases:
        q, sa, w, sw = make_case(m, n, k, seed=(m * 7 + k) if split else (m + n + k))
        want = ref.fp8_gemm(q, sa, w, sw)
        mag = ref.fp8_gemm(_abs_e4m3(q), sa, _abs_e4m3(w), sw).float()
        cfg = choose_config(m, n, k)
        got = fp8_block_gemm_nt(q.cuda(), sa.cuda(), w.cuda(), sw.cuda(), config=cfg, split_k=split).cpu()
        ulp = bf16_ulp_diff(got, want)
        d = (got.float() - want.float()).abs() / mag.clamp_min(1e-30)
        kind = "gemv" if cfg.get("GEMV") else "mma16" if cfg["BLOCK_M"] == 16 else "wgmma"
        r = dict(part="fp8", M=m, N=n, K=k, split=split, kind=kind, differ=float((ulp > 0).float().mean()),
                 max_ulp=int(ulp.max()), max_rel_mag=float(d.max()))
        rows_out.append(r)
        print(f"{m:>5} {n:>5} {k:>5} {str(split):>5} {kind:<10} {r['differ']:>8.4f} {r['max_ulp']:>8} "
              f"{r['max_rel_mag']:>12.3e}")


def part_oracle(rows_out):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import test_reference_oracle as T
    from dsv4_moe import reference as R
    print("== the external oracle's router on this CPU")
    for layer_idx in (0, 1):
        w = T.random_layer_weights(T.CFG, layer_idx=layer_idx, seed=7 + layer_idx)
        block, _ = T._hf_block(T.CFG, w, layer_idx)
        g = torch.Generator().manual_seed(layer_idx)
        t = 40
        x = torch.randn(t, T.CFG.hidden_size, generator=g) * 40.0
        ids = torch.randint(0, T.CFG.vocab_size, (t,), generator=g)
        with torch.no_grad():
            _, hf_w, hf_ids = (block.gate(x.view(1, t, -1), ids.view(1, t)) if block.is_hash
                               else block.gate(x.view(1, t, -1)))
            our_w, _ = R.route(x, w.router.weight.float(), w.router.bias, w.router.tid2eid, ids,
                               T.CFG.num_experts_per_tok, T.CFG.routed_scaling_factor)
            hl = torch.nn.functional.linear(x, w.router.weight.float())
            rl = (x.double() @ w.router.weight.double().T).float()
        _, order = torch.sort(hf_ids.view(t, -1), dim=-1)
        hw = hf_w.view(t, -1).gather(1, order)
        rel = ((hw - our_w).abs() / our_w.abs())
        dl = (hl - rl).abs().amax(1)
        r = dict(part="oracle", layer=layer_idx, max_rel_w=float(rel.max()), max_dlogit=float(dl.max()),
                 worst_ratio=float((rel.amax(1) / (1e-5 + dl)).max()), torch=torch.__version__,
                 threads=torch.get_num_threads())
        rows_out.append(r)
        print(r)


def part_mxfp4(rows_out):
    """The routed experts (routed_experts_forward: gate_up GEMM, SwiGLU-quant, down GEMM) at widths
    no check script runs - H 2880 / 1056 and I 160 / 224 / 96, besides the V4-like 4096 x 512 - in
    each byte order that takes them, T = 1, 5, 40, 300 (decode swap bodies, split-K, 32/64-row
    blocks, tiles), against the reference on the CPU under the layer's tolerance recipe."""
    from dsv4_moe import reference as ref
    from dsv4_moe.kernels.routed_experts import routed_experts_forward
    from dsv4_moe.testing import assert_bf16_close, bf16_diff_stats
    from dsv4_moe.weights.tensors import RoutedExpertWeights
    print("== routed experts at unusual widths against the reference; ptxas:",
          os.environ.get("TRITON_PTXAS_PATH", "Triton's bundled"))
    e, k = 8, 6
    for h, i in MXFP4_SHAPES:
        g = torch.Generator().manual_seed(h + i)
        gu = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g)
        gus = torch.randint(118, 125, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
        dn = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g)
        dns = torch.randint(118, 125, (e, h, i // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
        base = RoutedExpertWeights(gu, gus, dn, dns, first_expert=1, num_experts=e + 2)
        for layout in ("nk", "mma64", "mma64e"):
            try:
                routed = base.with_layout(layout)
                routed_dev = RoutedExpertWeights(routed.gate_up.to(DEV), routed.gate_up_scale.to(DEV),
                                                 routed.down.to(DEV), routed.down_scale.to(DEV), routed.first_expert,
                                                 routed.num_experts, routed.layout)
            except Exception as ex:  # noqa: BLE001 - a layout that does not take these widths
                print(f"{h:>5} {i:>4} {layout:<7} n/a ({type(ex).__name__}: {str(ex)[:100]})")
                continue
            for t in MXFP4_TOKENS:
                x = torch.randn(t, h, generator=g).bfloat16() * 4
                q, sa = ref.act_quant(x)
                ids = torch.stack([torch.randperm(e + 2, generator=g)[:k] for _ in range(t)]).sort(1).values
                tw = torch.rand(t, k, generator=g)
                local = ref.local_mask(ids, 1, e)
                r = dict(part="mxfp4", H=h, I=i, layout=layout, T=t)
                try:
                    y = routed_experts_forward(q.to(DEV), sa.to(DEV), tw.to(DEV), ids.to(DEV), routed_dev, 10.0).cpu()
                    yr = ref.routed_forward(q, sa, tw, ids, base, 10.0)
                    r.update(bf16_diff_stats(y[local], yr[local]))
                    try:
                        assert_bf16_close(y[local], yr[local], "layer", "routed", t=t)
                        r["ok"] = True
                    except AssertionError as ex:
                        r["ok"], r["why"] = False, str(ex)[:200]
                except Exception as ex:  # noqa: BLE001 - reported
                    r["ok"], r["why"] = False, f"{type(ex).__name__}: {str(ex)[:200]}"
                rows_out.append(r)
                print(f"{h:>5} {i:>4} {layout:<7} T={t:<4} ok={r['ok']} mismatch={r.get('mismatch_frac', -1):.4f} "
                      f"max_ulp={r.get('max_ulp', -1)} rel_l2={r.get('rel_l2', -1):.2e} {r.get('why', '')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="swiglu,fp8,oracle")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="swiglu: the intermediate widths I")
    args = ap.parse_args()
    rows = []
    widths = tuple(int(v) for v in args.widths.split(","))
    for p in args.parts.split(","):
        if p == "swiglu":
            part_swiglu(rows, widths)
        else:
            {"fp8": part_fp8, "oracle": part_oracle, "mxfp4": part_mxfp4}[p](rows)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "probe_native_bounds.json"), "w") as f:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        json.dump(dict(device=device, commit=os.environ.get("DSV4_MOE_GIT_COMMIT"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
