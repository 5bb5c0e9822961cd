"""This package's side of the benchmark: whole-layer paths and per-stage callables
(dsv4_moe.layers + dsv4_moe.dispatch + the stage adapters in dsv4_moe.stages).

    layer paths   "default"    DeepseekV4MoE.forward as dispatch chooses (best available)
                  "unfused"    force_paths(swiglu_quant="unfused", finalize="unfused")
                  "reference"  force_paths(every stage="reference")
                  "no_pdl"     "default" with programmatic dependent launch off (dispatch.PDL_MODE="off")
                  "pdl_early"  "default" with PDL successors released early (PDL_MODE="early")
                  "pdl_exit"   "default" with PDL successors released at CTA exit (PDL_MODE="exit")
                               (the last three opt-in: --paths default,no_pdl,pdl_early,pdl_exit)
    stages        router       dispatch "router" path on x
                  act_quant    dispatch "act_quant" path on x
                  shared       DeepseekV4MLP.forward(x) (the layer's shared_experts module type: its own
                               act_quant + 2 FP8 GEMMs + SwiGLU-quant)
                  routed       act_quant + "routed_experts" + "finalize" with a zero shared output:
                               the same work the routed peers do (GEMMs, SwiGLU, weighted combine)
                  finalize     "finalize" on precomputed expert rows and shared output

The layer modules are imported lazily, so a missing or broken piece becomes a skipped
row carrying the import error, not a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable, Optional

import torch

from dsv4_moe import reference as R
from dsv4_moe import stages
from dsv4_moe.weights.formats import dequant_fp8_block, dequant_mxfp4

__all__ = ["LAYER_PATHS", "DEFAULT_LAYER_PATHS", "STAGES", "path_forces", "force_context", "build_layer", "build_shared", "select_stage",
           "make_context", "single_rank_view", "plan_label", "StageSet", "stage_callables", "stage_reference",
           "fill_stage_inputs", "subset", "exact_output"]

LAYER_PATHS = ("default", "unfused", "reference", "no_pdl", "pdl_early", "pdl_exit", "front_fused", "front_separate")
DEFAULT_LAYER_PATHS = ("default", "unfused", "reference")
_PDL_PATHS = {"no_pdl": "off", "pdl_early": "early", "pdl_exit": "exit"}  # path -> dispatch.PDL_MODE
STAGES = ("router", "act_quant", "shared", "routed", "finalize")
_ALL_STAGES = ("router", "act_quant", "fp8_gemm", "swiglu_quant", "routed_experts", "finalize")


def path_forces(path: str) -> dict:
    if path == "default" or path in _PDL_PATHS:
        return {}
    if path == "unfused":
        return {"swiglu_quant": "unfused", "finalize": "unfused"}
    if path in ("front_fused", "front_separate"):  # the decode front in one launch, or not (A/B)
        return {"front": path.split("_")[1]}
    if path == "reference":
        return {s: "reference" for s in _ALL_STAGES}
    raise ValueError(f"path={path!r}: expected one of {LAYER_PATHS}")


def force_context(path: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of `dsv4_moe.force_paths(**path_forces(path))` contexts (nullcontext for default)."""
    forces = path_forces(path)
    if path in _PDL_PATHS:
        return lambda: _pdl_mode(_PDL_PATHS[path])
    if not forces:
        return contextlib.nullcontext
    force_paths = _force_paths_fn()
    return lambda: force_paths(**forces)


@contextlib.contextmanager
def _pdl_mode(mode: str):
    d = importlib.import_module("dsv4_moe.dispatch")
    saved, d.PDL_MODE = d.PDL_MODE, mode
    try:
        yield
    finally:
        d.PDL_MODE = saved


def _force_paths_fn():
    import dsv4_moe

    fp = getattr(dsv4_moe, "force_paths", None)
    if fp is None:
        fp = importlib.import_module("dsv4_moe.dispatch").force_paths
    return fp


def single_rank_view(config, weights):
    """(config, weights) describing one rank's work as a standalone layer.

    One GPU runs one rank: the TP/EP all-reduce is left out (it would need a process
    group). With TP the rank's layer is the same computation as a layer of intermediate
    I/tp (the shared partial is added before the all-reduce, SPEC §4.5); with EP the
    local expert range is kept (DeepseekV4MoE itself needs ep_size > 1 and a process group
    for that, so the sweep runs EP ranks' stages and skips the whole-layer rows).
    """
    inter = weights.shared.intermediate
    cfg = config if inter == config.moe_intermediate_size else config.replace(moe_intermediate_size=inter)
    w = dataclasses.replace(weights, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1)
    return cfg, w


def build_layer(config, weights, routed_layout: str = "auto", overlap_shared="auto"):
    """DeepseekV4MoE(config, weights, routed_layout=..., overlap_shared=...); raises
    ImportError while dsv4_moe.layers is absent."""
    layers = importlib.import_module("dsv4_moe.layers")
    return layers.DeepseekV4MoE(config, weights, routed_layout=routed_layout, overlap_shared=overlap_shared)


def build_shared(config, weights):
    """DeepseekV4MLP(config, weights.shared): the shared expert module on its own."""
    return importlib.import_module("dsv4_moe.layers").DeepseekV4MLP(config, weights.shared)


def make_context(layer, weights, config, num_tokens: int, device: str):
    """The DispatchContext the layer itself would use at num_tokens (layer.context), or one
    built from the weights when the layer is unavailable."""
    if layer is not None:
        return layer.context(num_tokens)
    d = importlib.import_module("dsv4_moe.dispatch")
    r = weights.routed
    return d.DispatchContext(device=torch.device(device), num_tokens=num_tokens, hidden=r.hidden,
                             intermediate=r.intermediate, num_experts=config.n_routed_experts,
                             num_local_experts=r.num_local, top_k=config.num_experts_per_tok,
                             tp_size=weights.tp_size, ep_size=weights.ep_size, is_hash=weights.router.is_hash)


def plan_label(layer, num_tokens: int, context_factory) -> str:
    """'router=triton act_quant=triton ...': the path dispatch picks per stage under the context
    (empty when dispatch cannot say)."""
    try:
        d = importlib.import_module("dsv4_moe.dispatch")
        with context_factory():
            return " ".join(f"{p.stage}={p.chosen.name}" for p in d.plan(layer.context(num_tokens)))
    except Exception as e:  # noqa: BLE001 - the row itself will report the failure
        return f"(plan unavailable: {type(e).__name__}: {str(e)[:120]})"


def select_stage(stage: str, ctx) -> tuple[str, Callable]:
    """(path name, implementation) that dispatch picks for `stage` under `ctx`."""
    d = importlib.import_module("dsv4_moe.dispatch")
    p = d.select(stage, ctx)
    return p.name, p.impl


@dataclasses.dataclass
class StageSet:
    """Inputs of one rotated set for the stage callables (made once, outside timing)."""

    x: torch.Tensor
    input_ids: Optional[torch.Tensor]
    topk_w: torch.Tensor
    topk_ids: torch.Tensor
    q: torch.Tensor = None
    sa: torch.Tensor = None
    y: torch.Tensor = None
    shared_out: torch.Tensor = None
    zeros: torch.Tensor = None


def stage_callables(stage: str, shared_mlp, weights, config, ctx, s: StageSet) -> tuple[str, Callable]:
    """(label, zero-arg callable) computing `stage` on one input set, via dispatch
    (the "shared" stage runs the DeepseekV4MLP module `shared_mlp`)."""
    limit = config.swiglu_limit
    r = weights.routed
    if stage == "router":
        name, impl = select_stage("router", ctx)
        rw = weights.router
        return name, lambda: impl(s.x, rw, s.input_ids, config.num_experts_per_tok, config.routed_scaling_factor)
    if stage == "act_quant":
        name, impl = select_stage("act_quant", ctx)
        return name, lambda: impl(s.x)
    if stage == "shared":
        return "DeepseekV4MLP.forward", lambda: shared_mlp.forward(s.x)
    if stage == "routed":
        n_aq, aq = select_stage("act_quant", ctx)
        n_re, re_ = select_stage("routed_experts", ctx)
        n_sw, _ = select_stage("swiglu_quant", ctx)  # routed_experts takes the SwiGLU-quant path by name
        n_fi, fi = select_stage("finalize", ctx)

        # as the layer: act_quant writes the bf16 pairs when the routed gate_up takes them
        pairs = n_re == "triton" and stages.routed_wants_pairs(s.topk_ids.numel(), r)

        def routed():
            q, sa, *qp = aq(s.x, pairs=pairs)
            y = re_(q, sa, s.topk_w, s.topk_ids, r, limit, n_sw, q_pairs=qp[0] if qp else None)
            return fi(y, s.topk_ids, s.zeros, r.first_expert, r.num_local)

        return f"act_quant={n_aq} routed_experts={n_re}(swiglu={n_sw}) finalize={n_fi}", routed
    if stage == "finalize":
        name, impl = select_stage("finalize", ctx)
        return name, lambda: impl(s.y, s.topk_ids, s.shared_out, r.first_expert, r.num_local)
    raise ValueError(f"stage={stage!r}: expected one of {STAGES}")


def stage_reference(stage: str, weights, config, s: StageSet):
    """The reference output a stage callable is checked against (same inputs)."""
    limit = config.swiglu_limit
    r = weights.routed
    if stage == "router":
        rw = weights.router
        return R.route(s.x, rw.weight, rw.bias, rw.tid2eid, s.input_ids, config.num_experts_per_tok,
                       config.routed_scaling_factor)
    if stage == "act_quant":
        return R.act_quant(s.x)
    if stage == "shared":
        return R.shared_forward(s.x, weights.shared, limit)
    if stage == "routed":
        q, sa = R.act_quant(s.x)
        y = R.routed_forward(q, sa, s.topk_w, s.topk_ids, r, limit)
        return R.finalize(y, s.topk_ids, r.first_expert, r.num_local).to(torch.bfloat16)
    if stage == "finalize":
        acc = R.finalize(s.y, s.topk_ids, r.first_expert, r.num_local)
        return (acc + s.shared_out.float()).to(torch.bfloat16)
    raise ValueError(f"stage={stage!r}: expected one of {STAGES}")


def exact_output(scope: str, weights, config, s: StageSet) -> Optional[torch.Tensor]:
    """fp32 output of the routed or shared part with quantisation switched off (dequantised
    weights, unquantised activations; only the experts the set hits are dequantised), or None
    for other scopes. Rows report the reference's own distance to it: the noise floor the
    peers' differing numerics are judged against."""
    limit = config.swiglu_limit
    x = s.x.float()

    def expert(xs, gu, dn, rw=None):
        i = gu.shape[0] // 2
        h = xs @ gu.T
        a = torch.nn.functional.silu(h[:, :i].clamp(max=limit)) * h[:, i:].clamp(-limit, limit)
        return (a if rw is None else a * rw[:, None]) @ dn.T

    if scope == "shared":
        sh = weights.shared
        return expert(x, dequant_fp8_block(sh.gate_up, sh.gate_up_scale), dequant_fp8_block(sh.down, sh.down_scale))
    if scope == "routed":
        r = weights.routed.with_layout("nk")  # values are read: the checkpoint byte order
        out = torch.zeros_like(x)
        for e in torch.unique(s.topk_ids).tolist():
            if not r.first_expert <= e < r.first_expert + r.num_local:
                continue
            tok, slot = torch.nonzero(s.topk_ids == e, as_tuple=True)
            el = e - r.first_expert
            out.index_add_(0, tok, expert(x[tok], dequant_mxfp4(r.gate_up[el], r.gate_up_scale[el]),
                                          dequant_mxfp4(r.down[el], r.down_scale[el]), s.topk_w[tok, slot].float()))
        return out
    return None


def fill_stage_inputs(s: StageSet, weights, generator: torch.Generator) -> None:
    """Inputs of the finalize stage: random expert rows y [T, k, H] bf16 (non-local slots 0, as
    routed_experts leaves them) and a random shared output [T, H] bf16; finalize only sums, so
    random rows measure it as well as real ones and cost no reference GEMMs at T = 8192."""
    r = weights.routed
    t, k = s.topk_ids.shape
    h = s.x.shape[1]
    y = torch.randn(t, k, h, device=s.x.device, generator=generator).to(torch.bfloat16)
    local = R.local_mask(s.topk_ids, r.first_expert, r.num_local)
    s.y = torch.where(local[..., None], y, torch.zeros_like(y))
    s.shared_out = torch.randn(t, h, device=s.x.device, generator=generator).to(torch.bfloat16)
    s.zeros = torch.zeros_like(s.x)


def subset(s: StageSet, n: int) -> StageSet:
    """The first n tokens of an input set (tokens are independent: checks run on a subset)."""
    cut = lambda t: None if t is None else t[:n]  # noqa: E731
    return StageSet(cut(s.x), cut(s.input_ids), cut(s.topk_w), cut(s.topk_ids), cut(s.q), cut(s.sa), cut(s.y),
                    cut(s.shared_out), cut(s.zeros))
