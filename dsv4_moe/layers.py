"""The modules users import: DeepseekV4MoE (router + routed experts + shared expert + combine),
DeepseekV4MLP (the shared expert, defined in dsv4_moe/mlp.py and re-exported here), and
`load_moe_layer`.

Layers hold the checkpoint's native tensors (FP8 shared expert, MXFP4 routed experts,
see weights/tensors.py) as non-persistent buffers, so `.to(device)` moves them and
nothing is dequantised. Each forward asks dispatch for one path per stage; the plan
for a token count is `layer.explain(num_tokens)`.

Data flow of DeepseekV4MoE.forward (x [T, H] bf16):

    router          -> topk_weights f32 [T, k], topk_ids [T, k] (ascending per token)
    act_quant(x)    -> q e4m3 [T, H], sa f32 [T, H/128]       (once, shared by all GEMMs)
    shared expert   -> [T, H] bf16   (FP8 gate_up GEMM -> swiglu_quant -> FP8 down GEMM)
    routed experts  -> y [T, k, H] bf16 (MXFP4 W4A8 grouped GEMMs, route weight before w2)
    finalize        -> bf16(sum_k y (fp32, ascending id) [+ all_reduce] + shared)
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch, stages
from ._checks import capturing, check_hidden, check_router, check_types
from .config import MoEConfig
from .dispatch import DispatchContext
from .mlp import DeepseekV4MLP, _NativeBuffers
from .weights.tensors import MoELayerWeights, RoutedExpertWeights, RouterWeights

__all__ = ["DeepseekV4MLP", "DeepseekV4MoE", "load_moe_layer", "choose_routed_layout"]


# CUDA priority of the shared expert's side stream (0: the default, as the main stream's;
# negative: higher). A module constant so scripts/gpu_profile_layer.py --ab can compare.
# NOTE: H200, session 13 (docs/bench/2026-11-29/session13/profile_layer_priority_8290931.txt,
# overlap forced, graphs, us, priority 0 / -1 / -5): Flash T=16 459.0 / 460.1 / 460.7, T=64
# 1088.4 / 1090.3 / 1087.2, T=256 1507.1 / 1516.1 / 1515.0 (in line: 1391.0); Pro-TP8 T=256
# 767.9 / 823.1 / 823.7. A higher priority does not remove the Flash slowdown and costs
# Pro-TP8 7 %, so 0 stays.
# NOTE (session 28, H200, gpu_profile_layer.py --ab, 12 forwards per graph, 3 captures, us,
# docs/bench/2026-11-30/session28/profile_layer_rprio_1e7bea6.txt): the other way round - the
# routed chain on a layer-owned stream of priority 0 (the caller's) / -1 / -5 beside this one -
# gained nothing: Pro-TP8 T=1 32.7 / 33.3 / 33.3, T=2 46.0 / 46.8 / 46.8, T=16 151.3 / 152.1 /
# 151.9; Flash T=1 56.0 / 56.8 / 56.8, T=16 337.8 / 339.1 / 341.7 (T=4, 8 level). Removed.
# NOTE (session 40, H200, docs/bench/2026-12-01/session40/, commit e6fecd4's SHARED_TAIL_PRIORITY,
# since removed): the shared SwiGLU-quant and down GEMM on a second stream of priority -5 after the
# shared gate_up. The timelines had shown them waiting for the routed down's last wave at Pro-TP8
# T = 64 / 128 (the SwiGLU launch starting 101 / 142 us after the gate_up ended). With the priority
# they ran right away, but the routed down stretched by as much: layer bench (graph-chain, us,
# default / priority -5): T=32 263.0 / 264.3, T=64 363.2 / 393.8, T=96 457.8 / 489.1, T=128 508.7 /
# 541.4, T=256 605.5 / 631.2; Flash T=64 823.1 / 834.7, T=256 1143.6 / 1148.3.
SIDE_STREAM_PRIORITY = 0
# Where the shared expert's side stream forks (dispatch.shared_fork_policy says why): "auto"
# (the policy), "logits" (between the router's logits launch, which quantises x, and its top-k
# launch, on the front's quant_in_logits path; after the front on the others), "front" (right
# after the front) or "align" (after the routed alignment's launch, triton routed path, so the
# shared GEMM's CTAs do not fill the SMs while that one program runs). A/B switch (it was
# FORK_AFTER_ALIGN "on" / "off" until session 30). NOTE (session 32, H200, gpu_profile_layer.py --ab,
# 12 forwards per graph, 3 captures, us, docs/bench/2026-11-30/session32/): a fork after the routed
# gate_up GEMM's launch ("gate_up", session 31) was slower at every T tried: Flash T=1 53.5 / 55.8,
# T=2 76.1 / 86.1, T=3 104.1 / 108.1, T=4 123.3 / 125.1, T=8 205.7 / 215.6; Pro-TP8 T=1 32.3 / 34.1,
# T=2 42.7 / 44.1, T=3 59.0 / 59.1, T=4 62.6 / 67.4, T=8 91.3 / 121.3. Removed; so was (same session, same
# method, off / on) holding only the shared down GEMM until the routed gate_up's launch: Flash T=1
# 54.2 / 55.8, T=2 75.9 / 77.6, T=4 123.3 / 124.6, T=16 352.4 / 353.1; Pro-TP8 T=1 32.7 / 36.0, T=2-16
# +0.2 to +0.5; the layer bench (--graph-chain) Flash T=1 55.7 / 60.7, Pro-TP8 T=1 31.1 / 34.4. At
# Flash T = 1 the shared gate_up GEMV already spans the routed gate_up and its down the routed down
# (session 32's timeline, timeline_layer_default_52f2c51.txt).
SHARED_FORK = "auto"
# Where the shared expert's weights are prefetched into the L2 (kernels/l2_prefetch.py, on a
# stream of the layer's own that joins before the finalize): "auto" (dispatch.shared_prefetch_policy),
# "off", "start" (before the router's logits launch) or "logits" (after it, on the quant_in_logits
# front; after the front on the others). Same bits with or without it. A/B switch (session 33;
# dispatch.shared_prefetch_policy has the measurements).
SHARED_L2_PREFETCH = "auto"
# Timing probe, off by default: True skips the shared expert (no launches, no side stream, no
# prefetch; finalize adds zeros), so the layer's output is NOT the model's (the bench needs
# --check-rows 0). Layer time with it off minus with it on is what the shared expert costs inside the
# layer: the most SPEC §5.3's fused heterogeneous MoE could save on CUDA (docs/DESIGN.md, session 39).
PROBE_SKIP_SHARED = False


class DeepseekV4MoE(_NativeBuffers):
    """Router + MXFP4 routed experts + FP8 shared expert + combine (SPEC §4).

    forward(hidden_states [T, H] bf16, input_ids [T] int64 | None) -> [T, H] bf16.
    `input_ids` is required on hash layers. With tp_size or ep_size > 1 the partial
    sums are all-reduced in fp32 over `group` (torch.distributed must be initialised).

    `routed_layout` is the byte order the layer keeps the routed experts' packed codes
    in (weights/mma_layout.py): "auto" (default) takes "mma64e" on CUDA when both expert
    GEMMs have whole 64 x 128 tiles (the Hopper kernels' fast layout: "mma64" tiles with
    every 32-bit word re-encoded for a cheaper e2m1 conversion) and keeps the given layout
    otherwise; "nk" / "mma64" / "mma64e" force one ("mma64" gives the same bits as
    "mma64e", a few per cent slower: the A/B twin). A conversion makes new tensors
    (the caller's are never modified); `explain()` states the layout and why.

    `overlap_shared` ("auto" default, True, False): on CUDA the shared expert can run on a
    side stream, concurrently with the router and the routed experts (they only meet in
    finalize), joining before finalize; a CUDA graph captures the fork and join. The
    results are the same bits either way (independent kernels). True always overlaps,
    False never; "auto" asks `dispatch.shared_overlap_policy` per forward (the overlap
    fills the GPU at decode, where each kernel alone leaves most SMs idle, but slowed the
    Flash-shaped layers at 0.5-8 routed rows per expert and Pro-TP8-shaped ones at T = 3-4 on
    the H200). `explain(T)` says
    which and why.
    """

    def __init__(self, config: MoEConfig, weights: MoELayerWeights, *, group=None, routed_layout: str = "auto",
                 overlap_shared: "bool | str" = "auto"):
        super().__init__()
        if not (isinstance(overlap_shared, bool) or overlap_shared == "auto"):
            raise TypeError(f"overlap_shared={overlap_shared!r}: expected 'auto', True or False")
        self.overlap_shared = overlap_shared
        self._side_streams: dict = {}
        self._prefetch_streams: dict = {}
        self._contexts: dict = {}  # (T, device) -> DispatchContext (immutable per layer)
        check_types(config, weights, MoELayerWeights)
        if group is not None and not (torch.distributed.is_available()
                                      and isinstance(group, torch.distributed.ProcessGroup)):
            raise TypeError(f"group={group!r}: expected None (the default group) or a torch.distributed.ProcessGroup")
        config.check_parallel(tp_rank=weights.tp_rank, tp_size=weights.tp_size, ep_rank=weights.ep_rank,
                              ep_size=weights.ep_size)
        r = weights.routed
        want = (config.n_routed_experts // weights.ep_size, 2 * config.local_intermediate(weights.tp_size),
                config.hidden_size // 2)
        if tuple(r.gate_up.shape) != want:
            raise ValueError(f"routed gate_up.shape={tuple(r.gate_up.shape)}, expected {want} for this config "
                             f"and tp_size={weights.tp_size}, ep_size={weights.ep_size}")
        if tuple(weights.router.weight.shape) != (config.n_routed_experts, config.hidden_size):
            raise ValueError(f"router weight shape {tuple(weights.router.weight.shape)} != "
                             f"{(config.n_routed_experts, config.hidden_size)}")
        check_router(config, weights)
        self.config = config
        self.layer_idx = weights.layer_idx
        self.is_hash = weights.router.is_hash
        self.tp_rank, self.tp_size = weights.tp_rank, weights.tp_size
        self.ep_rank, self.ep_size = weights.ep_rank, weights.ep_size
        self.first_expert = r.first_expert
        self.num_local_experts = r.num_local
        self.group = group
        # one pass over the scale bytes at construction (not per forward): the MXFP4
        # kernel's exactness depends on their range (see stages.ROUTED_SCALE_BYTES).
        lo = min(int(t.view(torch.uint8).min()) for t in (r.gate_up_scale, r.down_scale)) if r.num_local else 127
        hi = max(int(t.view(torch.uint8).max()) for t in (r.gate_up_scale, r.down_scale)) if r.num_local else 127
        self.routed_scale_range = (lo, hi)
        self.routed_layout, self.routed_layout_reason = choose_routed_layout(r, routed_layout)
        r = r.with_layout(self.routed_layout)
        self._register("router_", weights.router)
        self._register("routed_", r)
        self.shared_experts = DeepseekV4MLP(config, weights.shared, tp_size=weights.tp_size)

    # ------------------------------------------------------------------ views
    @property
    def device(self) -> torch.device:
        return self.router_weight.device

    def _views(self) -> tuple:
        """(key, RouterWeights, RoutedExpertWeights) over the current buffers, rebuilt only
        when a buffer or the layout changed (.to(), set_routed_layout, an assignment): a
        forward reads them several times, and each rebuild cost ~20 us of host time."""
        key = (*map(id, self._buffers.values()), self.routed_layout)
        views = self.__dict__.get("_view_cache")
        if views is None or views[0] != key:
            views = (key, self._rebuild(RouterWeights, "router_"),
                     self._rebuild(RoutedExpertWeights, "routed_", first_expert=self.first_expert,
                                   num_experts=self.config.n_routed_experts, layout=self.routed_layout))
            self.__dict__["_view_cache"] = views
        return views

    @property
    def router(self) -> RouterWeights:
        return self._views()[1]

    @property
    def routed(self) -> RoutedExpertWeights:
        return self._views()[2]

    @property
    def weights(self) -> MoELayerWeights:
        return MoELayerWeights(self.router, self.shared_experts.weights, self.routed, self.layer_idx,
                               self.tp_rank, self.tp_size, self.ep_rank, self.ep_size)

    def context(self, num_tokens: int) -> DispatchContext:
        device = self.device
        key = (num_tokens, device)
        ctx = self._contexts.get(key)
        if ctx is None:
            c = self.config
            ctx = DispatchContext(device=device, num_tokens=num_tokens, hidden=c.hidden_size,
                                  intermediate=c.local_intermediate(self.tp_size), num_experts=c.n_routed_experts,
                                  num_local_experts=self.num_local_experts, top_k=c.num_experts_per_tok,
                                  tp_size=self.tp_size, ep_size=self.ep_size, is_hash=self.is_hash,
                                  routed_scale_range=self.routed_scale_range,
                                  router_dtype=self.router_weight.dtype)
            if len(self._contexts) > 4096:
                self._contexts.clear()
            self._contexts[key] = ctx
        return ctx

    # ------------------------------------------------------------------ forward
    @torch.no_grad()  # inference only: the FP8 / MXFP4 paths have no backward
    def forward(self, hidden_states: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = hidden_states
        check_hidden("hidden_states", x, self.config.hidden_size, self.device)
        if self.is_hash and input_ids is None:
            raise ValueError(f"layer {self.layer_idx} is a hash-routed layer: input_ids [T] int64 is required")
        if input_ids is not None:   # checked on every layer (engines pass them to all), used on hash layers
            if not isinstance(input_ids, torch.Tensor):
                raise TypeError(f"input_ids must be a torch.Tensor (or None), got {type(input_ids).__name__}")
            if input_ids.shape != (x.shape[0],):
                raise ValueError(f"input_ids.shape={tuple(input_ids.shape)}: expected [{x.shape[0]}] (one id per "
                                 f"token)")
            if input_ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"input_ids.dtype={input_ids.dtype}: expected torch.int64 (or int32)")
            if input_ids.device != x.device:
                raise ValueError(f"input_ids is on {input_ids.device}, hidden_states on {x.device}")
            if self.is_hash and x.shape[0] and not capturing(x.device):
                # NOTE: one host sync per hash layer (3 per model) in eager forwards; skipped inside a
                # CUDA-graph capture (replays read the ids where they stand: an engine's own ids)
                lo, hi = int(input_ids.min()), int(input_ids.max())
                if lo < 0 or hi >= self.config.vocab_size:
                    raise ValueError(f"input_ids: ids in [{lo}, {hi}], expected [0, vocab_size="
                                     f"{self.config.vocab_size}) (the hash table's rows)")
        if self.tp_size * self.ep_size > 1:  # before any work, not at the final all-reduce
            from .reference.moe import check_group

            check_group(self, self.group)  # reads tp_rank / tp_size / ep_rank / ep_size only
        t = x.shape[0]
        if t == 0:
            return torch.empty_like(x)
        if dispatch.PDL_MODE != "auto" or x.device.type != "cuda":
            return self._forward(x, input_ids, t)
        with dispatch.pdl_scope(dispatch.pdl_policy(t, self._side_stream(x.device, t) is not None,
                                                    self.config.local_intermediate(self.tp_size))[0]):
            return self._forward(x, input_ids, t)

    def _forward(self, x: torch.Tensor, input_ids: Optional[torch.Tensor], t: int) -> torch.Tensor:
        ctx = self.context(t)
        c = self.config
        routed = dispatch.select("routed_experts", ctx)
        # bf16 activation pairs for the routed gate_up, written by act_quant itself (no
        # conversion launch) when the routed GEMM config takes them at this T
        pairs = routed.name == "triton" and stages.routed_wants_pairs(t * c.num_experts_per_tok, self.routed)
        # router + act_quant (+ the routed alignment, when the decode front runs in one launch)
        side = self._side_stream(x.device, t)
        forked: list = []

        def fork(q_, sa_, *_):
            """The shared expert on the side stream once q, sa are enqueued on the main one."""
            main_ = torch.cuda.current_stream(x.device)
            side.wait_stream(main_)
            split = dispatch.shared_split_policy(t, c.local_intermediate(self.tp_size))[0]
            with torch.cuda.stream(side), dispatch.side_stream_scope(split):
                forked.append(self.shared_experts.forward_quantised(q_, sa_, ctx))

        point = self._shared_fork(t) if side is not None else None
        pf_point = self._shared_prefetch_point(t) if x.device.type == "cuda" and not PROBE_SKIP_SHARED else "off"
        pf = self._prefetch_stream(x.device) if pf_point != "off" else None

        def prefetch():
            """The shared expert's weights into the L2, on the prefetch stream, after the main stream's work so far."""
            pf.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(pf):
                from .kernels.l2_prefetch import l2_prefetch

                l2_prefetch(self.shared_experts.prefetch_tensors())

        def after_logits(*a):
            if pf_point == "logits":
                prefetch()
            if point == "logits":
                fork(*a)

        if pf_point == "start":
            prefetch()
        front = dispatch.select("front", ctx)
        topk_w, topk_ids, q, sa, q_pairs, align = front.impl(
            ctx, x, self.router, input_ids, c.num_experts_per_tok, c.routed_scaling_factor, self.routed, pairs,
            after_logits=after_logits if "logits" in (point, pf_point) else None)
        if pf_point == "logits" and front.name != "quant_in_logits":
            prefetch()  # no logits hook on this front: right after it
        if point == "align" and align is None and routed.name == "triton":
            align = stages.routed_align(topk_w, topk_ids, self.routed)
        if PROBE_SKIP_SHARED:
            shared = self._probe_zeros(x)
        elif side is None:
            shared = self.shared_experts.forward_quantised(q, sa, ctx)
        elif not forked:  # fork: the shared expert on the side stream once q, sa exist
            fork(q, sa)
        swiglu = dispatch.select("swiglu_quant", ctx).name
        fin = dispatch.select("finalize", ctx)
        down_parts = self._finalize_sums_down(t, routed.name, fin.name)
        y = routed.impl(q, sa, topk_w, topk_ids, self.routed, c.swiglu_limit, swiglu, q_pairs=q_pairs, align=align,
                        **({"down_reduce": False} if down_parts else {}))
        if side is not None:  # join before the first reader of `shared`
            shared = forked[0]
            main = torch.cuda.current_stream(x.device)
            main.wait_stream(side)
            shared.record_stream(main)  # allocated on the side stream, freed after main reads it
        if pf is not None:  # the prefetch stream joins too (a capture must end on the origin stream)
            torch.cuda.current_stream(x.device).wait_stream(pf)
        if down_parts:
            return stages.finalize_fused_split(y, topk_ids, shared, self.first_expert, self.num_local_experts)
        if self.tp_size == 1 and self.ep_size == 1:
            return fin.impl(y, topk_ids, shared, self.first_expert, self.num_local_experts)
        # Distributed: the fp32 partial crosses ranks before the single bf16 rounding (SPEC §4.5, §6).
        partial = (stages.finalize_partial_reference if fin.name == "reference" else stages.finalize_partial_kernel)
        acc = partial(y, topk_ids, self.first_expert, self.num_local_experts)
        from .reference.moe import combine

        return combine(acc, shared, self.weights, group=self.group)

    def set_routed_layout(self, layout: str = "auto") -> "DeepseekV4MoE":
        """Re-order the routed experts' packed codes in place of the layer's buffers
        ("auto", "nk", "mma64" or "mma64e", as the constructor's `routed_layout`), e.g. after moving
        a layer built on the CPU to CUDA. Returns self."""
        r = self.routed
        layout, why = choose_routed_layout(r, layout)
        if layout != r.layout:
            self._register("routed_", r.with_layout(layout))
        self.routed_layout, self.routed_layout_reason = layout, why
        return self

    def shared_overlap(self, num_tokens: int) -> tuple[bool, str]:
        """(overlapped, reason) for the shared expert of a forward over num_tokens tokens."""
        if self.device.type != "cuda":
            return False, f"in line (device {self.device.type})"
        if self.overlap_shared is not True and self.overlap_shared is not False:  # "auto"
            return dispatch.shared_overlap_policy(num_tokens, self.num_local_experts,
                                                  self.config.num_experts_per_tok,
                                                  self.config.local_intermediate(self.tp_size))
        if self.overlap_shared:
            return True, "on a side stream, overlapped with the routed experts (overlap_shared=True)"
        return False, "in line (overlap_shared=False)"

    def _shared_fork(self, num_tokens: int) -> str:
        """Where the shared expert forks at num_tokens tokens: "logits", "front" or "align"."""
        if SHARED_FORK == "auto":
            return dispatch.shared_fork_policy(num_tokens, self.config.local_intermediate(self.tp_size))[0]
        if SHARED_FORK not in dispatch.SHARED_FORK_POINTS:
            raise ValueError(f"layers.SHARED_FORK={SHARED_FORK!r}: expected 'auto' or one of "
                             f"{dispatch.SHARED_FORK_POINTS}")
        return SHARED_FORK

    def _side_stream(self, device: torch.device, num_tokens: int):
        """The side stream of `device` for the shared expert (None: run it in line)."""
        if device.type != "cuda" or PROBE_SKIP_SHARED or not self.shared_overlap(num_tokens)[0]:
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = (idx, SIDE_STREAM_PRIORITY)
        if key not in self._side_streams:
            self._side_streams[key] = torch.cuda.Stream(device=device, priority=SIDE_STREAM_PRIORITY)
        return self._side_streams[key]

    def _probe_zeros(self, x: torch.Tensor) -> torch.Tensor:
        """PROBE_SKIP_SHARED's stand-in shared output: zeros like x, made once per shape and device
        outside a capture (a capture that meets a new shape records its memset)."""
        key = (tuple(x.shape), x.device, x.dtype)
        z = self.__dict__.setdefault("_probe_zero_cache", {}).get(key)
        if z is None:
            z = torch.zeros_like(x)
            if not capturing(x.device):
                self.__dict__["_probe_zero_cache"][key] = z
        return z

    def _shared_prefetch_point(self, num_tokens: int) -> str:
        """Where the shared expert's weights are prefetched into the L2 at num_tokens tokens:
        "off", "start" or "logits" (layers.SHARED_L2_PREFETCH; "auto": the policy)."""
        if SHARED_L2_PREFETCH == "auto":
            if self.device.type != "cuda":
                return "off"
            side = self.shared_overlap(num_tokens)[0]
            return dispatch.shared_prefetch_policy(num_tokens, self.config.local_intermediate(self.tp_size),
                                                   self._shared_fork(num_tokens) if side else None)[0]
        if SHARED_L2_PREFETCH not in dispatch.SHARED_PREFETCH_POINTS:
            raise ValueError(f"layers.SHARED_L2_PREFETCH={SHARED_L2_PREFETCH!r}: expected 'auto' or one of "
                             f"{dispatch.SHARED_PREFETCH_POINTS}")
        return SHARED_L2_PREFETCH

    def _prefetch_stream(self, device: torch.device):
        """The L2-prefetch stream of CUDA `device` (one per device, made on first use)."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._prefetch_streams:
            self._prefetch_streams[idx] = torch.cuda.Stream(device=device)
        return self._prefetch_streams[idx]

    def explain(self, num_tokens: int) -> str:
        """The plan of a forward over num_tokens tokens: each stage's path and why (dispatch), the
        routed layout, the shared expert's stream and L2 prefetch, SPEC §5.3, the routed GEMM bodies."""
        from . import _explain

        return _explain.explain(self, num_tokens)

    def _finalize_sums_down(self, num_tokens: int, routed: str, finalize: str) -> bool:
        """Whether the fused finalize sums the routed down GEMM's split-K partials itself (no
        reduce launch, same bits): triton routed path, fused finalize, no TP / EP reduce (the
        partial crosses ranks first), and a down that splits K at this T."""
        return (routed == "triton" and finalize == "fused" and self.tp_size == 1 and self.ep_size == 1
                and stages.routed_down_to_finalize(num_tokens * self.config.num_experts_per_tok, self.routed))


def choose_routed_layout(r: RoutedExpertWeights, requested: str = "auto") -> tuple[str, str]:
    """(layout, reason) for DeepseekV4MoE's routed weights (see its docstring)."""
    from .weights.mma_layout import LAYOUTS, mma64_supported

    if requested != "auto" and requested not in LAYOUTS:
        raise ValueError(f"routed_layout={requested!r}: expected 'auto' or one of {LAYOUTS}")
    if requested != "auto":
        return requested, "requested"
    if r.gate_up.device.type != "cuda":
        return r.layout, f"kept: weights on {r.gate_up.device.type} (the Hopper layout pays only on CUDA)"
    h, i = r.hidden, r.intermediate
    for what, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
        ok, why = mma64_supported(n, k)
        if not ok:
            return r.layout, f"kept: {what} {why}"
    return "mma64e", ("auto on CUDA: whole 64 x 128 tiles, 16-byte operand loads in the MXFP4 kernels, each "
                      "word re-encoded for a 4-shift + 4-LOP3 conversion per 8 weights ('mma64': same bits, "
                      "up to 1.10x slower per layer on the H200)")


def load_moe_layer(checkpoint_dir, layer_idx: int, *, device="cpu", tp_rank: int = 0, tp_size: int = 1,
                   ep_rank: int = 0, ep_size: int = 1, group=None, progress: Optional[bool] = None) -> DeepseekV4MoE:
    """Load one MoE layer from official safetensors shards, reading only that layer's tensors.

    checkpoint_dir  a directory with config.json and model.safetensors.index.json + shards (or one
                    model.safetensors), official V4 or written by `make-checkpoint`
    layer_idx       decoder layer index; layers below num_hash_layers are hash-routed (forward
                    then needs input_ids)
    device          where the weights go ("cpu", "cuda", "cuda:N" or a torch.device); CUDA picks
                    the Hopper kernels and the "mma64e" routed layout
    tp_rank/tp_size tensor parallelism: this rank's I/tp_size slice of every expert, cut from the
                    checkpoint bytes without padding (V4-Pro at TP8: 384)
    ep_rank/ep_size expert parallelism: this rank's E/ep_size routed experts
    group           the process group the forward all-reduces over when tp_size or ep_size > 1
                    (None: the default group)
    progress        tqdm bar over experts (None: when stderr is a terminal and > 32 experts load)

    Returns a DeepseekV4MoE holding the native tensors as non-persistent buffers (so its
    state_dict() is empty; move it with .to(device), dtype changes are refused). A bad checkpoint
    raises CheckpointError (a ValueError) naming the tensor and shard, before any byte is read.
    """
    from .weights import load_layer_weights

    config, weights = load_layer_weights(checkpoint_dir, layer_idx, device=device, tp_rank=tp_rank,
                                         tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size, progress=progress)
    return DeepseekV4MoE(config, weights, group=group)
