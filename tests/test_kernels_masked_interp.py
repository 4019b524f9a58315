"""The cache-write ops' CUDA store path (every row encoded, one masked Triton store) gives the
reference bytes, run on CPU tensors under ``TRITON_INTERPRET=1`` through ``masked_stores(True)``.

With the value checks off, that path never selects rows on the host: ``live_rows`` (``nonzero``) is
made to fail and the ops still write the same bytes, padding rows skipped.
"""

import os

import pytest
import torch

from kernels_cases import CACHE_ARGS, CASES, OPS, clone_args
from pcppass.ops import cache_ops, checks

MASKED = {
    "reshape_and_cache_flash": [{}, {"kv_cache_dtype": "fp8", "cache_dtype": torch.uint8},
                                {"kv_cache_dtype": "fp8", "cache_dtype": torch.float8_e4m3fn}],
    "concat_and_cache_mla": [{"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_ds_mla"}],
    "indexer_k_quant_and_cache": [{}, {"quant_block_size": 128, "scale_fmt": "fp32"}],
    "fused_norm_rope": [{}, {"mla_kv_cache_dtype": "auto"}],
    "swa_qnorm_rope_kv_insert": [{}],
    "compressor_save_state": [{}],
}
PARAMS = [(name, kw) for name, kws in MASKED.items() for kw in kws]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("name,kwargs", PARAMS, ids=[f"{n}-{i}" for n, kws in MASKED.items() for i in range(len(kws))])
def test_masked_store_path_matches_reference_without_host_selection(monkeypatch, name, kwargs):
    args = CASES[name](**kwargs)
    reference, masked = clone_args(args), clone_args(args)
    out_reference = OPS[name](**reference)

    def no_host_selection(slot_mapping):
        raise AssertionError("the masked store path selected rows on the host")

    monkeypatch.setattr(cache_ops, "live_rows", no_host_selection)
    with cache_ops.masked_stores(True), checks.value_checks(False):
        out_masked = OPS[name](**masked)
    for cache in CACHE_ARGS[name]:
        assert torch.equal(_bytes(masked[cache]), _bytes(reference[cache])), cache
        assert not torch.equal(_bytes(masked[cache]), _bytes(args[cache])), f"{cache}: nothing written"
    if out_reference is not None:
        assert torch.equal(out_masked, out_reference)


def test_value_checks_still_refuse_bad_slots_on_the_masked_path():
    args = CASES["reshape_and_cache_flash"]()
    args["slot_mapping"][0] = 10_000
    before = clone_args(args)
    with cache_ops.masked_stores(True), pytest.raises(checks.KernelInputError, match="holds slot 10000"):
        OPS["reshape_and_cache_flash"](**args)
    assert torch.equal(args["key_cache"], before["key_cache"])
    # checks off: an out-of-range slot is dropped by the kernel, never written out of bounds
    with cache_ops.masked_stores(True), checks.value_checks(False):
        OPS["reshape_and_cache_flash"](**args)
    assert os.environ["TRITON_INTERPRET"] == "1"
