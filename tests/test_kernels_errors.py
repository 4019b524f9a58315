"""Bad inputs: a KernelInputError naming the op, the argument and the calling line, raised before
anything is written (every cache bitwise unchanged). Bad slots sit in the LAST row so that an op
validating while it writes would already have written the earlier rows."""

import pytest
import torch

from kernels_cases import CACHE_ARGS, CASES, OPS, clone_args
from pcppass.ops import KernelInputError


def set_last(name, value):
    def mutate(a):
        a[name] = a[name].clone()
        a[name][-1] = value
    return mutate


def replace(name, fn):
    def mutate(a):
        a[name] = fn(a)
    return mutate


BAD_INPUTS = [
    # op, argument the error must name, mutation
    ("reshape_and_cache_flash", "slot_mapping", replace("slot_mapping", lambda a: a["slot_mapping"].int())),
    ("reshape_and_cache_flash", "slot_mapping", replace("slot_mapping", lambda a: a["slot_mapping"][:-1])),
    ("reshape_and_cache_flash", "slot_mapping", set_last("slot_mapping", 16)),  # 4 blocks x 4
    ("reshape_and_cache_flash", "slot_mapping", replace("slot_mapping", lambda a: a["slot_mapping"].where(
        torch.arange(6) != 5, a["slot_mapping"][0]))),  # duplicate slot
    ("reshape_and_cache_flash", "key_cache", replace("key_cache", lambda a: a["key_cache"].view(torch.uint8)[..., ::2])),
    ("reshape_and_cache_flash", "value_cache", replace("value_cache", lambda a: a["value_cache"][:, :, :1])),
    ("reshape_and_cache_flash", "kv_cache_dtype", replace("kv_cache_dtype", lambda a: "fp16")),
    ("concat_and_cache_mla", "kv_cache", replace("kv_cache", lambda a: a["kv_cache"][..., :576])),
    ("concat_and_cache_mla", "kv_c", replace("kv_c", lambda a: a["kv_c"][:, :500])),
    ("concat_and_cache_mla", "slot_mapping", set_last("slot_mapping", 12)),
    ("indexer_k_quant_and_cache", "kv_cache", replace("kv_cache", lambda a: a["kv_cache"][:, :-1])),
    ("indexer_k_quant_and_cache", "quant_block_size", replace("quant_block_size", lambda a: 48)),
    ("indexer_k_quant_and_cache", "scale_fmt", replace("scale_fmt", lambda a: "e8m0")),
    ("indexer_k_quant_and_cache", "slot_mapping", set_last("slot_mapping", 12)),
    ("fused_norm_rope", "indexer_slot_mapping", set_last("indexer_slot_mapping", 99)),
    ("fused_norm_rope", "positions", set_last("positions", 64)),  # cos_sin_cache has 64 rows
    ("fused_norm_rope", "slot_mapping", replace("slot_mapping", lambda a: a["slot_mapping"].int())),
    ("fused_norm_rope", "indexer_k_cache", replace("indexer_k_cache", lambda a: a["indexer_k_cache"].float())),
    ("fused_norm_rope", "mla_kv_cache", replace("mla_kv_cache_dtype", lambda a: "auto")),  # uint8 cache
    ("swa_qnorm_rope_kv_insert", "swa_cache", replace("swa_cache", lambda a: a["swa_cache"].view(torch.uint8))),
    ("swa_qnorm_rope_kv_insert", "slot_mapping", set_last("slot_mapping", 99)),
    ("swa_qnorm_rope_kv_insert", "cos_sin_cache", replace("cos_sin_cache", lambda a: a["cos_sin_cache"][:, :15])),
    ("compressor_save_state", "state_cache", replace("state_cache", lambda a: a["state_cache"].bfloat16())),
    ("compressor_save_state", "ape", replace("ape", lambda a: a["ape"][:3])),
    ("compressor_save_state", "slot_mapping", set_last("slot_mapping", 12)),
    ("compressor_compress_store", "positions", set_last("positions", 22)),  # a slot on a row not closing a group
    ("compressor_compress_store", "state_block_table", set_last("state_block_table", 8)),
    ("compressor_compress_store", "state_cache", replace("state_cache", lambda a: a["state_cache"][..., :32])),
    ("compressor_compress_store", "kv_cache_dtype", replace("kv_cache_dtype", lambda a: "fp8")),
]


@pytest.mark.parametrize("op_name,arg,mutate", BAD_INPUTS,
                         ids=[f"{op}-{arg}-{i}" for i, (op, arg, _) in enumerate(BAD_INPUTS)])
def test_bad_input_is_refused_before_any_write(op_name, arg, mutate):
    args = CASES[op_name]()
    mutate(args)
    before = clone_args(args)
    with pytest.raises(KernelInputError) as info:
        OPS[op_name](**args)
    message = str(info.value)
    assert f"pcppass::{op_name}: argument '{arg}'" in message, message
    assert "test_kernels_errors.py" in message, message  # the calling line
    for cache in CACHE_ARGS[op_name]:
        assert torch.equal(args[cache].view(torch.uint8), before[cache].view(torch.uint8)), cache


def test_padding_rows_may_carry_any_position():
    """Positions of skipped rows are never used: no error, and the same result as position 0."""
    args = CASES["fused_norm_rope"]()
    padded = clone_args(args)
    padded["positions"][4] = 10_000  # row 4 has slot -1
    args["positions"][4] = 0
    assert torch.equal(OPS["fused_norm_rope"](**args), OPS["fused_norm_rope"](**padded))
    assert torch.equal(args["mla_kv_cache"], padded["mla_kv_cache"])


def test_structural_error_surfaces_while_compiling():
    torch._dynamo.reset()
    args = CASES["concat_and_cache_mla"]()
    args["kv_cache"] = args["kv_cache"][..., :576]
    before = args["kv_cache"].clone()

    def step(kv_c, k_pe, kv_cache, slot_mapping, scale):
        torch.ops.pcppass.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, "fp8_ds_mla", scale)

    with pytest.raises(Exception, match=r"pcppass::concat_and_cache_mla: argument 'kv_cache'"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(
            args["kv_c"], args["k_pe"], args["kv_cache"], args["slot_mapping"], args["scale"])
    assert torch.equal(args["kv_cache"], before)
