"""Slot mappings the graph computes, checked inside it and agreed on by every rank before any write.

A computed slot mapping exists only on its rank, and only once the graph has run up to it; which
rows two ranks both write (two owners of one slot, overlapping views of one buffer) shows only in
every rank's slots together. The rewrite (:mod:`pcppass.rewrite.slot_checks`) emits, before the
step's first write::

    record   = pcppass::slot_check_record(slots, limits, rows, aten, send)        # this rank
    gathered = wait_tensor(all_gather_into_tensor(record, world, group))          # every rank
    checked  = pcppass::slot_check_verdict(gathered, slots, labels, aten, caches, layouts, sites)

and the writes take ``checked`` (the same values) as their slots, so they run after the verdict.
Every rank sees every rank's record: all raise the same error, or none does.
"""

from __future__ import annotations

import torch

from pcppass.errors import PcpInputError, PcpSyncError
from pcppass.sync.owners import Written, find_problems
from pcppass.sync.rows import decode_layouts
from pcppass.sync.stats import SYNC_COUNTERS


#: record columns: problem code, the offending value, the bound it broke
_OK, _LENGTH, _RANGE = 0, 1, 2


@torch.library.custom_op("pcppass::slot_check_record", mutates_args=())
def slot_check_record(slots: list[torch.Tensor], limits: list[int], rows: list[int],
                      aten: list[bool], send: bool = False) -> torch.Tensor:
    """``[n * 3]`` int64: for each slot mapping, (problem, value, bound) on this rank, followed,
    with ``send``, by every mapping's slots as int64. ``limits``: slots of the cache it addresses
    (-1: unchecked); ``rows``: rows of its op (-1: unknown); ``aten``: an aten index write, where
    negative slots are refused too."""
    out = torch.zeros(len(slots), 3, dtype=torch.int64)
    for i, (s, limit, expected, is_aten) in enumerate(zip(slots, limits, rows, aten)):
        s = s.reshape(-1)
        if expected >= 0 and s.numel() != expected:
            out[i] = torch.tensor([_LENGTH, s.numel(), expected])
            continue
        if limit < 0:
            continue
        bad = s[(s < (0 if is_aten else -1)) | (s >= limit)]
        if bad.numel():
            out[i] = torch.tensor([_RANGE, int(bad[0]), limit])
    sent = [s.reshape(-1).to(torch.int64).cpu() for s in slots] if send else []
    return torch.cat([out.reshape(-1), *sent]).to(slots[0].device)


@slot_check_record.register_fake
def _slot_check_record_fake(slots, limits, rows, aten, send=False):
    size = 3 * len(slots)
    if send:
        for s in slots:
            size = size + s.numel()
    return slots[0].new_empty((size,), dtype=torch.int64)


def _range_problem(rank: int, label: str, code: int, value: int, bound: int, is_aten: bool) -> str:
    what = (f"has {value} slots for {bound} rows" if code == _LENGTH
            else f"holds slot {value}, outside [{0 if is_aten else -1}, {bound}) of the cache")
    aten_note = (" (an aten index write takes -1 as the LAST row: mask padding rows in the model or "
                 "write through an op that skips slot -1)" if code == _RANGE and is_aten and value < 0 else "")
    return f"rank {rank}: {label}: the slot mapping computed in the graph {what}{aten_note}"


_UNCHANGED = ("Checked on every rank before the step wrote any state: every rank refuses this step and "
              "every replica is unchanged.")


@torch.library.custom_op("pcppass::slot_check_verdict", mutates_args=())
def slot_check_verdict(gathered: torch.Tensor, slots: list[torch.Tensor], labels: str,
                       aten: list[bool], caches: list[torch.Tensor], layouts: list[int],
                       sites: str) -> list[torch.Tensor]:
    """Raise on every rank if any rank's record shows a problem; else ``slots`` (copies). With
    ``caches`` (one per slot mapping, rows addressed through the i-th of ``layouts``, written by
    the site on line i of ``sites``), the records carry every rank's slots, and a row (or bytes
    of one buffer) two ranks would write is refused too (:mod:`pcppass.sync.owners`)."""
    n = len(slots)
    world = gathered.numel() // (3 * n + (sum(s.numel() for s in slots) if caches else 0))
    per_rank = gathered.cpu().view(world, -1)
    SYNC_COUNTERS.record(per_rank.shape[1] * 8, world)  # a collective of the step, like its syncs
    names = labels.split("\n")
    for rank in range(world):
        for i, (code, value, bound) in enumerate(per_rank[rank, :3 * n].view(n, 3).tolist()):
            if code != _OK:
                raise PcpInputError(f"{_range_problem(rank, names[i], code, value, bound, aten[i])}. {_UNCHANGED}")
    if caches:
        sizes = [s.numel() for s in slots]
        every_rank = [torch.split(per_rank[r, 3 * n:], sizes) for r in range(world)]
        written = [Written(cache, layout, label, [every_rank[r][i] for r in range(world)])
                   for i, (cache, layout, label) in enumerate(zip(caches, decode_layouts(layouts), sites.split("\n")))]
        problems = find_problems(written)
        if problems:
            raise PcpSyncError(f"pcppass: {'; '.join(problems)}; every row must have exactly one owner per step. "
                               f"{_UNCHANGED}")
    return [s.clone() for s in slots]


@slot_check_verdict.register_fake
def _slot_check_verdict_fake(gathered, slots, labels, aten, caches, layouts, sites):
    return [torch.empty_like(s) for s in slots]
