"""The one dispatch module: for each stage of the layer, an ordered list of paths.

A path is (name, predicate, implementation). The predicate takes a DispatchContext
and returns (ok, reason); the first path whose predicate holds is chosen, unless
`force_paths(stage=name)` forces one (a forced path whose predicate fails raises with
the reason: forcing never falls back silently). `plan(ctx)` / `explain(ctx)` list the
choice and every rejection. `DSV4_MOE_LOG_DISPATCH=1` prints each new choice to stderr.

Hardware facts are the named predicates below (`has_cuda`, `has_fp8_mma`, ...), never
version numbers scattered through the code. Implementations are imported lazily so
that CPU-only installs never import triton.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ._types import is_int

__all__ = [
    "DispatchContext", "Path", "STAGES", "select", "plan", "explain", "force_paths", "clear_plan_cache",
    "has_cuda", "has_fp8_mma", "has_pdl", "has_triton", "is_gfx950",
    "PDL_MODE", "PDL_MODES", "pdl_mode", "pdl_scope", "pdl_policy", "shared_overlap_policy", "shared_fork_policy",
    "SHARED_FORK_POINTS",
    "shared_prefetch_policy", "SHARED_PREFETCH_POINTS",
    "side_stream_scope", "on_side_stream", "side_stream_split_k", "shared_split_policy",
]


# --------------------------------------------------------------------------- hardware facts
@functools.lru_cache(maxsize=None)
def has_triton() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising something else
        return False, f"triton not importable ({type(e).__name__}: {e})"
    return True, "triton importable"


def has_cuda(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"device is {device.type}, not cuda"
    if torch.version.hip is not None:
        return False, "ROCm build (CUDA kernels not validated on ROCm)"
    return True, "cuda device"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def has_fp8_mma(device: torch.device) -> tuple[bool, str]:
    ok, why = has_cuda(device)
    if not ok or device.type == "cpu":  # cpu: only when a test runs kernels in Triton's interpreter
        return ok, why
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap < (8, 9):
        return False, f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores (needs >= 8.9)"
    return True, f"FP8 MMA on sm_{cap[0]}{cap[1]}"


# Programmatic dependent launch (PDL, sm_90+): every Triton kernel of the CUDA path is
# launched with the programmatic-serialisation attribute and waits (griddepcontrol.wait)
# as its first instruction for the previous kernel on the stream to finish and flush, so
# the next kernel's launch and scheduling overlap this one's tail; same bits by
# construction. The mode says when a kernel lets its successor launch:
#   "early"  griddepcontrol.launch_dependents right after the wait (the successor's CTAs
#            can become resident, idle, while this kernel's last wave runs)
#   "exit"   at CTA exit (implicit): only the launch latency is hidden
#   "off"    plain launches
#   "auto"   (default) the layer picks per forward (pdl_policy); kernels called on their
#            own outside a layer forward use "early"
# `DSV4_MOE_PDL=auto|early|exit|off` (1 = early, 0 = off) sets PDL_MODE; so does assigning it.
_PDL_ENV = {"1": "early", "early": "early", "exit": "exit", "0": "off", "": "off", "off": "off", "auto": "auto"}
_PDL_RAW = os.environ.get("DSV4_MOE_PDL", "auto").strip().lower()
PDL_MODE = _PDL_ENV.get(_PDL_RAW, _PDL_RAW)  # an unknown value is kept and rejected by pdl_mode()
PDL_MODES = ("early", "exit", "off")
_PDL_SCOPE: contextvars.ContextVar = contextvars.ContextVar("dsv4_moe_pdl_scope", default="early")


def pdl_mode() -> str:
    """The PDL mode launches use now: PDL_MODE, or under "auto" the enclosing pdl_scope's."""
    if PDL_MODE == "auto":
        return _PDL_SCOPE.get()
    if PDL_MODE not in PDL_MODES:
        raise ValueError(f"dispatch.PDL_MODE={PDL_MODE!r} (env DSV4_MOE_PDL={os.environ.get('DSV4_MOE_PDL')!r}): "
                         f"expected 'auto' or one of {PDL_MODES} (or 1 / 0)")
    return PDL_MODE


@contextlib.contextmanager
def pdl_scope(mode: str):
    """Launches inside use `mode` while PDL_MODE is "auto" (a layer's forward)."""
    if mode not in PDL_MODES:
        raise ValueError(f"pdl_scope(mode={mode!r}): expected one of {PDL_MODES}")
    token = _PDL_SCOPE.set(mode)
    try:
        yield
    finally:
        _PDL_SCOPE.reset(token)


# (inside side_stream_scope, the split-K target it was given or None), or None outside
_SIDE_STREAM: contextvars.ContextVar = contextvars.ContextVar("dsv4_moe_side_stream", default=None)
# Override of shared_split_policy for every overlapped forward: -1 follows the rule; >= 0 is the
# split-K target (programs per SM, 0: no split) of the shared expert's decode GEMMs. A/B switch.
SHARED_SPLIT_K_PROGRAMS_PER_SM = -1


@contextlib.contextmanager
def side_stream_scope(split_k_programs_per_sm: Optional[int] = None):
    """Launches inside run beside the routed experts (the layer's shared expert on its side
    stream): the FP8 GEMMs take the split-K target given here (None: their in-line grids;
    see shared_split_policy) and their `OVERLAPPED_*` settings (kernels/fp8_block_gemm.py)."""
    token = _SIDE_STREAM.set((split_k_programs_per_sm,))
    try:
        yield
    finally:
        _SIDE_STREAM.reset(token)


def on_side_stream() -> bool:
    """True inside side_stream_scope()."""
    return _SIDE_STREAM.get() is not None


def side_stream_split_k() -> Optional[int]:
    """The split-K target of the enclosing side_stream_scope (None: outside one, or none given)."""
    scope = _SIDE_STREAM.get()
    return None if scope is None else scope[0]


def shared_split_policy(num_tokens: int, intermediate: int) -> tuple[Optional[int], str]:
    """(split-K target, reason) of the shared expert's FP8 GEMMs on the side stream, in programs
    per SM (None: the in-line grid, ~4 per SM; 0: no split, N / 64 programs)."""
    # NOTE (session 28, H200, gpu_profile_layer.py --ab ...OVERLAPPED_SPLIT_K_PROGRAMS_PER_SM (the
    # switch's first form), 12 forwards per graph, 3 captures, us, ~4 per SM / no split;
    # docs/bench/2026-11-30/session28/): Flash (I = 2048) T=3 118.8 / 106.8, T=4 141.2 / 127.2
    # (sorted alignment) and 131.9 / 128.6 (pairwise), T=5 141.5 / 141.4, T=6 161.8 / 161.9, T=8
    # 207.4 / 207.5, T=16 352.3 / 352.7; Pro-TP8 (I = 384) T=2 46.2 / 50.2, T=4 67.5 / 68.8, T=8
    # and 16 level. The Flash shared GEMMs at T = 3-4 on 64 programs each instead of ~528
    # leave the SMs to the routed front's one-program kernels. With this rule (ecbc623, rule /
    # ~4 per SM / ~1 per SM): Flash T=2 (overlapped) 80.0 / 86.1 / 95.6, T=3 109.2 / 113.1 /
    # 113.4, T=4 128.9 / 132.4 / 132.0; Pro-TP8 (rule / none / ~2 per SM) T=2 45.9 / 50.1 / 45.8,
    # T=3 59.0 / 60.7 / 59.4.
    # NOTE (session 49, H200, scripts/gpu_ab_layer.py - the layer bench, graph-chain - alternating runs,
    # docs/bench/2026-12-02/session49/, us, rule / target 1 / 2 / 3 / 4 / 6 / 0): Flash T=1 53.9 (median of
    # 3) / 54.0 / 53.8 / 53.9 / 53.8 / 53.8; Pro-TP8 T=1 31.4 / - / 31.2 / - / 31.4, T=4 64.8 / - / 64.3 / - /
    # 64.6 / - / 66.7, T=8 91.8 / - / 91.5 / - / 91.5 / - / 91.4 (medians of 2). Level within the
    # default's own spread (53.7-54.1 at Flash T=1), so the rule stays.
    v = SHARED_SPLIT_K_PROGRAMS_PER_SM
    if not is_int(v) or v < -1:
        raise ValueError(f"dispatch.SHARED_SPLIT_K_PROGRAMS_PER_SM={v!r}: expected -1 (the rule) or an int >= 0")
    if SHARED_SPLIT_K_PROGRAMS_PER_SM >= 0:
        return SHARED_SPLIT_K_PROGRAMS_PER_SM, (f"split-K target {SHARED_SPLIT_K_PROGRAMS_PER_SM} programs per SM "
                                                f"(dispatch.SHARED_SPLIT_K_PROGRAMS_PER_SM)")
    if intermediate >= 2048 and 2 <= num_tokens <= 4:
        return 0, (f"T = {num_tokens}, I = {intermediate}: decode GEMMs unsplit (N / 64 programs), leaving SMs "
                   f"to the routed front (measured faster on the H200)")
    if num_tokens > 16:  # fp8_block_gemm.choose_config splits only M <= 16 (the split target is unused above)
        return None, ("GEMMs in one pass (T > 16): 64-row tiles, or 16 / 32-row ones on narrow GEMMs with a "
                      "long K (fp8_block_gemm.MID_M_MAX_N)")
    return None, "decode GEMMs on their in-line split-K grids"


@functools.lru_cache(maxsize=4096)  # pure; asked on every forward
def pdl_policy(num_tokens: int, shared_overlapped: bool, intermediate: int = 0) -> tuple[str, str]:
    """(mode, reason) a layer forward launches with under PDL_MODE "auto" (`intermediate`: the
    layer's expert intermediate size per rank; 0 when unknown)."""
    # NOTE: H200, session 7 (docs/bench/2026-11-29/session7/profile_layer_pdl_modes_3bae5ab.txt,
    # graph us early / exit / off): with the shared expert overlapped on a side stream,
    # early release was slower than release at exit from T = 4 (Pro-TP8 T=4 115.4 / 105.1,
    # T=64 574.3 / 533.4, T=256 847.3 / 809.4; Flash T=256 1608.9 / 1583.2): the routed
    # kernels' successors sit resident and idle beside the side stream's kernels. At T = 1
    # (Flash 82.2 / 86.9 / 98.0, Pro-TP8 49.6 / 52.8 / 58.7) and in line at every T (Flash
    # T=64 1142.7 / 1149.0 / 1154.0) early was fastest.
    # NOTE (session 21, docs/bench/2026-11-30/session21/, H200, graphs, rotated weights, us, PDL
    # at exit / off): the Flash-shaped layer (I = 2048) with its shared expert overlapped runs
    # T = 3-4 faster without PDL - layer bench, two alternating runs each (bench_pdl_*_7d952ed):
    # T=3 147.8 / 144.7 and 148.0 / 144.7, T=4 169.9 / 165.1 and 170.1 / 164.8; level at T=2
    # (107.5 / 107.5) and T=6 (214.9 / 217.3). gpu_profile_layer --weight-sets 4 --twins 5
    # (profile_layer_twins5_b99040d.txt): T=4 off 157.3 against 163.3-167.7 over six captures
    # at exit. Not on Pro-TP8 (I = 384), where exit stays ahead at T = 2-4 (80.4 vs 81.8 at
    # T = 3, 90.7 vs 92.3 at T = 4).
    # NOTE (session 27, docs/bench/2026-11-30/session27/profile_layer_sweep*_b617cfa.txt, H200,
    # gpu_profile_layer.py --weight-sets 4, 12 forwards per graph, two runs, us, shared expert
    # overlapped, PDL early / exit / off): Pro-TP8 (I = 384) T=2 46.3 / 48.4 / 48.9 and 45.8 / 48.2
    # / 48.6, T=3 60.5 / 60.6 / 60.5 and 58.9 / 59.3 / 59.4, T=4 75.1 / 69.4 / 68.2 and 75.0 / 69.0 /
    # 68.3, T=6 86.9 / 86.5 / 87.4; Flash (I = 2048) T=5 150.2 / 152.8 / 155.1, T=6 173.0 / 176.4 /
    # 178.5 and 167.0 / 170.0 / 172.2, T=8 213.0 / 212.8 / 214.9. So early at Pro-shaped T = 2-3
    # and Flash-shaped T = 5-6, none at Pro-shaped T = 4, at exit elsewhere from T = 2.
    # NOTE (session 28, same tool, docs/bench/2026-11-30/session28/profile_layer_{newrule_flash,
    # split_flash}_ecbc623.txt, us, Flash, overlapped with the unsplit shared GEMMs of
    # shared_split_policy, PDL early / exit / off): T=2 77.0 / 81.1 / 80.3 and 77.1 / 81.2 / 80.3
    # (in line, the old pick: 88.8 early), T=3 105.2 / 107.7 / 109.9 and 105.2 / 107.8 / 109.6,
    # T=4 124.7 / 126.8 / 128.9 and 125.4 / 127.4 / 129.5. Without the split-K grid beside them
    # the routed kernels gain from early release again, so early at Flash-shaped T = 2-6.
    # NOTE (session 30, docs/bench/2026-11-30/session30/all_call{2,3}_0ef2a20.log, same tool, us, PDL
    # early / exit / off with the shared expert forked after the router's logits launch, as
    # shared_fork_policy now does at Pro-shaped T <= 8): Pro-TP8 T=2 42.9 / 44.6 / 48.3 and 43.0 /
    # 44.8 / 48.5, T=3 58.0 / 56.2 / 60.1, T=4 70.4 / 63.0 / 66.8 and 70.8 / 63.4 / 67.8, T=5 79.2 /
    # 74.9 / 75.3, T=8 99.2 / 91.4 / 92.5. So at exit from Pro-shaped T = 4 (no longer off there);
    # T = 3 keeps its fork after the front and early release (the layer bench: 57.2 against 58.2
    # forked after the logits and released at exit; shared_fork_policy).
    # NOTE (session 41, docs/bench/2026-12-01/session41/, H200, PDL at exit / early, outputs bitwise
    # the same). gpu_profile_layer.py (4 weight sets, median of 3 interleaved captures per mode, us):
    # Pro-TP8 (I = 384) T=9 99.9 / 98.4, T=10 106.1 / 104.0, T=11 114.5 / 111.8, T=12 118.7 / 115.9,
    # T=16 143.7 / 140.6, T=20 174.8 / 176.7, T=24 194.0 / 193.8, T=32 231.5 / 233.4 (T=4 62.7 / 65.8,
    # T=8 91.2 / 97.2 in its six-variant table, the shared expert forked after the logits there:
    # shared_fork_policy). The layer bench (graph-chain, all_call8_a54454c.log) agrees: T=9 100.1 /
    # 96.9, T=12 121.2 / 117.4, T=16 140.8 / 136.6 - so early at Pro-shaped T = 9-16. On Flash
    # (I = 2048) the two tools disagree: the profile gave T=3 104.8 / 104.0, T=4 122.3 / 124.9, T=5
    # 139.6 / 140.0, T=6 159.4 / 159.8, T=8 197.7 / 201.3, but the layer bench, two alternating runs
    # each (all_call9_a54454c.log), T=4 122.4, 122.5 / 119.4, 119.3, T=5 142.9, 143.2 / 139.5, 140.2,
    # T=6 160.4, 160.4 / 157.2, 156.5 - the bench's figures are the targets', so Flash keeps early at
    # T = 2-6.
    if not shared_overlapped or num_tokens == 1:
        return "early", ("T = 1" if shared_overlapped else "shared expert in line") + ": successors released early"
    why = f"shared expert overlapped, T = {num_tokens}, I = {intermediate}"
    if (intermediate >= 2048 and 2 <= num_tokens <= 6) or \
            (0 < intermediate < 2048 and (2 <= num_tokens <= 3 or 9 <= num_tokens <= 16)):
        return "early", f"{why}: successors released early (measured faster than at exit on the H200)"
    return "exit", "shared expert overlapped, T > 1: successors released at CTA exit"


SHARED_FORK_POINTS = ("logits", "front", "align")


def shared_fork_policy(num_tokens: int, intermediate: int) -> tuple[str, str]:
    """(point, reason): where the layer forks the shared expert's side stream (`layers.SHARED_FORK`
    "auto"): "logits" - between the router's logits launch, which quantises x, and its top-k
    launch (the front's quant_in_logits path; elsewhere it falls back to "front"); "front" -
    right after the front; "align" - after the routed alignment's launch (triton routed path).
    (A fork after the routed gate_up GEMM's launch measured slower at every T in session 32: see
    layers.SHARED_FORK.)"""
    # NOTE (session 27, H200, gpu_profile_layer.py --ab dsv4_moe.layers.FORK_AFTER_ALIGN, 12
    # forwards per graph, us, after the front / after the alignment; docs/bench/2026-11-30/
    # session27/): Flash T=1 58.3 / 56.3 (3 captures each) and 60.2 / 58.4 (2 captures); Pro-TP8
    # T=1 33.1 / 33.4 and 32.6 / 32.7. At T >= 2 it moved by -3 to +20 us with no pattern that
    # held across T (Pro-TP8 T=8 97.5 / 117.6, T=16 157.5 / 154.5; Flash T=4 135.2 / 145.1).
    # NOTE (session 30, same tool and method, 3 captures per value, docs/bench/2026-11-30/session30/
    # all_call{2,3}_0ef2a20.log, us, the session-29 fork / after the logits, each with pdl_policy's
    # PDL): Pro-TP8 (I = 384) T=1 32.5 / 31.9 and 32.5 / 31.8, T=2 44.7 / 43.3 and 44.3 / 42.9, T=3
    # 58.5 / 57.9, T=4 65.4 / 67.0 (but 63.0 and 63.4 with PDL at exit, below), T=5 75.0 / 74.8, T=6
    # 84.5 / 80.5, T=8 93.3 / 91.7 and 92.4 / 91.0, T=12 118.7 / 119.0, T=16 145.0 / 144.9; Flash
    # (I = 2048) T=1 54.7 / 57.0, T=2-6 8-12 us slower, T=8 206.3 / 205.0 and 205.4 / 204.1, T=12
    # 281.1 / 280.5, T=16 level. The shared GEMMs launched before the top-k leave the routed
    # gate_up to itself (Pro-TP8 T=1 timeline: it starts at 9.2 us instead of 11.1); at Flash
    # T = 1-6 the larger shared GEMMs hold the SMs the one-program top-k and alignment need.
    # The layer bench (the method of record: 16 rotated input sets and router / shared copies, one
    # graph of forwards; all_call5_bb965db.log, two runs of the new rule) disagreed at Pro-TP8 T = 1
    # and 3: the session-29 fork 31.3 / 57.2 us against 33.7 and 33.7 / 58.2 and 58.1 after the
    # logits (per call T=1 39.6 / 42.3), and agreed at T = 2 (43.8 / 41.9 and 41.8) and T = 4 (65.1 /
    # 64.2 and 64.5). So after the logits at Pro-shaped T = 2 and 4-8 only. The rule's run
    # (all_call6_1adb013.log, us, after the logits / after the front): Pro-TP8 T=5 73.2 / 74.2, T=6
    # 79.0 / 82.5, T=8 92.8 / 93.1; Flash T=8 203.2 / 203.5, T=10 234.7 / 235.8, T=12 275.1 / 275.2 -
    # level, so the Flash-shaped layer keeps its fork after the front there.
    # NOTE (session 39, H200, the layer bench - graph-chain, 16 rotated sets - us, after the front /
    # after the alignment (layers.SHARED_FORK=align), docs/bench/2026-12-01/session39/): Pro-TP8
    # (I = 384) T=64 373.3 / 360.8 and 375.3 / 360.9, T=96 465.4 / 462.6, T=128 512.3 / 500.7; but T=16
    # 141.1 / 141.5, T=24 200.4 / 198.1, T=32 264.0 / 269.2, T=48 322.1 / 321.2, T=192 569.7 / 573.5, T=256
    # 589.4 / 594.8, T=4 / 8 +3.4 / +4.4 (two runs of the default agree within 0.6 us). Without the
    # shared expert (layers.PROBE_SKIP_SHARED) T=64 takes 343.9-344.6 and T=128 486.6: the fork after
    # the alignment halves its cost there. The rule's run (152faae, the same bench, rule / SHARED_FORK=front):
    # T=48 323.3 / 323.5 (both after the front), T=64 360.5 / 376.1, T=80 429.6 / 428.8, T=112 482.0 /
    # 484.6, T=128 506.4 / 512.1, T=160 553.1 / 547.9 (both after the front: the run-to-run spread at one
    # T is up to ~5 us). So T = 64 gains 12-16 us in all three runs; the rest of the band is level
    # within that spread. Left after the front at I > 384 (unmeasured; I = 2048 runs in line at these T).
    # NOTE (session 49, the layer bench via scripts/gpu_ab_layer.py, three alternating runs, us, rule /
    # "logits" / "logits" with the shared split-K target at 1 and 2 programs per SM; docs/bench/2026-12-02/
    # session49/ab_*_t1_fork_279ea61.txt): Flash T=1 53.7 / 56.8 / 56.9 / 56.9, Pro-TP8 T=1 31.5 / 34.9 /
    # 35.0 / 34.9. One shared program per SM leaves every SM room for the top-k's one CTA and loses as
    # much, so session 30's reading (the shared GEMMs hold the SMs the top-k needs) is not the cause.
    # The profiler's timeline put the logits fork 2 us ahead at Pro-TP8 T = 1 (BENCHMARKS session 49 item 3).
    # NOTE (session 50, BENCHMARKS.md session 50; docs/bench/2026-12-02/session50/): that disagreement was
    # the bench's graph, not the profiler or the rotation: the time per call depends on how many calls the
    # graph holds, by an amount that depends on the streams (same layers, us per call, 16 / 48 calls per
    # graph: Pro-TP8 T=1 logits 35.0 / 31.9, default 31.4 / 32.2; Flash T=1 logits 56.8 / 53.5, default
    # 53.5 / 51.4), and at 48 calls the bench's harness agrees with CUDA events within 0.3 us. The bench
    # now chains >= 64 calls (dsv4_moe.bench.timing.CHAIN_MIN_CALLS). Through it (gpu_ab_layer.py, 2
    # alternating runs, us, front / logits / align): Pro-TP8 T=1 32.2 / 31.2 / 32.8, T=2 43.8 / 41.8 /
    # 42.4, T=4 66.5 / 62.0 / 66.7, T=8 91.5 / 91.5 / 113.0; Flash T=1 51.5 / 53.0 / 51.4, T=2 75.6 / 85.2
    # / 75.5. So Pro-shaped T = 1 now forks after the logits too; Flash keeps its points. A fork before
    # the router (the side stream quantising x itself with the act_quant stage, session 49's "start")
    # lost in both tools:
    # bench (16-call graphs) Pro-TP8 T=1 33.6 / 31.3, T=4 77.6 / 64.4, Flash T=1 54.5 / 53.8; events
    # (48-call graphs) Pro-TP8 T=1 32.8 / 32.0, T=4 68.7 / 62.6 - its act_quant launch and the shared GEMMs share
    # the SMs with the router's logits (9.2 us instead of 6.9 at T=4). Removed.
    # NOTE (session 51, gpu_ab_layer.py, 64-forward graphs, 2 alternating runs each, us, BENCHMARKS.md
    # session 51; docs/bench/2026-12-02/session51/): Flash (I = 2048), front (the rule then) / align: T=2
    # 75.3 / 75.8, T=3 107.0 / 105.6, T=4 126.0 / 121.9, T=5 142.1 / 140.9, T=6 160.2 / 158.6, T=7 181.4 /
    # 182.9, T=8 198.2 / 199.0 (T = 3, 4, 8 the front also read 107.1, 126.0, 197.7 forced). So the
    # Flash-shaped layer forks after the alignment at T = 3-6 too; the rule's run (rule / front): T=3
    # 105.0 / 107.4, T=4 121.6 / 126.4, T=5 140.8 / 142.8, T=6 158.6 / 160.8, T=2 75.4 / 75.5, T=7 182.2 /
    # 181.7. (Session 27's "no pattern" was measured in 12-forward graphs; in one stream the time per
    # forward does not move with the graph's length, with the side stream it does - session 51's
    # gpu_probe_graph_length.py.) Pro-TP8 (I = 384) T = 9-16 keeps the front: front / logits / align
    # T=9 97.5 / 103.1 / 115.5, T=10 103.2 / 110.9 / 120.4, T=12 116.9 / 127.0 / 131.2, T=16 137.6 /
    # 170.1 / 136.9.
    if 0 < intermediate <= 384 and 64 <= num_tokens <= 128:  # measured at I = 384 (narrower: fewer tiles still)
        return "align", (f"T = {num_tokens}, I = {intermediate}: shared expert forked after the routed alignment's "
                         f"launch (measured faster on the H200 at I = 384)")
    if intermediate >= 2048 and (num_tokens == 1 or 3 <= num_tokens <= 6):
        return "align", (f"T = {num_tokens}, I = {intermediate}: shared expert forked after the routed alignment's "
                         f"launch (measured faster on the H200)")
    if 0 < intermediate < 2048 and (num_tokens <= 2 or 4 <= num_tokens <= 8):
        return "logits", (f"T = {num_tokens}, I = {intermediate}: shared expert forked after the router's logits "
                          f"launch (measured faster on the H200)")
    return "front", "shared expert forked right after the front"


SHARED_PREFETCH_POINTS = ("off", "start", "logits")


@functools.lru_cache(maxsize=4096)  # pure; asked on every forward
def shared_prefetch_policy(num_tokens: int, intermediate: int, fork: "str | None") -> tuple[str, str]:
    """(point, reason): whether and where a decode forward prefetches the shared expert's weights
    into the L2 (`layers.SHARED_L2_PREFETCH` "auto"; kernels/l2_prefetch.py): "off", "start"
    (before the router's logits launch) or "logits" (after it). `fork`: where the shared expert
    forks (shared_fork_policy), None when it runs in line."""
    # NOTE (session 33, H200, docs/bench/2026-11-30/session33/): gpu_profile_layer.py --ab
    # dsv4_moe.layers.SHARED_L2_PREFETCH=off,start,logits (12 forwards per graph, 4 weight sets,
    # 3 captures, us; every output bitwise the default's): Pro-TP8 (I = 384) T=1 32.1 / 32.4 / 31.6,
    # T=2 42.9 / 43.6 / 42.5, T=3 57.4 / 57.1 / 55.4, T=4 62.8 / 63.7 / 63.3, T=5 74.4 / 74.0 / 74.1,
    # T=6 79.6 / 80.6 / 79.7, T=8 90.8 / 92.1 / 90.9, T=16 144.4 / 145.9 / 144.1; Flash (I = 2048)
    # T=1 52.8 / 55.0 / 54.7, T=2 75.6 / 80.3 / 80.3, T=3 104.9 / 105.1 / 104.7, T=4 127.7 / 124.7 /
    # 123.5, T=6 164.2 / 162.6 / 161.8, T=8 203.7 / 205.5 / 205.2, T=16 342.4 / 344.7 / 344.1. The
    # layer bench (the method of record, --graph-chain; off / logits): Pro-TP8 T=1 30.9 / 30.9, T=2
    # 41.7 / 42.8, T=3 57.1 / 55.4; Flash T=3 105.7 / 106.0, T=4 122.7 / 123.7, T=6 160.6 / 162.6,
    # T=8 202.8 / 204.8; with this rule (3a078e8, two alternating runs, policy / off): Pro-TP8 T=3 54.9 /
    # 57.3 and 54.9 / 57.2 (T = 1, 2, 4 unchanged, as the rule leaves them: 31.0-31.1, 42.0-42.3,
    # 64.5-64.7). The gain needs a shared expert that forks after the front (Pro-shaped T = 3):
    # where it forks after the logits (T = 2, 4-8) its own GEMMs already read the DRAM during the
    # front. At Flash T = 1 the timeline with the weights prefetched (timeline_layer_pf_start_0eb38cb.txt) shows
    # the shared gate_up GEMV no faster from the L2 (24.5 us beside the routed gate_up either way):
    # the decode GEMMs there wait on issue, not on the DRAM. Prefetching the chosen experts' routed
    # down weights after the front was slower at every T tried (Flash T=1 53.0 / 55.1, T=4 127.4 /
    # 135.2; Pro-TP8 T=1 32.2 / 33.5, T=4 62.4 / 65.9): not kept.
    # NOTE (session 39, the layer bench, graph-chain, us, off / start / logits, with the shared expert
    # forked after the alignment at T = 64-128; all_call7_6bfdcb2.log): Pro-TP8 T=32 265.5 / 264.1 /
    # 262.3, T=48 324.9 / 324.9 / 321.9, T=64 361.8 / 362.8 / 363.1, T=96 460.4 / 463.5 / 462.5, T=128
    # 499.9 (a second default run) / 501.1 / 499.8: level, so off there too. The shared gate_up's 12
    # programs at these T are not helped by L2-resident weights inside the layer.
    # NOTE (session 51, gpu_ab_layer.py, 64-forward graphs, 2 alternating runs each, us; BENCHMARKS.md
    # session 51, docs/bench/2026-12-02/session51/): Pro-TP8 (I = 384) the rule then (off) / logits / shared
    # split-K target 0 / 2 per SM: T=9 97.6 / 95.9 / 97.4 / 98.0, T=10 103.2 / 102.1 / 103.3 / 103.5, T=12
    # 116.8 / 116.0 / 117.1 / 117.1; T = 3, 5, 6 (off / logits, the rule's picks logits / off / off held):
    # 59.3 / 56.0, 69.6 / 69.7, 76.7 / 77.1. With the prefetch at T = 9-16 (rule / off): T=9 96.1 / 98.0,
    # T=10 102.3 / 103.3, T=11 109.5 / 110.5, T=12 116.4 / 116.8, T=13 124.9 / 125.9, T=14 129.3 / 129.2,
    # T=15 135.2 / 136.1, T=16 136.8 / 137.7. Flash T=1 / 2 with the prefetch at logits: 53.4 / 80.3
    # against 51.5 / 75.4 (it forks after the alignment / the front there: off).
    if fork == "front" and 0 < intermediate < 2048 and (num_tokens == 3 or 9 <= num_tokens <= 16):
        return "logits", (f"T = {num_tokens}, I = {intermediate}, shared expert forked after the front: its weights "
                          f"prefetched during the router's top-k and alignment (measured faster on the H200)")
    if fork is None:
        return "off", "shared expert in line"
    return "off", f"T = {num_tokens}, I = {intermediate}: not measured faster on the H200"


@functools.lru_cache(maxsize=4096)  # pure; asked on every forward
def shared_overlap_policy(num_tokens: int, num_local_experts: int, top_k: int,
                          intermediate: int) -> tuple[bool, str]:
    """(overlap, reason): whether a layer forward runs the shared expert on its side stream
    (DeepseekV4MoE(overlap_shared="auto"), CUDA)."""
    # NOTE: H200, session 13 (docs/bench/2026-11-29/session13/profile_layer_overlap_924e2de.txt,
    # graph us, in line with PDL early vs overlapped with PDL at exit, this policy's two
    # choices): Flash (I = 2048, 256 experts) T=16 493.2 / 476.3 (overlap), T=32 716.2 /
    # 744.7, T=48 933.5 / 972.4, T=64 1058.6 / 1109.3, T=96 1240.9 / 1381.0, T=128 1305.2 /
    # 1433.5, T=192 1419.3 / 1493.7, T=256 1440.5 / 1537.5 (in line, 4-10 % faster; session 7
    # measured the same at T=256: 1528.8 / 1583.2), T=384 1913.0 / 1903.2, T=512 and up level.
    # Pro-TP8 (I/tp = 384): the overlap is faster or level at every T (T=8 148.0 vs 169.2 in
    # line, T=256 771.0 vs 813.7). So in line where the Flash-shaped routed GEMMs run the
    # 16-row swap body at 0.5-8 routed rows per expert; overlapped elsewhere.
    # NOTE (session 22, docs/bench/2026-11-30/session22/, H200, layer bench, graphs, rotated
    # weights, us in line / overlapped, two alternating runs each): the Pro-TP8-shaped layer
    # (I/tp = 384) at T = 3-4 runs in line faster: T=3 76.8 / 80.7 and 76.8 / 80.9, T=4 87.1 /
    # 91.0 twice; the overlap stays ahead at T = 1 (53.0 / 49.4), 2 (level, 65.0 / 64.4) and
    # 5-64 (T=5 112.1 / 100.5, T=16 204.5 / 188.3, T=64 431.7 / 418.0).
    # NOTE (session 27, same runs as pdl_policy's session-27 note, us, in line with PDL early /
    # the best overlapped form): Pro-TP8 T=3 65.2 / 60.5 and 63.8 / 58.9, T=4 70.9 / 68.2 and 70.8 /
    # 68.3 - the session-22 in-line band no longer pays since the front changed (the PDL modes
    # above); Flash T=2 88.9 / 91.5 and 88.7 / 91.4 (session 26 call: 89.2-89.5 / 93.0-93.5 at exit,
    # one capture of 86.0-86.1 without PDL) - in line.
    # NOTE (session 28): Flash T=2 overlapped with unsplit shared GEMMs (shared_split_policy) and
    # PDL early took 77.0 us against 88.8 in line (pdl_policy's session-28 note), so T = 2 is
    # overlapped again.
    rows = num_tokens * top_k / max(num_local_experts, 1)
    if intermediate >= 2048 and 0.5 <= rows <= 8:
        return False, (f"in line: {rows:.2f} routed rows per expert with I = {intermediate} (the side "
                       f"stream slowed such layers 4-10 % on the H200)")
    return True, f"on a side stream, overlapped with the routed experts ({rows:.2f} routed rows per expert)"


def has_pdl(device: torch.device) -> tuple[bool, str]:
    if pdl_mode() == "off":
        return False, "programmatic dependent launch off (DSV4_MOE_PDL=off / dispatch.PDL_MODE)"
    ok, why = has_cuda(device)
    if not ok:
        return ok, why
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False, "Triton interpreter (no griddepcontrol)"
    if not torch.cuda.is_available():  # planning for a CUDA context on a CPU-only machine
        return False, "CUDA not available in this process"
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap < (9, 0):
        return False, f"compute capability {cap[0]}.{cap[1]} has no programmatic dependent launch (needs >= 9.0)"
    ok, why = has_triton()
    if not ok:
        return ok, why
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401, PLC0415
    except ImportError:
        return False, "this Triton has no griddepcontrol (triton.language.extra.cuda.gdc_wait)"
    return True, (f"programmatic dependent launch on sm_{cap[0]}{cap[1]}"
                  + (" (mode per forward: pdl_policy)" if PDL_MODE == "auto" else f" (mode {PDL_MODE!r})"))


def is_gfx950(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda" or torch.version.hip is None:
        return False, "not a ROCm device"
    arch = torch.cuda.get_device_properties(device).gcnArchName
    return (arch.startswith("gfx950"), f"gcnArchName {arch}")


# --------------------------------------------------------------------------- context
@dataclass(frozen=True)
class DispatchContext:
    """What the predicates may look at. One per (layer, token count)."""

    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    num_tokens: int = 1
    hidden: int = 4096
    intermediate: int = 2048
    num_experts: int = 256
    num_local_experts: int = 256
    top_k: int = 6
    tp_size: int = 1
    ep_size: int = 1
    is_hash: bool = False
    routed_scale_range: tuple = (127, 127)  # min/max e8m0 byte of the routed weight scales
    router_dtype: torch.dtype = torch.bfloat16  # the gate weight's (the router's logits path)
    extra: tuple = field(default=())


Predicate = Callable[[DispatchContext], "tuple[bool, str]"]


@dataclass(frozen=True)
class Path:
    stage: str
    name: str
    predicate: Predicate
    target: str  # "module:function", imported on first use

    @property
    def impl(self) -> Callable:
        return _resolve(self.target)


@functools.lru_cache(maxsize=None)
def _resolve(target: str) -> Callable:
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)


def _all(*preds: Predicate) -> Predicate:
    def pred(ctx: DispatchContext) -> tuple[bool, str]:
        reasons = []
        for p in preds:
            ok, why = p(ctx)
            if not ok:
                return False, why
            reasons.append(why)
        return True, "; ".join(reasons)
    return pred


def _always(ctx: DispatchContext) -> tuple[bool, str]:
    return True, "plain torch, any device"


def _cuda(ctx):
    return has_cuda(ctx.device)


def _triton(ctx):
    return has_triton()


def _fp8(ctx):
    return has_fp8_mma(ctx.device)


def _bf16(ctx):
    if ctx.dtype != torch.bfloat16:
        return False, f"activations are {ctx.dtype}, kernels take bfloat16"
    return True, "bf16"


def _module_predicate(target: str) -> Predicate:
    """A predicate exported by a kernel module (`supported(ctx) -> (ok, reason)`), imported
    lazily; a module that is not there (not yet built, or import fails) rejects with why."""

    def pred(ctx: DispatchContext) -> tuple[bool, str]:
        try:
            fn = _resolve(target)
        except Exception as e:
            return False, f"{target} unavailable ({type(e).__name__}: {e})"
        return fn(ctx)

    return pred


def _gpu(*more: Predicate) -> Predicate:
    return _all(_cuda, _triton, _bf16, *more)


_S = "dsv4_moe.stages:"


def _stage_pred(name: str) -> Predicate:
    return _module_predicate(_S + name)


# Ordered preference per stage. The reference path exists for every stage and runs on CPU.
# Implementations and shape predicates live in dsv4_moe.stages (adapters over kernels/).
STAGES: dict[str, list[Path]] = {
    # the decode front: x quantised inside the router's logits launch ("quant_in_logits":
    # bitwise act_quant, one launch fewer, where the logits are the Triton GEMV / MMA kernel),
    # else the router, act_quant and routed-alignment stages one by one ("separate"), or in
    # one launch ("fused", kernels/route_front.py: bitwise the same, measured level, so only
    # when forced)
    "front": [
        Path("front", "quant_in_logits", _gpu(_stage_pred("front_quant_in_logits_supported")),
             _S + "front_quant_in_logits"),
        Path("front", "separate", _stage_pred("front_separate_preferred"), _S + "front_separate"),
        Path("front", "fused", _gpu(_stage_pred("front_fused_supported")), _S + "front_fused"),
    ],
    "router": [
        Path("router", "triton", _gpu(_stage_pred("router_triton_supported")), _S + "router_triton"),
        Path("router", "reference", _always, _S + "router_reference"),
    ],
    "act_quant": [
        Path("act_quant", "triton", _gpu(_stage_pred("act_quant_triton_supported")), _S + "act_quant_triton"),
        Path("act_quant", "reference", _always, _S + "act_quant_reference"),
    ],
    "fp8_gemm": [
        Path("fp8_gemm", "deep_gemm", _gpu(_fp8, _stage_pred("fp8_gemm_deep_gemm_supported")),
             _S + "fp8_gemm_deep_gemm"),
        Path("fp8_gemm", "scaled_mm", _gpu(_fp8, _stage_pred("fp8_gemm_scaled_mm_supported")),
             _S + "fp8_gemm_scaled_mm"),
        Path("fp8_gemm", "triton", _gpu(_fp8, _stage_pred("fp8_gemm_triton_supported")), _S + "fp8_gemm_triton"),
        Path("fp8_gemm", "reference", _always, _S + "fp8_gemm_reference"),
    ],
    "swiglu_quant": [
        Path("swiglu_quant", "fused", _gpu(_stage_pred("swiglu_quant_fused_supported")), _S + "swiglu_quant_fused"),
        Path("swiglu_quant", "unfused", _gpu(_stage_pred("swiglu_quant_unfused_supported")),
             _S + "swiglu_quant_unfused"),
        Path("swiglu_quant", "reference", _always, _S + "swiglu_quant_reference"),
    ],
    "routed_experts": [
        Path("routed_experts", "triton", _gpu(_fp8, _stage_pred("routed_experts_triton_supported")),
             _S + "routed_experts_triton"),
        Path("routed_experts", "reference", _always, _S + "routed_experts_reference"),
    ],
    "finalize": [
        Path("finalize", "fused", _gpu(_stage_pred("finalize_fused_supported")), _S + "finalize_fused"),
        Path("finalize", "unfused", _gpu(_stage_pred("finalize_unfused_supported")), _S + "finalize_unfused"),
        Path("finalize", "reference", _always, _S + "finalize_reference"),
    ],
}


# --------------------------------------------------------------------------- forcing
_FORCED: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("dsv4_moe_forced", default={})


@contextlib.contextmanager
def force_paths(**paths: str):
    """Force implementations per stage, e.g. `force_paths(finalize="unfused")`.

    `force_paths(all="reference")` forces the reference path of every stage that has one
    (`all=name` covers the stages with a path of that name). Nested uses
    combine, the innermost winning. Unknown stages or paths raise ValueError.
    """
    if "all" in paths:
        name = paths.pop("all")
        having = [stage for stage, ps in STAGES.items() if any(p.name == name for p in ps)]
        if not having:
            raise ValueError(f"force_paths: all={name!r}: no stage has a path {name!r}")
        for stage in having:  # e.g. "front" has no "reference": it then follows the stages it merges
            paths.setdefault(stage, name)
    for stage, name in paths.items():
        if stage not in STAGES:
            raise ValueError(f"force_paths: unknown stage {stage!r}; stages are {sorted(STAGES)}")
        names = [p.name for p in STAGES[stage]]
        if name not in names:
            raise ValueError(f"force_paths: stage {stage!r} has no path {name!r}; paths are {names}")
    token = _FORCED.set({**_FORCED.get(), **paths})
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced_paths() -> dict[str, str]:
    return dict(_FORCED.get())


# --------------------------------------------------------------------------- choosing
@dataclass(frozen=True)
class StagePlan:
    stage: str
    chosen: Path
    forced: bool
    reason: str
    rejected: tuple[tuple[str, str], ...]  # (path name, reason)


def _env_forced() -> dict[str, str]:
    """DSV4_MOE_FORCE="stage=path,stage=path" (handy for A/B runs from a shell)."""
    raw = os.environ.get("DSV4_MOE_FORCE", "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        if "=" not in item:
            raise ValueError(f"DSV4_MOE_FORCE={raw!r}: expected 'stage=path,...'")
        k, v = (t.strip() for t in item.split("=", 1))
        if k == "all":
            if not any(pa.name == v for ps in STAGES.values() for pa in ps):
                raise ValueError(f"DSV4_MOE_FORCE={raw!r}: all={v!r}: no stage has a path {v!r}")
        elif k not in STAGES:
            raise ValueError(f"DSV4_MOE_FORCE={raw!r}: unknown stage {k!r}; stages are {sorted(STAGES)}")
        elif not any(pa.name == v for pa in STAGES[k]):
            raise ValueError(f"DSV4_MOE_FORCE={raw!r}: stage {k!r} has no path {v!r}; its paths are "
                             f"{[pa.name for pa in STAGES[k]]}")
        out[k] = v
    return out


def plan_stage(stage: str, ctx: DispatchContext) -> StagePlan:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {sorted(STAGES)}")
    forced = {**_env_forced(), **_FORCED.get()}
    want = forced.get(stage)
    if want is None and any(p.name == forced.get("all") for p in STAGES[stage]):
        want = forced["all"]  # DSV4_MOE_FORCE="all=name": the stages that have that path
    rejected = []
    for path in STAGES[stage]:
        if want is not None and path.name != want:
            rejected.append((path.name, f"not the forced path {want!r}"))
            continue
        ok, why = path.predicate(ctx)
        if ok:
            return StagePlan(stage, path, want is not None, why, tuple(rejected))
        if want is not None:
            raise RuntimeError(f"stage {stage!r}: forced path {want!r} cannot run here: {why}")
        rejected.append((path.name, why))
    if want is not None:
        raise ValueError(f"stage {stage!r} has no path {want!r}")
    raise RuntimeError(f"stage {stage!r}: no path can run: {rejected}")  # reference always can


_LOGGED: set = set()

# select()'s memo: (stage, ctx, forced paths, the environment the predicates read) -> Path.
# NOTE: an eager forward selects 8-10 times; planning each from scratch (predicates,
# imports, reason strings) was ~0.35 ms of the ~2.4 ms host time of one H200 forward
# (docs/bench/2026-11-29/session15/host_profile_*.txt). The predicates are pure functions
# of this key and of the process's hardware and installed packages; code that swaps a
# predicate or a hardware fact at run time (tests' monkeypatch) calls clear_plan_cache().
_SELECT_CACHE: dict = {}
_ENV_KEYS = ("DSV4_MOE_FORCE", "TRITON_INTERPRET", "DSV4_MOE_SCALED_MM", "DSV4_MOE_LOG_DISPATCH")
_CLEARERS: list = []
# os.environ.get costs ~1 us (key encoding); on POSIX the environment's byte dict is read
# directly (os.environ writes go through it), elsewhere through os.environ.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_BYTE_KEYS = (tuple(k.encode() for k in _ENV_KEYS)
                  if os.name == "posix" and isinstance(_ENV_DATA, dict) else None)


def _env_state() -> tuple:
    if _ENV_BYTE_KEYS is not None:
        return tuple(map(_ENV_DATA.get, _ENV_BYTE_KEYS))
    return tuple(map(os.environ.get, _ENV_KEYS))


def register_cache(clear: Callable[[], None]) -> None:
    """Have clear_plan_cache() also call `clear` (host-side caches of the kernel wrappers)."""
    _CLEARERS.append(clear)


def clear_plan_cache() -> None:
    """Forget every memoised choice (select) and the registered wrapper caches: needed only
    after replacing a predicate or hardware fact at run time (tests)."""
    _SELECT_CACHE.clear()
    for clear in _CLEARERS:
        clear()


def select(stage: str, ctx: DispatchContext) -> Path:
    """The chosen path of `stage` for `ctx` (plan_stage's choice, memoised)."""
    forced = _FORCED.get()
    key = (stage, ctx, tuple(forced.items()) if forced else (), PDL_MODE, _env_state())
    hit = _SELECT_CACHE.get(key)
    if hit is not None:
        return hit
    p = plan_stage(stage, ctx)
    if os.environ.get("DSV4_MOE_LOG_DISPATCH", "0") not in ("", "0"):
        log_key = (stage, p.chosen.name, ctx)
        if log_key not in _LOGGED:
            _LOGGED.add(log_key)
            print(f"[dsv4_moe] {stage}: {p.chosen.name} ({'forced' if p.forced else p.reason}) "
                  f"T={ctx.num_tokens} device={ctx.device}", file=sys.stderr)
    if len(_SELECT_CACHE) > 65536:  # bounded: a server seeing every T still plans each once
        _SELECT_CACHE.clear()
    _SELECT_CACHE[key] = p.chosen
    return p.chosen


def plan(ctx: DispatchContext, stages: Optional[list[str]] = None) -> list[StagePlan]:
    return [plan_stage(s, ctx) for s in (stages or list(STAGES))]


def explain(ctx: DispatchContext, stages: Optional[list[str]] = None) -> str:
    lines = [f"plan for T={ctx.num_tokens} on {ctx.device} (hidden {ctx.hidden}, intermediate {ctx.intermediate}, "
             f"experts {ctx.num_local_experts}/{ctx.num_experts} local, top-{ctx.top_k}, tp {ctx.tp_size}, "
             f"ep {ctx.ep_size}{', hash layer' if ctx.is_hash else ''}):"]
    pdl, why = has_pdl(ctx.device)
    lines.append(f"  {'launches':<15} -> {'pdl' if pdl else 'plain':<10} ({why})")
    for stage in (stages or list(STAGES)):
        try:
            p = plan_stage(stage, ctx)
        except RuntimeError as e:  # a forced path that cannot run here: said, as a forward would raise it
            lines.append(f"  {stage:<15} -> (none)     a forward raises: {e}")
            continue
        lines.append(f"  {p.stage:<15} -> {p.chosen.name:<10} "
                     f"{'(forced)' if p.forced else '(' + p.reason + ')'}")
        for name, why in p.rejected:
            lines.append(f"  {'':<15}    not {name}: {why}")
    return "\n".join(lines)
