"""bench/kernel_sass.py and ``bench/ds_mla_variants.py --sass`` on a machine without a GPU: the decode
kernels compile for sm_90 from CPU tensors and their loops show what the GPU runs (tensor-core
MMAs, fp8 conversions, Hopper's warp-group MMA for the wgmma variant)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT / "bench", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


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
    assert len(rows) == 7, out
    assert all("0 B stack" in row for name, row in rows.items() if name.startswith("wgmma")), rows
    assert all("HGMMA" in row for name, row in rows.items() if name.startswith("wgmma")), rows
