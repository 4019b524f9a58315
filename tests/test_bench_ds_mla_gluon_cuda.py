"""The Gluon fp8_ds_mla dense MLA kernels of ``bench/ds_mla_gluon.py`` on a Hopper GPU, against the
reference path (skipped elsewhere): decode rows at DeepSeek-V2 widths (16 heads, 512 + 64), several
key splits per row, a row at position 0 and rows whose last tile is partial."""

import sys
from pathlib import Path

import pytest
import torch

from attention_cases import make_step, mla_cache, reference_mla

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a Hopper GPU")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

BF16_TOL = 2e-2  # as tests/test_attention_cuda.py: bf16 operands, relative to the largest reference value
DECODE = [(1, 4000), (1, 2500), (1, 17), (1, 0), (1, 3100)]


@pytest.mark.parametrize("kernel,options", [("gluon_one_group", {}), ("gluon_ws", {"DEQUANT_REGS": 192}),
                                            ("gluon_ws_f16", {"DEQUANT_REGS": 168})])
def test_gluon_ds_mla_matches_the_reference(kernel, options):
    import ds_mla_variants

    step = make_step(DECODE, 3, 64, 72, device="cuda")
    t = step.rows.positions.shape[0]
    cache = mla_cache(step, 512, 64, True, dtype=torch.bfloat16, device="cuda")
    q_lat = torch.randn(t, 16, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(t, 16, 64, device="cuda", dtype=torch.bfloat16)
    out = ds_mla_variants.gluon_attention(kernel, q_lat, q_pe, cache, step.rows, 0.07, **options)
    ref = reference_mla(step, q_lat, q_pe, cache, 0.07, 512, True)
    live = step.live
    err = float((out[live].float() - ref[live].float()).abs().max() / ref[live].float().abs().max())
    print(f"{kernel}: error {err:.1e}")
    assert err < BF16_TOL
