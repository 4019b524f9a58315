"""vLLM's own models decode-sharded on P gloo ranks through ``pcppass.integrations.vllm.adapter``.

Each rank is one process holding vLLM's model (vLLM's model code, its CPU attention backend and
its ``unified_kv_cache_update`` / ``unified_mla_kv_cache_update`` ops), driven by
``pcppass.engine`` with decode rows owned round-robin: the pcppass backend syncs the KV rows every
layer's update op fetched by layer name, in one all-gather per decode step. After every step each
layer's ``kv_cache`` must be bitwise identical on all ranks, and the greedy tokens must equal
vLLM's own single-process ``LLM.generate`` on the same prompts (default compile).

Negative control: with vLLM's KV-update pattern removed the decode graph is refused; forced to run
anyway (``on_uncovered="unsafe_ignore"``), the replicas diverge and the first diverging state is
a layer's KV cache, named by layer.
"""

from __future__ import annotations

import pytest
import torch

from pcppass.engine.launch import launch
from pcppass.engine.workload import RequestSpec
from vllm_cases import MAX_TOKENS, PROMPTS, VLLM_ENV

MODELS = ("llama", "deepseek_v2")


def _engine_args(model: str) -> dict:
    # CPU_ATTN takes blocks of 32; vLLM forces 16 for the CPU MLA kernel
    return dict(max_model_len=256, block_size=16 if model == "deepseek_v2" else 32)


def _sharded_run(rank: int, world: int, model_dir: str, model: str, inner: str, unregister: tuple,
                 on_uncovered: str) -> dict:
    """One rank: vLLM's model under the engine, decode sharded; per step the digest of every
    layer's cache and the sync the step ran."""
    from pcppass.integrations.vllm.adapter import (
        VllmModel, VllmRunner, init_vllm_ranks, load_model, sharded_vllm_engine, vllm_config_for,
    )
    from pcppass.registry import load_builtin_patterns, unregister_pattern

    load_builtin_patterns()
    for name in unregister:
        unregister_pattern(name)
    config = vllm_config_for(model_dir, **_engine_args(model))
    init_vllm_ranks(config, rank, world)
    vmodel = VllmModel(config, load_model(config))
    runner = VllmRunner(vmodel, inner=inner, on_uncovered=on_uncovered)
    engine = sharded_vllm_engine(vmodel, runner, world=world, rank=rank, num_blocks=48,
                                 max_num_batched_tokens=64, max_model_len=256, record_digests=True)
    engine.add_requests([RequestSpec(i, tuple(p), MAX_TOKENS) for i, p in enumerate(PROMPTS)])
    result: dict = {"digests": [], "kinds": [], "syncs": [], "rows": []}
    try:
        while (record := engine.step()) is not None:
            result["digests"].append(record.digests)
            result["kinds"].append(record.step_kind)
            result["rows"].append(record.tokens_per_rank)
            result["syncs"].append(runner.step_syncs[-1].collectives)
    except Exception as exc:  # noqa: BLE001 - a refusal is the result of a negative control
        return {"error": type(exc).__name__, "message": str(exc)}
    outputs = engine.outputs()
    result["tokens"] = [outputs[i] for i in range(len(PROMPTS))]
    result["graph_collectives"] = [r.all_gather_nodes for r in runner.decode_backend.reports]
    result["layers"] = vmodel.layer_names
    return result


def _run_models(rank: int, world: int, dirs: dict, runs: list[tuple]) -> list[dict]:
    out = []
    for model, inner, unregister, on_uncovered in runs:
        torch._dynamo.reset()
        out.append(_sharded_run(rank, world, dirs[model], model, inner, unregister, on_uncovered))
    return out


def _first_divergence(ranks: list[dict]) -> tuple[int, str] | None:
    for step, per_rank in enumerate(zip(*(r["digests"] for r in ranks))):
        for name in sorted(per_rank[0]):
            if len({d[name] for d in per_rank}) > 1:
                return step, name
    return None


def _check_sharded(label: str, ranks: list[dict], reference: list[list[int]]) -> None:
    for r in ranks:
        assert "error" not in r, f"{label}: {r}"
    assert _first_divergence(ranks) is None, f"{label}: replicas diverge at {_first_divergence(ranks)}"
    assert len({len(r["digests"]) for r in ranks}) == 1, label
    for rank, r in enumerate(ranks):
        assert r["tokens"] == reference, f"{label} rank {rank}: {r['tokens']} != vLLM's {reference}"
        assert r["graph_collectives"] == [1], (label, r["graph_collectives"])
        decode = [s for kind, s in zip(r["kinds"], r["syncs"]) if kind == "decode"]
        assert decode and all(s == 1 for s in decode), (label, r["kinds"], r["syncs"])
        # every layer's cache is among the digests compared after every step
        assert set(r["layers"]) <= set(r["digests"][0]), (label, r["layers"])
    # decode rows were really sharded: some step ran different rows on different ranks
    assert any(len(set(rows)) > 1 for rows, kind in zip(ranks[0]["rows"], ranks[0]["kinds"])
               if kind == "decode"), label


@pytest.mark.timeout(900)
def test_two_ranks_layername_and_negative_control(vllm_model_dirs, vllm_reference_tokens, monkeypatch):
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_USE_LAYERNAME", "1")
    runs = [("llama", "inductor", (), "raise"), ("deepseek_v2", "aot_eager", (), "raise"),
            ("llama", "eager", ("vllm.unified_kv_cache_update",), "raise"),
            ("llama", "eager", ("vllm.unified_kv_cache_update",), "unsafe_ignore")]
    dirs = {m: str(p) for m, p in vllm_model_dirs.items()}
    per_rank = launch(_run_models, 2, dirs, runs, timeout_s=860)
    for i, (model, inner, _, _) in enumerate(runs[:2]):
        _check_sharded(f"{model} P=2 {inner}", [per_rank[r][i] for r in range(2)], vllm_reference_tokens[model])
    refused = [per_rank[r][2] for r in range(2)]
    for r in refused:
        assert r.get("error") == "PcpCoverageError", r
        assert "vllm::unified_kv_cache_update" in r["message"], r["message"]
        assert "model.layers.0.self_attn.attn" in r["message"], r["message"]
    ignored = [per_rank[r][3] for r in range(2)]
    where = _first_divergence(ignored)
    assert where is not None, "an unsynced KV write did not make the replicas diverge"
    assert where[1].startswith("model.layers.") and where[1].endswith(".self_attn.attn"), where


@pytest.mark.timeout(900)
def test_four_ranks_layer_name_strings(vllm_model_dirs, vllm_reference_tokens, monkeypatch):
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_USE_LAYERNAME", "0")
    runs = [("llama", "aot_eager", (), "raise"), ("deepseek_v2", "eager", (), "raise")]
    dirs = {m: str(p) for m, p in vllm_model_dirs.items()}
    per_rank = launch(_run_models, 4, dirs, runs, timeout_s=860)
    for i, (model, inner, _, _) in enumerate(runs):
        _check_sharded(f"{model} P=4 {inner}", [per_rank[r][i] for r in range(4)], vllm_reference_tokens[model])
