"""Static check (CPU, no GPU needed): does a compiled routed GEMM body overwrite the registers
of a register-operand wgmma (HGMMA with A in registers) before the wait that retires it?

ptxas before CUDA 13.3 can reuse the input registers of an asynchronous register-operand
wgmma before the wgmma has read them (triton-lang/triton#9433; fixed in ptxas 13.3 per its
release notes). Triton 3.6 assembles sm_90 code with its bundled ptxas 12.8. Our swap body
is such a wgmma: the dequantised weight tile is the A operand, in registers. Folded
(GemmConfig.fold_sa) the block's second MMA stays in flight across the K loop's back edge.
The next block's dequant can then write that MMA's A registers before the
`WARPGROUP.DEPBAR` that waits for it. Session 16 saw exactly that on the H200: wrong and
run-to-run different outputs from the 32-row body at 3-4 stages (docs/DESIGN.md). Whether it
bites depends on timing, so the check reads the SASS instead. It compiles the kernel exactly
as Triton would for sm_90a, disassembles it, and walks every path from each HGMMA to the
first full wait (`WARPGROUP.DEPBAR.LE gsb0, 0x0`). Any other instruction on such a path that
writes the HGMMA's A or accumulator registers is a hazard.

    python scripts/sass_wgmma_hazard.py               # every config routed_configs returns (Flash, Pro-TP8,
                                                      # swap fold on and off) on "mma64e" weights (the
                                                      # layer's layout on CUDA); exit 1 on any hazard, or
                                                      # when a conversion input is not a stored word as
                                                      # loaded (the encoding is per aligned word)
    python scripts/sass_wgmma_hazard.py --variants    # folded / per-block swap variants (sessions 16-17)
    python scripts/sass_wgmma_hazard.py --self-test   # the check still finds session 15's hazard
    python scripts/sass_wgmma_hazard.py --compare-ptxas /usr/local/cuda/bin/ptxas
                                                      # each config's PTX assembled by both ptxas (same
                                                      # flags): identical SASS? hazards with the other?
    python scripts/sass_wgmma_hazard.py --layout mma64 --count
                                                      # the configs on "mma64" weights (the same-bits A/B
                                                      # twin), with per-opcode SASS counts
    python scripts/sass_wgmma_hazard.py --loads       # where each body's loads sit against its MMAs
                                                      # (session 41: the unrolled short-K Pro down issues
                                                      # each block's loads after the previous block's MMAs)

One row per compiled config: hazards found, registers, the ptxas that assembled it.
"""
import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_HGMMA = re.compile(r"[A-Z]GMMA\.(\d+)x(\d+)x(\d+)\S*\s+R(\d+),\s+(R(\d+)|gdesc)")  # HGMMA (bf16), QGMMA (fp8), ...


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_path() -> str:
    """The ptxas Triton assembles sm_90 code with (TRITON_PTXAS_PATH or the bundled one)."""
    from triton import knobs
    return knobs.nvidia.ptxas.path


def ptxas_version(path: str | None = None) -> tuple[int, int]:
    out = subprocess.run([path or ptxas_path(), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def parse_sass(sass: str) -> list[tuple[int, str]]:
    """cuobjdump -sass text -> [(address, instruction)] in address order (one function)."""
    return [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines() for m in [_LINE.match(line)] if m]


def _dest_regs(ins: str) -> set[int]:
    """Registers an instruction writes (its first operand; wide ops write 2 or 4)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", ins)
    parts = body.split(None, 1)
    if len(parts) < 2:
        return set()
    op, rest = parts
    m = re.match(r"R(\d+)\b", rest)
    if not m or "GMMA" in op or op.startswith(("ST", "RED", "ATOM", "BAR", "BRA", "EXIT", "WARPGROUP", "LDGSTS", "SYNCS")):
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    r = int(m.group(1))
    return set(range(r, r + width))


def hazards(ins: list[tuple[int, str]]) -> list[str]:
    """Every write to the A or accumulator registers of an in-flight register-operand HGMMA
    before a full wgmma wait, on any path (branches followed both ways)."""
    addr_index = {a: i for i, (a, _) in enumerate(ins)}
    found = {}  # one entry per offending write (the first in-flight HGMMA it hits)
    for i, (a, s) in enumerate(ins):
        m = _HGMMA.search(s)
        if not m or m.group(6) is None:
            continue  # A from shared memory: nothing in registers to protect but the accumulator
        n = int(m.group(2))
        watched = set(range(int(m.group(6)), int(m.group(6)) + 4)) | set(range(int(m.group(4)), int(m.group(4)) + n // 2))
        stack, seen = [i + 1], set()
        while stack:
            j = stack.pop()
            while j < len(ins) and j not in seen:
                seen.add(j)
                aj, sj = ins[j]
                if re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", sj):
                    break
                if "GMMA" not in sj and "WARPGROUP" not in sj:
                    hit = _dest_regs(sj) & watched
                    if hit and aj not in found:
                        found[aj] = f"{aj:#06x} {sj}  (writes R{min(hit)}, in use by {a:#06x} {s})"
                b = re.search(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", sj)
                if b and int(b.group(1), 16) in addr_index:
                    stack.append(addr_index[int(b.group(1), 16)])
                    if not re.match(r"^@", sj):
                        break  # unconditional: no fall-through
                if re.match(r"^(EXIT|RET)\b", sj):
                    break
                j += 1
    return [found[a] for a in sorted(found)]


def compile_swap(consts: dict, num_warps: int = 4, maxnreg: int | None = None, kernel: str = "swap"):
    """Compile the routed GEMM body for sm_90a exactly as a launch would (constexprs = the
    wrapper's). Returns (sass text, registers per thread, stack bytes per thread)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4_moe.kernels import _mxfp4_grouped_gemm as body
    fn = body._mxfp4_grouped_gemm_swap_kernel if kernel == "swap" else body._mxfp4_grouped_gemm_kernel
    names = fn.arg_names
    ptr = {"a_ptr": "*bf16" if consts.get("A_BF16") else "*fp8e4nv", "sa_ptr": "*fp32", "w_ptr": "*u8",
           "sw_ptr": "*u8", "out_ptr": "*bf16", "ws_ptr": "*fp32", "sorted_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32"}
    consts = {k: v for k, v in consts.items() if k in names}
    sig = {n: ("constexpr" if n in consts else ptr.get(n, "i32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("stride") or n in ("N", "R"))}
    opts = dict(num_warps=num_warps, launch_pdl=bool(consts.get("PDL")))  # the launch's options
    if maxnreg:
        opts["maxnreg"] = maxnreg
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                                 attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.TemporaryDirectory() as d:
        cub = os.path.join(d, "k.cubin")
        open(cub, "wb").write(c.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cub], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cub], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)  # a stack frame in these bodies means spilled registers
    compile_swap.last_ptx = c.asm["ptx"]
    return sass, (int(regs.group(1)) if regs else -1), (int(stack.group(1)) if stack else -1)


def assemble(ptx: str, ptxas: str, maxnreg: int | None = None) -> tuple[list[tuple[int, str]], int]:
    """`ptx` assembled for sm_90a by `ptxas` -> ([(address, instruction)], registers per thread)."""
    with tempfile.TemporaryDirectory() as d:
        src, cub = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(src, "w").write(ptx)
        cmd = [ptxas, "-arch=sm_90a", "-v", "-o", cub, src] + ([f"--maxrregcount={maxnreg}"] if maxnreg else [])
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{ptxas} failed ({res.returncode}): {res.stderr[-400:]}")
        regs = re.search(r"Used (\d+) registers", res.stderr)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cub], capture_output=True, text=True, check=True).stdout
    return parse_sass(sass), (int(regs.group(1)) if regs else -1)


def compare_ptxas(ptx: str, other: str, maxnreg: int | None = None) -> str:
    """One line: the same PTX assembled by Triton's ptxas and by `other` (same flags)."""
    mine, r_mine = assemble(ptx, ptxas_path(), maxnreg)
    theirs, r_theirs = assemble(ptx, other, maxnreg)
    return describe_difference(mine, theirs, r_mine, r_theirs, ".".join(map(str, ptxas_version(other))))


def describe_difference(mine, theirs, r_mine: int, r_theirs: int, version: str) -> str:
    """How two assemblies of one PTX differ: the same SASS; the same instructions in the same
    order with only `.reuse` operand-cache flags moved; or really different code."""
    if [i for _, i in mine] == [i for _, i in theirs]:
        return f"same SASS with ptxas {version} ({len(mine)} instructions)"
    if len(mine) == len(theirs):
        differ = [(a, b) for (_, a), (_, b) in zip(mine, theirs) if a != b]
        if all(a.replace(".reuse", "") == b.replace(".reuse", "") for a, b in differ):
            return (f"same instructions with ptxas {version} ({len(mine)}); {len(differ)} differ only in "
                    f".reuse operand-cache flags")
    return (f"SASS differs with ptxas {version}: {len(mine)} -> {len(theirs)} "
            f"instructions, {r_mine} -> {r_theirs} registers, {len(hazards(theirs))} hazards there")


def enc_word_sources(ptx: str) -> tuple[int, int]:
    """("mma64e") (asm input words, of them registers straight from a 16-byte vector load).
    The layout encodes aligned 4-byte words of the stored tensor; the conversion PTX is only
    right when each of its input registers is such a word as loaded (no byte shuffle between
    the load and the asm), which is what this counts."""
    loaded = set()
    for m in re.finditer(r"ld\.(?:shared|global)(?:\.\w+)*\.v4\.b32\s+\{([^}]*)\}", ptx):
        loaded |= {r.strip() for r in m.group(1).split(",")}
    inputs = (set(re.findall(r"and\.b32 t, (%r\d+), 0x81C081C0", ptx))
              | set(re.findall(r"shf\.r\.wrap\.b32 a, (%r\d+),", ptx)))
    return len(inputs), len(inputs & loaded)


def config_constexprs(cfg, k: int, gather: bool) -> dict:
    """The constexprs mxfp4_grouped_gemm passes for GemmConfig `cfg` on a K-wide GEMM
    (mma64 weights, PDL early; keep in step with _launch_split and the tile launch)."""
    kb = -(-k // 128)
    splits = min(cfg.split_k, kb)
    kb_per = -(-kb // splits)
    splits = -(-kb // kb_per)
    return dict(A_GATHER=gather, OUT_SCATTER=not gather, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                NUM_STAGES=cfg.num_stages, KB_PER=kb_per, SPLIT=splits > 1, SOFTWARE_BF16=False,
                SELECT_SUBNORMAL=False, ASM=cfg.asm and (cfg.kind == "swap" or cfg.scale_bcast), W_SWZ=True,
                A_BF16=cfg.a_bf16, DIAG=0, LOOP_UNROLL=cfg.unroll, PDL=1, FOLD_SA=cfg.fold_sa,
                A_SPLIT=cfg.a_split, W_KN=cfg.w_kn, SCALE_BCAST=cfg.scale_bcast,
                FOLD_WAIT=cfg.fold_order == "wait", N_FASTEST=cfg.n_fastest, W_ENC=False, A_PAD=_a_pad(),
                ONE_CHAIN=cfg.one_chain, PRELOAD=cfg.preload)


def _a_pad() -> int:
    from dsv4_moe.kernels import mxfp4_grouped_gemm as mg
    return mg.A_PAD_ROWS


def default_configs(layout: str = "mma64e"):
    """(label, config, K, gather) for every distinct GEMM config routed_configs returns for the
    Flash and Pro-TP8 layers over T = 1..8192 on `layout` weights (swap and tile bodies only)."""
    import torch
    from dsv4_moe.kernels import routed_experts as rx
    from dsv4_moe.weights.tensors import RoutedExpertWeights
    u8, e8 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.float8_e8m0fnu)
    seen = {}
    for name, e, h, i in (("flash", 256, 4096, 2048), ("pro-tp8", 384, 7168, 384)):
        r = RoutedExpertWeights(u8.expand(e, 2 * i, h // 2), e8.expand(e, 2 * i, h // 32), u8.expand(e, h, i // 2),
                                e8.expand(e, h, i // 32), 0, e, layout)
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
            up, down = rx.routed_configs(t * 6, r)
            for gemm, cfg, k, gather in (("gate_up", up, h, True), ("down", down, i, False)):
                if cfg.kind == "gemv":
                    continue
                key = (cfg, k, gather)
                seen.setdefault(key, f"{name} {gemm} T={t}")
    return [(label, cfg, k, gather) for (cfg, k, gather), label in seen.items()]


def session16_variants():
    from dsv4_moe.kernels.mxfp4_grouped_gemm import GemmConfig
    b32 = GemmConfig(32, 128, 4, 2, kind="swap", asm=True, a_bf16=True)
    b16 = GemmConfig(16, 128, 4, 4, kind="swap", asm=True, a_bf16=True)
    out = []
    for label, cfg in (("per-block 32 s3", dataclasses.replace(b32, num_stages=3)),
                       ("fold 32 s2 split", dataclasses.replace(b32, fold_sa=True, fold_order="split")),
                       ("fold 32 s2 u2 split", dataclasses.replace(b32, fold_sa=True, unroll=2, fold_order="split")),
                       ("fold 32 s3 split", dataclasses.replace(b32, num_stages=3, fold_sa=True, fold_order="split")),
                       ("fold 32 s3 wait", dataclasses.replace(b32, num_stages=3, fold_sa=True)),
                       ("per-block 16 s4 cap128", dataclasses.replace(b16, maxnreg=128)),
                       ("fold 16 s4 cap128 split", dataclasses.replace(b16, maxnreg=128, fold_sa=True, fold_order="split")),
                       ("fold 16 s4 cap128 wait", dataclasses.replace(b16, maxnreg=128, fold_sa=True)),
                       ("fold 16 s4 wait", dataclasses.replace(b16, fold_sa=True)),
                       # scripts/gpu_probe_swap_rows.py's bigger blocks (session 17, not yet timed)
                       ("fold 64 4w s3 wait", dataclasses.replace(b32, block_m=64, num_stages=3, fold_sa=True)),
                       ("fold 64 8w s3 wait", dataclasses.replace(b32, block_m=64, num_warps=8, num_stages=3,
                                                                  fold_sa=True)),
                       ("fold 128 8w s2 wait", dataclasses.replace(b32, block_m=128, num_warps=8, fold_sa=True))):
        out.append((label, cfg, 4096, True, {}))
    # the body session 15 shipped: both halves converted before the first MMA, no wait (still
    # what a folded "split" launch on "nk" weights would compile; the wrapper refuses it on CUDA),
    # with its padding rows reading row 0 of A as then (A_PAD 0): with A_PAD 1 ptxas 12.8 happens
    # to allocate that body's registers without the hazard, so the self-test would lose its case
    out.append(("fold 16 s4 cap128, unsplit", dataclasses.replace(b16, maxnreg=128, fold_sa=True, fold_order="split"),
                4096, True, {"W_SWZ": False, "A_PAD": 0}))
    return out


_COUNTED = ("LOP3", "SHF", "PRMT", "HMUL2", "HGMMA", "LDG", "LDGSTS", "IMAD", "IADD3", "LEA")


def opcode_counts(ins: list[tuple[int, str]]) -> dict:
    """Static instruction counts of the whole kernel per opcode stem (_COUNTED) and in total."""
    out = dict.fromkeys(_COUNTED, 0)
    for _, s in ins:
        op = re.sub(r"^@!?U?P\w+\s+", "", s).split(None, 1)[0].split(".")[0]
        if op in out:
            out[op] += 1
    out["total"] = len(ins)
    return out


def load_schedule(ins: list[tuple[int, str]]) -> dict:
    """Where the global loads sit against the MMAs (session 41): LDG / LDGSTS (cp.async, Triton's
    software pipelining) in the whole kernel and before its first HGMMA, and the full wgmma waits.
    A K loop whose next blocks' loads are issued only after the MMAs of the previous one has
    no LDGSTS and few loads before the first HGMMA; a pipelined one has its prologue's there."""
    def op(s):
        return re.sub(r"^@!?U?P\w+\s+", "", s).split(None, 1)[0]
    ops = [op(s) for _, s in ins]
    first = next((n for n, o in enumerate(ops) if o.startswith("HGMMA")), len(ops))
    stem = [o.split(".")[0] for o in ops]
    return dict(LDG=stem.count("LDG"), LDGSTS=stem.count("LDGSTS"),
                LDG_before_mma=stem[:first].count("LDG"), LDGSTS_before_mma=stem[:first].count("LDGSTS"),
                wgmma_waits=sum(o.startswith("WARPGROUP.DEPBAR") for o in ops))


def _row(label, cfg, k, gather, extra=None):
    consts = dict(config_constexprs(cfg, k, gather), **(extra or {}))
    sass, regs, stack = compile_swap(consts, cfg.num_warps, cfg.maxnreg, "swap" if cfg.kind == "swap" else "tile")
    ins = parse_sass(sass)
    words = enc_word_sources(compile_swap.last_ptx) if consts.get("W_ENC") else None
    _row.last_loads = load_schedule(ins)
    return hazards(ins), regs, stack, opcode_counts(ins), words


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", action="store_true", help="session 16's folded / per-block swap variants")
    ap.add_argument("--self-test", action="store_true",
                    help="exit 1 unless the unsplit folded body shows hazards and the split and wait ones none")
    ap.add_argument("--show", type=int, default=2, help="hazards printed per config")
    ap.add_argument("--layout", default="mma64e", choices=("mma64", "mma64e"),
                    help="the weights' byte order the bodies are compiled for (and routed_configs picks "
                         "for; default: 'mma64e', what the layer takes on CUDA)")
    ap.add_argument("--count", action="store_true", help="print static SASS counts per opcode")
    ap.add_argument("--loads", action="store_true",
                    help="print where each body's global loads sit against its MMAs (load_schedule)")
    ap.add_argument("--compare-ptxas", metavar="PTXAS", default="",
                    help="also assemble each config's PTX with this ptxas (e.g. a CUDA 13 toolkit's) and say "
                         "whether the SASS is the same (session 34: 13.0 gives the same SASS as Triton's 12.8)")
    args = ap.parse_args()
    if args.compare_ptxas and not os.access(args.compare_ptxas, os.X_OK):
        sys.exit(f"sass_wgmma_hazard: --compare-ptxas={args.compare_ptxas!r}: not an executable file")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("sass_wgmma_hazard: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    path = ptxas_path()
    print(f"# ptxas {'.'.join(map(str, ptxas_version(path)))} ({path})")
    if args.variants or args.self_test:
        rows = session16_variants()
    else:
        from dsv4_moe.kernels import routed_experts as rx
        keyed = {}
        for fold_swap in (True, False):  # the default and DSV4_MOE_FOLD_SWAP=0
            rx.FOLD_SWAP = fold_swap
            for label, cfg, k, gather in default_configs(args.layout):
                keyed.setdefault((cfg, k, gather), label + ("" if fold_swap else " (FOLD_SWAP=0)"))
        rows = [(label, cfg, k, gather, {"W_ENC": args.layout == "mma64e"}) for (cfg, k, gather), label in keyed.items()]
    result, bad_words = {}, []
    for label, cfg, k, gather, extra in rows:
        found, regs, stack, counts, words = _row(label, cfg, k, gather, extra)
        if words is not None and (words[0] == 0 or words[1] != words[0]):
            bad_words.append(label)
        result[label] = found
        print(f"{label:34s} {cfg.kind:4s} {cfg.block_m:3d}x{cfg.block_n} stages {cfg.num_stages} unroll {cfg.unroll} "
              f"cap {cfg.maxnreg} pairs {cfg.a_bf16!s:5s} fold {('-' if not cfg.fold_sa else cfg.fold_order if cfg.kind == 'swap' else 'on'):5s} "
              f"{'nf ' if cfg.n_fastest else ''}K={k:5d}: "
              f"{len(found):4d} hazards, {regs} registers, stack {stack}"
              + (f", {words[1]}/{words[0]} asm words as loaded" if words is not None else ""))
        if args.count:
            print("    " + " ".join(f"{op} {n}" for op, n in counts.items()))
        if args.loads:
            print("    loads: " + " ".join(f"{key} {n}" for key, n in _row.last_loads.items()))
        if args.compare_ptxas:
            print("    " + compare_ptxas(compile_swap.last_ptx, args.compare_ptxas, cfg.maxnreg))
        for h in found[:args.show]:
            print(f"    {h}")
    if args.self_test:
        ok = (bool(result["fold 16 s4 cap128, unsplit"]) and not result["fold 16 s4 cap128 split"]
              and not result["fold 16 s4 cap128 wait"])
        print("self-test", "ok" if ok else "FAILED")
        return 0 if ok else 1
    if args.variants:
        return 0
    if bad_words:
        print("mma64e: conversion input words not straight from a 16-byte load in", ", ".join(bad_words))
    return 1 if any(result.values()) or bad_words else 0


if __name__ == "__main__":
    sys.exit(main())
