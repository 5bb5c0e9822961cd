"""GraphedMoE: a DeepseekV4MoE forward replayed from CUDA graphs, one per token count.

An eager forward launches 10-13 kernels through Python; on the H200's host that costs
1.3-2.6 ms per layer (scripts/gpu_host_profile.py, BENCHMARKS.md session 15), while the
same forward replayed from a CUDA graph takes 41-460 us at T <= 16. Engines capture their
whole decode step in a graph and need nothing from here; this wrapper is for a standalone
caller that wants graph speed per layer:

    graphed = GraphedMoE(layer, token_counts=(1, 2, 4, 8, 16))
    out = graphed(x, input_ids)          # T in token_counts: copy in, replay, copy out

Per captured T it holds a static input (and, on hash layers, a static input_ids) and the
graph's output; a call copies x (and input_ids) into them, replays, and returns a clone
of the output (`clone=False` returns the static buffer itself, overwritten by the next
call with the same T). Graphs are captured on first use of a T (or all at once with
`capture()`), largest first, in one shared memory pool.

What a graph freezes: the plan at capture time - `dispatch` choices, force_paths, the
PDL mode and the layer's weights (their addresses). Call `reset()` after changing any of
them (or after moving the layer). A T not in token_counts runs the eager forward
(same bits: tests/scripts check graph == eager), or raises with `strict=True`.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ._types import is_int
from .layers import DeepseekV4MoE

__all__ = ["GraphedMoE"]


class GraphedMoE:
    """A DeepseekV4MoE forward replayed from CUDA graphs, one per token count (see the module
    docstring): GraphedMoE(layer, token_counts, strict=False, clone=True); call it as the layer,
    graphed(x, input_ids=None); capture() captures every T now, reset() drops the graphs."""

    def __init__(self, layer: DeepseekV4MoE, token_counts: Iterable[int], *, strict: bool = False,
                 clone: bool = True):
        if not isinstance(layer, DeepseekV4MoE):
            raise TypeError(f"layer: expected a DeepseekV4MoE, got {type(layer).__name__}")
        if isinstance(token_counts, (str, bytes)) or not (isinstance(token_counts, int)
                                                           or hasattr(token_counts, "__iter__")):
            raise ValueError(f"token_counts={token_counts!r}: expected an int or an iterable of ints >= 1")
        for key, v in (("strict", strict), ("clone", clone)):
            if not isinstance(v, bool):
                raise ValueError(f"{key}={v!r}: expected True or False")
        counts = tuple(token_counts) if not isinstance(token_counts, int) else (token_counts,)
        bad = [t for t in counts if not is_int(t) or t < 1]
        if not counts or bad:
            raise ValueError(f"token_counts={counts!r}: expected one or more ints >= 1"
                             + (f" (bad: {bad})" if bad else ""))
        if layer.device.type != "cuda":
            raise ValueError(f"layer is on {layer.device}: CUDA graphs need the layer on a CUDA device")
        if layer.tp_size > 1 or layer.ep_size > 1:
            raise ValueError(f"layer has tp_size={layer.tp_size}, ep_size={layer.ep_size}: its forward all-reduces "
                             f"across ranks; capture the distributed step in the engine's own graph instead")
        self.layer = layer
        self.token_counts = tuple(sorted(set(counts), reverse=True))
        self.strict = bool(strict)
        self.clone = bool(clone)
        self._graphs: dict[int, tuple] = {}   # T -> (graph, x_static, ids_static | None, out_static)
        self._pool = None
        self.replays = 0
        self.eager_calls = 0

    # ------------------------------------------------------------------ capture
    def capture(self, token_counts: Optional[Iterable[int]] = None) -> "GraphedMoE":
        """Capture the graphs of `token_counts` (default: all of them) now, largest T first."""
        wanted = self.token_counts if token_counts is None else tuple(token_counts)
        for t in sorted(set(wanted), reverse=True):
            if t not in self.token_counts:
                raise ValueError(f"token_counts: T={t} is not one of this wrapper's {self.token_counts}")
            if t not in self._graphs:
                self._graphs[t] = self._capture(t)
        return self

    def _capture(self, t: int) -> tuple:
        layer = self.layer
        dev = layer.device
        x = torch.zeros((t, layer.config.hidden_size), dtype=torch.bfloat16, device=dev)
        ids = torch.zeros((t,), dtype=torch.int64, device=dev) if layer.is_hash else None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(side):  # compile and warm up off the capture
            for _ in range(2):
                layer(x, ids)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool):
            out = layer(x, ids)
        return graph, x, ids, out

    def reset(self) -> None:
        """Drop every captured graph (after changing weights, forced paths or the PDL mode)."""
        self._graphs.clear()
        self._pool = None

    # ------------------------------------------------------------------ call
    def __call__(self, hidden_states: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        layer = self.layer
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
            raise ValueError(f"hidden_states: expected a [T, {layer.config.hidden_size}] tensor, got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        t = hidden_states.shape[0]
        if t not in self.token_counts:
            if self.strict:
                raise ValueError(f"hidden_states: T={t} tokens has no graph (token_counts={self.token_counts}, "
                                 f"strict=True)")
            self.eager_calls += 1
            return layer(hidden_states, input_ids)
        # the eager forward's own checks (shape, dtype, device, input_ids) before any copy
        if hidden_states.shape[1] != layer.config.hidden_size or hidden_states.dtype != torch.bfloat16 \
                or hidden_states.device != layer.device:
            return layer(hidden_states, input_ids)  # raises with the layer's message
        if layer.is_hash and (not isinstance(input_ids, torch.Tensor) or input_ids.shape != (t,)
                              or input_ids.device != layer.device
                              or input_ids.dtype not in (torch.int64, torch.int32)):
            return layer(hidden_states, input_ids)  # raises with the layer's message
        entry = self._graphs.get(t)
        if entry is None:
            entry = self._graphs[t] = self._capture(t)
        graph, x, ids, out = entry
        x.copy_(hidden_states)
        if ids is not None:
            ids.copy_(input_ids)
        graph.replay()
        self.replays += 1
        return out.clone() if self.clone else out

    def __repr__(self) -> str:
        return (f"GraphedMoE(layer {self.layer.layer_idx}, token_counts={self.token_counts}, "
                f"captured={sorted(self._graphs)}, strict={self.strict}, clone={self.clone})")
