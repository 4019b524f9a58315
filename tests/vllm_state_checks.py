"""Batch invariance of vLLM's recurrent-state updates, on vLLM's real kernels (one rank).

RERUN reproduces the owner's state bytes on the other replicas only if a row's update does not
depend on which other rows share its batch: the owner ran its own rows, a replica re-runs the
other ranks' rows in a batch of another size and order. :func:`check_batch_invariance` runs each
state op of a model (through ``pcppass.integrations.vllm.state.rerun``, the hook the replicas use)
on random state lines and inputs: once as one batch (with masked rows among them), once row by
row, once in reversed order, and compares every state's bytes.
"""

from __future__ import annotations

from typing import Any

import torch

#: lines of the scratch states; lines re-run (-1: a masked row, left alone)
NUM_LINES = 9
LINES = [5, -1, 2, 7, -1, 3]


def input_widths(op_name: str, layer: Any, vllm_config: Any) -> dict[str, int]:
    """Row width of each per-row input of the op for this layer."""
    if op_name == "vllm::mamba_mixer2":
        return {"projected_states": layer.tped_intermediate_size + layer.tped_conv_size + layer.tped_dt_size}
    if op_name == "vllm::short_conv":
        return {"hidden_states": vllm_config.model_config.get_hidden_size()}
    heads = layer.num_v_heads // layer.tp_size
    return {"mixed_qkv": (2 * layer.key_dim + layer.value_dim) // layer.tp_size, "b": heads, "a": heads}


def _state_bytes(layer: Any) -> list[torch.Tensor]:
    return [s.contiguous().view(torch.uint8).clone() for s in layer.kv_cache]


def _run(op_name: str, name: str, inputs: dict[str, torch.Tensor], lines: list[int], layer: Any,
         start: list[torch.Tensor], order: list[list[int]]) -> list[torch.Tensor]:
    """The states after re-running the rows in batches ``order`` (indices into ``lines``), from ``start``."""
    from pcppass.integrations.vllm.state import rerun

    for state, saved in zip(layer.kv_cache, start):
        state.copy_(saved.view(state.dtype).view(state.shape))
    for batch in order:
        rerun(op_name, name, {k: v[batch] for k, v in inputs.items()},
              torch.tensor([lines[i] for i in batch], dtype=torch.int64))
    return _state_bytes(layer)


def check_layer(op_name: str, name: str, layer: Any, vllm_config: Any, seed: int = 0) -> dict:
    """Batch vs row by row vs reversed batch for one state layer: equal bytes, and untouched lines."""
    gen = torch.Generator().manual_seed(seed)
    spec = layer.get_kv_cache_spec(vllm_config)
    layer.bind_kv_cache(torch.zeros(NUM_LINES, 1, 1, spec.page_size_bytes, dtype=torch.int8))
    for state in layer.kv_cache:
        state.copy_(torch.randn(state.shape, generator=gen).to(state.dtype))
    dtype = vllm_config.model_config.dtype
    inputs = {arg: torch.randn(len(LINES), width, generator=gen).to(dtype)
              for arg, width in input_widths(op_name, layer, vllm_config).items()}
    start = _state_bytes(layer)
    rows = list(range(len(LINES)))
    batch = _run(op_name, name, inputs, LINES, layer, start, [rows])
    one_by_one = _run(op_name, name, inputs, LINES, layer, start, [[i] for i in rows if LINES[i] >= 0])
    reversed_batch = _run(op_name, name, inputs, LINES, layer, start, [rows[::-1]])
    written = sorted(line for line in LINES if line >= 0)
    untouched = [line for line in range(NUM_LINES) if line not in written]
    changed = all(not torch.equal(b[written], s[written]) for b, s in zip(batch, start))
    return {
        "op": op_name, "layer": name,
        "invariant": all(torch.equal(a, b) and torch.equal(a, c)
                         for a, b, c in zip(batch, one_by_one, reversed_batch)),
        "untouched": all(torch.equal(b[untouched], s[untouched]) for b, s in zip(batch, start)),
        "changed": changed,
    }


def check_batch_invariance(rank: int, world: int, models: dict[str, tuple[str, dict]]) -> list[dict]:
    """For each model (directory, engine arguments): every kind of state op it has, on its first
    layer of that kind, with the kernel path it ran (``pcppass...state.kernel_path``)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from pcppass.integrations.vllm.adapter import VllmModel, init_vllm_ranks, load_model, vllm_config_for
    from pcppass.integrations.vllm.state import is_state_layer, kernel_path, state_op_of

    results = []
    for model_dir, engine_args in models.values():
        config = vllm_config_for(model_dir, **{"max_model_len": 256, "block_size": 32,
                                               "enable_prefix_caching": False, **engine_args})
        init_vllm_ranks(config, rank, world)
        VllmModel(config, load_model(config))  # checks the layers, selects vLLM's CPU state kernels
        seen: set[str] = set()
        for name, layer in config.compilation_config.static_forward_context.items():
            if not is_state_layer(layer):
                continue
            op_name, _ = state_op_of(layer, name)
            if op_name in seen:
                continue
            seen.add(op_name)
            with set_current_vllm_config(config), set_forward_context({}, config, num_tokens=len(LINES)):
                result = check_layer(op_name, name, layer, config)
                if op_name == "vllm::mamba_mixer2":
                    result["refusals"] = refusals(layer, name, op_name, config)
            result["path"] = kernel_path(op_name, layer)
            result["model"] = model_dir
            results.append(result)
    return results


def copy_state_rows() -> None:
    """A sharded case's hook: no kernel path counts as verified batch-invariant in this process,
    so every state op is synced by copying its rows (the COPY_ROWS recipe of a RERUN pattern)."""
    from pcppass.integrations.vllm.state import VERIFIED_BATCH_INVARIANT

    VERIFIED_BATCH_INVARIANT.clear()


def refusals(layer: Any, name: str, op_name: str, vllm_config: Any) -> dict[str, str]:
    """What the ``"vllm"`` resolver says of a Mamba2 layer vLLM would run in a way nobody reviewed
    (each raises naming the layer and the cause), and of a re-run asked for a line outside its
    states: ``{case: "ExceptionType: message"}`` (``"accepted"`` where nothing was raised)."""
    from vllm.config import set_current_vllm_config

    from pcppass.integrations.vllm.effects import OP_EFFECTS
    from pcppass.integrations.vllm.state import rerun

    def outcome(call) -> str:
        try:
            with set_current_vllm_config(vllm_config):
                call()
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            return f"{type(exc).__name__}: {exc}"
        return "accepted"

    effect = OP_EFFECTS[op_name]
    found = {"reviewed": outcome(lambda: effect(layer, name))}
    cache_config, cls = layer.cache_config, type(layer)
    layer.cache_config = type("AlignMode", (), {"mamba_cache_mode": "align"})()
    found["prefix caching"] = outcome(lambda: effect(layer, name))
    layer.cache_config = cache_config
    layer.num_spec = 1
    found["speculative decoding"] = outcome(lambda: effect(layer, name))
    layer.num_spec = 0
    layer.__class__ = type("MixerSubclass", (cls,), {})
    found["subclass"] = outcome(lambda: effect(layer, name))
    layer.__class__ = cls
    found["other op"] = outcome(lambda: OP_EFFECTS["vllm::short_conv"](layer, name))
    widths = input_widths(op_name, layer, vllm_config)
    rows = {arg: torch.zeros(1, width, dtype=vllm_config.model_config.dtype) for arg, width in widths.items()}
    found["line outside the states"] = outcome(
        lambda: rerun(op_name, name, rows, torch.tensor([layer.kv_cache[0].shape[0]])))
    return found
