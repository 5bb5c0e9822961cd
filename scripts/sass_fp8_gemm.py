"""Static look at the FP8 block GEMM (CPU, no GPU needed; session 40): its MMA-tile kernel compiled
for sm_90a as a launch would (Triton's bundled ptxas; M, N, K and the strides specialised divisible
by 16, as Triton's argument specialisation does for the V4 shapes), with and without
fp8_block_gemm.SCALE_PREFETCH: registers, instruction counts per opcode class, and each SASS into
$OUT (default ./out) to read the K loop.

    python3 scripts/sass_fp8_gemm.py
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

from sass_wgmma_hazard import _tool  # scripts/ is on sys.path when this script runs

OPCODES = ("LDGSTS", "LDG", "QGMMA", "HMMA", "WARPGROUP", "DEPBAR", "BAR", "LDS", "LDSM", "FMUL", "FADD")
CASES = ((64, 64, False), (16, 64, False), (64, 64, True), (16, 64, True), (64, 128, True))


def compile_fp8(bm: int, bn: int, prefetch: bool, imprecise: int = 32, stages: int = 4, warps: int = 4):
    """(sass text, cuobjdump -res-usage text) of _fp8_block_gemm_kernel's single pass, e8m0 weight scales."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_moe.kernels import _fp8_block_gemm as body

    fn = body._fp8_block_gemm_kernel
    names = fn.arg_names
    consts = dict(SB_E8M0=True, EVEN_K=True, IMPRECISE=imprecise, SOFTWARE=False, SPLIT=False,
                  SCALE_PREFETCH=prefetch, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8 if bm == 64 else 1, PDL=0)
    ptr = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*u8", "c_ptr": "*bf16",
           "ws_ptr": "*fp32"}
    sig = {n: ("constexpr" if n in consts else ptr.get(n, "i32")) for n in names}
    divisible = {"M", "N", "K", "stride_am", "stride_bn", "stride_cm"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (sig[n].startswith("*") or n in divisible)}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                                 attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False))
    with tempfile.TemporaryDirectory() as d:
        cub = os.path.join(d, "k.cubin")
        with open(cub, "wb") as f:
            f.write(c.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cub], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cub], capture_output=True, text=True).stdout
    return sass, res


def opcode_counts(sass: str) -> tuple[int, dict]:
    """(instructions, {opcode class: count}) of a cuobjdump listing."""
    counts: dict = {}
    lines = [x for x in sass.splitlines() if re.match(r"^\s+/\*[0-9a-f]{4,}\*/", x)]
    for line in lines:
        words = line.split("*/")[1].strip().split()
        op = words[1] if words[0].startswith("@") else words[0]
        op = op.split(".")[0]
        counts[op] = counts.get(op, 0) + 1
    return len(lines), counts


def main() -> int:
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    for bm, bn, prefetch in CASES:
        sass, res = compile_fp8(bm, bn, prefetch)
        tag = f"{bm}x{bn}{'_prefetch' if prefetch else ''}"
        with open(os.path.join(out, f"fp8_{tag}.sass"), "w") as f:
            f.write(sass)
        n, counts = opcode_counts(sass)
        regs = re.search(r"REG:(\d+)", res)
        print(f"{tag:>16}: {regs.group(1) if regs else '?'} registers, {n} instructions;",
              ", ".join(f"{op} {counts.get(op, 0)}" for op in OPCODES), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
