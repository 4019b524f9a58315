"""vLLM's own models decode-sharded on P gloo ranks through ``pcppass.integrations.vllm.adapter``.

Each rank is one process holding vLLM's model (vLLM's model code, its CPU attention backend and
its ``unified_kv_cache_update`` / ``unified_mla_kv_cache_update`` ops), driven by
``pcppass.engine`` with decode rows owned round-robin: the pcppass backend syncs the KV rows every
layer's update op fetched by layer name, in one all-gather per decode step. Requests finish on
different steps, so rows change owner between steps. After every step each layer's ``kv_cache``
must be bitwise identical on all ranks, and the greedy tokens must equal vLLM's own
single-process ``LLM.generate`` on the same prompts (default compile).

Negative control: with vLLM's KV-update pattern removed the decode graph is refused; forced to run
anyway (``on_uncovered="unsafe_ignore"``), the replicas diverge and the first diverging state is
a layer's KV cache, named by layer.
"""

from __future__ import annotations

import pytest

from vllm_sharding import check_sharded, first_divergence

#: the session's sharded launches run every case of the job (vllm_sharding.TWO_RANKS, FOUR_RANKS);
#: the first test to ask pays for them
pytestmark = pytest.mark.timeout(2400)


def test_two_ranks_layername_and_negative_control(vllm_sharded_two, vllm_reference_tokens):
    for key in ("llama", "deepseek_v2"):
        check_sharded(f"{key} P=2", vllm_sharded_two[key], vllm_reference_tokens[key])
    for r in vllm_sharded_two["llama without the KV pattern"]:
        assert r.get("error") == "PcpCoverageError", r
        assert "vllm::unified_kv_cache_update" in r["message"], r["message"]
        assert "model.layers.0.self_attn.attn" in r["message"], r["message"]
    where = first_divergence(vllm_sharded_two["llama without the KV pattern, forced"])
    assert where is not None, "an unsynced KV write did not make the replicas diverge"
    assert where[1].startswith("model.layers.") and where[1].endswith(".self_attn.attn"), where


def test_four_ranks_layer_name_strings(vllm_sharded_four, vllm_reference_tokens):
    for key in ("llama", "deepseek_v2"):
        check_sharded(f"{key} P=4", vllm_sharded_four[key], vllm_reference_tokens[key])
