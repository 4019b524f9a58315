"""Choose between a pattern's recipes for one covered write, by the bytes each moves per row.

A context-addressed pattern may list RERUN as an alternative to its COPY_ROWS (vLLM's recurrent
state ops: one request's state is kilobytes to megabytes, the op's inputs for one token a few
kilobytes). Per row, besides one int64 index that both send (the row's slot, or its state line):

* COPY_ROWS moves every cache row the op wrote: the sum of its context layouts' bytes per row;
* RERUN moves the op's per-row inputs (the pattern's ``row_args``): per input, the elements of
  every dim but the row dim times the element size, read from the graph's values.

RERUN is chosen only where it is exact and cheaper: the engine's resolver vouches that re-running
the op for other ranks' rows reproduces the owner's bytes on this handle
(:attr:`~pcppass.registry.HandleEffect.rerun_exact`: the kernel was verified batch-invariant), it
registered a ``rerun`` hook, every input's row size is static, and RERUN moves strictly fewer bytes
per row. The record keeps both counts (``StateWrite.recipe_bytes``) and says why in its detail.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from pcppass.analysis.records import StateWrite
from pcppass.analysis.views import node_value
from pcppass.registry import HandleEffect, get_resolver
from pcppass.spec import Recipe, WritePattern


def rerun_bytes_per_row(record: StateWrite, pattern: WritePattern) -> int | str:
    """Bytes per row of the op's per-row inputs, or why they cannot be counted."""
    total = 0
    for name, row_dim in pattern.row_args.items():
        value = node_value(record.bound_args.get(name))
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return f"per-row input {name} is not a tensor in the graph"
        elements = 1
        for i, d in enumerate(value.shape):
            if i == row_dim % value.dim():
                continue
            if not is_concrete_int(d):
                return f"per-row input {name} {list(value.shape)} has a dynamic row size"
            elements *= int(d)
        total += elements * value.element_size()
    return total


def _rerun_refusal(record: StateWrite, pattern: WritePattern, effect: HandleEffect) -> str | None:
    """Why RERUN cannot run for this handle (None when it can)."""
    if effect.rerun_exact is None:
        return "the engine has not verified that a re-run reproduces the owner's state bytes here"
    resolver = get_resolver(pattern.resolver)
    if resolver is None or resolver.rerun is None:
        return f"resolver {pattern.resolver!r} has no rerun hook"
    return None


def choose_recipe(record: StateWrite, pattern: WritePattern, effect: HandleEffect, copy_bytes: int) -> None:
    """Set ``record.recipe`` (COPY_ROWS unless RERUN is exact and moves fewer bytes per row),
    ``record.recipe_bytes`` and the reason, appended to ``record.detail``."""
    record.recipe = pattern.recipe
    if Recipe.RERUN not in pattern.alternatives:
        return
    record.recipe_bytes = {Recipe.COPY_ROWS.value: copy_bytes}
    rerun = rerun_bytes_per_row(record, pattern)
    refusal = rerun if isinstance(rerun, str) else _rerun_refusal(record, pattern, effect)
    if isinstance(rerun, int):
        record.recipe_bytes[Recipe.RERUN.value] = rerun
    counts = ", ".join(f"{name} {n} B/row" for name, n in record.recipe_bytes.items())
    if refusal is not None:
        why = f"copy_rows ({counts}): rerun not chosen: {refusal}"
    elif rerun >= copy_bytes:
        why = f"copy_rows ({counts}): copying moves no more bytes than a re-run"
    else:
        record.recipe = Recipe.RERUN
        why = f"rerun ({counts}): {effect.rerun_exact}"
    record.detail = f"{record.detail}; recipe {why}" if record.detail else f"recipe {why}"
