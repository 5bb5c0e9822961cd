"""The routed GEMM bodies compiled for sm_90a, on the CPU, by the ptxas Triton uses: no
instruction may write the registers of an in-flight register-operand wgmma before the wait
that retires it. ptxas before 13.3 can produce exactly that (triton-lang/triton#9433). Session
16 saw it corrupt the folded swap body on the H200, so this is checked on the SASS rather
than left to timing (scripts/sass_wgmma_hazard.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sass_wgmma_hazard as H  # noqa: E402



def _run(*args):
    """The script in a subprocess without TRITON_INTERPRET (the suite sets it; the
    interpreter compiles nothing); skipped where Triton's ptxas / cuobjdump are missing."""
    import subprocess
    try:
        path = H.ptxas_path()
    except Exception as exc:  # noqa: BLE001 - no Triton NVIDIA backend at all
        pytest.skip(f"no ptxas from Triton: {exc}")
    if not (os.path.exists(path) and os.path.exists(H._tool("cuobjdump"))):
        pytest.skip(f"Triton's ptxas / cuobjdump not found ({path})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, os.path.join(os.path.dirname(H.__file__), "sass_wgmma_hazard.py"),
                           *args], capture_output=True, text=True, env=env, timeout=900)


_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   WARPGROUP.ARRIVE ;
        /*0020*/                   HGMMA.64x16x16.F32.BF16 R24, R40, gdesc[UR4], R24 ;
        /*0030*/                   HGMMA.64x16x16.F32.BF16 R24, R44, gdesc[UR8], R24, gsb0 ;
        /*0040*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0050*/                   ISETP.GE.AND P0, PT, R2, 0x8, PT ;
        /*0060*/               @!P0 BRA 0x80 ;
        /*0070*/                   EXIT ;
        /*0080*/                   PRMT R{reg}, R8, 0x1404, RZ ;
        /*0090*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00a0*/                   PRMT R45, R8, 0x1404, RZ ;
        /*00b0*/                   BRA 0x10 ;
"""


@pytest.mark.parametrize("reg,expect", [(46, 1), (28, 1), (50, 0)], ids=["A-register", "accumulator", "other"])
def test_hazard_analysis_on_known_sass(reg, expect):
    """A write on the loop's back edge before the wait hits the A registers (R44..R47) or the
    accumulator (R24..R31) of the HGMMA still in flight; the write after the wait does not count;
    an unrelated register is no hazard."""
    found = H.hazards(H.parse_sass(_SASS.replace("{reg}", str(reg))))
    assert len(found) == expect, found


def test_hazard_analysis_sees_through_the_wait_only_when_full():
    """`WARPGROUP.DEPBAR.LE gsb0, 0x1` leaves one group in flight: not a full wait."""
    sass = _SASS.replace("{reg}", "50").replace("DEPBAR.LE gsb0, 0x0", "DEPBAR.LE gsb0, 0x1")
    found = H.hazards(H.parse_sass(sass))
    assert any("R45" in f for f in found), found


def test_default_routed_configs_have_no_wgmma_register_hazard():
    """Every distinct GEMM config routed_configs returns for the Flash and Pro-TP8 layers
    (T = 1..8192) on "mma64" weights (the A/B twin layout, whose short-K decode down keeps the
    "split" ordering), with the swap fold on (default) and off (DSV4_MOE_FOLD_SWAP=0), compiles
    to SASS with no write to an in-flight wgmma's registers."""
    r = _run("--layout", "mma64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fold wait " in r.stdout and "fold split" in r.stdout and " swap " in r.stdout, r.stdout  # both orders checked


def test_the_unsplit_folded_body_is_caught():
    """The check finds the hazard in the body session 15 shipped (both halves converted before
    the first MMA; still what a folded launch on "nk" weights would compile, which the wrapper
    refuses on CUDA), and none in the same config on "mma64" weights (split halves)."""
    r = _run("--self-test")
    assert r.returncode == 0 and "self-test ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_mma64e_bodies_hazard_free_and_read_stored_words():
    """On "mma64e" weights (the layer's layout on CUDA; the script's default) every config
    routed_configs picks for them compiles with no wgmma register hazard, and every input of
    the conversion PTX is a register straight from a 16-byte vector load - the aligned stored
    word the layout encoded (a byte shuffle between load and asm would break the encoding while
    the "mma64" PTX, byte-wise, would not notice)."""
    r = _run()
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln for ln in r.stdout.splitlines() if "hazards" in ln]
    assert rows and all("0 hazards" in ln and "asm words as loaded" in ln for ln in rows), r.stdout
    for ln in rows:
        got, total = ln.rsplit(", ", 1)[1].split()[0].split("/")
        assert got == total and int(total) > 0, ln


def test_describe_difference_between_two_assemblies():
    """--compare-ptxas's verdict: identical code, code equal but for `.reuse` operand-cache
    flags (session 34: CUDA 13.0's ptxas against Triton's 12.8), or really different code."""
    a = [(0, "PRMT R124, R43, 0x7770, RZ"), (16, "HMUL2.BF16_V2 R4, R4, R9"), (32, "EXIT")]
    reuse = [(0, "PRMT R124, R43.reuse, 0x7770, RZ"), (16, "HMUL2.BF16_V2 R4, R4, R9"), (32, "EXIT")]
    other = [(0, "PRMT R124, R43, 0x7771, RZ"), (16, "HMUL2.BF16_V2 R4, R4, R9"), (32, "EXIT")]
    assert H.describe_difference(a, list(a), 40, 40, "13.0") == "same SASS with ptxas 13.0 (3 instructions)"
    assert "1 differ only in .reuse" in H.describe_difference(a, reuse, 40, 40, "13.0")
    got = H.describe_difference(a, other, 40, 42, "13.0")
    assert got.startswith("SASS differs") and "40 -> 42 registers" in got and "0 hazards" in got, got
    assert H.describe_difference(a, a[:2], 40, 40, "13.0").startswith("SASS differs")


def test_compare_ptxas_needs_an_executable():
    r = _run("--compare-ptxas", "/nonexistent/ptxas")
    assert r.returncode != 0 and "--compare-ptxas='/nonexistent/ptxas'" in r.stderr, r.stdout + r.stderr


def test_load_schedule_counts_loads_before_the_first_mma():
    """load_schedule (session 41's --loads): loads and cp.async split at the first HGMMA, the full
    wgmma waits counted, predicated instructions read by their opcode."""
    ins = H.parse_sass("""
        /*0000*/                   LDG.E R2, desc[UR8][R2.64] ;
        /*0010*/              @!P0 LDGSTS.E.BYPASS.128 [R4], desc[UR8][R6.64] ;
        /*0020*/                   LDGDEPBAR ;
        /*0030*/                   HGMMA.64x16x16.F32.BF16 R24, R40, gdesc[UR4], R24, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/              @!P0 LDG.E.128 R8, desc[UR8][R28.64] ;
        /*0060*/                   HGMMA.64x16x16.F32.BF16 R24, R44, gdesc[UR8], R24, gsb0 ;
        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0080*/                   EXIT ;
""")
    assert H.load_schedule(ins) == dict(LDG=2, LDGSTS=1, LDG_before_mma=1, LDGSTS_before_mma=1, wgmma_waits=2)
    assert H.load_schedule(ins[:3])["LDG_before_mma"] == 1  # no MMA at all: everything counts as before
