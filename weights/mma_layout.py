"""The "mma64" byte layout of packed MXFP4 weights (pure functions, no arithmetic on values).

The checkpoint stores each expert's packed e2m1 bytes row-major ("nk": [N, K/2], row n,
byte j = k 2j (low nibble) and 2j+1 (high nibble)). The Hopper kernels
(kernels/_mxfp4_grouped_gemm.py `W_SWZ`, loads in _mxfp4_dequant.py) want each thread's bytes of a wgmma A-operand
fragment to be 16 contiguous bytes, so a [BLOCK_N, 64]-byte tile lands in registers
with 16-byte loads and no shared-memory shuffle. "mma64" permutes the bytes of every
64-row x 64-byte tile (64 rows x one 128-wide K block, 4096 bytes) for that:

    tile (t, b)  = rows 64t .. 64t+63, bytes 64b .. 64b+63 (k 128b .. 128b+127)
                   stored contiguously at byte offset t * 64 * (K/2) + b * 4096
    inside it    row n = 64t + (n5 n4 n3 n2 n1 n0), byte j = 64b + (k5 k4 k3 k2 k1 k0)
                 (binary digits) sits at r * 256 + c with
                 r = k5 n5 n4 n2              (most to least significant)
                 c = n1 n0 k2 k1 k4 k3 n3 k0

Why these bits: Triton's wgmma A-operand layout for a [64 x 64] tile over 4 warps gives
the thread (lane, warp) rows n = lane / 4 + 16 * warp and n + 8, and bytes
2q, 2q + 1 (q = lane % 4) plus {0, 8, 16, 24} in each 32-byte half of the block. The digits
above put each half's 16 bytes of a thread (2 rows x 8 bytes) in one 16-byte vector, in
the register order the operand wants (k0 first, so a 32-bit register holds a k-pair);
the kernel's reshape/permute of the loaded vectors then is the operand layout itself
(no shared-memory shuffle; checked in the compiled ttgir).

The tensor keeps its shape [..., N, K/2] and dtype uint8; only the byte order changes,
so shapes checks, `.to()` and memory size are unchanged. It needs N % 64 == 0 and
K % 128 == 0 (`mma64_supported`); other widths keep "nk" (nothing is padded).
Scales are not permuted. `to_mma64` and `from_mma64` are inverse permutations.

"mma64e" (session 19; the layer's layout on CUDA since session 20, when the H200 ran it
bitwise "mma64" and 1.01-1.10x faster per Flash layer) is "mma64" with the bits of
every aligned 32-bit word (4 stored bytes = 8 e2m1 codes, the word one thread's register
holds) re-encoded by an invertible GF(2)-linear map, so that the kernel builds the four bf16
pairs of a word with 4 funnel shifts and 4 LOP3 (`_ENC_OUTPUTS`) instead of 13 PRMT /
shift / LOP3 instructions. Output r of a word W (the bf16 pattern sign << 15 | magnitude
code << 6 in each 16-bit half, before the scale multiply) is

    O_r = (XOR over s in _ENC_OUTPUTS[r] of rotr(W, s)) & 0x81C081C0

with O_0 / O_1 the low nibbles (even k) of bytes (0, 1) / (2, 3) and O_2 / O_3 their high
nibbles (the pairs the "mma64" PTX writes to $0..$3). Eight source bits per output and four
outputs: any such scheme needs five sources (rotations) of the word, since four 8-bit
supports would have to tile the 32 bits, and no rotations of the pattern {6, 7, 8, 15} tile
Z/16; `scripts/enc_search.py` finds the rotation sets for which the 32 x 32 map is invertible.
`to_mma64e` / `from_mma64e` convert (pure bit arithmetic on the bytes, no value changes).
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "TILED_LAYOUTS", "mma64_supported", "to_mma64", "from_mma64", "to_mma64e", "from_mma64e",
           "convert_layout", "encode_words", "decode_words"]

LAYOUTS = ("nk", "mma64", "mma64e")
TILED_LAYOUTS = ("mma64", "mma64e")   # the 64 x 128 tile byte order (the swap / tile kernels' W_SWZ)

# "mma64e": output r of a stored word = XOR of the word rotated right by each s, masked
_ENC_MASK = 0x81C081C0
_ENC_OUTPUTS = ((0,), (12,), (2, 6), (2, 8))
_ENC_BITS = tuple(p for p in range(32) if (_ENC_MASK >> p) & 1)   # 6, 7, 8, 15, 22, 23, 24, 31


def _enc_matrix() -> tuple[list[int], list[int]]:
    """(rows, inverse columns): rows[i] = the stored-word bits whose XOR is decoded bit i
    (i = 8 r + index of p in _ENC_BITS); inverse[i] = the stored word of decoded bit i alone."""
    rows = []
    for shifts in _ENC_OUTPUTS:
        for p in _ENC_BITS:
            v = 0
            for sh in shifts:
                v ^= 1 << ((p + sh) % 32)
            rows.append(v)
    # Gauss-Jordan over GF(2): solve rows * W = e_i for every i
    aug = [(rows[i], 1 << i) for i in range(32)]
    for col in range(32):
        piv = next((j for j in range(col, 32) if (aug[j][0] >> col) & 1), None)
        if piv is None:
            raise AssertionError("the mma64e map is singular")  # guarded by the tests
        aug[col], aug[piv] = aug[piv], aug[col]
        for j in range(32):
            if j != col and (aug[j][0] >> col) & 1:
                aug[j] = (aug[j][0] ^ aug[col][0], aug[j][1] ^ aug[col][1])
    # now aug[c] = (e_c, combination of decoded bits giving stored bit c)
    inverse = [0] * 32
    for c in range(32):
        combo = aug[c][1]
        for i in range(32):
            if (combo >> i) & 1:
                inverse[i] |= 1 << c
    return rows, inverse


_ENC_ROWS, _ENC_INV = _enc_matrix()

# digits of (n within the 64-row tile, byte within the 64-byte block), most significant
# first: [n5 n4 n3 n2 n1 n0] and [k5 k4 k3 k2 k1 k0]; positions in the view below:
# 0 ..., 1 tile t, 2 n5, 3 n4, 4 n3, 5 n2, 6 n1, 7 n0, 8 block b, 9 k5, 10 k4, 11 k3,
# 12 k2, 13 k1, 14 k0. The stored order is t, b, k5 n5 n4 n2 | n1 n0 k2 k1 k4 k3 n3 k0.
_TO_MMA64 = (0, 1, 8, 9, 2, 3, 5, 6, 7, 12, 13, 10, 11, 4, 14)
_FROM_MMA64 = tuple(sorted(range(15), key=lambda i: _TO_MMA64[i]))


def mma64_supported(n: int, k: int) -> tuple[bool, str]:
    """Whether an [N, K] MXFP4 weight (K unpacked) can take the "mma64" layout."""
    if n % 64:
        return False, f"N={n} is not a multiple of 64"
    if k % 128:
        return False, f"K={k} is not a multiple of 128"
    return True, f"N={n}, K={k}: whole 64 x 128 tiles"


def _check(w4: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(w4, torch.Tensor) or w4.dtype != torch.uint8 or w4.dim() < 2:
        raise TypeError(f"{name}: expected a [..., N, K/2] uint8 tensor of packed e2m1, got "
                        f"{getattr(w4, 'dtype', type(w4).__name__)} {list(getattr(w4, 'shape', []))}")
    n, kh = w4.shape[-2], w4.shape[-1]
    ok, why = mma64_supported(n, 2 * kh)
    if not ok:
        raise ValueError(f"{name}: shape {list(w4.shape)} cannot take the 'mma64' layout: {why}")
    return n, kh


def _permute(w4: torch.Tensor, order: tuple[int, ...], name: str, source_mma64: bool) -> torch.Tensor:
    n, kh = _check(w4, name)
    lead = w4.shape[:-2]
    x = w4.reshape(-1, n, kh)
    if source_mma64:  # view the stored bytes with the stored digit order, then restore
        x = x.reshape(x.shape[0], n // 64, kh // 64, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2)
        x = x.permute(*order)
    else:
        x = x.reshape(x.shape[0], n // 64, 2, 2, 2, 2, 2, 2, kh // 64, 2, 2, 2, 2, 2, 2)
        x = x.permute(*order)
    return x.contiguous().reshape(*lead, n, kh)


def to_mma64(w4: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] uint8 in "nk" order -> the same bytes in "mma64" order (a new tensor)."""
    return _permute(w4, _TO_MMA64, "w4", source_mma64=False)


def from_mma64(w4: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_mma64`."""
    return _permute(w4, _FROM_MMA64, "w4", source_mma64=True)


def _rotr(w: torch.Tensor, s: int) -> torch.Tensor:
    return w if s == 0 else ((w >> s) | (w << (32 - s))) & 0xFFFFFFFF


def _words(w4: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K/8] int64 little-endian 32-bit words (K/2 % 4 == 0)."""
    b = w4.reshape(*w4.shape[:-1], w4.shape[-1] // 4, 4).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of _words."""
    b = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    return b.reshape(*words.shape[:-1], words.shape[-1] * 4).to(torch.uint8)


def decode_words(words: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stored "mma64e" words (int64, 32-bit values) -> the four outputs O_0..O_3 (see the
    module doc): what the kernel's PTX computes before the scale multiply."""
    outs = []
    for shifts in _ENC_OUTPUTS:
        o = _rotr(words, shifts[0])
        for sh in shifts[1:]:
            o = o ^ _rotr(words, sh)
        outs.append(o & _ENC_MASK)
    return tuple(outs)


def encode_words(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The four outputs (int64 words, bits only at _ENC_MASK) -> the stored word (inverse
    of decode_words)."""
    w = torch.zeros_like(outputs[0])
    for r, o in enumerate(outputs):
        for j, p in enumerate(_ENC_BITS):
            w ^= ((o >> p) & 1) * _ENC_INV[8 * r + j]
    return w


def _pattern(code: torch.Tensor) -> torch.Tensor:
    """e2m1 code (int64, 0..15) -> its bf16 bit pattern before the scale: sign << 15 | magnitude << 6."""
    return ((code & 7) << 6) | ((code >> 3) << 15)


def _code(pattern: torch.Tensor) -> torch.Tensor:
    return ((pattern >> 6) & 7) | (((pattern >> 15) & 1) << 3)


# Bytes of packed weights the "mma64e" conversions take at once. The bit arithmetic runs on
# int64: the bytes widened to int64 alone are 8x the chunk, with more int64 temporaries alive
# beside them. In one piece the Flash gate_up (2 GiB of codes) asked the H200 for a 16 GiB
# allocation and ran out of memory in the routed-peers bench, beside the peers' weights
# (session 20). Chunks of whole 64-row tile rows keep the temporaries to a small multiple of
# 8 MiB on any layer.
_ENC_CHUNK_BYTES = 8 << 20


def _chunked(w4: torch.Tensor, fn, name: str) -> torch.Tensor:
    """fn over slices of whole 64-row tile rows of w4 [..., N, K/2] (each slice's bytes are a
    contiguous range of the result's, in either layout), assembled into one new tensor."""
    n, kh = _check(w4, name)
    x = w4.reshape(-1, n, kh)
    out = torch.empty_like(x)
    rows = max(64, (_ENC_CHUNK_BYTES // max(kh, 1)) // 64 * 64)
    for e in range(x.shape[0]):
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            out[e, r0:r1] = fn(x[e, r0:r1])
    return out.reshape(w4.shape)


def to_mma64e(w4: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] uint8 in "nk" order -> "mma64e" (the "mma64" bytes, each word re-encoded);
    converted in chunks of at most ~_ENC_CHUNK_BYTES (bounded transient memory)."""
    return _chunked(w4, _to_mma64e, "w4")


def from_mma64e(w4: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_mma64e` (in chunks, as it)."""
    return _chunked(w4, _from_mma64e, "w4")


def _to_mma64e(w4: torch.Tensor) -> torch.Tensor:
    x = _words(to_mma64(w4))
    b = [(x >> (8 * i)) & 0xFF for i in range(4)]
    lo, hi = [v & 0xF for v in b], [v >> 4 for v in b]
    outs = (_pattern(lo[0]) | (_pattern(lo[1]) << 16), _pattern(lo[2]) | (_pattern(lo[3]) << 16),
            _pattern(hi[0]) | (_pattern(hi[1]) << 16), _pattern(hi[2]) | (_pattern(hi[3]) << 16))
    return _bytes(encode_words(outs)).reshape(w4.shape)


def _from_mma64e(w4: torch.Tensor) -> torch.Tensor:
    o = decode_words(_words(w4))
    half = [(o[r] >> (16 * h)) & 0xFFFF for r in range(4) for h in range(2)]  # O0 lo, O0 hi, O1 lo, ...
    lo = [_code(half[i]) for i in range(4)]        # bytes 0..3, even k
    hi = [_code(half[4 + i]) for i in range(4)]    # bytes 0..3, odd k
    words = sum((lo[i] | (hi[i] << 4)) << (8 * i) for i in range(4))
    return from_mma64(_bytes(words).reshape(w4.shape))


def convert_layout(w4: torch.Tensor, source: str, target: str) -> torch.Tensor:
    """w4 in layout `source` -> layout `target` (the same tensor when they are equal)."""
    for arg, v in (("source", source), ("target", target)):
        if v not in LAYOUTS:
            raise ValueError(f"{arg}={v!r}: expected one of {LAYOUTS}")
    if source == target:
        return w4
    nk = w4 if source == "nk" else from_mma64(w4) if source == "mma64" else from_mma64e(w4)
    return nk if target == "nk" else to_mma64(nk) if target == "mma64" else to_mma64e(nk)
