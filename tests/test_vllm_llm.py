"""pcppass inside a real ``vllm.LLM``: the graph vLLM itself compiles, audited, rewritten, run.

With ``compilation_config={"mode": 2, "backend": "pcppass.integrations.vllm.backend"}`` vLLM hands
pcppass Dynamo's whole graph of its model. For a Llama (GQA, ``unified_kv_cache_update``) and a
DeepSeek-V2 (MLA, ``unified_mla_kv_cache_update``), with the layer name as a hoisted ``LayerName``
object and as a string (``VLLM_USE_LAYERNAME=0``):

* exactly one KV write per layer, named by the layer, covered by vLLM's pattern with the bytes of
  one token's K and V (or latent) row; the attention op of each layer declared read-only; nothing
  reported on the attention op's ``output`` (a temporary), nothing uncovered;
* the rewritten graph (one sync collective, run every step) compiled by Inductor gives the same
  greedy tokens as vLLM's default compile;
* ``pcppass audit --vllm DIR`` prints the same records as JSON and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_cases import MAX_TOKENS, finish_worker, start_worker, vllm_env

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
KV_OP = {"llama": "vllm::unified_kv_cache_update", "deepseek_v2": "vllm::unified_mla_kv_cache_update"}
ATTENTION_OP = {"llama": "vllm::unified_attention_with_output",
                "deepseek_v2": "vllm::unified_mla_attention_with_output"}
#: one token's bytes: K and V of 2 KV heads x 32 (fp32) for the Llama, the 576-wide latent for MLA
ROW_BYTES = {"llama": 2 * 2 * 32 * 4, "deepseek_v2": 576 * 4}


def _check_writes(label: str, model: str, writes: list[dict]) -> None:
    assert all(w["covered"] for w in writes), f"{label}: {[w for w in writes if not w['covered']]}"
    assert not [w for w in writes if w["arg"] == "output"], f"{label}: the attention output reported"
    kv = [w for w in writes if w["recipe"] == "copy_rows"]
    assert [w["state"] for w in kv] == LAYERS, f"{label}: {writes}"
    for w in kv:
        assert (w["op"], w["arg"], w["bytes_per_row"]) == (KV_OP[model], "layer_name", ROW_BYTES[model]), w
    reads = [w for w in writes if w["recipe"] == "read_only"]
    assert [(w["op"], w["state"]) for w in reads] == [(ATTENTION_OP[model], name) for name in LAYERS], label
    assert len(writes) == len(kv) + len(reads), f"{label}: {writes}"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layername", [True, False], ids=["LayerName", "str"])
def test_llm_generate_with_the_pcppass_backend(vllm_model_dirs, vllm_reference_tokens, layername):
    procs = {model: start_worker("generate", path, backend="pcppass", layername=layername, timeout_s=900)
             for model, path in vllm_model_dirs.items()}
    for model, proc in procs.items():
        label = f"{model} layername={layername}"
        result = finish_worker(proc)
        assert "error" not in result, f"{label}: {result}"
        assert result["graphs"] == 1, label  # one Dynamo graph for every step
        _check_writes(label, model, result["writes"])
        assert result["collectives_per_graph"] == [1], label
        # prefill and every decode step ran the sync (one collective each)
        assert result["sync_collectives_run"] == MAX_TOKENS, (label, result["sync_collectives_run"])
        assert result["tokens"] == vllm_reference_tokens[model], label


@pytest.mark.timeout(600)
def test_audit_cli_on_a_vllm_model_directory(vllm_model_dirs):
    out = subprocess.run(
        [sys.executable, "-m", "pcppass", "audit", "--vllm", str(vllm_model_dirs["llama"]), "--json"],
        env=vllm_env(layername=False), capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout[-2000:]
    report = json.loads(out.stdout)  # vLLM's own log goes to stderr
    assert report["ok"] and report["engine"] == "vllm" and report["uncovered"] == 0, report
    _check_writes("pcppass audit --vllm", "llama", report["writes"])
