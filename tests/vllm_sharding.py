"""vLLM's models decode-sharded on P gloo ranks through ``pcppass.integrations.vllm.adapter``.

:func:`run_sharded` is one rank's run (called through ``pcppass.engine.launch.launch``): vLLM's
model under pcppass's engine, decode rows owned round-robin, every state tensor's digest recorded
after every step. :func:`check_sharded` asserts what a sharded run must give: no error, replicas
bitwise identical after every step, the greedy tokens of vLLM's own ``LLM.generate``, one sync
collective per decode step, and decode rows that really moved between ranks.

Requests finish on different steps (:data:`STAGGERED_MAX_TOKENS`): round-robin ownership is
recomputed every step from the rows' order, so when a request finishes the rows after it change
owner. Without that, every request would keep its owner and a missing sync could not change a
token.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from vllm_cases import MAX_TOKENS, PROMPTS

#: tokens each prompt generates in a sharded run (a prefix of vLLM's MAX_TOKENS reference)
STAGGERED_MAX_TOKENS = [MAX_TOKENS, 3, 6, 2, 5]


@dataclass(frozen=True)
class ShardedCase:
    """One sharded run: a model directory's name, how to compile, and what to change first."""

    model: str
    inner: str = "eager"
    #: patterns removed before the run (negative controls)
    unregister: tuple[str, ...] = ()
    #: ``"module"`` (its ``register()``) or ``"module:function"``, called first in each rank (an
    #: attention backend override, a negative control's declaration)
    register: tuple[str, ...] = ()
    on_uncovered: str = "raise"
    #: vLLM engine arguments beyond the defaults (``block_size`` by model below)
    engine_args: dict = field(default_factory=dict)
    #: MoE layers through vLLM's GPU dispatch op (``vllm::moe_forward``) instead of the CPU path
    moe_dispatch_op: bool = False
    #: the cross-rank state digest (``SyncChecks.state_digest``); off only in a negative control
    #: that must show the divergence the digest would otherwise refuse
    state_digest: bool = True


def _engine_args(case: ShardedCase) -> dict:
    # CPU_ATTN takes blocks of 32; vLLM forces 16 for the CPU MLA kernel
    args = dict(max_model_len=256, block_size=16 if case.model.startswith("deepseek") else 32)
    args.update(case.engine_args)
    return args


def run_sharded(rank: int, world: int, model_dir: str, case: ShardedCase) -> dict:
    """One rank: vLLM's model under the engine, decode sharded; per step the digest of every state
    tensor, the owners of the decode rows and the collectives the step ran."""
    from pcppass.engine.workload import RequestSpec
    from pcppass.integrations.vllm.adapter import (
        VllmModel, VllmRunner, init_vllm_ranks, load_model, sharded_vllm_engine, vllm_config_for,
    )
    from pcppass.checks import SyncChecks
    from pcppass.registry import load_builtin_patterns, unregister_pattern

    torch._dynamo.reset()
    load_builtin_patterns()
    for name in case.unregister:
        unregister_pattern(name)
    for hook in case.register:
        call_hook(hook)
    config = vllm_config_for(model_dir, **_engine_args(case))
    init_vllm_ranks(config, rank, world)
    vmodel = VllmModel(config, load_model(config), moe_dispatch_op=case.moe_dispatch_op)
    runner = VllmRunner(vmodel, inner=case.inner, on_uncovered=case.on_uncovered,
                        checks=SyncChecks(state_digest=case.state_digest))
    engine = sharded_vllm_engine(vmodel, runner, world=world, rank=rank, num_blocks=48,
                                 max_num_batched_tokens=64, max_model_len=256, record_digests=True)
    engine.add_requests([RequestSpec(i, tuple(p), n) for i, (p, n) in enumerate(zip(PROMPTS, STAGGERED_MAX_TOKENS))])
    result: dict = {"digests": [], "kinds": [], "syncs": [], "rows": [], "owners": []}
    try:
        while (record := engine.step()) is not None:
            result["digests"].append(record.digests)
            result["kinds"].append(record.step_kind)
            result["rows"].append(record.tokens_per_rank)
            result["owners"].append(record.owners)
            result["syncs"].append(runner.step_syncs[-1].collectives)
    except Exception as exc:  # noqa: BLE001 - a refusal is the result of a negative control
        return {"error": type(exc).__name__, "message": str(exc)}
    outputs = engine.outputs()
    result["tokens"] = [outputs[i] for i in range(len(PROMPTS))]
    result["graph_collectives"] = [r.all_gather_nodes for r in runner.decode_backend.reports]
    result["writes"] = [(w.op, w.state, w.recipe.value if w.recipe else None, w.bytes_per_row)
                        for r in runner.decode_backend.reports for w in r.writes]
    result["recipe_bytes"] = [dict(w.recipe_bytes) for r in runner.decode_backend.reports for w in r.writes]
    result["layers"] = vmodel.layer_names
    return result


def call_hook(hook: str) -> None:
    """Call ``"module:function"`` (``function`` defaults to ``register``)."""
    module, _, function = hook.partition(":")
    getattr(importlib.import_module(module), function or "register")()


def run_cases(rank: int, world: int, dirs: dict, cases: list[ShardedCase]) -> list[dict]:
    """Every case in turn on this rank (one process group, one vLLM distributed state)."""
    return [run_sharded(rank, world, dirs[case.model], case) for case in cases]


def first_divergence(ranks: list[dict]) -> tuple[int, str] | None:
    """(step, state) of the first state tensor whose digest differs between ranks."""
    for step, per_rank in enumerate(zip(*(r["digests"] for r in ranks))):
        for name in sorted(per_rank[0]):
            if len({d[name] for d in per_rank}) > 1:
                return step, name
    return None


def moved_requests(result: dict) -> set[int]:
    """Requests whose decode rows ran on more than one rank over the run."""
    seen: dict[int, set[int]] = {}
    for owners, kind in zip(result["owners"], result["kinds"]):
        if kind == "decode":
            for req, rank in owners.items():
                seen.setdefault(req, set()).add(rank)
    return {req for req, ranks in seen.items() if len(ranks) > 1}


def reference_prefixes(reference: list[list[int]]) -> list[list[int]]:
    """vLLM's greedy tokens cut to each request's length in the sharded run."""
    return [tokens[:n] for tokens, n in zip(reference, STAGGERED_MAX_TOKENS)]


def check_sharded(label: str, ranks: list[dict], reference: list[list[int]]) -> None:
    for r in ranks:
        assert "error" not in r, f"{label}: {r}"
    assert first_divergence(ranks) is None, f"{label}: replicas diverge at {first_divergence(ranks)}"
    assert len({len(r["digests"]) for r in ranks}) == 1, label
    expected = reference_prefixes(reference)
    for rank, r in enumerate(ranks):
        assert r["tokens"] == expected, f"{label} rank {rank}: {r['tokens']} != vLLM's {expected}"
        assert r["graph_collectives"] == [1], (label, r["graph_collectives"])
        decode = [s for kind, s in zip(r["kinds"], r["syncs"]) if kind == "decode"]
        assert decode and all(s == 1 for s in decode), (label, r["kinds"], r["syncs"])
        # every layer's cache is among the digests compared after every step
        assert set(r["layers"]) <= set(r["digests"][0]), (label, r["layers"])
    # decode rows were really sharded, and requests changed owner between steps
    assert any(len(set(rows)) > 1 for rows, kind in zip(ranks[0]["rows"], ranks[0]["kinds"])
               if kind == "decode"), label
    assert moved_requests(ranks[0]), f"{label}: no request changed owner: {ranks[0]['owners']}"
