"""One vLLM run in its own process, for the vLLM job (started by ``vllm_cases.start_worker``).

``python tests/vllm_worker.py '{"task": "generate", "model_dir": ..., "backend": "pcppass"}'``
runs ``vllm.LLM.generate`` on the test prompts (greedy) with vLLM's default compile
(``"backend": "default"``), with pcppass's backend for vLLM, or with its audit backend
(``"audit"``: the graph runs unchanged, eagerly), and prints one line ``PCPPASS_RESULT {json}``:
the tokens, with pcppass what its backend found and inserted and how many sync collectives each
step ran, with the audit backend the custom ops of the graph. ``"register"`` names modules whose
``register()`` runs first (e.g. an attention backend override); ``"moe_dispatch": "op"`` runs the
MoE layers through ``vllm::moe_forward`` (``pcppass.integrations.vllm.loaders``).
"""

from __future__ import annotations

import json
import sys

from vllm_cases import MAX_TOKENS, PROMPTS


def _write_row(w) -> dict:
    return {"op": w.op, "arg": w.arg, "state": w.state, "source": w.source, "covered": w.covered,
            "pattern": w.pattern.name if w.pattern is not None else None,
            "recipe": w.recipe.value if w.recipe is not None else None,
            "bytes_per_row": w.bytes_per_row, "recipe_bytes": dict(w.recipe_bytes),
            "reason": w.reason.value if w.reason else None,
            "detail": w.detail}


def generate(options: dict) -> dict:
    from vllm import LLM, SamplingParams

    from pcppass.integrations.vllm.engine_args import cpu_engine_args

    from vllm_sharding import call_hook, forget_attention_backends

    for hook in options.get("register", ()):  # e.g. an attention backend registered over CPU_ATTN
        call_hook(hook)
    if options.get("register"):  # an earlier run in this process (generate_each) cached the lookups
        forget_attention_backends()
    args = cpu_engine_args(options["model_dir"], max_model_len=256, **options.get("engine_args", {}))
    if "moe_dispatch" in options:
        from pcppass.integrations.vllm.loaders import AUTO_FORMAT, MOE_DISPATCH, register_loaders

        register_loaders()
        args.update(load_format=AUTO_FORMAT, model_loader_extra_config={MOE_DISPATCH: options["moe_dispatch"]})
    if options["backend"] == "audit":
        import pcppass.integrations.vllm  # noqa: F401  (the audit backend vLLM resolves by name)

        args["compilation_config"] = {"mode": 2, "backend": "pcppass.integrations.vllm.audit_backend"}
    result: dict = {}
    if options["backend"] == "pcppass":
        import pcppass.integrations.vllm as integration
        from pcppass.sync.stats import SYNC_COUNTERS

        for name in options.get("unregister", ()):
            from pcppass.registry import unregister_pattern

            unregister_pattern(name)
        args["compilation_config"] = {"mode": 2, "backend": "pcppass.integrations.vllm.backend"}
    try:
        llm = LLM(**args)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result of a negative control
        cause = exc
        while cause.__cause__ is not None or getattr(cause, "inner_exception", None) is not None:
            cause = getattr(cause, "inner_exception", None) or cause.__cause__
        return {"error": type(cause).__name__, "message": str(cause)}
    if options["backend"] == "pcppass":
        SYNC_COUNTERS.take()
    # the engine under test never stops at an end-of-sequence token: neither does the reference
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    if options["backend"] == "pcppass":
        reports = integration.backend.reports
        result["graphs"] = len(reports)
        result["writes"] = [_write_row(w) for w in reports[0].writes]
        result["collectives_per_graph"] = [r.rewrite.collectives for r in reports]
        result["sync_collectives_run"] = SYNC_COUNTERS.take().collectives
    if options["backend"] == "audit":
        from pcppass.integrations.vllm.audit import op_inventory
        from pcppass.integrations.vllm.compile import audit_backend

        graphs = [r.graph for r in audit_backend.reports]
        result["ops"] = {u.op: u.calls for u in op_inventory(graphs, [])}
    return result


def generate_each(options: dict) -> dict:
    """:func:`generate` for each of ``options["runs"]`` (``{name: options}``) in turn, in this one
    process (one vLLM import for all): ``{name: result}``. A run that registers a hook (an
    attention backend override) or uses pcppass's backend must come last: neither is undone."""
    import gc

    results = {}
    for name, run in options["runs"].items():
        results[name] = generate(run)
        gc.collect()
    return results


TASKS = {"generate": generate, "generate_each": generate_each}


if __name__ == "__main__":
    opts = json.loads(sys.argv[1])
    out = TASKS[opts["task"]](opts)
    print("PCPPASS_RESULT " + json.dumps(out), flush=True)
