"""Negative controls and schedules of decode sharding (2 gloo ranks, DeepSeek-V3.2 / Llama tiny).

* The V3.2 fused direct write (``fused_norm_rope`` writes the MLA and the indexer cache) with its
  pattern removed: the default backend refuses to compile, listing both writes with their source
  line; ``on_uncovered="unsafe_ignore"`` runs and the verification names the divergent state;
  ``on_uncovered="replicate"`` keeps decode replicated, and replicas and tokens stay exact.
* The immediate schedule on decode steps: one collective per write site, same bytes, still exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pcppass.engine.launch import launch
from pcppass.errors import PcpCoverageError
from pcppass.cli.run_driver import RunConfig, compare, rank_main, reference_run

SHORT = RunConfig(model="deepseek_v32", steps=12, num_requests=6, mean_arrival_gap=1.0, spec_width=2,
                  inner="eager")


def _controls(rank: int, world: int, configs: dict[str, RunConfig]):
    from pcppass.registry import load_builtin_patterns, register_pattern

    load_builtin_patterns()
    import pcppass.patterns.deepseek_v32_fused as fused

    out = {}
    for name, cfg in configs.items():
        torch._dynamo.reset()
        try:
            out[name] = rank_main(rank, world, cfg)
        except PcpCoverageError as exc:
            out[name] = exc.args[0]
        finally:
            register_pattern(fused.FUSED_NORM_ROPE, replace=True)  # undo cfg.unregister
    return out


@pytest.mark.timeout(300)
def test_removed_fused_pattern_is_refused_detected_or_replicated_and_immediate_schedule():
    unfused = replace(SHORT, unregister=("fused_norm_rope",))
    configs = {
        "refuse": unfused,
        "unsafe": replace(unfused, on_uncovered="unsafe_ignore"),
        "replicate": replace(unfused, on_uncovered="replicate"),
        "immediate": replace(SHORT, model="llama", schedule="immediate"),
        "deferred": replace(SHORT, model="llama"),
    }
    per_rank = launch(_controls, 2, configs, timeout_s=280)

    # default: compilation refuses, naming every uncovered write and where it is
    for r in range(2):
        message = per_rank[r]["refuse"]
        assert isinstance(message, str), "compiled a graph with an uncovered fused write"
        assert "pcppass::fused_norm_rope" in message
        assert "mla" in message and "indexer" in message
        assert "deepseek_v32.py:" in message

    # proceeding anyway diverges, and the verification names the state
    reference = reference_run(configs["unsafe"])
    unsafe = compare(reference, [per_rank[r]["unsafe"] for r in range(2)])
    assert not unsafe.ok and unsafe.divergent
    step, state, _ = unsafe.divergent[0]
    assert "mla" in state or "indexer" in state, state
    assert "differs across ranks" in unsafe.first_divergence()

    # replicate: decode runs on every rank, nothing needs syncing, everything stays exact
    replicated = compare(reference, [per_rank[r]["replicate"] for r in range(2)])
    assert replicated.mode == "replicated"
    assert replicated.ok, replicated.first_divergence()
    assert all(rows[0] == rows[1] for rows in per_rank[0]["replicate"].tokens_per_rank)

    # immediate decode sync: one collective per site (and one that checks every rank's slots before
    # the first write), same rows moved in total, still exact
    llama_ref = reference_run(configs["deferred"])
    for name in ("immediate", "deferred"):
        v = compare(llama_ref, [per_rank[r][name] for r in range(2)])
        assert v.ok, (name, v.first_divergence())
    immediate, deferred = per_rank[0]["immediate"], per_rank[0]["deferred"]
    sites = immediate.graph_collectives["decode"][0]
    assert sites >= 2 and deferred.graph_collectives["decode"] == [1]
    decode_steps = [i for i, k in enumerate(immediate.step_kinds) if k == "decode"]
    assert decode_steps
    for i in decode_steps:
        assert immediate.syncs[i][0] == sites and deferred.syncs[i][0] == 1
        # per-site buffers repeat the header; the rows and slots are the same bytes
        assert immediate.syncs[i][1] > deferred.syncs[i][1]
