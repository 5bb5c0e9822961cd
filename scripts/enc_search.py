"""Search (CPU, seconds): GF(2)-linear re-encodings of a packed 32-bit word of eight e2m1
codes that the kernel turns into four bf16 pairs with the fewest instructions.

Model: output r (two bf16 halves: sign at bits 15 / 31, magnitude code at 6-8 / 22-24, the
mask 0x81C081C0) is one LOP3 of at most two source registers plus the mask immediate,
(X & M), (Y & M) or ((X ^ Y) & M); a source is the stored word itself or one funnel shift /
logical shift of it (one instruction each). The 32 output bits must be an invertible linear
map of the 32 stored bits; the layout stores the inverse (weights/mma_layout.py "mma64e").

    python scripts/enc_search.py            # with 3 extra sources: none; with 4: the solutions

Why 3 extra sources cannot work: every output row lies in the span of the sources' mask
bits (8 per source), so 4 sources must tile the 32 bits with translates of the mask; the
mask is 16-periodic and {6, 7, 8, 15} has no 4 disjoint translates in Z/16.
"""
import argparse
import itertools

MASK_BITS = [6, 7, 8, 15, 22, 23, 24, 31]


def source(kind: str, s: int) -> list[int]:
    """Rows (stored-word bit masks) of the masked bits of a source register."""
    rows = []
    for p in MASK_BITS:
        q = {"id": p, "rot": (p + s) % 32, "shr": p + s if p + s < 32 else None,
             "shl": p - s if p - s >= 0 else None}[kind]
        rows.append(0 if q is None else 1 << q)
    return rows


def rank(rows: list[int]) -> int:
    piv, r = {}, 0
    for v in rows:
        while v:
            b = v.bit_length() - 1
            if b in piv:
                v ^= piv[b]
            else:
                piv[b] = v
                r += 1
                break
    return r


def search(extra_sources: int, limit: int):
    kinds = [(k, s) for k in ("rot", "shr", "shl") for s in range(1, 32)]
    found = []
    for extra in itertools.combinations(kinds, extra_sources):
        srcs = [source("id", 0)] + [source(k, s) for k, s in extra]
        if len({b for rows in srcs for b in rows if b}) < 32:  # the masked bits must cover the word
            continue
        opts = {}
        for i, j in itertools.combinations(range(len(srcs)), 2):
            for f in ("x", "y", "xor"):
                rows = tuple(srcs[i][n] if f == "x" else srcs[j][n] if f == "y" else srcs[i][n] ^ srcs[j][n]
                             for n in range(8))
                opts.setdefault(rows, (f, i, j))
        for combo in itertools.combinations(opts.items(), 4):
            if rank([r for rows, _ in combo for r in rows]) == 32:
                found.append((extra, [o for _, o in combo]))
                if len(found) >= limit:
                    return found
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=5)
    args = ap.parse_args()
    for n in (3, 4):
        sols = search(n, args.limit)
        print(f"{n} extra sources ({n} shifts + 4 LOP3 = {n + 4} instructions per 8 weights): "
              f"{len(sols)} solution(s){' (first ' + str(args.limit) + ')' if len(sols) >= args.limit else ''}")
        for extra, outs in sols:
            print(f"    sources {extra}; outputs {outs}")


if __name__ == "__main__":
    main()
