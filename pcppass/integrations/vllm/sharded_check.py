"""vLLM's models decode-sharded on P gloo ranks through :mod:`.adapter`, checked against vLLM.

:func:`run_sharded` is one rank's run (called through ``pcppass.engine.launch.launch``): vLLM's
model under pcppass's engine, decode rows owned round-robin, every state tensor's digest recorded
after every step. :func:`sharded_failures` lists what a sharded run got wrong (empty: it is right):
an error, replicas not bitwise identical after every step, greedy tokens other than vLLM's own
``LLM.generate``, other than one sync collective per decode step, decode rows that never moved
between ranks.

Requests finish on different steps (:data:`STAGGERED_MAX_TOKENS`): round-robin ownership is
recomputed every step from the rows' order, so when a request finishes the rows after it change
owner. Without that, every request would keep its owner and a missing sync could not change a
token.

``python -m pcppass.integrations.vllm.sharded_check FAMILY MODEL_DIR`` runs one zoo family (see
:mod:`.zoo`) decode-sharded at P=2 with dummy weights, then vLLM's ``LLM.generate`` on the same
weights in the same process, and prints the verdict as one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

#: prompts (token ids) every sharded run and its vLLM reference generate from
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 7, 18, 28], [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122],
           [5, 6], [400, 401, 402, 403, 404, 405]]
#: tokens vLLM's reference generates per prompt
MAX_TOKENS = 8
#: tokens each prompt generates in a sharded run (a prefix of vLLM's MAX_TOKENS reference)
STAGGERED_MAX_TOKENS = [MAX_TOKENS, 3, 6, 2, 5]
#: ranks the zoo shards over
ZOO_RANKS = 2
#: the whole sharded run of one zoo family (ranks and reference), seconds
ZOO_RUN_TIMEOUT_S = 840
#: starts the line of the JSON verdict on stdout (vLLM writes its own log there too)
RESULT_MARKER = "PCPPASS_SHARDED "


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


def engine_args_for(case: ShardedCase) -> dict:
    # CPU_ATTN takes blocks of 32; vLLM forces 16 for the CPU MLA kernel
    args = dict(max_model_len=256, block_size=16 if case.model.startswith("deepseek") else 32)
    args.update(case.engine_args)
    return args


def _uses_pcppass_loader(engine_args: dict) -> bool:
    from pcppass.integrations.vllm.loaders import AUTO_FORMAT, DUMMY_FORMAT

    return engine_args.get("load_format") in (DUMMY_FORMAT, AUTO_FORMAT)


def call_hook(hook: str) -> None:
    """Call ``"module:function"`` (``function`` defaults to ``register``)."""
    module, _, function = hook.partition(":")
    getattr(importlib.import_module(module), function or "register")()


def _build(rank: int, world: int, model_dir: str, case: ShardedCase) -> tuple[Any, Any, Any]:
    """vLLM's model, the runner and the engine of one rank (the adapter may refuse the model)."""
    from pcppass.checks import SyncChecks
    from pcppass.integrations.vllm.adapter import (
        VllmModel, VllmRunner, init_vllm_ranks, load_model, sharded_vllm_engine, vllm_config_for,
    )
    from pcppass.integrations.vllm.loaders import register_loaders

    engine_args = engine_args_for(case)
    if _uses_pcppass_loader(engine_args):
        register_loaders()
    config = vllm_config_for(model_dir, **engine_args)
    init_vllm_ranks(config, rank, world)
    vmodel = VllmModel(config, load_model(config), moe_dispatch_op=case.moe_dispatch_op)
    runner = VllmRunner(vmodel, inner=case.inner, on_uncovered=case.on_uncovered,
                        checks=SyncChecks(state_digest=case.state_digest))
    engine = sharded_vllm_engine(vmodel, runner, world=world, rank=rank, num_blocks=48,
                                 max_num_batched_tokens=64, max_model_len=256, record_digests=True)
    return vmodel, runner, engine


def run_sharded(rank: int, world: int, model_dir: str, case: ShardedCase) -> dict:
    """One rank: vLLM's model under the engine, decode sharded; per step the digest of every state
    tensor, the owners of the decode rows and the collectives the step ran. A pcppass refusal
    (while building or in a step) is the result: ``{"error", "message", "stage"}``."""
    import torch

    from pcppass.engine.workload import RequestSpec
    from pcppass.errors import PcpError
    from pcppass.registry import load_builtin_patterns, unregister_pattern

    torch._dynamo.reset()
    load_builtin_patterns()
    for name in case.unregister:
        unregister_pattern(name)
    for hook in case.register:
        call_hook(hook)
    try:
        vmodel, runner, engine = _build(rank, world, model_dir, case)
    except PcpError as exc:  # the adapter refuses the model (e.g. a sliding-window layer)
        return {"error": type(exc).__name__, "message": str(exc), "stage": "build"}
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
        return {"error": type(exc).__name__, "message": str(exc), "stage": f"step {len(result['kinds'])}"}
    outputs = engine.outputs()
    result["tokens"] = [outputs[i] for i in range(len(PROMPTS))]
    result["graph_collectives"] = [r.all_gather_nodes for r in runner.decode_backend.reports]
    result["writes"] = [(w.op, w.state, w.recipe.value if w.recipe else None, w.bytes_per_row)
                        for r in runner.decode_backend.reports for w in r.writes]
    result["recipe_bytes"] = [dict(w.recipe_bytes) for r in runner.decode_backend.reports for w in r.writes]
    result["layers"] = vmodel.layer_names
    return result


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


def token_mismatch(tokens: list[list[int]], expected: list[list[int]]) -> str | None:
    """The first (request, position) where ``tokens`` leave ``expected``, said in words."""
    for req, (got, want) in enumerate(zip(tokens, expected)):
        for pos, (a, b) in enumerate(zip(got, want)):
            if a != b:
                return f"request {req} token {pos}: {a} where vLLM gives {b}"
        if len(got) != len(want):
            return f"request {req}: {len(got)} tokens where vLLM gives {len(want)}"
    if len(tokens) != len(expected):
        return f"{len(tokens)} requests where vLLM gives {len(expected)}"
    return None


def _rank_failures(rank: int, result: dict, expected: list[list[int]]) -> list[str]:
    failures = []
    mismatch = token_mismatch(result["tokens"], expected)
    if mismatch is not None:
        failures.append(f"rank {rank}: {mismatch}")
    if result["graph_collectives"] != [1]:
        failures.append(f"rank {rank}: decode graphs with {result['graph_collectives']} all-gathers, "
                        "not one graph with one")
    decode = [s for kind, s in zip(result["kinds"], result["syncs"]) if kind == "decode"]
    if not decode or any(s != 1 for s in decode):
        failures.append(f"rank {rank}: sync collectives per decode step {decode}, not one each")
    missing = set(result["layers"]) - set(result["digests"][0] if result["digests"] else ())
    if missing:  # every layer's cache must be among the digests compared after every step
        failures.append(f"rank {rank}: layers {sorted(missing)} not digested")
    return failures


def sharded_failures(ranks: list[dict], reference: list[list[int]]) -> list[str]:
    """What the ranks' results of one sharded run got wrong, in words; empty when it is right.

    Right: no rank failed or refused; every state tensor's digest equal on all ranks after every
    step; every rank's greedy tokens those of vLLM's ``reference`` (cut to each request's length);
    one decode graph with one all-gather, one collective per decode step; every layer digested;
    some decode step with different row counts on the ranks (replicated, they would be equal), and
    some request's decode rows on two ranks over the run.
    """
    errors = [f"rank {rank}: {r['error']} ({r.get('stage', '?')}): {r['message']}"
              for rank, r in enumerate(ranks) if "error" in r]
    if errors:
        return errors
    failures = []
    where = first_divergence(ranks)
    if where is not None:
        failures.append(f"replicas diverge after step {where[0]} in {where[1]}")
    if len({len(r["digests"]) for r in ranks}) != 1:
        failures.append(f"ranks ran {[len(r['digests']) for r in ranks]} steps")
    expected = reference_prefixes(reference)
    for rank, r in enumerate(ranks):
        failures.extend(_rank_failures(rank, r, expected))
    first = ranks[0]
    if not any(len(set(rows)) > 1 for rows, kind in zip(first["rows"], first["kinds"]) if kind == "decode"):
        # replicated, every rank would run every row: equal counts in every step
        failures.append(f"no decode step gave the ranks different row counts (not sharded?): {first['rows']}")
    if not moved_requests(first):
        failures.append(f"no request's decode rows changed owner: {first['owners']}")
    return failures


def refusal(ranks: list[dict]) -> str | None:
    """The adapter's refusal (every rank refused the model while building it), else None."""
    if ranks and all(r.get("stage") == "build" for r in ranks):
        return ranks[0]["message"]
    return None


def reference_tokens(model_dir: str, engine_args: dict) -> list[list[int]]:
    """vLLM's own greedy ``LLM.generate`` (its default compile) on :data:`PROMPTS`, in this process."""
    from vllm import LLM, SamplingParams

    from pcppass.integrations.vllm.engine_args import cpu_engine_args
    from pcppass.integrations.vllm.loaders import register_loaders

    if _uses_pcppass_loader(engine_args):
        register_loaders()
    llm = LLM(**cpu_engine_args(model_dir, max_model_len=256, **engine_args))
    # the engine under test never stops at an end-of-sequence token: neither does the reference
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# -- one zoo family -------------------------------------------------------------------------------


@dataclass
class ShardedCheck:
    """A family's decode sharded at ``ranks`` ranks against ``vllm.LLM.generate``.

    ``verdict``: ``"yes"`` (no failure), ``"no"`` (``failures`` says what went wrong, first
    first), ``"refused"`` (``detail``: the adapter's refusal), ``"error"`` (the run itself failed:
    ``detail``)."""

    ranks: int
    verdict: str
    failures: list[str] = field(default_factory=list)
    detail: str = ""
    #: how many different token ids vLLM's reference generated (a degenerate model gives one)
    distinct_tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def zoo_engine_args(dtype: str) -> dict:
    """vLLM engine arguments of a zoo family's sharded run and its reference: dummy weights (the
    directory holds config.json alone), the family's dtype, prefix caching off (refused for state
    layers; it changes no greedy token elsewhere)."""
    from pcppass.integrations.vllm.loaders import DUMMY_FORMAT

    return {"load_format": DUMMY_FORMAT, "dtype": dtype, "enable_prefix_caching": False}


def check_zoo_family(family: str, model_dir: str, dtype: str, *, ranks: int = ZOO_RANKS) -> ShardedCheck:
    """``family`` decode-sharded at ``ranks`` ranks, then vLLM's reference in this process."""
    from pcppass.engine.launch import launch

    start = time.perf_counter()
    engine_args = zoo_engine_args(dtype)
    case = ShardedCase(family, inner="inductor", engine_args=engine_args)
    per_rank = launch(run_sharded, ranks, model_dir, case, backend="gloo", timeout_s=ZOO_RUN_TIMEOUT_S)  # vLLM on CPU
    refused = refusal(per_rank)
    if refused is not None:
        return ShardedCheck(ranks, "refused", detail=refused, seconds=time.perf_counter() - start)
    reference = reference_tokens(model_dir, engine_args)
    failures = sharded_failures(per_rank, reference)
    return ShardedCheck(ranks, "no" if failures else "yes", failures=failures,
                        distinct_tokens=len({t for seq in reference for t in seq}),
                        seconds=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one zoo family decode-sharded, checked against vLLM")
    parser.add_argument("family")
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ranks", type=int, default=ZOO_RANKS)
    args = parser.parse_args(argv)
    try:
        check = check_zoo_family(args.family, args.model_dir, args.dtype, ranks=args.ranks)
    except Exception as exc:  # noqa: BLE001 - the row says why the run itself failed
        traceback.print_exc()
        last = (str(exc).strip().splitlines() or [""])[-1]
        check = ShardedCheck(args.ranks, "error", detail=f"{type(exc).__name__}: {last}")
    print(RESULT_MARKER + json.dumps(check.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
