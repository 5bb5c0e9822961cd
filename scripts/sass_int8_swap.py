"""Offline SASS count (CPU, no GPU needed) of a W4A8 decode body on the integer tensor cores - the
exact route DESIGN.md's session-48 lead (c) priced on paper - against the shipped swap body's K loop,
counted the same way (the longest backward-branch range of the compiled kernel).

    python scripts/sass_int8_swap.py

The probe kernel is the swap orientation at decode (BN weight rows x 128 k per step, one warpgroup):
weights assumed re-encoded at load so each 32-bit word holds 8 nibbles of one row and one 32-group, the
4 even-k codes in its low half and the 4 odd-k codes in its high half (PRMT selector order); per word
one inline-PTX block builds the four int8 operands (PRMT table lookups of 2 x |e2m1|, the e8m0 scale
folded as a table shift by its distance to the row-block's smallest scale - exact while that spread is
<= 3 binades - and the sign split into a positive and a negative part, fed against B and -B); the
activation as three signed 7-bit planes (n8 column groups of B, a fourth group idle), four int8 dots
(IGMMA, s32 accumulation, exact), then per 128-block the s32 -> fp32 conversion, the planes combined and
the block's two scales applied. Session 48 (Triton 3.6, ptxas 12.8, sm_90a): 613 SASS per 128-k step at
BN = 128 (150 registers) against 427-428 for the shipped 16 x 128 swap body (the same 128 weights per
thread). ~210 of the 613 are the converted operand's trip through shared memory and its byte assembly
(STS 64, LDS 23, PRMT beyond the conversion's 64) - Triton's layout conversion of the loaded tile; an
8-bit "mma64"-like load layout that removed all of it would leave ~405, about the shipped count. So the
route does not pay in a Triton body: the per-block s32 -> fp32 epilogue, the scale tables and the
addressing take what the cheaper conversion saves. Nothing here is exact-checked or run on a GPU.
"""
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

# weights pre-encoded at load ("int8e", assumed): each 32-bit word = 8 weights of one row and one 32-group,
# low 16 bits = the 4 even-k nibbles, high 16 bits = the 4 odd-k nibbles (selector order)
ASM = tl.constexpr("""{
.reg .b32 d, t0, t1, sh, xn, shn;
and.b32 d, $5, 0xff;
shl.b32 t0, 0x03020100, d;
shl.b32 t1, 0x0C080604, d;
shr.u32 sh, $4, 16;
xor.b32 xn, $4, 0x88888888;
shr.u32 shn, xn, 16;
prmt.b32 $0, t0, t1, $4;
prmt.b32 $1, t0, t1, xn;
prmt.b32 $2, t0, t1, sh;
prmt.b32 $3, t0, t1, shn;
}""")


@triton.jit
def _probe(w_ptr, sw_ptr, a_ptr, sa_ptr, out_ptr, K: tl.constexpr, BN: tl.constexpr, NSTAGE: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    b64 = tl.arange(0, 64)
    k64 = tl.arange(0, 64)
    c32 = tl.arange(0, 32)
    k4 = tl.arange(0, 4)
    pw = tl.where(tl.arange(0, 4) == 0, 1.0, tl.where(tl.arange(0, 4) == 1, 128.0, tl.where(tl.arange(0, 4) == 2, 16384.0, 0.0)))
    acc = tl.zeros([BN, 8], tl.float32)
    for kb in tl.range(0, K // 128, num_stages=NSTAGE):
        raw = tl.load(w_ptr + n[:, None] * (K // 2) + kb * 64 + b64[None, :])
        sb = tl.load(sw_ptr + n[:, None] * (K // 32) + kb * 4 + k4[None, :]).to(tl.int32)
        smin = tl.min(sb, axis=1)
        d = (sb - smin[:, None])
        d64 = tl.reshape(tl.broadcast_to(d[:, :, None], [BN, 4, 16]), [BN, 64]).to(tl.uint8)
        pe, ne, po, no = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [raw, d64],
                                                   dtype=(tl.int8, tl.int8, tl.int8, tl.int8), is_pure=True, pack=4)
        base = a_ptr + kb * (4 * 64 * 32)
        ae = tl.load(base + k64[:, None] * 32 + c32[None, :])
        ane = tl.load(base + 64 * 32 + k64[:, None] * 32 + c32[None, :])
        ao = tl.load(base + 2 * 64 * 32 + k64[:, None] * 32 + c32[None, :])
        ano = tl.load(base + 3 * 64 * 32 + k64[:, None] * 32 + c32[None, :])
        part = tl.dot(pe, ae, out_dtype=tl.int32)
        part = tl.dot(ne, ane, part, out_dtype=tl.int32)
        part = tl.dot(po, ao, part, out_dtype=tl.int32)
        part = tl.dot(no, ano, part, out_dtype=tl.int32)
        f3 = tl.reshape(part.to(tl.float32), [BN, 4, 8])
        comb = tl.sum(f3 * pw[None, :, None], axis=1)
        sa = tl.load(sa_ptr + kb * 8 + tl.arange(0, 8))
        acc += comb * tl.exp2((smin - 127).to(tl.float32))[:, None] * sa[None, :]
    tl.store(out_ptr + n[:, None] * 8 + tl.arange(0, 8)[None, :], acc.to(tl.bfloat16))


def compile_it(fn, sig, consts, warps=4):
    """Compile for sm_90a as a launch would -> ([(address, instruction)], cuobjdump -res-usage, ttgir)."""
    names = fn.arg_names
    s = {n: ("constexpr" if n in consts else sig[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and s[n].startswith("*")}
    c = triton.compile(ASTSource(fn=fn, signature=s, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    with tempfile.TemporaryDirectory() as d:
        cub = os.path.join(d, "k.cubin"); open(cub, "wb").write(c.asm["cubin"])
        sass = subprocess.run([sw._tool("cuobjdump"), "-sass", cub], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([sw._tool("cuobjdump"), "-res-usage", cub], capture_output=True, text=True).stdout
    return sw.parse_sass(sass), res, c.asm["ttgir"]


def loop_body(ins):
    """The instructions of the longest backward-branch range: the K loop."""
    best = None
    addr = [a for a, _ in ins]
    for i, (a, s) in enumerate(ins):
        mm = re.search(r"BRA.*?0x([0-9a-f]+)", s)
        if mm:
            tgt = int(mm.group(1), 16)
            if tgt < a:
                j = addr.index(tgt) if tgt in addr else None
                if j is not None and (best is None or i - j > best[1] - best[0]):
                    best = (j, i)
    return ins[best[0]:best[1] + 1] if best else []


def shipped_k_loop() -> tuple[int, int]:
    """(SASS in the K loop, registers) of the shipped swap body as the layer compiles it for Pro-TP8's
    gate_up at T = 16 (16 x 128 tiles, "mma64e" weights, folded)."""
    for label, cfg, k, gather in sw.default_configs():
        if label == "pro-tp8 gate_up T=16":
            sass, regs, _ = sw.compile_swap(sw.config_constexprs(cfg, k, gather), cfg.num_warps, cfg.maxnreg)
            return len(loop_body(sw.parse_sass(sass))), regs
    raise RuntimeError("no Pro-TP8 gate_up T=16 config among sass_wgmma_hazard.default_configs()")


def main() -> int:
    print(f"triton {triton.__version__}, ptxas {'.'.join(map(str, sw.ptxas_version()))}, sm_90a, 4 warps, K = 7168")
    n, regs = shipped_k_loop()
    print(f"shipped swap body (Pro-TP8 gate_up T = 16, 16 x 128): {n} SASS per 128-k step (128 weights per thread), "
          f"{regs} registers")
    sig = dict(w_ptr="*u8", sw_ptr="*u8", a_ptr="*i8", sa_ptr="*fp32", out_ptr="*bf16")
    for bn, st in ((128, 3), (64, 3)):
        ins, res, _ = compile_it(_probe, sig, dict(K=7168, BN=bn, NSTAGE=st))
        body = loop_body(ins)
        ops: dict = {}
        for _, s in body:
            op = re.sub(r"^@!?U?P\w+\s+", "", s).split(None, 1)[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        top = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda x: -x[1])[:12])
        reg = re.search(r"REG:(\d+)", res).group(1)
        print(f"int8 probe, BN = {bn}, {st} stages: {len(body)} SASS per 128-k step ({bn} weights per thread), "
              f"{reg} registers; {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
