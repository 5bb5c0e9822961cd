"""The token sweep of the layer benchmark: input sets, rows per path / stage / peer.

Rotation (what differs between consecutive timed calls):
  * x (and input_ids on hash layers) — n_sets sets; the routing follows x, so each set
    reads other routed experts' weights;
  * router + shared weights — n_w copies (the routed experts are shared between copies:
    they are GBs, and the rotated routing already reads different experts);
  * routed peers: x and routing only (their converted weights exist once);
    shared peers: x and the n_w shared copies.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from dsv4_moe import reference as R

from . import ours
from .model import LayerDims, count_routes, layer_work, routed_expert_bytes
from .peers import PEER_TOLERANCE, make_peer

__all__ = ["run", "rel_err", "auto_sets", "weight_copies"]

_L2_BYTES = 60e6  # H200 L2 (SPEC §8); rotation is sized against it
_MAX_WEIGHT_SETS = 16


def rel_err(out, ref) -> float:
    """rel-L2 of out vs ref. (weights, ids) router pairs add the fraction of differing ids;
    (q e4m3, s f32) act-quant pairs are compared dequantised."""
    if isinstance(ref, tuple):
        if ref[0].dtype == torch.float8_e4m3fn:
            def deq(qs):
                q, s = qs
                return q.float() * s.float().repeat_interleave(128, dim=1)[:, :q.shape[1]]
            return rel_err(deq(out), deq(ref))
        ids_diff = (out[1].long() != ref[1].long()).float().mean().item()
        return rel_err(out[0], ref[0]) + ids_diff
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return float("nan")
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def _cut(out, n):
    return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]


def auto_sets(t1_bytes: float, per_set_bytes: float, device: str) -> int:
    """Enough sets that they move > 4x the L2 at T = 1 (4..12); at large T one set alone
    exceeds the L2, so 2 suffice (and bound memory)."""
    if device != "cuda":
        return 2
    small = min(12, max(4, math.ceil(4 * _L2_BYTES / max(t1_bytes, 1))))
    return max(2, min(small, math.ceil(4 * _L2_BYTES / max(per_set_bytes, 1))))


def rotation(sets: list, n_copies: int, per_set_bytes: float) -> list:
    """(rotation index, input set) pairs timed in turn: every input set, and, while one set's
    activations are small against the L2, every weight copy too (index j uses set
    j % len(sets) and copy j % n_copies). NOTE (session 9): rotating only over the input sets
    used min(n_sets, copies) weight copies, so at T = 1 a stage whose weights are small (the
    Pro-TP8 shared expert, 8.3 MB) read them from L2."""
    if not sets:
        return []
    n = len(sets) if per_set_bytes >= 2 * _L2_BYTES else max(len(sets), n_copies)
    return [(j, sets[j % len(sets)]) for j in range(n)]


def weight_copies(weights, n: int) -> list:
    """n layer weights sharing the routed experts, each with its own router and shared tensors."""
    out = [weights]
    for _ in range(n - 1):
        r, s = weights.router, weights.shared
        router = type(r)(r.weight.clone(), None if r.bias is None else r.bias.clone(), r.tid2eid)
        shared = type(s)(s.gate_up.clone(), s.gate_up_scale.clone(), s.down.clone(), s.down_scale.clone())
        out.append(dataclasses.replace(weights, router=router, shared=shared))
    return out


def _make_sets(b, cfg, w, T: int, n_sets: int, with_stage_inputs: bool) -> list:
    dev = b.device
    g = torch.Generator(device=dev)
    g.manual_seed(b.args.seed * 1_000_003 + T)
    r = w.router
    out = []
    for _ in range(n_sets):
        x = torch.randn(T, w.routed.hidden, device=dev, generator=g).to(torch.bfloat16)
        ids = (torch.randint(0, r.tid2eid.shape[0], (T,), device=dev, generator=g) if r.is_hash else None)
        tw, tid = R.route(x, r.weight, r.bias, r.tid2eid, ids, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        s = ours.StageSet(x, ids, tw, tid)
        if with_stage_inputs:
            ours.fill_stage_inputs(s, w, g)
        out.append(s)
    return out


def run(b, cfg, w, w_ep_size, tokens, parts, paths, stage_list, peer_names) -> None:
    args, dev = b.args, b.device
    k = cfg.num_experts_per_tok
    rt = w.routed
    dims = LayerDims(hidden=rt.hidden, intermediate=rt.intermediate, num_experts=cfg.n_routed_experts, top_k=k,
                     first_expert=rt.first_expert, num_local=rt.num_local, hash_layer=w.router.is_hash)
    t1 = layer_work(dims, 1, unique_experts=min(k, rt.num_local), local_routes=k * rt.num_local / dims.num_experts)
    # every stage's own weights must exceed 2x the L2 over the copies: size by the smaller
    # of the two (the shared stage reads only the shared expert, the router only its matrix)
    small_w = max(1, min(t1["shared"].bytes, t1["router"].bytes))
    # NOTE (session 9): the cap was 4 and the copies were sized by router + shared bytes
    # together, which left Pro-TP8's shared expert (8.3 MB a copy) inside the 60 MB L2: its
    # shared stage timed L2-warm (12.7 us at T = 1 in session 7, 20.7 us with the weights
    # rotated over 120 MB). Now up to 16 copies, sized by the smaller of the two.
    nw = args.weight_sets or (min(_MAX_WEIGHT_SETS, max(1, math.ceil(2 * _L2_BYTES / small_w))) if dev == "cuda"
                              else 1)
    # this package's layers and stages get the routed byte order the layer picks on this
    # device ("mma64" on CUDA, converted once here, not per layer); peers keep `w` ("nk")
    from dsv4_moe.layers import choose_routed_layout  # noqa: PLC0415

    layout, why = choose_routed_layout(w.routed, getattr(args, "routed_layout", "auto"))
    w_ours = dataclasses.replace(w, routed=w.routed.with_layout(layout))
    b.notes.append(f"routed weights of this package in layout {layout!r} ({why}); peers read the checkpoint's")
    wcopies = weight_copies(w_ours, nw)
    b.notes.append(
        f"rotated per call: x{' + input_ids' if w.router.is_hash else ''} over n_sets input sets (per row in the "
        f"JSON; routing follows the set, so routed-expert reads rotate); {nw} copies of router + shared weights "
        f"(one layer object each; while a set is small against the L2 the calls rotate over max(n_sets, copies), "
        f"'rotations' in the JSON); routed expert weights (one expert = "
        f"{routed_expert_bytes(rt.hidden, rt.intermediate) / 1e6:.1f} MB) are not copied")
    b.notes.append("routing of every set: dsv4_moe.reference.route on that set's x "
                   + ("(hash layer: tid2eid[input_ids])" if w.router.is_hash else "(real router, random x)"))

    layers, layer_err = None, None
    mlps, mlp_err = None, None
    if "stages" in parts and "shared" in stage_list:
        try:  # the shared expert module on its own (also for EP ranks, where the layer is skipped)
            mlps = [ours.build_shared(cfg, wc) for wc in wcopies]
        except Exception as e:  # noqa: BLE001
            mlp_err = f"DeepseekV4MLP unavailable: {type(e).__name__}: {str(e)[:200]}"
    if "layer" in parts or "stages" in parts:
        if w_ep_size > 1:
            layer_err = (f"EP rank (ep_size={w_ep_size}): DeepseekV4MoE all-reduces its partial sums over a "
                         f"process group, which this single-GPU bench does not create; stages still run")
        else:
            try:
                ov = {"auto": "auto", "on": True, "off": False}[getattr(args, "overlap_shared", "auto")]
                layers = [ours.build_layer(cfg, wc, layout, ov) for wc in wcopies]
                if ov != "auto":
                    b.notes.append(f"layers built with overlap_shared={ov} (--overlap-shared "
                                   f"{args.overlap_shared}): the shared expert "
                                   f"{'on its side stream' if ov else 'in line'} at every T")
            except Exception as e:  # noqa: BLE001 - reported on every row that needs the layer
                layer_err = f"DeepseekV4MoE unavailable: {type(e).__name__}: {str(e)[:200]}"

    peers = []
    if "peers" in parts:
        for name in peer_names:
            p = make_peer(name)
            base = dict(case=f"peer {name}", kind="peer", scope=p.scope, T=None, label=p.label)
            why = p.unavailable(dev, w)
            if why:
                b.add(dict(base, status="skipped", reason=why))
                continue
            if b.left() < 30:
                b.add(dict(base, status="skipped", reason="time budget (peer preparation)"))
                continue
            t0 = time.time()
            try:
                p.prepare(cfg, w, [wc.shared for wc in wcopies], dev)
            except Exception as e:  # noqa: BLE001
                b.add(dict(base, status="error", reason=f"prepare: {type(e).__name__}: {str(e)[:300]}"))
                continue
            b.notes.append(f"peer {name}: {p.label}; prepared in {time.time() - t0:.1f}s")
            peers.append(p)
        if any(p.scope == "routed" for p in peers):
            b.notes.append("routed peers: their sort / block-align of the routing is precomputed outside the timed "
                           "region (as in shared/peers); 'stage routed' of this package includes its own")

    for T in tokens:
        per_set = T * rt.hidden * 2 * (2 + k)
        n_sets = args.sets or auto_sets(t1["layer"].bytes, per_set, dev)
        if b.left() < 5:
            sets = []
        else:
            sets = _make_sets(b, cfg, w, T, n_sets, "stages" in parts)
        counts = [count_routes(s.topk_ids, dims.first_expert, dims.num_local) for s in sets]
        ue = sum(c[0] for c in counts) / max(len(counts), 1)
        lr = sum(c[1] for c in counts) / max(len(counts), 1)
        works = layer_work(dims, T, unique_experts=ue, local_routes=lr)
        layer_floor = works["layer"].floor_us(b.hw.copy_bytes_per_s, b.hw.mm_flops_per_s)
        n = min(T, args.check_rows)
        refs = {}

        def ref(scope):
            if scope not in refs:
                sub = ours.subset(sets[0], n)
                if scope == "layer":
                    refs[scope] = R.moe_forward(sub.x, sub.input_ids, wcopies[0], cfg)
                else:
                    refs[scope] = ours.stage_reference(scope, wcopies[0], cfg, sub)
            return refs[scope]

        noise = {}

        def ref_noise(scope):
            """rel-L2 of the reference vs the unquantised output (None outside routed/shared)."""
            if scope not in noise:
                ex = ours.exact_output(scope, wcopies[0], cfg, ours.subset(sets[0], n))
                noise[scope] = None if ex is None else rel_err(ref(scope), ex)
            return noise[scope]

        rot = rotation(sets, len(wcopies), per_set)
        common = dict(T=T, n_sets=n_sets, rotations=len(rot), unique_experts=ue, local_routes=lr,
                      layer_floor_us=layer_floor)
        first = len(b.rows)
        if "layer" in parts:
            for path in paths:
                _layer_row(b, cfg, layers, layer_err, rot, path, common, works["layer"], ref, n)
        if "stages" in parts:
            ctx, ctx_err = None, None
            try:
                ctx = ours.make_context(layers[0] if layers else None, wcopies[0], cfg, T, dev)
            except Exception as e:  # noqa: BLE001
                ctx_err = f"dsv4_moe.dispatch unavailable: {type(e).__name__}: {str(e)[:200]}"
            for st in stage_list:
                _stage_row(b, cfg, mlps, mlp_err, ctx, ctx_err, wcopies, rot, st, common, works[st], ref, n)
        for p in peers:
            base = dict(common, case=f"peer {p.name}", kind="peer", scope=p.scope, peer=p.name, label=p.label)
            row = b.case(base, lambda p=p: [p.bind(s, j) for j, s in rot],
                         lambda out, p=p: rel_err(_cut(out, n), ref(p.scope)), work=works[p.scope],
                         tol=PEER_TOLERANCE[p.name])
            if row.get("rel_err") is not None:
                row["ref_rel_err_vs_unquantised"] = ref_noise(p.scope)
        _peer_sum_row(b, b.rows[first:], common, works["layer"])
        del sets, rot, refs, noise
        if dev == "cuda":
            torch.cuda.empty_cache()
    for p in peers:
        p.release()


def _layer_row(b, cfg, layers, layer_err, rot, path, common, work, ref, n):
    base = dict(common, case=f"layer {path}", kind="path", scope="layer", path=path)
    if b.device != "cuda" and path != "reference":
        b.add(dict(base, status="skipped",
                   reason="CPU run: only the reference path is timed on CPU (the others need --device cuda)"))
        return
    if b.device == "cuda" and path == "reference" and common["T"] > b.args.ref_max_tokens:
        b.add(dict(base, status="skipped", reason=f"reference path (fp64 loops) is timed on CUDA only for "
                                                  f"T <= {b.args.ref_max_tokens} (--ref-max-tokens)"))
        return
    if layers is None:
        b.add(dict(base, status="skipped", reason=layer_err))
        return
    try:
        ctx = ours.force_context(path)
    except Exception as e:  # noqa: BLE001
        b.add(dict(base, status="skipped", reason=f"force_paths unavailable: {type(e).__name__}: {e}"))
        return
    nw = len(layers)
    slow = b.device == "cuda" and path == "reference"
    plan = ours.plan_label(layers[0], common["T"], ctx)
    base["label"] = plan
    key = f"plan {path}"
    if plan and b.last_plan.get(key) != plan:
        b.last_plan[key] = plan
        b.notes.append(f"layer {path} from T={common['T']}: {plan}")
    b.case(base,
           lambda: [(lambda L=layers[j % nw], s=s: L.forward(s.x, s.input_ids)) for j, s in rot],
           lambda out: rel_err(out[:n], ref("layer")), work=work, context=ctx,
           # NOTE: the reference path loops over experts with host syncs: eager, few calls.
           graphs=not slow, reps=3 if slow else None, max_sets=2 if slow else None, max_inner=2 if slow else 200)


def _stage_row(b, cfg, mlps, mlp_err, ctx, ctx_err, wcopies, rot, st, common, work, ref, n):
    base = dict(common, case=f"stage {st}", kind="stage", scope=st, stage=st)
    if st == "shared" and mlps is None:
        b.add(dict(base, status="skipped", reason=mlp_err))
        return
    if st != "shared" and ctx is None:
        b.add(dict(base, status="skipped", reason=ctx_err))
        return
    nw = len(wcopies)
    labels = []

    def make():
        fns = []
        for j, s in rot:
            label, fn = ours.stage_callables(st, mlps[j % nw] if mlps else None, wcopies[j % nw], cfg, ctx, s)
            labels.append(label)
            fns.append(fn)
        return fns

    row = b.case(base, make, lambda out: rel_err(_cut(out, n), ref(st)), work=work)
    if labels:
        row["label"] = labels[0]


def _peer_sum_row(b, rows, common, work):
    """Best peer per part summed: what a user assembling the layer from peers would get
    (router + routed + shared; the final shared add is not counted)."""
    best = {}
    for r in rows:
        if r.get("kind") == "peer" and r.get("status") == "ok":
            if r["scope"] not in best or r["us"] < best[r["scope"]]["us"]:
                best[r["scope"]] = r
    if not all(sc in best for sc in ("router", "routed", "shared")):
        return
    us = sum(best[sc]["us"] for sc in ("router", "routed", "shared"))
    row = dict(common, case="peers best sum", kind="sum", scope="layer", status="ok", us=us, mode="sum of rows",
               label=" + ".join(best[sc]["case"] for sc in ("router", "routed", "shared")))
    row.update(b.derived(us, work))
    b.add(row)
