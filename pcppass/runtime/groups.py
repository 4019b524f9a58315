"""Aborting a process group, by the group or by its id.

Below both :mod:`pcppass.runtime.failstop` (which aborts the group a failing rank runs in) and
:mod:`pcppass.runtime.liveness` (whose watch aborts the group of a dead peer by the id it holds,
never the group itself), so neither has to import the other to abort.
"""

from __future__ import annotations

import logging
import sys
import types

import torch.distributed as dist

log = logging.getLogger(__name__)


def group_is_gone(group: dist.ProcessGroup | None) -> bool:
    """No process group at all, or ``group`` destroyed or aborted already."""
    if not dist.is_initialized():
        return True
    from torch.distributed import distributed_c10d as c10d

    return group is not None and c10d._world.pg_map.get(group) is None


def world_as_none(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or None for the world group (aborting None aborts every group)."""
    from torch.distributed import distributed_c10d as c10d

    return None if group is c10d.GroupMember.WORLD else group


def abort_process_group(group: dist.ProcessGroup | None) -> None:
    """Abort a live ``group`` (None: the world group and every subgroup); nothing else is told."""
    from torch.distributed import distributed_c10d as c10d

    aborted = group if group is not None else c10d.GroupMember.WORLD
    abort = getattr(c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort(group)
        else:
            dist.destroy_process_group(group)
    except Exception as exc:  # aborting a broken group may fail too; it is unusable either way
        log.debug("pcppass: aborting the process group raised %r", exc)
    _drop_import_time_references(aborted)


def abort_group_by_id(pg_id: int) -> None:
    """Abort the group whose ``id()`` is ``pg_id`` if it still exists (a liveness watch holds
    the id, never the group), without marking this rank failed: a peer is the cause."""
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        if id(pg) == pg_id:
            abort_process_group(world_as_none(pg))
            return


def _drop_import_time_references(group: dist.ProcessGroup) -> None:
    """Let the aborted ``group`` be destroyed (a gloo group closes its connections only then).

    ``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as default arguments when it
    is imported (torch._dynamo imports it); imported after ``init_process_group``, those defaults
    keep the world group alive forever. Reset them to None, their value when the module is
    imported before a group exists (None means the default group).
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(fn, types.FunctionType) and defaults and any(d is group for d in defaults):
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)


