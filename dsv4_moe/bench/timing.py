"""Timing for the layer benchmark: CUDA events, CUDA-graph replay, rotated input sets, median.

    time_sets(fns, device=..., graphs=..., context=...) -> Timing

`fns` holds one zero-argument callable per rotated input set (different x / routing /
weight copies), so consecutive calls touch different memory and the H200's 60 MB L2 does
not serve the next call from cache. On CUDA:

1. warm-up: every callable runs twice on a side stream (also triggers Triton JIT);
2. with graphs, each callable is captured into its own CUDA graph and replayed; if capture
   raises (a host sync, a dynamic allocation), it falls back to eager and says so in
   `Timing.mode`. With `chain=True` all the callables are captured one after the other into
   one graph (mode "graph-chain"), as a model's graph holds its layers: no graph launch
   between two calls, and programmatic dependent launch reaches from one call into the next.
   One replay is then n calls - or the rotation repeated until the graph holds `chain_min_calls`
   calls (a model's graph holds ~43-61 MoE layers), while one replay stays under CHAIN_MAX_MS;
3. one calibration batch sizes the inner loop so each timed batch lasts >= target_ms;
4. `reps` batches are timed with CUDA events around the whole batch, cycling the sets;
   the reported time is the median batch time / calls.

On CPU the same loop runs with time.perf_counter and no graphs.

`measure_hardware(device)` measures the ceilings the floor is computed from, in the same
process: device-to-device copy (read + write counted), bf16 matmul, FP8 tensorwise
`torch._scaled_mm` (8192^3 on CUDA).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import torch

__all__ = ["Timing", "time_sets", "measure_hardware", "Hardware"]


@dataclass
class Timing:
    """Median / min microseconds per call over `reps` batches; mode 'graph', 'eager', 'cpu'
    or 'eager (graph capture failed: ...)'."""

    median_us: float
    min_us: float
    mode: str
    n_sets: int
    calls_per_batch: int
    samples_us: list = field(default_factory=list)
    graph_calls: int = 1  # calls captured in one graph ("graph-chain": the rotation, maybe repeated)

    def as_dict(self) -> dict:
        return {"us": self.median_us, "us_min": self.min_us, "mode": self.mode, "n_sets": self.n_sets,
                "calls_per_batch": self.calls_per_batch, "graph_calls": self.graph_calls}


# NOTE (session 50, H200, BENCHMARKS.md session 50): the time per call depends on how many calls the
# chained graph holds, in either direction and by an amount that depends on the streams. The same
# layers in one graph of the 16-call rotation and of that rotation three times over (48 calls), us per
# call: Flash T = 1 53.5 / 51.4, with the shared expert forked after the logits 56.8 / 53.5; Pro-TP8
# T = 1 31.4 / 32.2, with that fork 35.0 / 31.9; T = 4 65.3 / 63.3, with a fork before the router
# 78.8 / 71.4. The idle time between replays is 1.8-2.4 us. From 48 calls on the figures agree with
# CUDA events over a 48-call graph (within 0.3 us at T = 1) and with 64-call graphs (within 0.7), and
# a model's decode graph holds 43 (Flash) or 61 (Pro) MoE layers, so the chain now holds at least
# CHAIN_MIN_CALLS calls. The mechanism was not found (DESIGN.md, leads left by session 50).
CHAIN_MIN_CALLS = 64
CHAIN_MAX_MS = 50.0  # no repeat beyond this much device time per replay (large T: a few calls already take long)


def chain_repeats(n_calls: int, replay_ms: float, min_calls: int = CHAIN_MIN_CALLS,
                  max_ms: float = CHAIN_MAX_MS) -> int:
    """How often a rotation of n_calls calls (one replay of it: replay_ms) repeats in one chained
    graph: enough for min_calls calls, as long as one replay of the whole stays within max_ms;
    at least once."""
    if n_calls < 1:
        raise ValueError(f"chain_repeats: n_calls={n_calls!r}: expected >= 1")
    want = max(1, math.ceil(min_calls / n_calls))
    fit = max(1, int(max_ms / replay_ms + 1e-9)) if replay_ms > 0 else want
    return min(want, fit)


def _nullctx() -> ContextManager:
    return contextlib.nullcontext()


def time_sets(fns: Sequence[Callable[[], object]], *, device: str, graphs: bool = True, reps: int = 15,
              target_ms: float = 3.0, max_inner: int = 200,
              context: Callable[[], ContextManager] = _nullctx, chain: bool = False,
              chain_min_calls: int = CHAIN_MIN_CALLS) -> Timing:
    """Time a rotation of callables; see the module docstring. `context()` is entered around
    every eager call and every capture (e.g. `force_paths(...)`); graph replays need it not.
    `chain` (graphs only): all callables in one graph, repeated up to `chain_min_calls` calls
    (1: the rotation once), the time still per call."""
    if not fns:
        raise ValueError("time_sets: fns is empty; expected one callable per rotated input set")
    if reps < 1:
        raise ValueError(f"time_sets: reps={reps!r}: expected >= 1")
    if chain_min_calls < 1:
        raise ValueError(f"time_sets: chain_min_calls={chain_min_calls!r}: expected >= 1")
    if str(device).startswith("cuda"):
        return _time_cuda(list(fns), graphs, reps, target_ms, max_inner, context, chain, chain_min_calls)
    return _time_cpu(list(fns), reps, target_ms, max_inner, context)


def _time_cpu(fns, reps, target_ms, max_inner, context) -> Timing:
    n = len(fns)
    with context():
        for f in fns:
            f()
        t0 = time.perf_counter()
        for f in fns:
            f()
        one_ms = (time.perf_counter() - t0) * 1e3 / n
        inner = n * min(max_inner, max(1, math.ceil(target_ms / max(one_ms * n, 1e-3))))
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(inner):
                fns[i % n]()
            samples.append((time.perf_counter() - t0) * 1e6 / inner)
    return Timing(statistics.median(samples), min(samples), "cpu", n, inner, samples)


def _capture(group):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in group:
            f()
    return g


def _replay_ms(g) -> float:
    """One replay of g, timed by events after one untimed replay."""
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _time_cuda(fns, graphs, reps, target_ms, max_inner, context, chain=False,
               chain_min_calls=CHAIN_MIN_CALLS) -> Timing:
    cur = torch.cuda.current_stream()
    runners = fns
    mode = "eager"
    captured = []
    # Warm-up on a side stream (the pattern torch.cuda.graphs recommends before capture).
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with context(), torch.cuda.stream(side):
        for f in fns:
            f()
            f()
    cur.wait_stream(side)
    torch.cuda.synchronize()
    repeats = 1
    if graphs:
        try:
            with context():
                for group in ([fns] if chain else [[f] for f in fns]):
                    captured.append(_capture(group))
                if chain and chain_min_calls > len(fns):
                    repeats = chain_repeats(len(fns), _replay_ms(captured[0]), chain_min_calls)
                    if repeats > 1:
                        captured = []
                        torch.cuda.synchronize()
                        captured.append(_capture(list(fns) * repeats))
            runners = [g.replay for g in captured]
            mode = "graph-chain" if chain else "graph"
        except Exception as e:  # noqa: BLE001 - any capture failure means "time it eagerly"
            torch.cuda.synchronize()
            captured = []
            mode = f"eager (graph capture failed: {type(e).__name__}: {str(e)[:120]})"
    ctx = _nullctx if mode.startswith("graph") else context
    calls = len(fns) * repeats if mode == "graph-chain" else 1  # calls per runner
    n = len(runners)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with ctx():
        for r in runners:
            r()
        start.record()
        for r in runners:
            r()
        end.record()
        end.synchronize()
        one_ms = start.elapsed_time(end) / n
        inner = n * min(max_inner, max(1, math.ceil(target_ms / max(one_ms * n, 1e-3))))
        samples = []
        for _ in range(reps):
            start.record()
            for i in range(inner):
                runners[i % n]()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / (inner * calls))
    del captured
    return Timing(statistics.median(samples), min(samples), mode, len(fns), inner * calls, samples, calls)


@dataclass
class Hardware:
    """Ceilings measured in this process. Rates in bytes/s and FLOP/s; None = not measured."""

    device_name: str
    copy_bytes_per_s: float
    bf16_flops_per_s: Optional[float]
    fp8_flops_per_s: Optional[float]
    fp32_flops_per_s: Optional[float] = None
    notes: list = field(default_factory=list)

    @property
    def floor_matmul(self) -> str:
        """FP8 dense (the package's GEMMs run FP8 MMA), else bf16, else fp32 (CPU)."""
        return "fp8" if self.fp8_flops_per_s else ("bf16" if self.bf16_flops_per_s else "fp32")

    @property
    def mm_flops_per_s(self) -> float:
        return {"fp8": self.fp8_flops_per_s, "bf16": self.bf16_flops_per_s,
                "fp32": self.fp32_flops_per_s}[self.floor_matmul]

    def as_dict(self) -> dict:
        def tf(v):
            return None if v is None else v / 1e12

        return {"device_name": self.device_name, "copy_TBps": self.copy_bytes_per_s / 1e12,
                "bf16_TFLOPs": tf(self.bf16_flops_per_s), "fp8_TFLOPs": tf(self.fp8_flops_per_s),
                "fp32_TFLOPs": tf(self.fp32_flops_per_s), "floor_matmul": self.floor_matmul,
                "floor_TFLOPs": tf(self.mm_flops_per_s), "notes": list(self.notes)}


def _median_ms(fn, device, reps=10, warm=2) -> float:
    for _ in range(warm):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        st = torch.cuda.Event(enable_timing=True)
        en = torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(reps):
            st.record()
            fn()
            en.record()
            en.synchronize()
            ts.append(st.elapsed_time(en))
        return statistics.median(ts)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def measure_hardware(device: str, *, quick: bool = False) -> Hardware:
    """Copy bandwidth, bf16 and FP8 matmul rates on `device`.

    CUDA: copy of 1 GiB (read + write = 2 GiB moved), 8192^3 bf16 matmul, 8192^3 FP8
    `torch._scaled_mm` with tensorwise scales (fast accumulation off, as a blockwise kernel
    must rescale per block). CPU: 64 MiB copy and a 512^3 fp32 matmul; no FP8/bf16 rate.
    `quick` shrinks the CUDA sizes (tests).
    """
    device = str(device)
    notes = []
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        n = (1 << 24) if quick else (1 << 29)
        m = 1024 if quick else 8192
    else:
        name = "cpu"
        n = 1 << 25
        m = 512
    x = torch.empty(n, device=device, dtype=torch.bfloat16).fill_(1.0)
    y = torch.empty_like(x)
    ms = _median_ms(lambda: y.copy_(x), device)
    copy_bw = 2 * n * 2 / (ms * 1e-3)
    notes.append(f"copy: {n * 2 / 2**20:.0f} MiB bf16 d2d, read + write counted")
    del x, y
    fp8 = bf16 = fp32 = None
    if not device.startswith("cuda"):
        # CPU bf16 matmul is emulated (slow); the CPU floor uses fp32, labelled as such.
        a = torch.randn(m, m)
        ms = _median_ms(lambda: a @ a, device, reps=5)
        fp32 = 2 * m**3 / (ms * 1e-3)
        notes.append(f"cpu: fp32 matmul {m}^3; no FP8/bf16 rate, the floor uses fp32")
        return Hardware(name, copy_bw, None, None, fp32, notes)
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ms = _median_ms(lambda: a @ b, device, reps=8)
    bf16 = 2 * m**3 / (ms * 1e-3)
    notes.append(f"bf16 matmul {m}^3 random")
    try:
        a8 = (a * 0.5).to(torch.float8_e4m3fn)
        b8 = (b * 0.5).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device, dtype=torch.float32)
        ms = _median_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                 out_dtype=torch.bfloat16), device, reps=8)
        fp8 = 2 * m**3 / (ms * 1e-3)
        notes.append(f"fp8 e4m3 _scaled_mm tensorwise {m}^3")
        del a8, b8
    except Exception as e:  # noqa: BLE001 - no FP8 MMA: the floor falls back to bf16
        notes.append(f"fp8 _scaled_mm unavailable ({type(e).__name__}: {str(e)[:100]}); floor uses bf16")
    del a, b
    torch.cuda.empty_cache()
    return Hardware(name, copy_bw, bf16, fp8, None, notes)
