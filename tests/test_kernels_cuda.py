"""The reference ops on CUDA tensors (skipped without a GPU).

Pure store / quantise ops must give the CPU bytes exactly (IEEE division, amax, clamp, RNE
conversion). Ops with norms / RoPE / softmax may differ from CPU in the last float32 bit (different
reduction orders), so for them: deterministic on the device (two runs give the same bytes) and
equal to the device's unfused path, which the CPU tests check structurally.
"""

import pytest
import torch

from kernels_cases import CACHE_ARGS, CASES, OPS, clone_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXACT_ACROSS_DEVICES = ("reshape_and_cache_flash", "concat_and_cache_mla", "indexer_k_quant_and_cache",
                        "compressor_save_state")


def to_cuda(args):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def test_cuda_fp32_indexer_scales_and_cpu_scale_tensor_match_cpu():
    """Exact division on the device: raw fp32 indexer scales, and a per-tensor fp8 scale given as
    a CPU tensor with CUDA caches."""
    args = CASES["indexer_k_quant_and_cache"](64, "fp32")
    cpu, dev = clone_args(args), to_cuda(args)
    OPS["indexer_k_quant_and_cache"](**cpu)
    OPS["indexer_k_quant_and_cache"](**dev)
    assert torch.equal(dev["kv_cache"].cpu(), cpu["kv_cache"])
    args = CASES["concat_and_cache_mla"]("fp8")
    cpu, dev = clone_args(args), {**to_cuda(args), "scale": args["scale"]}
    OPS["concat_and_cache_mla"](**cpu)
    OPS["concat_and_cache_mla"](**dev)
    assert torch.equal(dev["kv_cache"].cpu().view(torch.uint8), cpu["kv_cache"].view(torch.uint8))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_matches_cpu_or_is_deterministic(name):
    args = CASES[name]()
    cpu = clone_args(args)
    first, second = to_cuda(args), to_cuda(args)
    out_cpu = OPS[name](**cpu)
    out_first = OPS[name](**first)
    out_second = OPS[name](**second)
    for cache in CACHE_ARGS[name]:
        a, b = first[cache].view(torch.uint8), second[cache].view(torch.uint8)
        assert torch.equal(a, b), cache
        if name in EXACT_ACROSS_DEVICES:
            assert torch.equal(a.cpu(), cpu[cache].view(torch.uint8)), cache
    if out_cpu is not None:
        assert torch.equal(out_first, out_second)
        torch.testing.assert_close(out_first.cpu().float(), out_cpu.float(), rtol=2e-2, atol=2e-2)
