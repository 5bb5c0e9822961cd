"""H200 probe: the decode floor of a layer built from dependent kernel launches.

    OUT=./out python3 scripts/gpu_floor_decode.py

Two measurements, both under CUDA-graph replay (scripts/gpu_probe_swz.py's graph_time):

* null chain: N dependent launches of a kernel that reads one int and writes one int per
  program (132 programs, pdl_enter first), for N = 1, 6, 12 (the layer runs 12-15
  launches at T <= 16, two streams), PDL off / early / exit: the per-launch floor.
* weight stream: the routed weight bytes of top-6 decode read once by two dependent
  launches (the gate_up experts, then the down experts; 16-byte loads, an xor per
  program), for Flash and Pro-TP8 at T = 1 (6 experts) and T = 4 (24 experts): the time
  a memory-bound pair of GEMMs cannot beat, and its TB/s.

The floor of a layer = its launch chain + its two dependent weight streams (the shared
expert overlaps on a side stream). Writes $OUT/floor_decode.json.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from dsv4_moe import dispatch
from dsv4_moe.kernels._triton_utils import pdl_enter, pdl_options

DEV = torch.device("cuda")


@triton.jit
def _null_kernel(x_ptr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    v = tl.load(x_ptr + pid)
    tl.store(x_ptr + pid, v + 1)


@triton.jit
def _stream_kernel(w_ptr, ids_ptr, out_ptr, expert_bytes, CHUNK: tl.constexpr, PDL: tl.constexpr = 0):
    """Program (e, c): xor of chunk c (4 x CHUNK int32 words) of expert ids[e]'s region."""
    pdl_enter(PDL)
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    n_words = expert_bytes // 4
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.int32)
    for i in tl.static_range(4):  # 4 independent loads in flight per program
        o = c * CHUNK * 4 + i * CHUNK + offs
        acc ^= tl.load(w_ptr + e * n_words + o, mask=o < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + c, tl.xor_sum(acc, 0))


def graph_time(fn, reps=25, inner=10):
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return sorted(times)[len(times) // 2]


def main():
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    x = torch.zeros(sms, dtype=torch.int32, device=DEV)
    for mode in ("off", "early", "exit"):
        with dispatch.pdl_scope(mode):
            opts = pdl_options(DEV)
            for n in (1, 6, 12):
                def chain(n=n, opts=opts):
                    for _ in range(n):
                        _null_kernel[(sms,)](x, **opts)
                us = graph_time(chain)
                rows.append(dict(kind="null_chain", pdl=mode, launches=n, us=us, us_per_launch=us / n))
                print(f"null chain  PDL {mode:5s} {n:3d} launches {us:7.2f} us  {us / n:5.2f} us/launch", flush=True)
    chunk = 2048  # int32 words per sub-chunk: 8 KiB, 32 KiB per program
    shapes = {  # (gate_up bytes, down bytes) per expert, codes + e8m0 scales
        "flash": (4096 * 4096 // 2 + 4096 * 128, 4096 * 2048 // 2 + 4096 * 64, 256),
        "pro_tp8": (768 * 7168 // 2 + 768 * 224, 7168 * 384 // 2 + 7168 * 12, 384),
    }
    gen = torch.Generator().manual_seed(0)
    for name, (b_up, b_dn, e) in shapes.items():
        b_up, b_dn = -(-b_up // 16) * 16, -(-b_dn // 16) * 16
        w_up = torch.randint(0, 2 ** 31 - 1, (e * b_up // 4,), dtype=torch.int32, device=DEV)
        w_dn = torch.randint(0, 2 ** 31 - 1, (e * b_dn // 4,), dtype=torch.int32, device=DEV)
        for t in (1, 4):
            hit = torch.unique(torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)])).int().to(DEV)
            g_up = (hit.numel(), triton.cdiv(b_up // 4, 4 * chunk))
            g_dn = (hit.numel(), triton.cdiv(b_dn // 4, 4 * chunk))
            o_up = torch.empty(g_up[0] * g_up[1], dtype=torch.int32, device=DEV)
            o_dn = torch.empty(g_dn[0] * g_dn[1], dtype=torch.int32, device=DEV)
            for mode in ("off", "exit"):
                with dispatch.pdl_scope(mode):
                    opts = pdl_options(DEV)

                    def both(opts=opts, g_up=g_up, g_dn=g_dn, o_up=o_up, o_dn=o_dn, hit=hit):
                        _stream_kernel[g_up](w_up, hit, o_up, b_up, CHUNK=chunk, num_warps=4, **opts)
                        _stream_kernel[g_dn](w_dn, hit, o_dn, b_dn, CHUNK=chunk, num_warps=4, **opts)

                    us = graph_time(both)
                    nbytes = hit.numel() * (b_up + b_dn)
                    rows.append(dict(kind="weight_stream", shape=name, T=t, experts=hit.numel(), pdl=mode,
                                     bytes=nbytes, us=us, TBps=nbytes / us / 1e6))
                    print(f"stream {name:8s} T={t} {hit.numel():3d} experts PDL {mode:4s} {nbytes / 1e6:7.1f} MB "
                          f"{us:7.2f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True)
    with open(os.path.join(out_dir, "floor_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
