"""RERUN for an op whose state is fetched through a handle: re-run its update on the replicas.

An op such as vLLM's ``mamba_mixer2(projected_states, output, layer_name)`` updates one state line
per request (the layer's recurrent state) that it fetches from the engine's context by the handle.
Instead of copying the owner's new state rows, every replica may re-run the update for the other
ranks' rows from the op's per-row inputs, gathered in the step's one collective (the recipe the
classification chose: :mod:`pcppass.analysis.recipes`)::

    lines = pcppass.sync_context_slots(resolver, handle, slots_role, rows_like, [token])   # this rank
    ...   every rank's per-row inputs and lines, in the step's one all-gather   ...
    token = pcppass.sync_rerun_context(resolver, handle, op, names, rows, lines, after, group, site)

``sync_rerun_context`` checks every rank's lines (the same on every rank, so every rank decides
alike), masks this rank's own rows and calls the resolver's ``rerun`` hook, which runs the engine's
own op for the remaining rows with a scratch output. It writes state no graph tensor stands for,
so it is registered side-effectful, like ``pcppass::sync_scatter_context``.
"""

from __future__ import annotations

import torch

from pcppass.sync.rows import _group_rank, context_slots, context_tensors


def _where(resolver: str, handle: str) -> str:
    return f"pcppass replica re-run of {handle!r} (resolver {resolver!r})"


@torch.library.custom_op("pcppass::sync_context_slots", mutates_args=())
def sync_context_slots(resolver: str, handle: str, slots_role: str, rows_like: torch.Tensor,
                       after: list[torch.Tensor]) -> torch.Tensor:
    """The state line of each of this step's rows, ``[n]`` int64 (-1 where the op wrote no line),
    ``n = rows_like.shape[0]``. ``after`` (the op's result) only orders this after the op."""
    tensors = context_tensors(resolver, handle)
    n = rows_like.shape[0]
    return context_slots(tensors, slots_role, n, _where(resolver, handle)).to(rows_like.device)


@sync_context_slots.register_fake
def _sync_context_slots_fake(resolver, handle, slots_role, rows_like, after):
    return rows_like.new_empty((rows_like.shape[0],), dtype=torch.int64)


def one_writer_per_line(lines: torch.Tensor, world: int, where: str) -> None:
    """Raise (the same error on every rank) when two rows of the step wrote one state line."""
    from pcppass.errors import PcpSyncError

    valid = lines[lines >= 0]
    unique, counts = torch.unique(valid, return_counts=True)
    if not bool((counts > 1).any()):
        return
    line = int(unique[counts > 1][0])
    per_rank = lines.numel() // world
    ranks = sorted({i // per_rank for i in (lines == line).nonzero().flatten().tolist()})
    raise PcpSyncError(
        f"{where}: state line {line} was written by more than one row in this step (ranks {ranks}); "
        f"every state line must have exactly one owner per step. Nothing was re-run; the line holds "
        f"what each of its writers computed")


@torch.library.custom_op("pcppass::sync_rerun_context", mutates_args=())
def sync_rerun_context(
    resolver: str,
    handle: str,
    op: str,
    names: str,
    rows: list[torch.Tensor],
    lines: torch.Tensor,
    after: list[torch.Tensor],
    group_name: str,
    site: str,
) -> torch.Tensor:
    """Re-run ``op``'s state update through ``handle`` for every other rank's rows.

    ``rows``: the op's per-row inputs of every rank (rank order along dim 0), one per line of
    ``names``; ``lines``: every rank's state lines, unmasked. ``after`` only orders the re-run after
    what produced those tensors. Returns an empty token."""
    from pcppass.errors import PcpSyncError
    from pcppass.registry import get_resolver

    where = f"{site}: {_where(resolver, handle)}"
    found = get_resolver(resolver)
    if found is None or found.rerun is None:
        raise PcpSyncError(f"{where}: no resolver {resolver!r} with a rerun hook is registered")
    labels = names.split("\n")
    if len(labels) != len(rows) or any(r.shape[0] != lines.shape[0] for r in rows):
        raise PcpSyncError(f"{where}: {len(rows)} inputs for names {labels}, rows "
                           f"{[r.shape[0] for r in rows]} for {lines.shape[0]} lines")
    world = torch.distributed.get_world_size(_group(group_name))
    lines = lines.reshape(-1).to(torch.int64)
    one_writer_per_line(lines, world, where)
    per_rank = lines.numel() // world
    others = lines.clone()
    rank = _group_rank(group_name)
    others[rank * per_rank:(rank + 1) * per_rank] = -1
    if bool((others >= 0).any()):
        found.rerun(op, handle, dict(zip(labels, rows)), others)
    return lines.new_empty((0,), dtype=torch.float32)


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@sync_rerun_context.register_fake
def _sync_rerun_context_fake(resolver, handle, op, names, rows, lines, after, group_name, site):
    return lines.new_empty((0,), dtype=torch.float32)


# It writes state no graph tensor stands for: keep it through dead-code elimination.
torch.fx.node.has_side_effect(torch.ops.pcppass.sync_rerun_context.default)
