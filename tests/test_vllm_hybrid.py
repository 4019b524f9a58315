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
from vllm_sharding import check_sharded, first_divergence

STATE_OPS = {"nemotron_h": "vllm::mamba_mixer2", "qwen3_next": "vllm::cpu_gdn_attention_core",
             "lfm2": "vllm::short_conv"}
STATE_LAYER = {"nemotron_h": "model.layers.0.mixer", "qwen3_next": "model.layers.0.linear_attn",
               "lfm2": "model.layers.0.short_conv"}
#: bytes per row of each tiny model's state op: copying the state line, re-running from the inputs
#: (Qwen3-Next's delta-rule state by its dtype: :func:`_recipe_bytes`)
RECIPE_BYTES = {
    # conv [3, 160] + SSM [4, 32, 16], float32; projected_states 128 + 160 + 4, float32
    "nemotron_h": {"copy_rows": (3 * 160 + 4 * 32 * 16) * 4, "rerun": (128 + 160 + 4) * 4},
    # copy_rows by the state's dtype (_recipe_bytes); mixed_qkv 512, b 2, a 2, bfloat16
    "qwen3_next": {"rerun": (512 + 2 + 2) * 2},
    # window [2, 128] float32; hidden_states 128 float32
    "lfm2": {"copy_rows": 2 * 128 * 4, "rerun": 128 * 4},
}


def _recipe_bytes(model: str, model_dir: str) -> dict[str, int]:
    """:data:`RECIPE_BYTES`, Qwen3-Next's state at the dtype vLLM settles on for this machine: its
    CPU platform keeps the delta-rule state in float32 where the CPU has AVX-512 BF16 (for its
    accelerated kernel) and leaves ``mamba_ssm_cache_dtype="auto"`` (the model's bfloat16)
    elsewhere, so CI machines differ."""
    from pcppass.integrations.vllm.adapter import vllm_config_for
    from pcppass.integrations.vllm.sharded_check import engine_args_for
    from vllm_sharding import TWO_RANKS

    expected = dict(RECIPE_BYTES[model])
    if model == "qwen3_next":
        ssm = vllm_config_for(model_dir, **engine_args_for(TWO_RANKS[model])).cache_config.mamba_ssm_cache_dtype
        # conv [3, 512] bfloat16 + delta-rule state [2, 128, 128]
        expected["copy_rows"] = 3 * 512 * 2 + 2 * 128 * 128 * (4 if ssm == "float32" else 2)
    return expected


def _env(monkeypatch) -> None:
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)


def _verified_here(op: str) -> bool:
    from pcppass.integrations.vllm.state import VERIFIED_BATCH_INVARIANT, platform_path

    return platform_path() in VERIFIED_BATCH_INVARIANT[op]


@pytest.mark.timeout(300)
def test_state_updates_batch_invariance(vllm_hybrid_dirs, vllm_references, tmp_path, monkeypatch):
    """A re-run's batch (other ranks' rows, masked rows among them) gives every state line the
    bytes a row-by-row run and a reversed batch give, on vLLM's CPU kernels: at the tiny test
    widths and at NemotronH-8B's and Qwen3-Next-80B's state widths. Where this machine's kernel
    path is declared verified, that must hold; each op must really write its rows' lines only.
    (``vllm_references`` only starts vLLM's reference runs, so they overlap this test.)"""
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


@pytest.mark.timeout(2400)  # the session's sharded launches (vllm_sharding), if this test comes first
def test_hybrids_sharded_two_ranks(vllm_sharded_two, vllm_reference_tokens, vllm_hybrid_dirs, monkeypatch):
    _env(monkeypatch)
    for key, model, copied in (("nemotron_h", "nemotron_h", False), ("qwen3_next", "qwen3_next", False),
                               ("nemotron_h copying its state", "nemotron_h", True)):
        ranks = vllm_sharded_two[key]
        check_sharded(f"{key} P=2", ranks, vllm_reference_tokens[model])
        (state,) = [(w, b) for w, b in zip(ranks[0]["writes"], ranks[0]["recipe_bytes"]) if w[0] == STATE_OPS[model]]
        (op, layer, recipe, _), recipe_bytes = state
        assert layer == STATE_LAYER[model], (key, state)
        assert recipe_bytes == _recipe_bytes(model, str(vllm_hybrid_dirs[model])), (key, state)
        rerun = _verified_here(op) and not copied
        assert recipe == ("rerun" if rerun else "copy_rows"), (key, state)
    for r in vllm_sharded_two["nemotron_h without the Mamba2 pattern"]:
        assert r.get("error") == "PcpCoverageError", r
        assert "vllm::mamba_mixer2" in r["message"] and STATE_LAYER["nemotron_h"] in r["message"], r["message"]
    where = first_divergence(vllm_sharded_two["nemotron_h without the Mamba2 pattern, forced"])
    assert where is not None, "an unsynced state update did not make the replicas diverge"
    assert where[1] == STATE_LAYER["nemotron_h"], where


def _two_owner_decode_step(rank: int, world: int, model_dir: str, model: str) -> dict:
    """vLLM's model under the adapter until a decode step ran, then a decode step in which both
    ranks also write the cache's last slot (their first row's K/V): the error, and the digest of
    every KV cache and state tensor before and after the refused step."""
    from pcppass.engine.layout import slot_key
    from pcppass.engine.workload import RequestSpec
    from pcppass.integrations.vllm.adapter import GROUP
    from pcppass.integrations.vllm.sharded_check import (
        PROMPTS, STAGGERED_MAX_TOKENS, ShardedCase, _build, engine_args_for,
    )
    from pcppass.registry import load_builtin_patterns

    load_builtin_patterns()
    case = ShardedCase(model, engine_args=HYBRID_ENGINE_ARGS[model])
    _, runner, engine = _build(rank, world, model_dir, case)
    last_slot = engine.num_blocks(GROUP) * engine_args_for(case)["block_size"] - 1
    engine.add_requests([RequestSpec(i, tuple(p), n) for i, (p, n) in enumerate(zip(PROMPTS, STAGGERED_MAX_TOKENS))])
    while engine.step().step_kind != "decode":
        pass
    before = engine.cache_digests()

    def both_write_the_last_slot(input_ids, positions, meta, caches, step_kind):
        key = slot_key(GROUP)
        slots = meta[key].clone()
        slots[0] = last_slot
        return runner(input_ids, positions, {**meta, key: slots}, caches, step_kind)

    engine.runner = both_write_the_last_slot
    try:
        record = engine.step()
        return {"error": None, "kind": record.step_kind}
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(exc).__name__}: {exc}", "before": before, "after": engine.cache_digests()}


@pytest.mark.timeout(400)
def test_a_refused_two_owner_decode_step_leaves_every_kv_cache_and_state_as_before(vllm_hybrid_dirs, monkeypatch):
    """NemotronH at P=2: a decode step in which both ranks write one KV slot is refused on both
    ranks, and every KV cache and Mamba2 state (whose lines each rank's own op had already
    advanced) holds on every rank what it held before the step."""
    _env(monkeypatch)
    monkeypatch.setenv("VLLM_USE_LAYERNAME", "1")
    ranks = launch(_two_owner_decode_step, 2, str(vllm_hybrid_dirs["nemotron_h"]), "nemotron_h", timeout_s=380)
    assert ranks[0]["error"] == ranks[1]["error"], [r["error"] for r in ranks]
    error = ranks[0]["error"]
    assert error is not None and error.startswith("PcpSyncError: "), error
    assert "vllm::unified_kv_cache_update" in error and "(key_cache): slot" in error, error
    assert "was written by ranks [0, 1]" in error, error
    assert "every replica holds what it held before the step" in error, error
    assert ranks[0]["before"] == ranks[1]["before"]
    assert any(STATE_LAYER["nemotron_h"] in name for name in ranks[0]["before"]), sorted(ranks[0]["before"])
    for rank, r in enumerate(ranks):
        changed = sorted(name for name in r["before"] if r["after"][name] != r["before"][name])
        assert not changed, f"rank {rank}: {changed} changed although the step was refused"
