"""HF transformers decode graphs with StaticCache: exactly the K/V index_copy_ writes, the
cache-length counter as non-row state, nothing else (MoE routing scratch is not state)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from pcppass.analysis import Uncovered, find_state_writes  # noqa: E402
from pcppass.analysis.trace import StepInputs, capture_graph  # noqa: E402


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return cfg, transformers.LlamaForCausalLM(cfg)


def _deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=64, n_group=1, topk_group=1)
    return cfg, transformers.DeepseekV3ForCausalLM(cfg)


@pytest.mark.parametrize("build", [_llama, _deepseek_v3], ids=["llama", "deepseek_v3"])
def test_static_cache_decode_graph(build):
    torch.manual_seed(0)
    cfg, model = build()
    model.eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=32)
    with torch.no_grad():  # prefill eagerly: lazily allocates the cache (as HF recommends)
        model(input_ids=torch.randint(0, 128, (1, 4)), past_key_values=cache, use_cache=True)
    step = StepInputs((), {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache,
                           "use_cache": True})
    writes = find_state_writes(capture_graph(model, step))

    layers = cfg.num_hidden_layers
    prefix = "L['kwargs']['past_key_values'].layers"
    expected = []
    for i in range(layers):
        expected += [
            (f"{prefix}[{i}].cumulative_length", "aten::add_", False, Uncovered.NON_ROW_STATE),
            (f"{prefix}[{i}].keys", "aten::index_copy_", True, None),
            (f"{prefix}[{i}].values", "aten::index_copy_", True, None),
        ]
    assert [(w.state, w.op, w.covered, w.reason) for w in writes] == expected
    for w in writes:
        if w.covered:
            keys = cache.layers[0].keys if w.state.endswith("keys") else cache.layers[0].values
            b, h, length, d = keys.shape
            assert (w.layout.kind, w.layout.dim, w.layout.block_size) == ("indexed_dim", 2, length)
            assert w.bytes_per_row == w.written_bytes_per_row == b * h * d * keys.element_size()
            assert w.source.endswith(".py:" + w.source.rsplit(":", 1)[1]) and "cache_utils" in w.source
