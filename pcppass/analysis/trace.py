"""Capture the graph a ``torch.compile`` backend receives, for the audit.

:func:`capture_graph` compiles the model with a recording backend (``fullgraph=True``), marks the
row-count dims dynamic, keeps each placeholder's source name (Dynamo drops ``meta["grapharg"]`` once
the backend returns) and stops before anything runs, so full-width models traced on the ``meta``
device cost only the trace.

:func:`contract_step_inputs` builds one decode step for a model that follows
:mod:`pcppass.contract` (caches from ``cache_specs()``, slots from ``cache_groups()``).
Resolving ``pcppass audit``'s target (a built-in model name or ``module:factory``) is the CLI's:
:mod:`pcppass.cli.targets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from pcppass.analysis.state_writes import SOURCE_META_KEY, _kind_of
from pcppass.contract import (
    IS_PADDING, QUERY_START_LOC, SEQ_LENS, TOKEN_TO_REQ, slot_key, table_key,
)


class TraceError(RuntimeError):
    """The target could not be loaded or traced; the message says what to change."""


@dataclass
class StepInputs:
    """One step's call arguments and the ``(tensor, dim)`` pairs that are the row count."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    dynamic: list[tuple[torch.Tensor, int]] = field(default_factory=list)


def follows_model_contract(model: torch.nn.Module) -> bool:
    """Whether ``model`` has the contract's methods (:mod:`pcppass.contract`)."""
    return all(hasattr(model, a) for a in ("cache_groups", "cache_specs", "forward"))


def contract_step_inputs(
    model: torch.nn.Module, num_rows: int = 6, device: torch.device | str = "cpu", seed: int = 0
) -> StepInputs:
    """A decode step of ``num_rows`` rows (the last one padding) for a contract model.

    Each real row is its own request at position ``3 + 5 * i`` with its own blocks, so the slots of
    one step never collide; per-request tensors are padded to ``num_rows`` like the engine's.
    """
    gen = torch.Generator().manual_seed(seed)
    groups = model.cache_groups()
    real = num_rows - 1
    positions = [3 + 5 * i for i in range(real)] + [0]
    next_block = {g.name: 1 for g in groups}  # block 0 is never handed out: a stale slot shows
    tables: dict[str, list[list[int]]] = {}
    slots: dict[str, list[int]] = {}
    for g in groups:
        rows, row_slots = [], []
        for p in positions[:real]:
            n = g.blocks_for(p + 1, 1)
            rows.append(list(range(next_block[g.name], next_block[g.name] + n)))
            next_block[g.name] += n
            row_slots.append(g.slot(rows[-1], p) if rows[-1] else -1)
        cols = max(1, max(len(r) for r in rows))
        tables[g.name] = [r + [0] * (cols - len(r)) for r in rows] + [[0] * cols]
        slots[g.name] = row_slots + [-1]
    vocab = model.embed_tokens.num_embeddings if hasattr(model, "embed_tokens") else 2
    i64 = dict(dtype=torch.int64, device=device)
    input_ids = torch.randint(0, vocab, (num_rows,), generator=gen).to(device)
    pos = torch.tensor(positions, **i64)
    meta: dict[str, torch.Tensor] = {
        TOKEN_TO_REQ: torch.tensor(list(range(real)) + [0], **i64),
        SEQ_LENS: torch.tensor([p + 1 for p in positions[:real]] + [0], **i64),
        QUERY_START_LOC: torch.tensor(list(range(real + 1)) + [real], **i64),
        IS_PADDING: torch.tensor([False] * real + [True], dtype=torch.bool, device=device),
    }
    for g in groups:
        meta[slot_key(g.name)] = torch.tensor(slots[g.name], **i64)
        meta[table_key(g.name)] = torch.tensor(tables[g.name], **i64)
    caches = {}
    for spec in model.cache_specs():
        num_blocks = next_block[spec.group] + 1
        caches[spec.name] = torch.zeros((num_blocks, *spec.block_shape), dtype=spec.dtype, device=device)
    dynamic = [(input_ids, 0), (pos, 0)] + [(t, 0) for t in meta.values()]
    return StepInputs((input_ids, pos, meta, caches), {}, dynamic)


class _Captured(Exception):
    """Raised by the recording backend to stop Dynamo before the graph runs."""


def capture_graph(
    model: Callable[..., Any], inputs: StepInputs, *, dynamic: bool = True
) -> torch.fx.GraphModule:
    """The Dynamo graph of ``model(*inputs.args, **inputs.kwargs)`` (fullgraph), without running it."""
    captured: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        for node in gm.graph.nodes:
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            if node.op == "placeholder" and source is not None:
                name = source.name() if callable(source.name) else source.name
                node.meta[SOURCE_META_KEY] = (name, _kind_of(name, source).value)
        captured.append(gm)
        raise _Captured

    if dynamic:
        for tensor, dim in inputs.dynamic:
            torch._dynamo.mark_dynamic(tensor, dim)
    compiled = torch.compile(model, backend=record, fullgraph=True, dynamic=None)
    try:
        compiled(*inputs.args, **inputs.kwargs)
    except Exception as exc:  # noqa: BLE001 - Dynamo wraps the backend's exception
        if captured and _is_capture(exc):
            return captured[0]
        raise TraceError(_trace_failure(exc)) from exc
    finally:
        torch._dynamo.reset()
    if captured:
        return captured[0]
    raise TraceError("torch.compile produced no graph (is the model's forward empty?)")


def _is_capture(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, _Captured):
            return True
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    return False


def _trace_failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    head = text[0] if text else type(exc).__name__
    hint = ""
    if "graph break" in str(exc).lower() or type(exc).__name__ in ("Unsupported", "UserError"):
        hint = ("; the audit needs one graph (fullgraph=True): remove the graph break, or audit "
                "with --dynamic to observe writes made outside the compiled region")
    elif "ConstraintViolation" in type(exc).__name__ or "specializ" in str(exc):
        hint = "; the model specialises the row count: keep shapes symbolic in forward"
    return f"tracing failed: {type(exc).__name__}: {head}{hint}"
