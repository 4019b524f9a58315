"""bench/ncu_wavefronts.py on a source page in Nsight Compute's CSV form: wavefronts summed by
opcode (predicated instructions under their opcode), the first kernel's only."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import ncu_wavefronts  # noqa: E402

HEADER = ('"Address","Source","Instructions Executed","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal"\n')
PAGE = ('"Kernel Name","dense_mla_kernel",\n' + HEADER
        + '"0x10","      STS.128 [R8], R4","131,072","1,048,576","524,288"\n'
        + '"0x20","@!P1  STS.128 [R9], R4","100","800","400"\n'
        + '"0x30","      LDS.64 R4, [R2]","10","20","20"\n'
        + '"0x40","      IMAD R1, R2, R3, R4","50","0","0"\n'
        + '"0x50","",,"",""\n'
        + '"Kernel Name","sparse_mla_kernel",\n' + HEADER
        + '"0x10","      STS.128 [R8], R4","1","999","1"\n')


def test_wavefronts_by_opcode_of_the_first_kernel(tmp_path):
    page = tmp_path / "prof.csv"
    page.write_text(PAGE)
    counts = ncu_wavefronts.wavefronts(page)
    assert counts == {"STS.128": (1_049_376.0, 524_688.0, 131_172.0), "LDS.64": (20.0, 20.0, 10.0)}
    text = ncu_wavefronts.table(page, tiles=2)
    assert "1.0 M wavefronts (ideal 0.5 M)" in text
    assert "| STS.128 | 1.05 | 0.52 | 0.13 | 524688 |" in text
