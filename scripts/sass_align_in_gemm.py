"""Offline price (CPU, no GPU needed) of an alignment computed inside every routed gate_up program
(BENCHMARKS.md session 45, item 5): sm_90a SASS of two prologues that find a program's M-block (its
local expert and its <= BLOCK_M route rows) from the top-k ids alone, against the gate_up's K loop.

    python scripts/sass_align_in_gemm.py

* sorted: the alignment kernel's own method (kernels/_moe_align.py `_align_sorted_body`): one sort of
  the BLOCK packed route keys, the segment scans, then the block's rows by a [BLOCK_M, BLOCK] compare;
  any number of routes per expert.
* bitmap: for top-k layers (distinct experts per token, so <= T <= BLOCK_M routes per expert): the
  used experts as a bitmap (an OR over the routes), the block's expert as the pid-th set bit (popcount
  prefix), its rows by a prefix count over the routes that chose it.
* the K loop of the Pro-TP8 gate_up config at T = 8-9 (the layer's, "mma64e"): SASS instructions
  between the loop's head and its back edge, per 128-wide K block.

Prints instructions, CTA barriers, shuffles and shared-memory accesses per thread. Nothing here is
part of the package: the prologues are probes, never launched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_wgmma_hazard as sw  # noqa: E402


@triton.jit
def _maxc(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sorted_prologue(ids_ptr, out_ptr, R, num_local, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                     E_PAD: tl.constexpr):
    pid_m = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    key = tl.load(ids_ptr + i, mask=i < R, other=-1)
    local = (key >= 0) & (key < num_local) & (i < R)
    srt = tl.sort(tl.where(local, key, E_PAD) * BLOCK + i)
    sk = srt // BLOCK
    si = srt % BLOCK
    s_local = sk < E_PAD
    prev = tl.gather(sk, tl.maximum(i - 1, 0), 0)
    nxt = tl.gather(sk, tl.minimum(i + 1, BLOCK - 1), 0)
    start = (i == 0) | (sk != prev)
    last = (i == BLOCK - 1) | (sk != nxt)
    rank = i - tl.associative_scan(tl.where(start, i, 0), 0, _maxc)
    pf = tl.where(last & s_local, (rank + BLOCK_M) // BLOCK_M * BLOCK_M, 0)
    dest = tl.cumsum(pf, axis=0) - pf + rank
    nvb = tl.sum(pf, axis=0) // BLOCK_M
    inb = s_local & (dest // BLOCK_M == pid_m)
    e = tl.max(tl.where(inb, sk, -1), axis=0)
    j = tl.arange(0, BLOCK_M)
    hit = inb[None, :] & ((dest % BLOCK_M)[None, :] == j[:, None])
    route = tl.sum(tl.where(hit, si[None, :], 0), axis=1) + tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0, 0, R)
    tl.store(out_ptr + j, route + e + nvb)


@triton.jit
def _bitmap_prologue(ids_ptr, out_ptr, R, num_local, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                     E_PAD: tl.constexpr):
    pid_m = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    key = tl.load(ids_ptr + i, mask=i < R, other=-1)
    local = (key >= 0) & (key < num_local) & (i < R)
    W: tl.constexpr = E_PAD // 32
    w = tl.arange(0, W)
    bits = tl.where(local[None, :] & ((key // 32)[None, :] == w[:, None]), (1 << (key % 32))[None, :], 0)
    words = tl.reduce_or(bits, axis=1)
    pc = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [words], dtype=tl.int32, is_pure=True, pack=1)
    cum = tl.cumsum(pc, axis=0) - pc
    nvb = tl.sum(pc, axis=0)
    inw = (cum <= pid_m) & (pid_m < cum + pc)
    word = tl.sum(tl.where(inw, words, 0), axis=0)
    nth = pid_m - tl.sum(tl.where(inw, cum, 0), axis=0)
    b = tl.arange(0, 32)
    below = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [word & ((1 << b) - 1)], dtype=tl.int32,
                                      is_pure=True, pack=1)
    e = tl.sum(tl.where(inw, w, 0), axis=0) * 32 + tl.sum(tl.where(((word >> b) & 1 == 1) & (below == nth), b, 0),
                                                         axis=0)
    m = local & (key == e)
    pos = tl.cumsum(m.to(tl.int32), axis=0) - 1
    j = tl.arange(0, BLOCK_M)
    hit = m[None, :] & (pos[None, :] == j[:, None])
    route = tl.sum(tl.where(hit, i[None, :], 0), axis=1) + tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0, 0, R)
    tl.store(out_ptr + j, route + e + nvb)


def _sass(fn, consts: dict, num_warps: int = 4) -> list[tuple[int, str]]:
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else ("*i32" if n.endswith("ptr") else "i32")) for n in names}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    with tempfile.TemporaryDirectory() as d:
        cub = os.path.join(d, "k.cubin")
        open(cub, "wb").write(c.asm["cubin"])
        text = subprocess.run([sw._tool("cuobjdump"), "-sass", cub], capture_output=True, text=True, check=True).stdout
    return sw.parse_sass(text)


def _counts(ins: list[tuple[int, str]]) -> str:
    bars = sum(1 for _, s in ins if re.search(r"\bBAR\.SYNC", s))
    shfl = sum(1 for _, s in ins if "SHFL" in s)
    smem = sum(1 for _, s in ins if re.match(r"(@!?U?P\w+ )?(LDS|STS)\b", s))
    return f"{len(ins)} instructions, {bars} CTA barriers, {shfl} shuffles, {smem} shared-memory accesses"


def _k_loop(label: str = "pro-tp8 gate_up T=8") -> str:
    """SASS instructions per iteration of the gate_up's K loop (head to back edge)."""
    for name, cfg, k, gather in sw.default_configs():
        if name == label:
            consts = sw.config_constexprs(cfg, k, gather)
            consts["W_ENC"] = True
            text, regs, _ = sw.compile_swap(consts, cfg.num_warps, cfg.maxnreg)
            ins = sw.parse_sass(text)
            back = [(a, int(m.group(1), 16)) for a, s in ins for m in [re.search(r"BRA\s+0x([0-9a-f]+)", s)]
                    if m and int(m.group(1), 16) < a]
            a, head = max(back, key=lambda ab: ab[0] - ab[1])   # the longest backward branch: the K loop
            n = sum(1 for x, _ in ins if head <= x <= a)
            return f"{label} (16 x {cfg.block_n}, split {cfg.split_k}, {regs} registers): {n} instructions per K block"
    raise SystemExit(f"no config labelled {label!r}")


def main() -> int:
    consts = {"BLOCK": 128, "BLOCK_M": 16, "E_PAD": 512}   # Pro-TP8 shapes: <= 96 routes, 384 experts
    print(f"triton {triton.__version__}, ptxas {'.'.join(map(str, sw.ptxas_version()))}, sm_90a, 4 warps, "
          f"{consts}")
    print(f"sorted prologue: {_counts(_sass(_sorted_prologue, consts))}")
    print(f"bitmap prologue: {_counts(_sass(_bitmap_prologue, consts))}")
    print(_k_loop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
