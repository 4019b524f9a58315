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

from pcppass.engine.launch import launch
from vllm_cases import VLLM_ENV
from vllm_sharding import ShardedCase, check_sharded, first_divergence, run_cases

UNREGISTER_KV = ("vllm.unified_kv_cache_update",)


@pytest.mark.timeout(900)
def test_two_ranks_layername_and_negative_control(vllm_model_dirs, vllm_reference_tokens, monkeypatch):
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_USE_LAYERNAME", "1")
    cases = [ShardedCase("llama", inner="inductor"), ShardedCase("deepseek_v2", inner="aot_eager"),
             ShardedCase("llama", unregister=UNREGISTER_KV),
             ShardedCase("llama", unregister=UNREGISTER_KV, on_uncovered="unsafe_ignore")]
    dirs = {m: str(p) for m, p in vllm_model_dirs.items()}
    per_rank = launch(run_cases, 2, dirs, cases, timeout_s=860)
    for i, case in enumerate(cases[:2]):
        check_sharded(f"{case.model} P=2 {case.inner}", [per_rank[r][i] for r in range(2)],
                      vllm_reference_tokens[case.model])
    refused = [per_rank[r][2] for r in range(2)]
    for r in refused:
        assert r.get("error") == "PcpCoverageError", r
        assert "vllm::unified_kv_cache_update" in r["message"], r["message"]
        assert "model.layers.0.self_attn.attn" in r["message"], r["message"]
    ignored = [per_rank[r][3] for r in range(2)]
    where = first_divergence(ignored)
    assert where is not None, "an unsynced KV write did not make the replicas diverge"
    assert where[1].startswith("model.layers.") and where[1].endswith(".self_attn.attn"), where


@pytest.mark.timeout(900)
def test_four_ranks_layer_name_strings(vllm_model_dirs, vllm_reference_tokens, monkeypatch):
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_USE_LAYERNAME", "0")
    cases = [ShardedCase("llama", inner="aot_eager"), ShardedCase("deepseek_v2")]
    dirs = {m: str(p) for m, p in vllm_model_dirs.items()}
    per_rank = launch(run_cases, 4, dirs, cases, timeout_s=860)
    for i, case in enumerate(cases):
        check_sharded(f"{case.model} P=4 {case.inner}", [per_rank[r][i] for r in range(4)],
                      vllm_reference_tokens[case.model])
