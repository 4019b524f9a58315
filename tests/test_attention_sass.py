"""The launcher's decode kernels compile for sm_90 on a machine without a GPU (``sass_cases``), and
their machine code shows what the GPU runs: tensor-core MMAs and fp8 conversions in the Triton MLA
loop; Hopper's warp-group MMAs, TMA or ``cp.async`` copies and the register split between the warp
groups of the two Gluon kernels the launcher runs on Hopper."""

import re

from sass_cases import compile_launch, dense_mla_gluon_case, sass_stats, sparse_mla_gluon_case, triton_mla_case


def gluon_summary(case) -> tuple[int, int, list[int], str]:
    """(stack bytes, shared bytes, the register counts its warp groups set, SASS) of a Gluon launch."""
    stats = sass_stats(compile_launch(case))
    regs = sorted({int(m, 16) for m in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?0x([0-9a-f]+)", stats.sass)})
    return stats.stack_bytes, stats.shared_bytes, regs, stats.sass


def test_dense_kernels_compile_for_sm90_and_show_their_loops():
    for ds_mla in (False, True):
        stats = sass_stats(compile_launch(triton_mla_case(ds_mla)))
        assert 0 < stats.registers <= 255, (ds_mla, stats.registers)
        assert stats.loop_instructions > 100, (ds_mla, stats.loop_instructions)
        assert stats.loop_opcodes["HMMA"] > 0, (ds_mla, stats.loop_opcodes)  # the dots run on tensor cores
        if ds_mla:
            assert stats.loop_opcodes["F2FP"] > 0, stats.loop_opcodes  # e4m3 codes converted in the loop


def test_gluon_sparse_mla_kernel_fits_an_sm_and_splits_its_warps():
    """The launcher's sparse MLA kernel on Hopper (``gluon_kernels.sparse_mla_kernel``) compiles
    for sm_90: no spills, one program's shared memory within an SM's 227 KB, three warp groups with
    their own register counts (values 160, dequant 120, scores the rest), the scores' MMAs over a
    whole 32-key tile and the values' over 128 latent dims, the codes converted to float16 and
    scaled two at a time."""
    stack, shared, regs, sass = gluon_summary(sparse_mla_gluon_case())
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
    stack, shared, regs, sass = gluon_summary(dense_mla_gluon_case())
    assert stack == 0 and shared <= 227 * 1024, (stack, shared)
    assert {112, 152} <= set(regs), regs
    for op in ("HGMMA.64x16x16.F32 ", "HGMMA.64x16x16.F32.BF16", "HMUL2", "F2FP.F16.E4M3", "UTMALDG.2D"):
        assert op in sass, op
    assert "LDGSTS" not in sass
