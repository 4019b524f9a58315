"""Whether vLLM's attention op writes is decided per layer, from the backend vLLM really runs.

An out-of-tree backend registered over ``CPU_ATTN`` with vLLM's ``register_backend``
(``tests/vllm_kv_in_forward.py``) stores K/V inside ``vllm::unified_attention_with_output``
(``forward_includes_kv_cache_update = True``) and still calls itself ``CPU_ATTN``. Its graph holds
no ``unified_kv_cache_update``: the attention op is the only KV write of each layer.

* In a real ``vllm.LLM`` (the pcppass backend for vLLM), the audit reports each layer's attention
  op as a covered write (COPY_ROWS, one token's K and V bytes), and the tokens equal vLLM's.
* Sharded at P=2 under the adapter, with requests finishing on different steps (rows change
  owner): replicas bitwise identical after every step, tokens equal ``LLM.generate``.
* Negative control: with the attention op declared read-only whatever the backend (what pcppass
  said before), the same run passes the coverage check; the state digest then refuses the first
  decode step, naming a layer's KV cache, and with the digest off the replicas diverge at a
  layer's KV cache: the silent miss this decision closes.
"""

from __future__ import annotations

import pytest

from vllm_sharding import KV_IN_FORWARD, check_sharded, first_divergence

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
#: one token's K and V: 2 KV heads x 32 x fp32, twice
ROW_BYTES = 2 * 2 * 32 * 4


@pytest.mark.timeout(2400)  # the session's sharded launches (vllm_sharding), if this test comes first
def test_backend_storing_kv_in_forward_is_covered_and_sharded(vllm_sharded_two, vllm_references,
                                                              vllm_reference_tokens):
    result = vllm_references.results()[KV_IN_FORWARD]  # a vllm.LLM under pcppass's backend
    assert "error" not in result, result
    writes = result["writes"]
    assert not [w for w in writes if w["op"] == "vllm::unified_kv_cache_update"], writes
    kv = [w for w in writes if w["recipe"] == "copy_rows"]
    assert [(w["op"], w["state"], w["bytes_per_row"]) for w in kv] == [
        ("vllm::unified_attention_with_output", name, ROW_BYTES) for name in LAYERS], writes
    assert all(w["covered"] for w in writes) and len(writes) == len(kv), writes
    assert "stores K and V inside the attention op" in kv[0]["detail"], kv[0]
    assert result["tokens"] == vllm_reference_tokens["llama"]

    check_sharded("llama, K/V stored in forward, P=2", vllm_sharded_two["llama, K/V in forward"],
                  vllm_reference_tokens["llama"])
    refused = vllm_sharded_two["llama, K/V in forward, read-only"]
    assert all(r.get("error") == "PcpSyncError" for r in refused), refused
    assert all("state diverged across ranks" in r["message"] for r in refused), refused
    assert all(any(layer in r["message"] for layer in LAYERS) for r in refused), refused
    old = vllm_sharded_two["llama, K/V in forward, read-only, no digest"]
    assert all("error" not in r for r in old), old
    where = first_divergence(old)
    assert where is not None, "the attention op's K/V writes went unsynced and nothing diverged"
    assert where[1] in LAYERS, where
