"""From one global step to each rank's local step (vLLM's PCP layout), and its validation.

Which rank runs what (:func:`plan_layout`):

* decode rows, by ownership ``policy``:
  ``round_robin``: owner = ordinal of the row among this step's decode rows ``% P``, recomputed
  every step (vLLM #52162), so a request moves between ranks when the batch compacts;
  ``sticky``: the owner fixed at admission (balanced by the scheduler);
  ``replicated``: every rank runs every decode row (DCP > 1, or no decode sharding).
  A multi-token decode row (speculative verify) goes whole to its owner.
* prefill rows: ``partition_prefill`` cuts a row of ``q`` tokens into ``2P`` chunks of
  ``ceil(q / 2P)`` (empty trailing chunks dropped); rank ``r`` takes chunks ``r`` and ``2P-1-r``
  (DualChunkSwap: balances causal work). Each chunk is its own local segment. Without it, every
  rank runs every prefill row.

A rank's segments run decodes first, then prefills by row and chunk start. Every rank pads to the
same token count ``T`` (the largest rank's count, at least 2, rounded up to a bucket when buckets
are given; a decode-only step that fits a captured CUDA graph, up to that graph's size): padding
rows have input id 0, position 0, slot -1 in every group, ``token_to_req`` 0.
After the step the local hidden rows are all-gathered (rank-major, ``P * T`` rows) and
``restore_index`` puts them back in global token order, taking a replicated row from rank 0::

    global tokens (P=2, one 7-token prefill):   A B C D E F G
    rank 0 / rank 1:                            A B G _ | C D E F
    restore_index:                              [0, 1, 4, 5, 6, 7, 2]
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np
import torch

from pcppass.contract import (
    IS_PADDING,
    QUERY_START_LOC,
    SEQ_LENS,
    TOKEN_TO_REQ,
    CacheGroupSpec,
    slot_key,
    table_key,
)
from pcppass.engine.scheduler import GlobalStep

Policy = Literal["round_robin", "sticky", "replicated"]
POLICIES: tuple[str, ...] = ("round_robin", "sticky", "replicated")
ALL_RANKS = -1  # owner of a replicated row
MIN_LOCAL_TOKENS = 2  # sizes 0 and 1 are specialised by torch.compile: never hand them out


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, stop)`` of global row ``row`` run on one rank as one local request."""

    row: int
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class LayoutPlan:
    world: int
    segments: tuple[tuple[Segment, ...], ...]  # per rank, in local order
    #: per global row: the rank that runs it whole (decode rows), ALL_RANKS (replicated), or
    #: None (partitioned prefill)
    owners: tuple[int | None, ...]
    padded_tokens: int
    #: global token g comes from gathered row restore_index[g] (rank-major, padded_tokens per rank)
    restore_index: tuple[int, ...]

    def tokens_per_rank(self) -> list[int]:
        return [sum(s.num_tokens for s in segs) for segs in self.segments]


def dual_chunk_swap(q: int, rank: int, world: int) -> list[tuple[int, int]]:
    """Token ranges of a ``q``-token prefill on ``rank``: chunks ``rank`` and ``2P-1-rank``."""
    n_chunks = 2 * world
    size = -(-q // n_chunks)
    out = []
    for c in (rank, n_chunks - 1 - rank):
        start, stop = c * size, min((c + 1) * size, q)
        if start < stop:
            out.append((start, stop))
    return out


def pad_size(n: int, buckets: Sequence[int] | None) -> int:
    n = max(n, MIN_LOCAL_TOKENS)
    if not buckets:
        return n
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} local tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def graph_size(n: int, graph_sizes: Sequence[int]) -> int | None:
    """The smallest of the (sorted) CUDA-graph sizes that holds ``n`` local tokens, or None."""
    i = bisect.bisect_left(graph_sizes, max(n, MIN_LOCAL_TOKENS))
    return graph_sizes[i] if i < len(graph_sizes) else None


def plan_layout(
    step: GlobalStep,
    world: int,
    policy: Policy = "round_robin",
    *,
    partition_prefill: bool = True,
    buckets: Sequence[int] | None = None,
    graph_sizes: Sequence[int] = (),
) -> LayoutPlan:
    """``graph_sizes`` (sorted): a decode-only step is padded to the smallest that holds its
    largest rank's tokens (a CUDA graph of that size replays it); past the largest, as without."""
    if policy not in POLICIES:
        raise ValueError(f"unknown ownership policy {policy!r}; expected one of {POLICIES}")
    per_rank: list[list[Segment]] = [[] for _ in range(world)]
    owners: list[int | None] = []
    decode_ordinal = 0
    for i, row in enumerate(step.rows):
        whole = Segment(i, 0, row.num_tokens)
        if row.kind == "decode":
            if policy == "replicated" or world == 1:
                owner = ALL_RANKS if world > 1 else 0
            elif policy == "round_robin":
                owner = decode_ordinal % world
            else:
                owner = row.sticky_owner
                if not 0 <= owner < world:
                    raise ValueError(f"request {row.req_id}: sticky owner {owner} outside world {world}")
            decode_ordinal += 1
        elif partition_prefill and world > 1:
            owner = None
            for r in range(world):
                per_rank[r].extend(Segment(i, a, b) for a, b in dual_chunk_swap(row.num_tokens, r, world))
        else:
            owner = ALL_RANKS if world > 1 else 0
        owners.append(owner)
        if owner == ALL_RANKS:
            for r in range(world):
                per_rank[r].append(whole)
        elif owner is not None:
            per_rank[owner].append(whole)

    kind_rank = {"decode": 0, "prefill": 1}
    for segs in per_rank:
        segs.sort(key=lambda s: (kind_rank[step.rows[s.row].kind], s.row, s.start))
    largest = max(sum(s.num_tokens for s in segs) for segs in per_rank)
    padded = (graph_size(largest, graph_sizes) if graph_sizes and step.step_kind == "decode" else None) \
        or pad_size(largest, buckets)

    offsets = step.row_offsets()
    restore = [-1] * step.num_tokens
    for r, segs in enumerate(per_rank):
        local = 0
        for s in segs:
            for j in range(s.num_tokens):
                g = offsets[s.row] + s.start + j
                if restore[g] < 0:  # replicated rows: the lowest rank's copy
                    restore[g] = r * padded + local + j
            local += s.num_tokens
    assert all(x >= 0 for x in restore), "layout dropped a token"
    return LayoutPlan(
        world=world,
        segments=tuple(tuple(s) for s in per_rank),
        owners=tuple(owners),
        padded_tokens=padded,
        restore_index=tuple(restore),
    )


@dataclass
class LocalStep:
    """What one rank runs: ``T`` rows (padding included) and the step meta of the contract."""

    rank: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: dict[str, torch.Tensor]
    #: per local row, its global token index (-1: padding)
    global_index: tuple[int, ...]
    num_real_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> "LocalStep":
        """The same step with its tensors on ``device`` (itself when they are there already)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return LocalStep(self.rank, self.input_ids.to(device), self.positions.to(device),
                         {k: v.to(device) for k, v in self.meta.items()}, self.global_index, self.num_real_tokens)


def padding_step(num_tokens: int, rank: int, world: int, groups: Sequence[CacheGroupSpec],
                 table_columns: Callable[[str], int], device: torch.device | str = "cpu") -> LocalStep:
    """A local step of ``num_tokens`` padding rows: every slot -1, so running it writes nothing
    (compiling and capturing a step on it leaves every cache as it was)."""
    plan = LayoutPlan(world=world, segments=((),) * world, owners=(), padded_tokens=num_tokens, restore_index=())
    return build_local_step(GlobalStep(index=-1, rows=()), plan, rank, groups, table_columns, device)


def build_local_step(
    step: GlobalStep,
    plan: LayoutPlan,
    rank: int,
    groups: Sequence[CacheGroupSpec],
    table_columns: Callable[[str], int],
    device: torch.device | str = "cpu",
    writes_replicated: bool = True,
) -> LocalStep:
    """``writes_replicated=False``: this rank runs the replicated rows but writes none of their
    cache rows (slot -1 in every group); another rank's write reaches it through the step's sync."""
    t_pad = plan.padded_tokens
    r_pad = t_pad  # one size for every per-row and per-request dim (contract.py)
    segs = plan.segments[rank]
    offsets = step.row_offsets()
    ids = [0] * t_pad
    pos = [0] * t_pad
    tok_req = [0] * t_pad
    is_pad = [True] * t_pad
    gidx = [-1] * t_pad
    slots = {g.name: [-1] * t_pad for g in groups}
    # numpy rows, filled a request at a time: a nested list of T x columns ints made into a tensor
    # cost a long-context step more host time than the rest of its layout
    tables = {g.name: np.zeros((r_pad, table_columns(g.name)), dtype=np.int64) for g in groups}
    seq_lens = [0] * r_pad
    qsl = [0] * (r_pad + 1)
    t = 0
    for k, s in enumerate(segs):
        row = step.rows[s.row]
        writes = writes_replicated or plan.owners[s.row] != ALL_RANKS
        for j in range(s.start, s.stop):
            ids[t] = row.token_ids[j]
            pos[t] = row.start_position + j
            tok_req[t] = k
            is_pad[t] = False
            gidx[t] = offsets[s.row] + j
            for g in groups:
                slots[g.name][t] = row.slots[g.name][j] if writes else -1
            t += 1
        for g in groups:
            tab = row.block_table[g.name]
            if len(tab) > table_columns(g.name):
                raise ValueError(
                    f"request {row.req_id} group {g.name!r}: {len(tab)} blocks exceed the "
                    f"{table_columns(g.name)} block-table columns"
                )
            tables[g.name][k][: len(tab)] = tab
        seq_lens[k] = row.start_position + s.stop
        qsl[k + 1] = t
    for k in range(len(segs), r_pad):
        qsl[k + 1] = t

    def i64(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    meta = {
        TOKEN_TO_REQ: i64(tok_req),
        SEQ_LENS: i64(seq_lens),
        QUERY_START_LOC: i64(qsl),
        IS_PADDING: torch.tensor(is_pad, dtype=torch.bool, device=device),
    }
    for g in groups:
        meta[slot_key(g.name)] = i64(slots[g.name])
        meta[table_key(g.name)] = torch.from_numpy(tables[g.name]).to(device)
    return LocalStep(rank, i64(ids), i64(pos), meta, tuple(gidx), t)


class PlanError(ValueError):
    """A step whose cache writes are unsafe; raised before anything runs."""


def validate_plan(
    step: GlobalStep,
    plan: LayoutPlan,
    local_steps: Sequence[LocalStep],
    groups: Sequence[CacheGroupSpec],
    num_blocks: Callable[[str], int],
    is_shared: Callable[[str, int], bool] | None = None,
    replicated_writers: Literal["every_rank", "first_rank"] = "every_rank",
) -> None:
    """Check every rank's writes before a step runs.

    Per group: slot mappings are int64 ``[T]``; padding rows carry -1; every valid slot lies in
    the cache and in a block of its own request's table (never a block shared through the prefix
    cache); each valid slot is written by exactly one global token, and that token is run by
    exactly the ranks the plan gives it (its owner, or every rank for a replicated row; rank 0
    alone with ``replicated_writers="first_rank"``, the other ranks giving those rows slot -1).
    Raises :class:`PlanError` naming the step, request, group and slot.
    """
    offsets = step.row_offsets()
    row_of_token = [0] * step.num_tokens
    for i, row in enumerate(step.rows):
        for j in range(row.num_tokens):
            row_of_token[offsets[i] + j] = i
    if len(local_steps) != plan.world:
        raise PlanError(f"step {step.index}: {len(local_steps)} local steps for world {plan.world}")

    def where(g: int, group: str, slot: int) -> str:
        row = step.rows[row_of_token[g]]
        p = row.start_position + g - offsets[row_of_token[g]]
        return f"step {step.index}: request {row.req_id} ({row.kind}, position {p}) group {group!r} slot {slot}"

    for grp in groups:
        name = grp.name
        key = slot_key(name)
        capacity = num_blocks(name) * grp.block_size
        writers: dict[int, set[int]] = {}  # global token -> ranks writing it
        token_of_slot: dict[int, int] = {}
        row_blocks: dict[int, set[int]] = {}  # global row -> its table's blocks (membership per slot)
        for ls in local_steps:
            sm = ls.meta[key]
            if sm.dtype != torch.int64:
                raise PlanError(f"step {step.index} rank {ls.rank} group {name!r}: slot mapping is {sm.dtype}, not int64")
            if tuple(sm.shape) != (ls.num_tokens,):
                raise PlanError(
                    f"step {step.index} rank {ls.rank} group {name!r}: slot mapping shape {tuple(sm.shape)}, "
                    f"expected ({ls.num_tokens},)"
                )
            for t, slot in enumerate(sm.tolist()):
                g = ls.global_index[t]
                if g < 0:
                    if slot != -1:
                        raise PlanError(
                            f"step {step.index} rank {ls.rank} group {name!r}: padding row {t} has slot {slot}, not -1"
                        )
                    continue
                row = step.rows[row_of_token[g]]
                planned = row.slots[name][g - offsets[row_of_token[g]]]
                if plan.owners[row_of_token[g]] == ALL_RANKS and replicated_writers == "first_rank" and ls.rank:
                    planned = -1
                if slot != planned:
                    raise PlanError(f"{where(g, name, slot)}: rank {ls.rank} writes it, the global plan says {planned}")
                if slot < 0:
                    if slot != -1:
                        raise PlanError(f"{where(g, name, slot)}: negative slot other than -1")
                    continue
                if slot >= capacity:
                    raise PlanError(f"{where(g, name, slot)}: out of range [0, {capacity}) on rank {ls.rank}")
                block = slot // grp.block_size
                blocks = row_blocks.get(row_of_token[g])
                if blocks is None:
                    blocks = row_blocks[row_of_token[g]] = set(row.block_table[name])
                if block not in blocks:
                    raise PlanError(f"{where(g, name, slot)}: block {block} is not in the request's block table")
                if is_shared is not None and is_shared(name, block):
                    raise PlanError(f"{where(g, name, slot)}: block {block} is shared through the prefix cache")
                other = token_of_slot.setdefault(slot, g)
                if other != g:
                    raise PlanError(f"{where(g, name, slot)}: also written by {where(other, name, slot)}")
                writers.setdefault(g, set()).add(ls.rank)
        for g, ranks in writers.items():
            owner = plan.owners[row_of_token[g]]
            expected = None
            if owner == ALL_RANKS:
                expected = {0} if replicated_writers == "first_rank" else set(range(plan.world))
            if expected is None and len(ranks) != 1 or expected is not None and ranks != expected:
                slot = step.rows[row_of_token[g]].slots[name][g - offsets[row_of_token[g]]]
                want = {None: "exactly one rank", 1: "rank 0 only"}.get(expected and len(expected), "every rank")
                raise PlanError(f"{where(g, name, slot)}: written by ranks {sorted(ranks)}, expected {want}")
