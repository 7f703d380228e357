"""scripts/sass_diff.py, the kernel-by-kernel comparison of two builds' machine code: its reading of
cuobjdump's listings (on made-up listings, so that no toolkit is needed)."""

import importlib.util
import io
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sass_diff", REPO / "scripts" / "sass_diff.py")
sass_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_diff)


def listing(functions, base=0):
    """A cuobjdump --dump-sass listing of {name: [instruction, ...]}, addresses from `base`, with encodings."""
    lines = ["", "Fatbin elf code:", "================", "arch = sm_90a", "", "\tcode for sm_90a"]
    for name, instructions in functions.items():
        lines += [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_TEXMODE_UNIFIED"']
        for i, ins in enumerate(instructions):
            address = base + 16 * i
            lines.append(f"        /*{address:04x}*/                   {ins} ;"
                         f"                 /* 0x{address:016x} */")
            lines.append("                                                                /* 0x000fe20000000f00 */")
        lines.append("\t\t..........")
    return "\n".join(lines) + "\n"


GEMM = ["LDC R1, c[0x0][0x28]", "@!P0 BRA `(.L_x_1)", "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1", "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", "STSM.16.M88.4 [R3], R4",
        "@P1 STG.E desc[UR6][R8.64], R10", "UTMASTG.2D [UR8], [UR10]", "EXIT"]
COPY = ["S2R R0, SR_TID.X", "LDG.E R2, desc[UR4][R2.64]", "STG.E desc[UR4][R4.64], R2", "EXIT"]


def test_parse_drops_addresses_encodings_and_headers():
    kernels = sass_diff.parse_sass(listing({"_Z4gemmv": GEMM, "_Z4copyv": COPY}))
    assert kernels == {"_Z4gemmv": GEMM, "_Z4copyv": COPY}


def test_a_kernel_moved_in_the_binary_is_the_same():
    a = sass_diff.parse_sass(listing({"_Z4gemmv": GEMM}, base=0))
    b = sass_diff.parse_sass(listing({"_Z4gemmv": GEMM}, base=0x4000))
    same, differ, only_a, only_b = sass_diff.compare(a, b)
    assert (same, differ, only_a, only_b) == (["_Z4gemmv"], [], [], [])


def test_counted_opcodes_ignore_predicates():
    c = sass_diff.counts(GEMM)
    assert c["wgmma"] == 1 and c["wgmma waits"] == 1 and c["barriers"] == 1
    assert c["shared stores"] == 1 and c["global stores"] == 1 and c["TMA"] == 1
    assert c["local memory"] == 0 and c["shared loads"] == 0


def test_report_names_what_differs_and_local_memory():
    spilled = GEMM[:-1] + ["STL [R1+0x10], R4", "LDL R4, [R1+0x10]", "EXIT"]
    a = sass_diff.parse_sass(listing({"_Z4gemmv": GEMM, "_Z4copyv": COPY, "_Z3oldv": COPY}))
    b = sass_diff.parse_sass(listing({"_Z4gemmv": spilled, "_Z4copyv": COPY, "_Z3newv": COPY}))
    out = io.StringIO()
    different = sass_diff.report(a, b, show="gemm", out=out)
    text = out.getvalue()
    assert different == 3  # gemm differs, old only in A, new only in B
    assert "same instruction for instruction: 1; differ: 1; only in A: 1; only in B: 1" in text
    assert f"instructions {len(GEMM)} -> {len(spilled)}; local memory 0->2" in text
    assert "+STL [R1+0x10], R4" in text  # --show: the first differences
    assert "B uses local memory" in text


def test_resources():
    text = (" Function _Z4gemmv:\n  REG:168 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:1584 TEXTURE:0\n"
            " Function _Z4copyv:\n  REG:32 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:900\n")
    r = sass_diff.parse_resources(text)
    assert r == {"_Z4gemmv": {"REG": 168, "STACK": 0, "SHARED": 1024, "LOCAL": 0},
                 "_Z4copyv": {"REG": 32, "STACK": 16, "SHARED": 0, "LOCAL": 8}}
    out = io.StringIO()
    kernels = sass_diff.parse_sass(listing({"_Z4copyv": COPY}))
    assert sass_diff.report(kernels, kernels, out=out, b_resources=r) == 0
    assert "(stack 16 B, local 8 B)" in out.getvalue()
