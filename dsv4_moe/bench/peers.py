"""Baselines ("peers") the layer benchmark runs side by side, each import-guarded.

    routed scope (gate_up GEMM + clamped SwiGLU (+ quant) + down GEMM + weighted combine):
      hum16    humming-kernels MXFP4 MoE, W4A16 (bf16 activations), indexed layout
      hum8t    humming W4A8, FP8 e4m3 activations with a per-token dynamic scale
      hum8g    humming W4A8, FP8 activations with 1x128 group scales (DeepSeek style)
      grouped  torch._grouped_mm in bf16 on expert weights dequantised once (outside timing)
    shared scope (act quant + gate_up + SwiGLU + quant + down):
      scaled_mm  torch blockwise FP8 scaled_mm (1x128 activations x 128x128 weights), quant
                 and SwiGLU in plain torch ops
      deep_gemm  deep_gemm.fp8_gemm_nt for both GEMMs, quant and SwiGLU in torch

Routing metadata (sort by expert, block alignment) is computed once per input set outside
the timed region for every routed peer, as in shared/peers/README.md; the labels and the
run's notes say so. The humming adapter lives in _humming.py (with the wheel's download line).

Each peer: `unavailable(env) -> reason | None`, `prepare(...)` once (weight conversion),
`bind(input_set, set_index) -> callable` per rotated input set, `release()`.
`sweep.py` checks every bound output against dsv4_moe.reference before timing it.

humming-kernels on the (offline) GPU machine, as a wheel brought along:

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 humming-kernels==0.1.20 -d wheels/

Missing peers are reported as skipped, with the import error.
"""

from __future__ import annotations

import abc
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dsv4_moe.weights.formats import dequant_mxfp4, e8m0_to_float32

__all__ = ["PEERS", "DEFAULT_PEERS", "Peer", "make_peer", "PEER_TOLERANCE"]

# rel-L2 error vs dsv4_moe.reference above which a peer's output is called wrong. The
# peers run other numerics (bf16 or per-token FP8 activations, routing weight after w2,
# slot-order sums), so they match the reference only to its own quantisation noise:
# measured on the tiny preset (CPU), the reference (FP8 x and FP8 h) is 4.8% from the
# unquantised result and the bf16 grouped peer 0.4%, so bf16 / W4A16 peers sit ~5% from
# the reference; W4A8 peers add their own independent FP8 noise (~sqrt(2) x 5% = 7%).
# A wrong scale exponent, swapped nibbles or swapped gate/up give >= 50%. Rows also
# report the reference's own distance to the unquantised output (ref_rel_err_vs_unquantised).
PEER_TOLERANCE = {"torch_router": 0.05, "hum16": 0.10, "hum8t": 0.15, "hum8g": 0.15, "grouped": 0.10,
                  "scaled_mm": 0.05, "deep_gemm": 0.05}

DEFAULT_PEERS = ("torch_router", "hum16", "hum8t", "grouped", "scaled_mm", "deep_gemm")


class Peer(abc.ABC):
    name = ""
    label = ""
    scope = ""

    def unavailable(self, device: str, weights) -> Optional[str]:
        if not str(device).startswith("cuda"):
            return "needs CUDA (peers run on the GPU only)"
        return None

    def prepare(self, config, weights, shared_copies, device: str) -> None:
        pass

    @abc.abstractmethod
    def bind(self, s, index: int) -> Callable:
        """A zero-argument callable computing this peer's output for input set `s` (a
        stages.StageSet: x [T, H] bf16, input_ids [T] | None, topk_w [T, k] f32, topk_ids
        [T, k] ascending) which is rotation set number `index`."""

    def release(self) -> None:
        pass


# ----------------------------------------------------------------------------- helpers
def _swiglu_torch(h: torch.Tensor, inter: int, limit: float) -> torch.Tensor:
    """Clamped SwiGLU of a [M, 2I] bf16 gate|up tensor, fp32 math, bf16 out (no route weight)."""
    g = h[:, :inter].float().clamp(max=limit)
    u = h[:, inter:].float().clamp(-limit, limit)
    return (F.silu(g) * u).to(torch.bfloat16)


def _weighted_sum(y: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """y [T*k, H] bf16 (slot-major rows) x topk_w [T, k] -> [T, H] bf16 (one bmm)."""
    t, k = topk_w.shape
    return torch.bmm(topk_w.to(torch.bfloat16).view(t, 1, k), y.view(t, k, -1)).view(t, -1)


def _quant_1x128(x: torch.Tensor, s_out: torch.Tensor) -> torch.Tensor:
    """Plain-torch act quant: bf16 [M, K] -> e4m3 [M, K]; fp32 power-of-two scales written into s_out."""
    m, k = x.shape
    xv = x.view(m, k // 128, 128).float()
    amax = xv.abs().amax(-1).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    s_out.copy_(s)
    return (xv / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)


# ----------------------------------------------------------------------------- torch._grouped_mm
class GroupedMMPeer(Peer):
    name = "grouped"
    scope = "routed"
    label = "torch._grouped_mm bf16 (dequantised weights) [sort precomputed]"

    def unavailable(self, device, weights):
        r = super().unavailable(device, weights)
        if r:
            return r
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        if weights.routed.num_local != (weights.routed.num_experts or weights.routed.num_local):
            return "EP split (local experts only): this adapter indexes all experts on one rank"
        return None

    def prepare(self, config, weights, shared_copies, device):
        r = weights.routed
        self.E, self.I, self.H = r.num_local, r.intermediate, r.hidden
        self.limit = float(config.swiglu_limit)
        gu = torch.empty(self.E, 2 * self.I, self.H, device=device, dtype=torch.bfloat16)
        dn = torch.empty(self.E, self.H, self.I, device=device, dtype=torch.bfloat16)
        for e0 in range(0, self.E, 16):  # chunks bound the fp32 temporaries
            e1 = min(self.E, e0 + 16)
            gu[e0:e1] = dequant_mxfp4(r.gate_up[e0:e1], r.gate_up_scale[e0:e1]).to(torch.bfloat16)
            dn[e0:e1] = dequant_mxfp4(r.down[e0:e1], r.down_scale[e0:e1]).to(torch.bfloat16)
        self.gu_t = gu.transpose(1, 2)  # [E, H, 2I]: _grouped_mm wants [G, K, N]
        self.dn_t = dn.transpose(1, 2)  # [E, I, H]

    def bind(self, s, index):
        x, topk_w, topk_ids = s.x, s.topk_w, s.topk_ids
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=self.E), 0).to(torch.int32)
        w = topk_w.float()

        def call():
            xs = x.index_select(0, tok)
            h = torch._grouped_mm(xs, self.gu_t, offs=offs)
            a = _swiglu_torch(h, self.I, self.limit)
            y = torch._grouped_mm(a, self.dn_t, offs=offs)
            y_slots = torch.empty_like(y).index_copy_(0, order, y)
            return _weighted_sum(y_slots, w)

        return call

    def release(self):
        self.gu_t = self.dn_t = None


# ----------------------------------------------------------------------------- shared expert, FP8
def _shared_f32_scales(sh):
    return e8m0_to_float32(sh.gate_up_scale), e8m0_to_float32(sh.down_scale)


class ScaledMMSharedPeer(Peer):
    """Shared expert with torch's blockwise FP8 GEMM. The scale layout torch accepts changed
    between releases, so `prepare` validates candidate (API, layout) pairs on one GEMM and
    keeps the first that matches the dequantised product (SPEC §8: 'verify before relying')."""

    name = "scaled_mm"
    scope = "shared"
    label = "shared: torch act quant + blockwise FP8 scaled_mm + torch SwiGLU"

    def unavailable(self, device, weights):
        r = super().unavailable(device, weights)
        if r:
            return r
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no _scaled_mm"
        sh = weights.shared
        if sh.hidden % 128 or sh.intermediate % 128:
            return f"blockwise scaled_mm needs H, I multiples of 128 (H={sh.hidden}, I={sh.intermediate})"
        return None

    @staticmethod
    def _candidates(w, s_rowmajor, s_cm, s_cm4=None):
        try:
            from torch.nn.functional import ScalingType, scaled_mm
        except ImportError:
            ScalingType = scaled_mm = None
        out = {}
        layouts = [("colmajor (K/128,N/128)", s_cm), ("rowmajor (N/128,K/128)", s_rowmajor)]
        if s_cm4 is not None:
            # NOTE: torch 2.11 wants K/128 padded to a multiple of 4 when it is not one (Pro TP8
            # down: K = 384 -> 3 blocks); kernels/scaled_mm_fp8.py's "kn_cm4" layout, proven on the H200.
            layouts.insert(1, ("colmajor padded (K4/128,N/128)", s_cm4))
        if scaled_mm is not None:
            for nm, sb in layouts:
                out[f"F.scaled_mm b={nm}"] = (lambda q, sa, sb=sb: scaled_mm(
                    q, w.t(), sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16))
        for nm, sb in (("colmajor (K/128,N/128)", s_cm), ("rowmajor (N/128,K/128)", s_rowmajor)):
            out[f"_scaled_mm b={nm}"] = (lambda q, sa, sb=sb: torch._scaled_mm(
                q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        return out

    def _weight_gemms(self, sh):
        """(gate_up gemm, down gemm) closures for one weight copy, using the validated API."""
        sgu, sdn = _shared_f32_scales(sh)
        res = []
        for w, s, which in ((sh.gate_up, sgu, "gate_up"), (sh.down, sdn, "down")):
            nb, kb = s.shape
            kb4 = (kb + 3) // 4 * 4
            s_pad = torch.zeros(nb, kb4, device=s.device, dtype=torch.float32)
            s_pad[:, :kb] = s
            cands = self._candidates(w, s.contiguous(), s_pad.t()[:kb], s_pad.t())
            res.append(cands[self.api[which]])
        return res

    def prepare(self, config, weights, shared_copies, device):
        self.limit = float(config.swiglu_limit)
        sh = weights.shared
        self.H, self.I = sh.hidden, sh.intermediate
        self.api = {}
        self.tried = {}
        sgu, sdn = _shared_f32_scales(sh)
        for which, w, s in (("gate_up", sh.gate_up, sgu), ("down", sh.down, sdn)):
            kdim = w.shape[1]
            m = 64
            x = torch.randn(m, kdim, device=device, dtype=torch.bfloat16)
            sa = torch.empty(kdim // 128, m, device=device).t()  # column-major activation scales
            q = _quant_1x128(x, sa)
            wref = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
            ref = (q.float() * sa.repeat_interleave(128, 1)) @ wref.T
            nb, kb = s.shape
            kb4 = (kb + 3) // 4 * 4
            s_pad = torch.zeros(nb, kb4, device=device)
            s_pad[:, :kb] = s
            tried = {}
            for nm, fn in self._candidates(w, s.contiguous(), s_pad.t()[:kb], s_pad.t()).items():
                try:
                    o = fn(q, sa)
                    torch.cuda.synchronize()
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    tried[nm] = err
                    if err < 1e-2:
                        self.api[which] = nm
                        break
                except Exception as e:  # noqa: BLE001 - an API/layout torch rejects: try the next
                    tried[nm] = f"{type(e).__name__}: {str(e)[:100]}"
            self.tried[which] = tried
        if len(self.api) != 2:
            raise RuntimeError(f"no blockwise scaled_mm API/layout matched the dequantised product: {self.tried}")
        self.gemms = [self._weight_gemms(c) for c in shared_copies]
        self.label += f" [{self.api['gate_up']}]"

    def bind(self, s, index):
        x = s.x
        t = x.shape[0]
        mp = (t + 3) // 4 * 4  # blockwise scaled_mm wants M padded to a multiple of 4 (SPEC §8)
        xp = torch.zeros(mp, self.H, device=x.device, dtype=torch.bfloat16)
        xp[:t] = x
        sa1 = torch.empty(self.H // 128, mp, device=x.device).t()
        sa2 = torch.empty(self.I // 128, mp, device=x.device).t()
        g1, g2 = self.gemms[index % len(self.gemms)]

        def call():
            h = g1(_quant_1x128(xp, sa1), sa1)
            a = _swiglu_torch(h, self.I, self.limit)
            return g2(_quant_1x128(a, sa2), sa2)[:t]

        return call


class DeepGemmSharedPeer(Peer):
    name = "deep_gemm"
    scope = "shared"
    label = "shared: torch act quant + deep_gemm.fp8_gemm_nt + torch SwiGLU"

    def unavailable(self, device, weights):
        r = super().unavailable(device, weights)
        if r:
            return r
        try:
            import deep_gemm
        except Exception as e:  # noqa: BLE001 - missing or broken install (SPEC §8)
            return f"deep_gemm not importable ({type(e).__name__}: {str(e)[:120]})"
        if not hasattr(deep_gemm, "fp8_gemm_nt"):
            return "deep_gemm has no fp8_gemm_nt"
        return None

    def prepare(self, config, weights, shared_copies, device):
        import deep_gemm

        self.dg = deep_gemm
        self.limit = float(config.swiglu_limit)
        self.H, self.I = weights.shared.hidden, weights.shared.intermediate
        self.copies = [(c.gate_up, *_shared_f32_scales(c), c.down) for c in shared_copies]

    def bind(self, s, index):
        x = s.x
        t = x.shape[0]
        wgu, sgu, sdn, wdn = self.copies[index % len(self.copies)]
        sa1 = torch.empty(t, self.H // 128, device=x.device)
        sa2 = torch.empty(t, self.I // 128, device=x.device)
        h = torch.empty(t, 2 * self.I, device=x.device, dtype=torch.bfloat16)
        out = torch.empty(t, self.H, device=x.device, dtype=torch.bfloat16)

        def call():
            self.dg.fp8_gemm_nt((_quant_1x128(x, sa1), sa1), (wgu, sgu), h)
            a = _swiglu_torch(h, self.I, self.limit)
            self.dg.fp8_gemm_nt((_quant_1x128(a, sa2), sa2), (wdn, sdn), out)
            return out

        return call


# ----------------------------------------------------------------------------- router
class TorchRouterPeer(Peer):
    """The router as plain torch ops a user would write: fp32 matmul, sqrt(softplus), biased
    top-k (or the hash table), gather, sort, renormalise."""

    name = "torch_router"
    scope = "router"
    label = "router: torch fp32 matmul + sqrt(softplus) + topk"

    def prepare(self, config, weights, shared_copies, device):
        self.k = config.num_experts_per_tok
        self.scale = float(config.routed_scaling_factor)
        rw = weights.router
        self.w = rw.weight.float()
        self.bias = rw.bias
        self.tid2eid = rw.tid2eid

    def bind(self, s, index):
        x, input_ids = s.x, s.input_ids

        def call():
            scores = torch.sqrt(F.softplus(x.float() @ self.w.T))
            if self.tid2eid is not None:
                ids = self.tid2eid[input_ids]
            else:
                ids = torch.topk(scores + self.bias, self.k, dim=-1).indices
            ids = torch.sort(ids, dim=-1).values
            w = scores.gather(1, ids)
            return w / w.sum(-1, keepdim=True) * self.scale, ids

        return call


from ._humming import HummingPeer  # noqa: E402  (after Peer, which it subclasses)

PEERS = {
    "torch_router": TorchRouterPeer,
    "hum16": lambda: HummingPeer("hum16"),
    "hum8t": lambda: HummingPeer("hum8t"),
    "hum8g": lambda: HummingPeer("hum8g"),
    "grouped": GroupedMMPeer,
    "scaled_mm": ScaledMMSharedPeer,
    "deep_gemm": DeepGemmSharedPeer,
}


def make_peer(name: str) -> Peer:
    if name not in PEERS:
        raise ValueError(f"peer={name!r}: expected one of {sorted(PEERS)}")
    return PEERS[name]()
