"""The sharded-run harness of the vLLM tests: :mod:`pcppass.integrations.vllm.sharded_check`,
with :func:`check_sharded` asserting that a run has no failure, and every sharded case of the
vLLM job in one table.

:func:`run_sharded` is one rank's run (called through ``pcppass.engine.launch.launch``); the
library lists what a sharded run got wrong (an error, replicas not bitwise identical after every
step, tokens other than vLLM's own ``LLM.generate``, other than one sync collective per decode
step, decode rows that never moved between ranks), and the tests assert the list is empty.

A launch costs a vLLM import, model builds and a process group on every rank, so the job runs
all its P=2 cases in one launch and all its P=4 cases in another (:func:`run_all`, behind the
``vllm_sharded_two`` and ``vllm_sharded_four`` session fixtures); each test reads its cases by
key. Each case's declarations (patterns, vLLM attention backend overrides, kernel paths counted
as batch-invariant) are undone after it (:func:`case_declarations`), so one case's hooks never
reach the next.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest

from pcppass.engine.launch import launch
from pcppass.integrations.vllm.sharded_check import (  # noqa: F401  (the tests' harness)
    STAGGERED_MAX_TOKENS, ShardedCase, call_hook, first_divergence, moved_requests, reference_prefixes,
    run_sharded, sharded_failures,
)
from vllm_cases import HYBRID_ENGINE_ARGS, VLLM_ENV

UNREGISTER_KV = ("vllm.unified_kv_cache_update",)
UNREGISTER_MAMBA2 = ("vllm.mamba_mixer2",)
#: an attention backend registered over CPU_ATTN that stores K/V inside the attention op
KV_IN_FORWARD = "vllm_kv_in_forward"
#: the old declaration of that op, read-only whatever the backend (a negative control)
ATTENTION_READ_ONLY = "vllm_kv_in_forward:declare_attention_read_only"


def _hybrid(model: str, **kwargs) -> ShardedCase:
    return ShardedCase(model, engine_args=HYBRID_ENGINE_ARGS[model], **kwargs)


#: every P=2 case of the vLLM job, in the order they run (vLLM's ``LayerName`` handles). An MoE
#: model first: vLLM creates its expert-parallel group only when the first config it initialises
#: its parallel state with has experts, and a later MoE model asks for that group.
TWO_RANKS: dict[str, ShardedCase] = {
    # test_vllm_moe: vLLM's GPU MoE dispatch (moe_forward, moe_forward_shared), Mixtral on the CPU path
    "qwen3_moe": ShardedCase("qwen3_moe", moe_dispatch_op=True),
    "deepseek_v2_moe": ShardedCase("deepseek_v2_moe", moe_dispatch_op=True),
    "mixtral": ShardedCase("mixtral", inner="aot_eager"),
    # test_vllm_sharded: dense and MLA, and the KV-update pattern's negative controls
    "llama": ShardedCase("llama", inner="inductor"),
    "deepseek_v2": ShardedCase("deepseek_v2", inner="aot_eager"),
    "llama without the KV pattern": ShardedCase("llama", unregister=UNREGISTER_KV),
    "llama without the KV pattern, forced": ShardedCase("llama", unregister=UNREGISTER_KV,
                                                        on_uncovered="unsafe_ignore"),
    # test_vllm_hybrid: Mamba2 and gated delta net state, and the Mamba2 pattern's negative controls
    "nemotron_h": _hybrid("nemotron_h"),
    "qwen3_next": _hybrid("qwen3_next"),
    # RERUN declared unverified: the Mamba2 layer's conv and SSM lines are copied
    "nemotron_h copying its state": _hybrid("nemotron_h", register=("vllm_state_checks:copy_state_rows",)),
    "nemotron_h without the Mamba2 pattern": _hybrid("nemotron_h", unregister=UNREGISTER_MAMBA2),
    "nemotron_h without the Mamba2 pattern, forced": _hybrid("nemotron_h", unregister=UNREGISTER_MAMBA2,
                                                             on_uncovered="unsafe_ignore"),
    # test_vllm_backends: K/V stored inside the attention op, and the old read-only declaration
    "llama, K/V in forward": ShardedCase("llama", inner="aot_eager", register=(KV_IN_FORWARD,)),
    "llama, K/V in forward, read-only, no digest": ShardedCase(
        "llama", register=(KV_IN_FORWARD, ATTENTION_READ_ONLY), state_digest=False),
    # last: a refused sharded step aborts the process group the cases share
    "llama, K/V in forward, read-only": ShardedCase("llama", register=(KV_IN_FORWARD, ATTENTION_READ_ONLY)),
}

#: every P=4 case (vLLM's layer names as plain strings: ``VLLM_USE_LAYERNAME`` is read at import,
#: so the other encoding needs its own launch anyway)
FOUR_RANKS: dict[str, ShardedCase] = {
    "qwen3_moe": ShardedCase("qwen3_moe", moe_dispatch_op=True),  # first: the expert-parallel group
    "deepseek_v2_moe": ShardedCase("deepseek_v2_moe", moe_dispatch_op=True),
    "mixtral": ShardedCase("mixtral", inner="aot_eager"),
    "llama": ShardedCase("llama", inner="aot_eager"),
    "deepseek_v2": ShardedCase("deepseek_v2"),
}

#: a launch's limit: every case of it, on a 2-core machine
LAUNCH_TIMEOUT_S = 1700


def check_sharded(label: str, ranks: list[dict], reference: list[list[int]]) -> None:
    failures = sharded_failures(ranks, reference)
    assert not failures, f"{label}: " + "; ".join(failures)


def forget_attention_backends() -> None:
    """Clear vLLM's cached attention-backend lookups, which keep the class an earlier model got
    whatever overrides are registered since."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    selector._cached_get_mamba_attn_backend.cache_clear()


@contextmanager
def case_declarations() -> Iterator[None]:
    """What a case's hooks declare is undone after it: pcppass's patterns and resolvers, vLLM's
    attention backend overrides (and its cached backend lookups, which would keep an override's
    class), and the kernel paths counted as batch-invariant."""
    from vllm.v1.attention.backends import registry as backends

    from pcppass.integrations.vllm.state import VERIFIED_BATCH_INVARIANT
    from pcppass.registry import declarations_restored

    saved = [(table, dict(table)) for table in (backends._ATTN_OVERRIDES, backends._MAMBA_ATTN_OVERRIDES,
                                                VERIFIED_BATCH_INVARIANT)]
    forget_attention_backends()
    try:
        with declarations_restored():
            yield
    finally:
        for table, before in saved:
            table.clear()
            table.update(before)
        forget_attention_backends()


def run_isolated(rank: int, world: int, dirs: dict, cases: list[ShardedCase]) -> list[dict]:
    """Every case in turn on this rank (one process group, one vLLM distributed state), each
    under :func:`case_declarations`."""
    results = []
    for case in cases:
        with case_declarations():
            results.append(run_sharded(rank, world, dirs[case.model], case))
    return results


def run_all(world: int, cases: dict[str, ShardedCase], dirs: dict[str, str], *, layername: bool) -> dict[str, list[dict]]:
    """Every case of ``cases`` on ``world`` gloo ranks in one launch: ``{key: [result by rank]}``."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in VLLM_ENV.items():
            env.setenv(key, value)
        env.setenv("VLLM_USE_LAYERNAME", "1" if layername else "0")
        per_rank = launch(run_isolated, world, dirs, list(cases.values()), backend="gloo",
                          timeout_s=LAUNCH_TIMEOUT_S)
    return {key: [per_rank[rank][i] for rank in range(world)] for i, key in enumerate(cases)}
