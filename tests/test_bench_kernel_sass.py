"""bench/kernel_sass.py and ``bench/ds_mla_variants.py --sass`` on a machine without a GPU: the decode
kernels compile for sm_90 from CPU tensors and their loops show what the GPU runs (tensor-core
MMAs, fp8 conversions, Hopper's warp-group MMA for the wgmma variant and the Gluon kernels, and the
Gluon warp-specialised kernel's register split between its partitions)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT / "bench", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def gluon_summary(launch_expr: str) -> tuple[int, int, list[int], str]:
    """(stack bytes, shared bytes, the register counts its warp groups set, SASS) of the Gluon
    launch ``launch_expr`` (an expression over ``kernel_sass`` and ``ds_mla_variants as v``),
    compiled for sm_90."""
    out = run("-c", f"""
import os, sys, tempfile
import kernel_sass, ds_mla_variants as v
kernel = kernel_sass.compile_launch({launch_expr})
stats = kernel_sass.sass_stats(kernel)
with tempfile.TemporaryDirectory() as tmp:
    cubin = os.path.join(tmp, "k.cubin")
    open(cubin, "wb").write(kernel.asm["cubin"])
    sys.stdout.write(f"stack {{stats.stack_bytes}} shared {{stats.shared_bytes}}\\n")
    sys.stdout.write(kernel_sass._tool("cuobjdump", "-sass", cubin))
""")
    stack, shared = map(int, re.search(r"stack (\d+) shared (\d+)", out).groups())
    regs = sorted({int(m, 16) for m in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?0x([0-9a-f]+)", out)})
    return stack, shared, regs, out


def test_dense_kernels_compile_for_sm90_and_show_their_loops():
    out = run("kernel_sass.py", "--kernels", "mla_bf16,mla_fp8_ds_mla")
    rows = dict(re.findall(r"^(\w+): (.*)$", out, re.M))
    for name, row in rows.items():
        registers = int(re.match(r"(\d+) registers", row).group(1))
        assert 0 < registers <= 255, (name, row)
        assert int(re.search(r"loop (\d+) instructions", row).group(1)) > 100, (name, row)
        assert re.search(r"\bHMMA \d+", row), (name, row)  # the dots run on tensor cores
    assert set(rows) == {"mla_bf16", "mla_fp8_ds_mla"}
    assert re.search(r"\bF2FP \d+", rows["mla_fp8_ds_mla"])  # e4m3 codes converted in the loop


def test_ds_mla_variants_compile_for_sm90():
    out = run("ds_mla_variants.py", "--sass")
    rows = dict(re.findall(r"^(.*?): (\d+ registers.*)$", out, re.M))
    assert len(rows) == 10, out
    assert all("0 B stack" in row for name, row in rows.items() if name.startswith(("wgmma", "gluon warp"))), rows
    assert all("HGMMA" in row for name, row in rows.items() if name.startswith(("wgmma", "gluon, one"))), rows


def test_gluon_warp_specialised_kernel_splits_its_registers_and_fits_an_sm():
    stack, shared, regs, sass = gluon_summary(
        'v._intercepted(lambda: v.gluon_attention("gluon_ws", *kernel_sass.mla_inputs(True), 0.07, DEQUANT_REGS=192))')
    assert stack == 0 and shared <= 227 * 1024, (stack, shared)  # no spills; one program fits an SM's shared memory
    assert 192 in regs and max(regs) > 192, regs  # dequant warps 192 registers, MMA warps the rest
    # warp-group MMAs, cp.async, mbarrier waits
    assert sass.count("HGMMA") >= 68 and sass.count("LDGSTS") > 0 and sass.count("SYNCS") > 0


def test_gluon_sparse_mla_kernel_fits_an_sm_and_splits_its_warps():
    """The launcher's sparse MLA kernel on Hopper (``gluon_kernels.sparse_mla_kernel``) compiles
    for sm_90: no spills, one program's shared memory within an SM's 227 KB, three warp groups with
    their own register counts (values 160, dequant 120, scores the rest), the scores' MMAs over a
    whole 32-key tile and the values' over 128 latent dims, the codes converted to float16 and
    scaled two at a time."""
    stack, shared, regs, sass = gluon_summary("kernel_sass.sparse_mla_gluon_case()")
    assert stack == 0 and shared <= 227 * 1024, (stack, shared)
    assert {120, 160} <= set(regs) and max(regs) > 160, regs
    for op in ("HGMMA.64x32x16.F32 ", "HGMMA.64x32x16.F32.BF16", "HGMMA.64x128x16.F32", "HMUL2", "F2FP.F16.E4M3"):
        assert op in sass, op


def test_gluon_dense_mla_kernel_fits_an_sm_and_splits_its_warps():
    """The launcher's dense fp8_ds_mla kernel on Hopper (``gluon_kernels.dense_mla_kernel``)
    compiles for sm_90: no spills, within an SM's 227 KB of shared memory, its warp groups with
    their own register counts (values 112, dequant 152, scores the rest), the scores' MMAs with the
    64-key tile as M and the 16 heads as N (float16 latent, bf16 RoPE), the codes converted to
    float16 and scaled two at a time, the raw slot filled by TMA copies (2-D boxes) and no
    ``cp.async``."""
    stack, shared, regs, sass = gluon_summary("kernel_sass.dense_mla_gluon_case()")
    assert stack == 0 and shared <= 227 * 1024, (stack, shared)
    assert {112, 152} <= set(regs), regs
    for op in ("HGMMA.64x16x16.F32 ", "HGMMA.64x16x16.F32.BF16", "HMUL2", "F2FP.F16.E4M3", "UTMALDG.2D"):
        assert op in sass, op
    assert "LDGSTS" not in sass


def test_gluon_dense_mla_regs_kernel_takes_its_mma_operands_from_registers():
    """``gluon_dense.dense_mla_regs_kernel`` compiles for sm_90 (every layout conversion into the
    MMA fragments moves no data: the kernel asserts it), two programs fit an SM's shared memory,
    every latent MMA takes its A operand from registers (64 per pair of tiles, 16 heads as N) and
    only the RoPE scores read A from shared memory (bf16), the codes are converted in the loop (the
    values' scaled two at a time), the raw slots are filled by TMA copies and nothing goes through a
    float16 tile in shared memory (no ``stmatrix`` of codes: the only shared stores are the
    probabilities')."""
    stack, shared, regs, sass = gluon_summary("kernel_sass.dense_mla_regs_case()")
    assert 2 * shared <= 227 * 1024, shared
    register_a = re.findall(r"HGMMA\.64x16x16\.F32 R\d+, R\d+, gdesc", sass)
    shared_a = re.findall(r"HGMMA\.64x16x16\.F32\.BF16 R\d+, gdesc", sass)
    assert len(register_a) >= 64 and shared_a, (len(register_a), len(shared_a))
    assert not re.search(r"HGMMA\.64x16x16\.F32 R\d+, gdesc", sass)  # no latent MMA reads A from shared memory
    for op in ("F2FP.F16.E4M3", "HMUL2", "UTMALDG.2D"):
        assert op in sass, op
    assert "LDGSTS" not in sass


def test_gluon_dense_mla_regs_ws_kernel_splits_its_warp_groups_without_spills():
    """``gluon_dense.dense_mla_regs_ws_kernel`` compiles for sm_90: no spills, one program's three
    raw slots within an SM's shared memory, the values groups at 152 registers and the scores group
    at 200, the 64 latent MMAs of a tile with A in registers (the scores' over 64 keys, the values'
    over 256 dims in each values group) and the RoPE scores' four from shared memory."""
    stack, shared, regs, sass = gluon_summary("kernel_sass.dense_mla_regs_ws_case()")
    assert stack == 0 and shared <= 227 * 1024, (stack, shared)
    assert {152, 200} <= set(regs), regs
    register_a = re.findall(r"HGMMA\.64x16x16\.F32 R\d+, R\d+, gdesc", sass)
    shared_a = re.findall(r"HGMMA\.64x16x16\.F32\.BF16 R\d+, gdesc", sass)
    assert len(register_a) == 64 and len(shared_a) == 4, (len(register_a), len(shared_a))
    for op in ("F2FP.F16.E4M3", "HMUL2", "UTMALDG.2D", "SYNCS"):
        assert op in sass, op


def test_gluon_dense_mla_fp8_kernel_runs_the_scores_as_fp8_mmas_on_the_raw_codes():
    """``gluon_dense_fp8.dense_mla_fp8_kernel`` compiles for sm_90: no spills, four raw slots within
    an SM's shared memory, the values groups at 152 registers and the scores group at 200; a tile's
    latent scores are 16 e4m3 MMAs reading both operands from shared memory (the TMA-copied codes as
    A, the query's two e4m3 parts as the 32 columns of B: four 128-dim chunks of four 32-deep
    steps), its RoPE scores four bf16 MMAs, its values 32 MMAs with A in registers; no latent code is
    converted for the scores: the e4m3 -> float16 conversions are the values' (each scaled) and the
    query's 32 ``hi`` parts read back once per program."""
    stack, shared, regs, sass = gluon_summary("kernel_sass.dense_mla_fp8_case()")
    assert stack == 0 and shared <= 227 * 1024, (stack, shared)
    assert {152, 200} <= set(regs), regs
    fp8_scores = re.findall(r"QGMMA\.64x32x32\.F32\.E4M3\.E4M3 R\d+, gdesc", sass)
    rope = re.findall(r"HGMMA\.64x16x16\.F32\.BF16 R\d+, gdesc", sass)
    register_a = re.findall(r"HGMMA\.64x16x16\.F32 R\d+, R\d+, gdesc", sass)
    assert (len(fp8_scores), len(rope), len(register_a)) == (16, 4, 32), (len(fp8_scores), len(rope), len(register_a))
    assert sass.count("F2FP.F16.E4M3") == sass.count("HMUL2") + 32, (sass.count("F2FP.F16.E4M3"), sass.count("HMUL2"))
    for op in ("UTMALDG.2D", "SYNCS"):
        assert op in sass, op
