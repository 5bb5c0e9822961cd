"""humming-kernels MXFP4 MoE peers (W4A16, W4A8 per-token, W4A8 1x128), indexed layout.

humming is not on the GPU machine's index (no network there); bring the wheel with

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 humming-kernels==0.1.20 -d wheels/

and install it there: `pip install --no-deps --target /tmp/hum wheels/humming_kernels-*.whl`,
then run with `PYTHONPATH=/tmp/hum`. Without it the peers are reported skipped with the
import error. The call sequence (layer transform, heuristic tuning config as a one-interval
tuning_config, block-aligned routing, binary_split activation) follows shared/peers/peer_bench.py.
"""

from __future__ import annotations

import copy
import json

import torch

from .peers import Peer, _weighted_sum

__all__ = ["HummingPeer", "align_routes"]


def align_routes(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Indexed-MoE layout: (sorted_ids [P] i32, expert_ids [P/bm] i32, num_padded i32 scalar).

    Routes (t*k + j) sorted by expert (stable), each expert's run padded to a multiple of
    block_m with the sentinel T*k. Host-synchronising (the total), so it runs outside timing.
    """
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    start_padded = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = start_padded[e_sorted] + torch.arange(n, device=flat.device) - start[e_sorted]
    total = int(padded.sum().item())
    sorted_ids = torch.full((total,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=flat.device),
                                         padded // block_m).to(torch.int32)
    return sorted_ids, expert_ids, torch.tensor(total, dtype=torch.int32, device=flat.device)


class HummingPeer(Peer):
    scope = "routed"
    _VARIANTS = {
        "hum16": ("humming MXFP4 W4A16", None),
        "hum8t": ("humming MXFP4 W4A8 (fp8 per-token)", {"quant_method": "humming", "a_dtype": "float8e4m3"}),
        "hum8g": ("humming MXFP4 W4A8 (fp8 1x128)",
                  {"quant_method": "humming", "a_dtype": "float8e4m3", "input_scale_group_size": 128}),
    }

    def __init__(self, name: str):
        self.name = name
        self.label, self.input_cfg = self._VARIANTS[name]
        self.label += " [align precomputed]"

    def unavailable(self, device, weights):
        r = super().unavailable(device, weights)
        if r:
            return r
        if weights.routed.num_local != (weights.routed.num_experts or weights.routed.num_local):
            return "EP split (local experts only): this adapter indexes all experts on one rank"
        try:
            import humming  # noqa: F401
            from humming.forward import may_process_input  # noqa: F401
            from humming.layer import HummingLayer  # noqa: F401
            from humming.tune import get_heuristics_config  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure is "not installed here"
            return f"humming-kernels not importable ({type(e).__name__}: {str(e)[:120]})"
        return None

    def prepare(self, config, weights, shared_copies, device):
        from humming.forward import may_process_input
        from humming.layer import HummingLayer
        from humming.tune import get_heuristics_config

        self._process = may_process_input
        self._heur = get_heuristics_config
        r = weights.routed
        self.E, self.K = r.num_local, config.num_experts_per_tok
        self.H, self.I = r.hidden, r.intermediate
        lim = float(config.swiglu_limit)
        # The clamped SwiGLU of SPEC §4.4 (gate: upper clamp only) as humming's activation string.
        self.act_impl = (f"(fminf(a, {lim}f) / (1.0f + expf(-fminf(a, {lim}f)))) * "
                         f"fminf(fmaxf(b, -{lim}f), {lim}f)")

        def layer(n, k, codes, scale):
            lay = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "mxfp4"},
                               input_config=copy.deepcopy(self.input_cfg), num_experts=self.E,
                               torch_dtype=torch.bfloat16)
            lay.weight = torch.nn.Parameter(codes.clone(), requires_grad=False)
            lay.weight_scale = torch.nn.Parameter(scale.view(torch.uint8).clone(), requires_grad=False)
            lay.transform()
            return lay

        self.gu = layer(2 * self.I, self.H, r.gate_up, r.gate_up_scale)
        self.dn = layer(self.H, self.I, r.down, r.down_scale)
        self._cfg_cache = {}

    def _tuning(self, lay, m):
        """humming's heuristic config for M rows as a one-interval tuning config, and its block_m."""
        key = (id(lay), m)
        if key not in self._cfg_cache:
            c = copy.deepcopy(self._heur(lay.humming_config, shape_m=m, gemm_type="indexed"))
            js = json.dumps([[0, 1 << 30, c]], default=lambda o: getattr(o, "value", str(o)))
            self._cfg_cache[key] = (js, int(c["block_shape"][0]))
        return self._cfg_cache[key]

    def bind(self, s, index):
        x, topk_w, topk_ids = s.x, s.topk_w, s.topk_ids
        t, k = topk_ids.shape
        ids = topk_ids.to(torch.int32)
        tc_gu, bm_gu = self._tuning(self.gu, t * k)
        tc_dn, bm_dn = self._tuning(self.dn, t * k)
        al_gu = align_routes(ids, self.E, bm_gu)
        al_dn = al_gu if bm_dn == bm_gu else align_routes(ids, self.E, bm_dn)
        cc = json.dumps({"gemm_type": "indexed"})
        w = topk_w.float()

        def call():
            h = self.gu(x, sorted_ids=al_gu[0], expert_ids=al_gu[1], num_tokens_padded=al_gu[2], top_k=k,
                        compute_config=cc, tuning_config=tc_gu)
            a, gs, ts = self._process(self.dn.humming_config, h, activation_type="binary_split",
                                      activation_impl=self.act_impl)
            y = self.dn(a, input_scale=gs if gs is not None else ts, sorted_ids=al_dn[0], expert_ids=al_dn[1],
                        num_tokens_padded=al_dn[2], top_k=1, compute_config=cc, tuning_config=tc_dn)
            return _weighted_sum(y, w)

        return call

    def release(self):
        self.gu = self.dn = None
