"""vLLM's hybrid models (recurrent-state layers beside attention) decode-sharded at P=2.

The state ops (``vllm::mamba_mixer2``, ``vllm::cpu_gdn_attention_core``, ``vllm::short_conv``)
write one state line per request, fetched by layer name. pcppass syncs them by copying the owner's
new state lines (COPY_ROWS) or, where the kernel's update was verified batch-invariant and the op's
inputs are smaller than its state, by re-running the update on the other ranks from the gathered
inputs (RERUN), in the step's one collective.

* the batch invariance RERUN relies on, on vLLM's real CPU kernels, at tiny and production widths;
* NemotronH (Mamba2) and Qwen3-Next (gated delta net, bfloat16) sharded at P=2 under the adapter: every KV cache and every state tensor bitwise equal on both ranks after every
  step, tokens equal to vLLM's ``LLM.generate``, one collective per decode step, rows changing
  owner; the recipe each state op got, with both byte counts; NemotronH once more with RERUN
  declared unverified (its two states copied);
* negative controls: without the Mamba2 pattern the decode graph is refused naming op and layer;
  forced to run anyway, the first state that diverges is the Mamba2 layer's.
"""

from __future__ import annotations

import pytest

from pcppass.engine.launch import launch
from vllm_cases import HYBRID_ENGINE_ARGS, VLLM_ENV, WIDE_STATE_BUILDERS
from vllm_sharding import ShardedCase, check_sharded, first_divergence, run_cases

STATE_OPS = {"nemotron_h": "vllm::mamba_mixer2", "qwen3_next": "vllm::cpu_gdn_attention_core",
             "lfm2": "vllm::short_conv"}
STATE_LAYER = {"nemotron_h": "model.layers.0.mixer", "qwen3_next": "model.layers.0.linear_attn",
               "lfm2": "model.layers.0.short_conv"}
#: bytes per row of each tiny model's state op: copying the state line, re-running from the inputs
RECIPE_BYTES = {
    # conv [3, 160] + SSM [4, 32, 16], float32; projected_states 128 + 160 + 4, float32
    "nemotron_h": {"copy_rows": (3 * 160 + 4 * 32 * 16) * 4, "rerun": (128 + 160 + 4) * 4},
    # conv [3, 512] + delta-rule state [2, 128, 128], both bfloat16: vLLM 0.32 keeps a GDN layer's
    # state in the model's dtype when mamba_ssm_cache_dtype is "auto" (only NemotronH's config
    # promotes its SSM state to float32); mixed_qkv 512, b 2, a 2, bfloat16
    "qwen3_next": {"copy_rows": 3 * 512 * 2 + 2 * 128 * 128 * 2, "rerun": (512 + 2 + 2) * 2},
    # window [2, 128] float32; hidden_states 128 float32
    "lfm2": {"copy_rows": 2 * 128 * 4, "rerun": 128 * 4},
}


def _case(model: str, **kwargs) -> ShardedCase:
    return ShardedCase(model, engine_args=HYBRID_ENGINE_ARGS[model], **kwargs)


def _env(monkeypatch) -> None:
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)


def _verified_here(op: str) -> bool:
    from pcppass.integrations.vllm.state import VERIFIED_BATCH_INVARIANT, platform_path

    return platform_path() in VERIFIED_BATCH_INVARIANT[op]


@pytest.mark.timeout(300)
def test_state_updates_batch_invariance(vllm_hybrid_dirs, vllm_hybrid_references, tmp_path, monkeypatch):
    """A re-run's batch (other ranks' rows, masked rows among them) gives every state line the
    bytes a row-by-row run and a reversed batch give, on vLLM's CPU kernels: at the tiny test
    widths and at NemotronH-8B's and Qwen3-Next-80B's state widths. Where this machine's kernel
    path is declared verified, that must hold; each op must really write its rows' lines only.
    (``vllm_hybrid_references`` only starts vLLM's reference runs, so they overlap this test.)"""
    from pcppass.integrations.vllm.state import VERIFIED_BATCH_INVARIANT
    from vllm_state_checks import check_batch_invariance

    _env(monkeypatch)
    wide = {name: str(build(tmp_path / name)) for name, build in WIDE_STATE_BUILDERS.items()}
    models = {name: (str(vllm_hybrid_dirs[name]), HYBRID_ENGINE_ARGS[name]) for name in STATE_OPS}
    models.update({name: (path, HYBRID_ENGINE_ARGS[name]) for name, path in wide.items()})
    (results,) = launch(check_batch_invariance, 1, models, timeout_s=280)
    assert sorted({r["op"] for r in results}) == sorted(STATE_OPS.values()), results
    assert len(results) == len(models), results
    for r in results:
        assert r["changed"] and r["untouched"], r
        if r["path"] in VERIFIED_BATCH_INVARIANT[r["op"]]:
            assert r["invariant"], f"declared batch-invariant, but it is not: {r}"
    # a Mamba2 layer run in a way nobody reviewed is refused by name (the write is then uncovered)
    refused = next(r["refusals"] for r in results if "refusals" in r)
    assert refused["reviewed"] == "accepted", refused
    for case, words in (("prefix caching", "enable_prefix_caching=False"), ("speculative decoding", "state lines"),
                        ("subclass", "MixerSubclass"), ("other op", "not vllm::short_conv")):
        assert refused[case].startswith("UnsupportedLayer") and words in refused[case], (case, refused[case])
        assert "model.layers.0.mixer" in refused[case], (case, refused[case])
    assert refused["line outside the states"].startswith("PcpSyncError") and "outside" in refused[
        "line outside the states"], refused


@pytest.mark.timeout(900)
def test_hybrids_sharded_two_ranks(vllm_hybrid_dirs, vllm_hybrid_references, monkeypatch):
    _env(monkeypatch)
    monkeypatch.setenv("VLLM_USE_LAYERNAME", "1")
    cases = [_case("nemotron_h"), _case("qwen3_next"),
             # RERUN declared unverified: the Mamba2 layer's conv and SSM lines are copied
             _case("nemotron_h", register=("vllm_state_checks:copy_state_rows",)),
             _case("nemotron_h", unregister=("vllm.mamba_mixer2",)),
             _case("nemotron_h", unregister=("vllm.mamba_mixer2",), on_uncovered="unsafe_ignore")]
    dirs = {name: str(path) for name, path in vllm_hybrid_dirs.items()}
    per_rank = launch(run_cases, 2, dirs, cases, timeout_s=860)
    reference = vllm_hybrid_references.tokens()  # vLLM's runs went on beside ours
    for i, case in enumerate(cases[:3]):
        ranks = [per_rank[r][i] for r in range(2)]
        label = f"{case.model} P=2 {case.register}"
        check_sharded(label, ranks, reference[case.model])
        (state,) = [(w, b) for w, b in zip(ranks[0]["writes"], ranks[0]["recipe_bytes"])
                    if w[0] == STATE_OPS[case.model]]
        (op, layer, recipe, _), recipe_bytes = state
        assert layer == STATE_LAYER[case.model], (label, state)
        assert recipe_bytes == RECIPE_BYTES[case.model], (label, state)
        rerun = _verified_here(op) and not case.register
        assert recipe == ("rerun" if rerun else "copy_rows"), (label, state)
    for r in (per_rank[rank][3] for rank in range(2)):
        assert r.get("error") == "PcpCoverageError", r
        assert "vllm::mamba_mixer2" in r["message"] and STATE_LAYER["nemotron_h"] in r["message"], r["message"]
    where = first_divergence([per_rank[rank][4] for rank in range(2)])
    assert where is not None, "an unsynced state update did not make the replicas diverge"
    assert where[1] == STATE_LAYER["nemotron_h"], where
