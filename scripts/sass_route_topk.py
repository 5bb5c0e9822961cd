"""Offline size (CPU, no GPU needed) of the router's top-k kernel as the layer compiles it for decode
(BENCHMARKS.md session 47, item 3): sm_90a SASS of `_route_topk_kernel` with V4's k = 6, E = 384
(E_PAD 512), the bias, sqrt-softplus applied in the kernel, the packed selection, 4 warps and PDL, once
reading whole logits (PARTS = 1: T <= 4, the GEMV logits), once summing the tensor-core logits' 14
split-K partials (Pro's H = 7168 in chunks of 512: T = 5-16), and once as T = 1 launches it, also writing
the routed alignment (router.TOPK_ALIGN_T1, session 48).

    python scripts/sass_route_topk.py

Prints SASS instructions, CTA barriers, shuffles, shared-memory accesses, global loads and MUFU
instructions per thread. With ncu's ~4.8 cycles per issued instruction at one CTA per SM (session 47)
the instruction count is most of the kernel's time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_wgmma_hazard as sw  # noqa: E402

from dsv4_moe.kernels._router import _route_topk_kernel  # noqa: E402

_TYPES = dict(scores_ptr="*fp32", bias_ptr="*fp32", tid2eid_ptr="*i32", input_ids_ptr="*i64", out_w_ptr="*fp32",
              out_ids_ptr="*i32", E="i32", stride_s="i32", stride_tab="i32", scale="fp32", part_stride="i32")


_ALIGN_TYPES = dict(route_rows_ptr="*i32", expert_counts_ptr="*i32", expert_offsets_ptr="*i32", num_blocks_ptr="*i32",
                    sorted_ids_ptr="*i32", block_expert_ptr="*i32", row_expert_ptr="*i32", row_weight_ptr="*fp32",
                    first_expert="i32", num_local="i32", max_blocks="i32")


def topk_sass(parts: int, num_warps: int = 4, align: bool = False) -> list[tuple[int, str]]:
    """The kernel's SASS (the constexprs `router.route_topk` passes at E = 384, k = 6, on the H200);
    align: as the layer launches it at T = 1 with TOPK_ALIGN_T1 (BLOCK_M 16, 384 local experts)."""
    fn = _route_topk_kernel
    consts = dict(TOP_K=6, K_PAD=8, E_PAD=512, HAS_BIAS=True, HASH=False, APPLY_SCORES=True, PDL=1,
                  PACKED=True, PARTS=parts, ALIGN=align, BLOCK_M=16, ROWS_PAD=128, MB_PAD=8, EL_PAD=512)
    types = dict(_TYPES, **_ALIGN_TYPES) if align else _TYPES
    if not align:   # the alignment's pointers and sizes are left at their defaults (None / 0 / 1)
        consts.update({n: fn.params[fn.arg_names.index(n)].default for n in _ALIGN_TYPES})
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, enable_reflect_ftz=False))
    with tempfile.TemporaryDirectory() as d:
        cub = os.path.join(d, "k.cubin")
        with open(cub, "wb") as f:
            f.write(c.asm["cubin"])
        text = subprocess.run([sw._tool("cuobjdump"), "-sass", cub], capture_output=True, text=True, check=True).stdout
    return sw.parse_sass(text)


def counts(ins: list[tuple[int, str]]) -> str:
    def n(pat: str) -> int:
        return sum(1 for _, s in ins if re.search(pat, s))
    bars, smem = n(r"\bBAR\."), n(r"^(@!?U?P\w+ )?(LDS|STS)\b")
    return (f"{len(ins)} instructions, {bars} CTA barriers, {n('SHFL')} shuffles, {smem} shared-memory accesses, "
            f"{n('LDG')} global loads, {n('MUFU')} MUFU")


def main() -> int:
    print(f"triton {triton.__version__}, ptxas {'.'.join(map(str, sw.ptxas_version()))}, sm_90a, 4 warps, "
          "E = 384, k = 6, packed selection")
    for parts, what in ((1, "whole logits (T <= 4)"), (14, "14 logit partials (Pro, T = 5-16)")):
        print(f"top-k, {what}: {counts(topk_sass(parts))}")
    print(f"top-k, whole logits, aligning its token's routes (T = 1, TOPK_ALIGN_T1): {counts(topk_sass(1, align=True))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
