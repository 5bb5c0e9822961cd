"""Triton bodies of the L2 prefetch (`l2_prefetch.py` has the wrapper and the why).

Nothing is loaded into registers and nothing is written: each program issues prefetch
instructions for its share of up to four byte ranges (grid axis 1 = the range), so the
lines are in the L2 when a later kernel reads them.

    MODE 0 ("line"):  prefetch.global.L2[::evict_last] [addr]   one 128-byte line per lane
    MODE 1 ("bulk"):  cp.async.bulk.prefetch.L2.global [addr], size   one CHUNK per lane (TMA)

A lane whose unit lies past its range's end issues nothing (a predicate in the PTX), and
no address outside the range's allocation is touched (line mode: only lines that hold a
byte of the range; bulk mode: the range trimmed to 16-byte boundaries, as the
instruction needs).
The PTX has side effects (is_pure=False), so the compiler keeps it without a use.
"""

import triton
import triton.language as tl

_LINE = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }")
_LINE_LAST = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
              "mov.u32 $0, 0; }")
_BULK = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
         "mov.u32 $0, 0; }")
_BULK_LAST = tl.constexpr("{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; "
              "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
              "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")


@triton.jit
def _prefetch_range(addr, nbytes, pid, nprog, MODE: tl.constexpr, EVICT_LAST: tl.constexpr,
                    UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """Program `pid` of `nprog` prefetches units pid*BLOCK.., strided by nprog*BLOCK, of the
    range [addr, addr + nbytes) (UNIT bytes each: 128 in line mode, the chunk in bulk).
    Line mode starts at the line that holds addr (every line holds a byte of the range, so
    it lies in the range's allocation); bulk mode trims the range to 16-byte boundaries
    inside it, as cp.async.bulk needs."""
    if MODE == 0:
        lead = addr & 127
        addr = addr - lead
        nbytes = tl.where(nbytes > 0, nbytes + lead, 0)
    else:
        head = (16 - (addr & 15)) & 15
        addr = addr + head
        nbytes = tl.maximum(nbytes - head, 0) & -16
    nunits = tl.cdiv(nbytes, UNIT)
    for start in range(pid * BLOCK, nunits, nprog * BLOCK):
        u = start + tl.arange(0, BLOCK)
        off = u.to(tl.int64) * UNIT
        ok = (u < nunits).to(tl.int32)
        a = addr + off
        if MODE == 0:
            tl.inline_asm_elementwise(_LINE_LAST if EVICT_LAST else _LINE, "=r,l,r", [a, ok],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            size = tl.minimum(nbytes - off, UNIT).to(tl.int32)
            tl.inline_asm_elementwise(_BULK_LAST if EVICT_LAST else _BULK, "=r,l,r,r", [a, size, ok],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(a0, n0, a1, n1, a2, n2, a3, n3,
                        MODE: tl.constexpr, EVICT_LAST: tl.constexpr, UNIT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Grid (P, ranges): ranges 0..3 are (a_i, n_i) (address as int64, bytes)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.program_id(1)
    addr = tl.where(r == 0, a0, tl.where(r == 1, a1, tl.where(r == 2, a2, a3)))
    nbytes = tl.where(r == 0, n0, tl.where(r == 1, n1, tl.where(r == 2, n2, n3)))
    _prefetch_range(addr, nbytes, pid, nprog, MODE, EVICT_LAST, UNIT, BLOCK)
